"""The harness is real: sessions live and die with the node's agent, as Consul decides."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.agents import Cluster, wait_for

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.consul
def test_dev_agent_is_real_consul(consul) -> None:
    info = consul.get("agent/self")
    assert info["Config"]["Version"] == "1.16.3"
    consul.api("PUT", "kv/harness/probe", data=b"x")
    assert consul.get("kv/harness/probe")[0]["Key"] == "harness/probe"


@pytest.mark.cluster
def test_session_invalidated_when_its_node_agent_dies(cluster: Cluster) -> None:
    node2 = cluster.by_name("node2")
    session = node2.api("PUT", "session/create", json={"Name": "harness-probe", "TTL": "60s"}).json()["ID"]
    info = cluster.server.get(f"session/info/{session}")
    assert info[0]["Node"] == "node2"
    assert "serfHealth" in info[0]["NodeChecks"]
    lock = node2.api("PUT", "kv/harness/lock", params={"acquire": session}, data=b"held").json()
    assert lock is True

    node2.kill()

    # The TTL is 60s: the session can only vanish this fast through serfHealth going critical.
    wait_for(lambda: cluster.server.get(f"session/info/{session}") in ([], None), 30,
             "the servers to invalidate node2's session")
    entry = cluster.server.get("kv/harness/lock")[0]
    assert "Session" not in entry


# --- the suite's own rules: what may never pass as green ------------------------------------------------


def _copy_of_repo(dest: Path) -> Path:
    repo = Path(__file__).resolve().parents[1]
    for part in ("consulrun", "templates", "tests", "examples"):
        shutil.copytree(repo / part, dest / part, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
    shutil.copy(repo / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _pytest(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=where,
                          capture_output=True, text=True, timeout=120)


def test_update_golden_fails_the_run_and_names_the_files_it_rewrote(tmp_path: Path) -> None:
    copy = _copy_of_repo(tmp_path)
    stale = copy / "tests" / "golden" / "minimal" / "expected" / "consulrun-nightly.timer"
    stale.write_text(stale.read_text().replace("OnCalendar=", "OnCalendar=weekly\n#"))
    result = _pytest(copy, "tests/test_generate.py", "-k", "test_golden", "--update-golden")
    assert result.returncode == 1, result.stdout
    assert "--update-golden rewrote tests/golden/minimal/expected/consulrun-nightly.timer" in result.stdout
    assert "weekly" not in stale.read_text()
    again = _pytest(copy, "tests/test_generate.py", "-k", "test_golden", "--update-golden")
    assert again.returncode == 1 and "--update-golden rewrote nothing" in again.stdout, again.stdout
    assert _pytest(copy, "tests/test_generate.py", "-k", "test_golden").returncode == 0


def test_xfail_and_skip_fail_the_run(tmp_path: Path) -> None:
    copy = _copy_of_repo(tmp_path)
    (copy / "tests" / "test_dodge.py").write_text(
        "import pytest\n\n@pytest.mark.xfail(reason='known')\ndef test_x():\n    assert False\n\n"
        "def test_s():\n    pytest.skip('later')\n\ndef test_ok():\n    pass\n")
    for name, words in (("test_x", "1 xfailed"), ("test_s", "1 skipped")):
        result = _pytest(copy, f"tests/test_dodge.py::{name}")
        assert result.returncode == 1, result.stdout
        assert f"FAILED: {words}; this suite treats a skip or an xfail as a failure" in result.stdout
    assert _pytest(copy, "tests/test_dodge.py::test_ok").returncode == 0


def test_a_module_that_shares_a_booted_fixture_runs_on_one_worker() -> None:
    """tests/conftest.py marks such modules with xdist_group; pytest 9.2 made xdist ignore the mark (its issue
    #1386: the group rides on the node id, which 9.2 no longer lets it change), so pytest stays below 9.2."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                             "-v", "tests/test_remote.py", "-k", "good_hosts or bad_hosts"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    workers = {line.split("]")[0] for line in result.stdout.splitlines() if " PASSED " in line}
    assert len(workers) == 1 and sum(" PASSED " in line for line in result.stdout.splitlines()) > 4, result.stdout


# --- the private LAN: a killed run's leftovers do not block the next run -----------------------------------


def _routed(net: str) -> str:
    return subprocess.run(["ip", "route", "show", net], capture_output=True, text=True, check=True).stdout.strip()


def test_a_killed_runs_network_is_cleared_and_a_live_one_is_refused() -> None:
    """A run killed before its teardown left its bridge and namespace; CI failed on that once (subnet already routed)."""
    from tests.harness.netns import Network

    subnet = "10.213.79.0/24"
    leftover = Network(1, subnet=subnet, tag="zl").up()
    # The same pid made it, but a killed run's pid is gone: fake that by writing a dead owner into its alias.
    subprocess.run(["ip", "link", "set", "dev", leftover.bridge, "alias", "consulrun-test:999999999:1"], check=True)
    fresh = Network(1, subnet=subnet, tag="zf")
    try:
        fresh.up()
        subnet = str(fresh.net)  # a parallel worker moves it (CONSULRUN_TEST_NET_PREFIX)
        assert f"dev {fresh.bridge} " in _routed(subnet) + " "
        gone = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert leftover.namespace(0) not in gone and fresh.namespace(0) in gone
        assert subprocess.run(["ip", "link", "show", leftover.bridge], capture_output=True).returncode != 0

        # A network whose owner lives (this process) is not touched, and neither is one with a process inside.
        with pytest.raises(RuntimeError, match="already routed"):
            Network(1, subnet=subnet, tag="zs").up()
        subprocess.run(["ip", "link", "set", "dev", fresh.bridge, "alias", "consulrun-test:999999999:1"], check=True)
        sleeper = subprocess.Popen(["ip", "netns", "exec", fresh.namespace(0), "sleep", "60"])
        try:
            wait_for(lambda: subprocess.run(["ip", "netns", "pids", fresh.namespace(0)], capture_output=True,
                                            text=True).stdout.strip() != "", 10, "the sleeper to enter the namespace")
            with pytest.raises(RuntimeError, match="already routed"):
                Network(1, subnet=subnet, tag="zs").up()
            assert f"dev {fresh.bridge} " in _routed(subnet) + " "
        finally:
            sleeper.kill()
            sleeper.wait()
    finally:
        fresh.down()
        leftover.down()
    assert _routed(subnet) == ""
