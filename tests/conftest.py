"""Shared fixtures: real Consul agents, artifacts for failed tests, golden-file switch, parallel workers.

A missing tool is a failure, not a skip: a skipped integration test would hide
exactly the breakage CI exists to catch.

The suite runs in parallel (pytest-xdist, `scripts/test` starts TEST_WORKERS
workers). Each worker has its own dev agent on its own free ports, its own
network namespaces, bridges and containers (named after its pid) and its own
subnets: worker gwN moves every test subnet from 10.213.x.x to 10.(200+N).x.x
(CONSULRUN_TEST_NET_PREFIX, which a caller such as the mutation driver may set
first; CONSULRUN_TEST_NET_BASE moves the 200, for two checkouts testing at once). A test module whose tests share one booted container or cluster
(a module-scoped fixture) runs on one worker, so that it is booted once.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# The shared helpers in tests/harness/ report a failed assert with its values, as test modules do.
pytest.register_assert_rewrite("tests.harness")

from tests.harness.agents import (  # noqa: E402 - after the rewrite above
    Agent,
    Cluster,
    consul_binary,
    save_logs,
    start_cluster,
    start_dev_agent,
)
from tests.harness.netns import Network  # noqa: E402

if TYPE_CHECKING:
    from tests.harness.nspawn import Container

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"

# Fixtures that several test modules use, each beside its helpers in tests/harness/ (a test module
# never imports another: tests/test_layout.py).
pytest_plugins = [
    "tests.harness.acl",
    "tests.harness.healthchecks",
    "tests.harness.pings",
    "tests.harness.sshd",
]


# Golden files rewritten by --update-golden in this run (paths relative to the repo), for the closing report.
GOLDEN_REWRITTEN = pytest.StashKey[list[str]]()


# Modules whose tests share a module-scoped container, cluster or sshd (test_deb: also one build/ folder): kept on
# one worker (booted once).
ONE_WORKER_MODULES = {"test_coldboot", "test_deb", "test_each_node", "test_each_node_units", "test_hardening",
                      "test_install", "test_logs", "test_missed_units", "test_onfailure", "test_placement",
                      "test_remote", "test_systemd_stops", "test_trigger"}


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "CONSULRUN_TEST_NET_PREFIX" not in os.environ:
        base = int(os.environ.get("CONSULRUN_TEST_NET_BASE", "200"))
        os.environ["CONSULRUN_TEST_NET_PREFIX"] = f"10.{base + int(worker[2:])}."


AGENT_FIXTURES = frozenset({"consul", "catalog", "acl_agent", "consul_bin", "cluster"})


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the scheduling scope
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem
        if module in ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
        # A test that starts an agent is a `consul` test whether or not it says so (scripts/test-pythons selects
        # the others); one on a cluster is a `cluster` test too.
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & AGENT_FIXTURES and not item.get_closest_marker("consul"):
            item.add_marker(pytest.mark.consul)
        if "cluster" in fixtures and not item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.cluster)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/ from the current output (the run then fails, naming what it rewrote)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ANN201 - pytest hook
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(getattr(request.node, f"rep_{when}", None) is not None and getattr(request.node, f"rep_{when}").failed
               for when in ("setup", "call"))


def artifact_dir(node: pytest.Item) -> Path:
    return ARTIFACTS / re.sub(r"[^A-Za-z0-9_.-]+", "_", node.nodeid)


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Path:
    path = artifact_dir(request.node)
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        pytest.fail(f"required tool {name!r} is not installed (scripts/test installs it)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def consul_bin() -> str:
    try:
        return consul_binary()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def _dev_agent(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    # No coordinate updates: they are the agent's own Raft writes, and tests count ours.
    agent = start_dev_agent(consul_bin, tmp_path_factory.mktemp("consul-dev"), extra_config={"disable_coordinates": True})
    yield agent
    agent.stop()


@pytest.fixture
def consul(_dev_agent: Agent, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    """The shared dev agent with an empty KV store and no sessions; CONSUL_HTTP_ADDR points at it."""
    if not _dev_agent.alive():
        pytest.fail(f"the dev agent died; log: {_dev_agent.log_path}", pytrace=False)
    _dev_agent.wipe()
    for name in [n for n in os.environ if n.startswith("CONSUL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", _dev_agent.http_addr)
    yield _dev_agent
    if _failed(request):
        save_logs([_dev_agent], artifact_dir(request.node))


@pytest.fixture
def cluster(consul_bin: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """node1 (server) and node2, node3 (clients), each in its own network namespace."""
    require_tool("ip")
    if os.geteuid() != 0:
        pytest.fail("the cluster fixture needs root for network namespaces", pytrace=False)
    network = Network(3).up()
    started: Cluster | None = None
    try:
        started = start_cluster(consul_bin, tmp_path, network)
        yield started
    finally:
        if started:
            started.stop()
        if started is None or _failed(request):
            logs = list(tmp_path.glob("node*.log"))
            dest = artifact_dir(request.node)
            dest.mkdir(parents=True, exist_ok=True)
            for log in logs:
                shutil.copy(log, dest / log.name)
        network.down()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if anything was skipped or xfailed: every test here must really run and really pass."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    dodged = {kind: len(stats.get(kind, [])) for kind in ("skipped", "xfailed", "xpassed") if stats.get(kind)}
    if dodged and exitstatus == 0:
        session.exitstatus = 1
        if reporter:
            counts = ", ".join(f"{n} {kind}" for kind, n in dodged.items())
            reporter.write_line(f"FAILED: {counts}; this suite treats a skip or an xfail as a failure", red=True)
    rewritten = session.config.stash.get(GOLDEN_REWRITTEN, [])
    if session.config.getoption("--update-golden"):
        if exitstatus == 0:
            session.exitstatus = 1  # a run that rewrote its own expectations proves nothing
        if reporter:
            reporter.write_line("--update-golden rewrote " + (", ".join(rewritten) if rewritten else "nothing")
                                + "; review the diff and rerun without --update-golden", red=True)


def container_binds() -> list[Path]:
    """What a container must see at the same path: this checkout, its venv, the Consul binary."""
    import sys

    from tests.harness.agents import consul_binary as built

    return sorted({REPO, Path(sys.prefix), Path(built()).parent})


@pytest.fixture(scope="session")
def systemd_container(tmp_path_factory: pytest.TempPathFactory) -> Iterator["Container"]:
    """One booted systemd container (real PID 1) in its own network namespace, shared by the session."""
    from tests.harness.nspawn import Container

    require_tool("systemd-nspawn")
    require_tool("nsenter")
    if os.geteuid() != 0:
        pytest.fail("booting a systemd container needs root", pytrace=False)
    network = Network(1, subnet="10.213.78.0/24", tag="s").up()
    container = Container(f"crt{os.getpid() % 100000}", tmp_path_factory.mktemp("nspawn"), netns=network.namespace(0),
                          binds=container_binds())
    try:
        container.start()
        yield container
    finally:
        container.stop()
        network.down()
