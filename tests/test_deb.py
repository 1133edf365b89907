"""The .deb from scripts/package, installed with dpkg into a booted systemd container that has only the system
python3 and no way to a registry: `consulrun install` there, the timer fires and the job runs under the lock
against a real agent, the units verify, and `dpkg -r` leaves no timer that would fire against a missing program.

The container sees this machine's root through an overlay, this checkout included; the checkout is hidden under
a tmpfs inside it, so everything that runs there comes from the package's /opt/consulrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, require_tool
from tests.harness.agents import wait_for
from tests.harness.netns import Network
from tests.harness.nspawn import Container, tear_down

pytestmark = [pytest.mark.systemd, pytest.mark.consul, pytest.mark.slow]

PACKAGED = "/usr/bin/consulrun"


RELEASE = "0.1.0-1"  # what scripts/package names the venv's tree (<version>-<release>) by default
LIVE = "/opt/consulrun"


def package(release: int = 1) -> Path:
    env = {**os.environ, "CONSULRUN_PACKAGE_RELEASE": str(release)}
    result = subprocess.run([str(REPO / "scripts" / "package")], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package, built once for the module and copied out of dist/ (a rebuild rewrites dist/)."""
    built = package()
    copy = tmp_path_factory.mktemp("deb") / built.name
    copy.write_bytes(built.read_bytes())
    return copy


@pytest.fixture(scope="module")
def node(consul_bin: str, deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """A booted container with its own Consul dev agent, the checkout hidden, the .deb in /shared."""
    require_tool("systemd-nspawn")
    if os.geteuid() != 0:
        pytest.fail("booting systemd containers needs root", pytrace=False)
    workdir = tmp_path_factory.mktemp("debnode")
    network = Network(1, subnet="10.213.95.0/24", tag="k").up()
    ctr = agent = None
    try:
        ctr = Container(f"crk{os.getpid() % 100000}", workdir, netns=network.namespace(0),
                        binds=[Path(consul_bin).parent]).start()
        # The checkout and its venv, where the container sees them (not under /tmp: the container has its own).
        ctr.exec("sh", "-c", f'test ! -d "{REPO}" || mount -t tmpfs -o size=1m tmpfs "{REPO}"')
        (ctr.shared / deb.name).write_bytes(deb.read_bytes())
        agent = ctr.spawn(consul_bin, "agent", "-dev", "-node", "debnode", "-client", "127.0.0.1", "-bind",
                          "127.0.0.1", "-hcl", "disable_update_check = true", log=workdir / "consul.log")
        wait_for(lambda: "debnode" in ctr.exec(consul_bin, "catalog", "nodes", check=False).stdout.split(), 60,
                 "the container's Consul agent to elect itself leader")
        yield ctr
    finally:
        tear_down(ctr, agent, network)


def test_same_input_gives_the_same_package(deb: Path) -> None:
    assert package().read_bytes() == deb.read_bytes()


def test_package_holds_the_venv_the_command_the_completions_docs_and_rules(deb: Path) -> None:
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    paths = {line.split()[5].removeprefix(".") for line in listing.splitlines()}
    payload = f"/usr/lib/consulrun/releases/{RELEASE}"  # dpkg's copy; postinst links it to /opt/consulrun/<release>
    for path in (f"{payload}/bin/consulrun", f"{payload}/pyvenv.cfg", "/usr/bin/consulrun",
                 "/usr/share/bash-completion/completions/consulrun", "/usr/share/zsh/vendor-completions/_consulrun",
                 "/usr/share/fish/vendor_completions.d/consulrun.fish", "/usr/share/doc/consulrun/copyright",
                 "/usr/share/doc/consulrun/examples/jobs.yaml", "/usr/share/doc/consulrun/alerts.md",
                 "/usr/share/consulrun/prometheus/consulrun-rules.yml"):
        assert path in paths, path
    assert "/usr/bin/consulrun -> /opt/consulrun/current/bin/consulrun" in listing
    assert not [p for p in paths if p.startswith("/opt/")]  # the live trees are postinst's, never dpkg's to overwrite
    sources = [p for p in paths if p.startswith(f"{payload}/lib/") and p.endswith(".py")]
    uncompiled = [p for p in sources if f"{Path(p).parent}/__pycache__/{Path(p).stem}.cpython-311.pyc" not in paths]
    assert sources and uncompiled == []
    assert not [p for p in paths if "/pip/" in p or p.startswith(f"{payload}/lib/python3.11/site-packages/pip")]
    fields = subprocess.run(["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True).stdout
    assert fields.strip() == "python3 (>= 3.11), python3 (<< 3.12)"


def history(ctr: Container, job: str) -> list[dict]:
    out = ctr.exec(PACKAGED, "history", "/shared/jobs.yaml", job, "--json").stdout
    return json.loads(out)["runs"]


def test_installed_package_runs_a_timer_job_under_the_lock_and_removal_disarms_its_timer(node: Container,
                                                                                      deb: Path) -> None:
    # Nothing of consulrun before the package: not the host's checkout, not a system-wide install, no registry.
    assert node.exec("test", "-e", "/opt/consulrun", check=False).returncode == 1
    assert node.exec("python3", "-c", "import consulrun", check=False).returncode == 1
    offline = node.exec("python3", "-c", "import socket; socket.create_connection(('pypi.org', 443), timeout=5)",
                        check=False)
    assert offline.returncode == 1 and ("gaierror" in offline.stderr or "unreachable" in offline.stderr), offline.stderr

    node.exec("dpkg", "-i", f"/shared/{deb.name}")
    where = node.exec(PACKAGED.replace("bin/consulrun", "bin/env"), "-i", f"/opt/consulrun/{RELEASE}/bin/python", "-c",
                      "import consulrun, jsonschema; print(consulrun.__file__, jsonschema.__file__)").stdout.split()
    assert all(path.startswith(f"/opt/consulrun/{RELEASE}/lib/python3.11/site-packages/") for path in where), where
    assert node.exec("readlink", "/opt/consulrun/current").stdout.strip() == RELEASE
    # bash completion where bash-completion looks, answered by the packaged program.
    completion = node.exec("bash", "-c", "source /usr/share/bash-completion/completions/consulrun; "
                           "COMP_WORDS=(consulrun ins); COMP_CWORD=1; _consulrun_completion consulrun; "
                           "echo \"${COMPREPLY[*]}\"").stdout.split()
    assert "install" in completion and "run" not in completion, completion

    (node.shared / "jobs.yaml").write_text(yaml.safe_dump({
        "defaults": {"lock": {"ttl": "10s", "lock_delay": "5s"}, "timer": {"accuracy": "1s"}},
        "jobs": {"tick": {"command": ["sh", "-c", "echo $CONSULRUN_OCCURRENCE >> /shared/runs"],
                          "schedule": "*:*:0/2"}}}))
    result = node.exec(PACKAGED, "install", "/shared/jobs.yaml", "--consulrun-path", PACKAGED, check=False)
    assert result.returncode == 0, result.stderr
    service = (node.unit_dir / "consulrun-tick.service").read_text()
    assert f"ExecStart={PACKAGED} run " in service

    runs = node.shared / "runs"
    wait_for(lambda: runs.exists() and len(set(runs.read_text().split())) >= 2, 60, "the timer to fire twice")
    occurrences = runs.read_text().split()
    assert len(occurrences) == len(set(occurrences))
    done = [r for r in history(node, "tick") if r.get("exit_status") == 0]
    # Recorded in Consul by the packaged `consulrun run`, each run under a session of this node's agent.
    assert done and {r["node"] for r in done} == {"debnode"}, done
    assert all(r["session"] and r["state"] == "done" for r in done), done
    assert {r["occurrence"] for r in done} <= set(occurrences), (done, occurrences)

    # With the man pages in the package, verify checks the units' Documentation= too.
    has_man = node.exec("test", "-e", "/usr/share/man/man1/consulrun.1.gz", check=False).returncode == 0
    units = [f"/etc/systemd/system/consulrun-tick.{kind}" for kind in ("service", "timer")]
    verify = node.exec("systemd-analyze", "verify", *([] if has_man else ["--man=no"]), *units, check=False)
    assert verify.returncode == 0 and verify.stderr == "", verify.stderr

    removed = node.exec("dpkg", "-r", "consulrun", check=False)
    assert removed.returncode == 0, removed.stderr
    assert ("consulrun: removed; left in /etc/systemd/system, timers stopped and disabled (they run "
            "/usr/bin/consulrun): consulrun-tick.service consulrun-tick.timer") in removed.stderr, removed.stderr
    # The trees go, but one a tick still runs from at this moment (a job is left to finish), which is named; only
    # the byte code shipped was ever in them (no run wrote there).
    if f"left {LIVE}/{RELEASE}: a process still runs from it" in removed.stderr:
        assert node.exec("ls", "-A", LIVE).stdout.split() == [RELEASE]
        # Ended, not just no longer `active`: a oneshot's run is `activating` until its end (and `deactivating`
        # while its reap runs), so `is-active` is never `active` for it. The tree left serves the run to its end.
        wait_for(lambda: node.ended("consulrun-tick.service"), 30, "the last tick to finish")
        assert node.systemctl("show", "-P", "Result", "consulrun-tick.service").stdout.strip() == "success"
        node.exec("rm", "-rf", LIVE)
    assert node.exec("test", "-e", LIVE, check=False).returncode == 1, removed.stderr
    assert node.systemctl("is-enabled", "consulrun-tick.timer", check=False).stdout.strip() == "disabled"
    assert node.systemctl("is-active", "consulrun-tick.timer", check=False).stdout.strip() == "inactive"
    # Nothing enabled or active is left pointing at the missing program.
    leftover = node.systemctl("list-units", "--all", "--no-legend", "--plain", "consulrun-*").stdout
    assert [line for line in leftover.splitlines() if " active " in line and ".timer" in line] == []


# --- an upgrade under running timers ----------------------------------------------------------------------------

NEXT = "0.1.0-2"
# The job's own record of which tree its wrapper runs from: the wrapper's command line (its venv's python).
WHERE = "printf '%s %s\\n' $CONSULRUN_OCCURRENCE \"$(tr '\\0' ' ' < /proc/$PPID/cmdline)\" >> /shared/{out}"


@pytest.fixture(scope="module")
def next_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same source built as the next Debian revision: a newer package whose tree has another name."""
    built = package(release=2)
    copy = tmp_path_factory.mktemp("deb-next") / built.name
    copy.write_bytes(built.read_bytes())
    return copy


def test_upgrade_under_running_timers_swaps_trees_and_the_running_job_finishes(node: Container, deb: Path,
                                                                              next_deb: Path) -> None:
    """dpkg -i of a newer package while a job runs and a timer fires every 2 s (issue #31: an upgrade in place gave
    ModuleNotFoundError and 203/EXEC): no unit fails, the running job ends as it began, from its own tree, the next
    runs come from the new one; old trees go only when nothing runs from them."""
    (node.shared / next_deb.name).write_bytes(next_deb.read_bytes())
    node.exec("dpkg", "-i", f"/shared/{deb.name}")
    (node.shared / "up.yaml").write_text(yaml.safe_dump({
        "defaults": {"lock": {"ttl": "10s", "lock_delay": "5s"}, "timer": {"accuracy": "1s"}},
        "jobs": {"tock": {"command": ["sh", "-c", WHERE.format(out="tock-runs")], "schedule": "*:*:0/2"},
                 "long": {"command": ["sh", "-c", WHERE.format(out="long-runs") + "; exec sleep 12"],
                          "schedule": "*-01-01 00:00:00"}}}))
    result = node.exec(PACKAGED, "install", "/shared/up.yaml", "--consulrun-path", PACKAGED, check=False)
    assert result.returncode == 0, result.stderr
    tock, long_runs = node.shared / "tock-runs", node.shared / "long-runs"
    wait_for(lambda: tock.exists() and f"{LIVE}/{RELEASE}/bin/python" in tock.read_text(), 60, "a run of tock")
    # Older trees: one a process still runs from (its command line names it), one a unit calls by its own path,
    # one nothing uses.
    for old in ("0.0.7-1", "0.0.8-1", "0.0.9-1"):
        node.exec("sh", "-c", f"mkdir -p {LIVE}/{old}/bin && touch {LIVE}/{old}/pyvenv.cfg")
    (node.unit_dir / "old-caller.service").write_text(f"[Service]\nExecStart={LIVE}/0.0.7-1/bin/consulrun --version\n")
    node.exec("systemd-run", "--unit", "old-user", "bash", "-c", f"exec -a {LIVE}/0.0.8-1/bin/python sleep 600")
    node.systemctl("start", "--no-block", "consulrun-long.service")
    wait_for(lambda: long_runs.exists(), 30, "the long job to start")

    upgraded = node.exec("dpkg", "-i", f"/shared/{next_deb.name}", check=False)
    assert upgraded.returncode == 0, upgraded.stderr
    assert node.exec("readlink", f"{LIVE}/current").stdout.strip() == NEXT
    assert f"kept {LIVE}/0.0.8-1: a process still runs from it" in upgraded.stderr, upgraded.stderr
    assert (f"kept {LIVE}/0.0.7-1: units call it (/etc/systemd/system/old-caller.service); install them with "
            "--consulrun-path /usr/bin/consulrun") in upgraded.stderr, upgraded.stderr
    trees = node.exec("ls", LIVE).stdout.split()
    assert sorted(trees) == sorted(["0.0.7-1", "0.0.8-1", RELEASE, NEXT, "bin", "current"]), trees  # 0.0.9-1 went
    # The running wrapper's tree is whole: what it imports lazily at its end is still there.
    assert node.exec(f"{LIVE}/{RELEASE}/bin/python", "-c", "import consulrun.protocol.runner, consulrun.report.status",
                     check=False).returncode == 0
    wait_for(lambda: f"{LIVE}/{NEXT}/bin/python" in tock.read_text(), 60, "a run of tock from the new tree")
    wait_for(lambda: node.ended("consulrun-long.service"), 60, "the long job to finish")
    assert node.systemctl("show", "-P", "Result", "consulrun-long.service").stdout.strip() == "success"
    assert f"{LIVE}/{RELEASE}/bin/python" in long_runs.read_text()  # it ran from the old tree, to its end
    runs = json.loads(node.exec(PACKAGED, "history", "/shared/up.yaml", "long", "--json").stdout)["runs"]
    assert [(r["state"], r.get("exit_status")) for r in runs] == [("done", 0)], runs
    failed = node.systemctl("list-units", "--failed", "--no-legend", "--plain", "consulrun-*").stdout
    assert failed.strip() == "", failed
    log = node.exec("journalctl", "--no-pager", "-o", "cat", "-u", "consulrun-*").stdout
    assert "ModuleNotFoundError" not in log and "203/EXEC" not in log and "Traceback" not in log, log

    # tock fires every 2 s: a run of it in progress would (rightly) keep its tree; stop it for the removal to judge.
    node.systemctl("stop", "consulrun-tock.timer")
    wait_for(lambda: node.systemctl("show", "-P", "ActiveState", "consulrun-tock.service").stdout.strip()
             in ("inactive", "failed"), 60, "tock's last run to end")
    removed = node.exec("dpkg", "-r", "consulrun", check=False)
    assert removed.returncode == 0, removed.stderr
    assert f"left {LIVE}/0.0.8-1: a process still runs from it" in removed.stderr, removed.stderr
    assert node.exec("ls", LIVE).stdout.split() == ["0.0.8-1"]
    node.systemctl("stop", "old-user.service")
    (node.unit_dir / "old-caller.service").unlink()
    node.exec("rm", "-rf", LIVE)


# --- a bare node, from nothing to a firing timer in one command from this machine -------------------------------


@pytest.fixture(scope="module")
def bare_node(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Container, str, Path]]:
    """A booted container with python3, sshd and a Consul agent, and nothing of consulrun: not the checkout, not
    the package (it is not in /shared). Yields the node, its address and the key it accepts for root."""
    require_tool("systemd-nspawn")
    require_tool("ssh")
    if os.geteuid() != 0:
        pytest.fail("booting systemd containers needs root", pytrace=False)
    workdir = tmp_path_factory.mktemp("barenode")
    key = workdir / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    network = Network(1, subnet="10.213.96.0/24", tag="q").up()
    ctr = agent = None
    try:
        ctr = Container(f"crq{os.getpid() % 100000}", workdir, netns=network.namespace(0),
                        binds=[Path(consul_bin).parent])
        ssh_dir = ctr.dir / "upper" / "root" / ".ssh"
        ssh_dir.mkdir(parents=True)
        (ssh_dir / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
        ssh_dir.chmod(0o700)
        ctr.start()
        ctr.exec("sh", "-c", f'test ! -d "{REPO}" || mount -t tmpfs -o size=1m tmpfs "{REPO}"')
        ctr.systemctl("start", "ssh.service")
        agent = ctr.spawn(consul_bin, "agent", "-dev", "-node", "barenode", "-client", "127.0.0.1", "-bind",
                          "127.0.0.1", "-hcl", "disable_update_check = true", log=workdir / "consul.log")
        wait_for(lambda: "barenode" in ctr.exec(consul_bin, "catalog", "nodes", check=False).stdout.split(), 60,
                 "the bare node's Consul agent to elect itself leader")
        yield ctr, network.address(0), key
    finally:
        tear_down(ctr, agent, network)


def test_install_with_package_takes_a_bare_node_to_a_firing_timer_over_ssh(bare_node, deb: Path,
                                                                          tmp_path: Path) -> None:
    ctr, address, key = bare_node
    assert ctr.exec("test", "-e", "/opt/consulrun", check=False).returncode == 1
    assert ctr.exec("test", "-e", PACKAGED, check=False).returncode == 1
    jobs = tmp_path / "bare.yaml"  # on this machine only: it crosses on ssh's standard input
    jobs.write_text(yaml.safe_dump({
        "defaults": {"lock": {"ttl": "10s", "lock_delay": "5s"}, "timer": {"accuracy": "1s"}},
        "jobs": {"tick": {"command": ["sh", "-c", "echo $CONSULRUN_OCCURRENCE >> /shared/bare-runs"],
                          "schedule": "*:*:0/2"}}}))
    ssh = [a for opt in ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", f"IdentityFile={key}",
                         "ConnectTimeout=5", "LogLevel=ERROR") for a in ("--ssh-option", opt)]
    here = str(Path(sys.prefix) / "bin" / "consulrun")  # the operator's consulrun, this checkout's
    result = subprocess.run([here, "install", str(jobs), "--host", f"root@{address}", "--with-package", str(deb),
                             *ssh], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert f"root@{address}: ok" in result.stderr, result.stderr

    assert ctr.exec("dpkg-query", "-W", "-f", "${Status}", "consulrun").stdout == "install ok installed"
    service = (ctr.unit_dir / "consulrun-tick.service").read_text()  # the package's consulrun, not this one
    assert f"ExecStart={PACKAGED} run " in service, service
    runs = ctr.shared / "bare-runs"
    wait_for(lambda: runs.exists() and len(set(runs.read_text().split())) >= 2, 60, "the timer to fire twice")
    (ctr.shared / "bare.yaml").write_text(jobs.read_text())
    done = json.loads(ctr.exec(PACKAGED, "history", "/shared/bare.yaml", "tick", "--json").stdout)["runs"]
    assert [r for r in done if r.get("exit_status") == 0 and r["node"] == "barenode"], done
    # No package file is left behind on the node.
    assert ctr.exec("sh", "-c", "ls -d /tmp/tmp.* 2>/dev/null | wc -l").stdout.strip() == "0"

