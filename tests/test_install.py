"""`consulrun install` on real systemd (nspawn containers) and over real ssh to three nodes."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from consulrun.protocol import keys as kvkeys
from tests.conftest import artifact_dir, container_binds, require_tool
from tests.harness.agents import consul_binary as consul_bin_path
from tests.harness.agents import wait_for
from tests.harness.booted import agent_node, boot, start_agent  # noqa: F401 - other modules use them here
from tests.harness.netns import Network
from tests.harness.nspawn import Container, tear_down

pytestmark = [pytest.mark.systemd, pytest.mark.consul]

CONSULRUN = str(Path(sys.prefix) / "bin" / "consulrun")


def manifest(jobs: dict[str, dict], **top: object) -> str:
    base = {"defaults": {"lock": {"ttl": "10s", "lock_delay": "5s"}, "timer": {"accuracy": "1s"}}}
    return yaml.safe_dump({**base, **top, "jobs": jobs})


def tick_job(every: str = "*:*:0/2", extra: dict | None = None) -> dict:
    return {"command": ["sh", "-c", "echo $CONSULRUN_OCCURRENCE $(hostname) >> /shared/runs"], "schedule": every,
            **(extra or {})}


@pytest.fixture(scope="module")
def node(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """One booted node with a Consul dev agent of its own."""
    with agent_node(consul_bin, tmp_path_factory.mktemp("install"), "10.213.80.0/24", "i") as ctr:
        yield ctr


def install(ctr: Container, text: str, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    path = ctr.shared / "jobs.yaml"
    path.write_text(text)
    return ctr.exec(CONSULRUN, "install", "/shared/jobs.yaml", *args, check=check)


def show(ctr: Container, unit: str, *props: str) -> dict[str, str]:
    """systemd's own view of a unit: the named properties, as `systemctl show` gives them."""
    out = ctr.systemctl("show", unit, "-p", ",".join(props)).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if "TimersCalendar" in values:  # the next elapse moves every time the timer fires; the spec is what counts
        values["TimersCalendar"] = re.sub(r" ; next_elapse=[^}]*", "", values["TimersCalendar"])
    return values


def agent_get(ctr: Container, path: str) -> object:
    """GET /v1/<path> from the node's own agent (it listens on the container's loopback only)."""
    code = ("import json, sys, urllib.request\n"
            "print(urllib.request.urlopen('http://127.0.0.1:8500/v1/' + sys.argv[1], timeout=10).read().decode())")
    return json.loads(ctr.exec(sys.executable, "-c", code, path).stdout)


def journal(ctr: Container, unit: str) -> str:
    return ctr.exec("journalctl", "--no-pager", "-o", "cat", "-u", unit).stdout


TIMER_STATE = ("ActiveState", "ActiveEnterTimestampMonotonic", "TimersCalendar", "UnitFileState")


def test_install_enables_timer_that_fires_and_second_install_is_a_no_op(node: Container) -> None:
    runs = node.shared / "runs"
    runs.unlink(missing_ok=True)
    text = manifest({"tick": tick_job()})
    result = install(node, text)
    assert result.returncode == 0, result.stderr
    assert "installed: 2 added, 0 changed, 0 removed" in result.stdout
    timers = node.systemctl("list-timers", "--all", "--no-legend").stdout
    assert "consulrun-tick.timer" in timers
    assert node.systemctl("is-enabled", "consulrun-tick.timer").stdout.strip() == "enabled"
    # The timer fires for real and the unit's `consulrun run` takes the lock from the node's agent.
    wait_for(lambda: runs.exists() and len(set(runs.read_text().split("\n")) - {""}) >= 2, 30,
             "the timer to fire twice")
    occurrences = [line.split()[0] for line in runs.read_text().splitlines()]
    assert len(occurrences) == len(set(occurrences))
    before = show(node, "consulrun-tick.timer", *TIMER_STATE)
    again = install(node, text)
    assert again.returncode == 0 and again.stdout.startswith("up to date"), again.stdout + again.stderr
    # No systemctl call: a restart or re-enable would have moved the timer's activation time.
    assert show(node, "consulrun-tick.timer", "ActiveEnterTimestampMonotonic", "UnitFileState") == \
        {k: before[k] for k in ("ActiveEnterTimestampMonotonic", "UnitFileState")}


def test_job_removed_from_manifest_disappears(node: Container) -> None:
    assert install(node, manifest({"tick": tick_job(), "gone": tick_job("hourly")})).returncode == 0
    assert (node.unit_dir / "consulrun-gone.timer").exists()
    result = install(node, manifest({"tick": tick_job()}))
    assert result.returncode == 0, result.stderr
    assert "0 added, 0 changed, 2 removed" in result.stdout
    assert not (node.unit_dir / "consulrun-gone.timer").exists()
    assert not (node.unit_dir / "consulrun-gone.service").exists()
    assert "consulrun-gone" not in node.systemctl("list-timers", "--all", "--no-legend").stdout


def test_dry_run_changes_nothing(node: Container) -> None:
    assert install(node, manifest({"tick": tick_job()})).returncode == 0
    before = {p.name: p.read_bytes() for p in node.unit_dir.glob("consulrun-*")}
    state = show(node, "consulrun-tick.timer", *TIMER_STATE)
    result = install(node, manifest({"tick": tick_job("*:*:0/4"), "new": tick_job("daily")}), "--dry-run")
    assert result.returncode == 0
    assert "+OnCalendar=*:*:0/4" in result.stdout
    assert "would run: systemctl enable --now consulrun-new.timer" in result.stdout
    assert {p.name: p.read_bytes() for p in node.unit_dir.glob("consulrun-*")} == before
    assert show(node, "consulrun-tick.timer", *TIMER_STATE) == state
    assert show(node, "consulrun-new.timer", "LoadState")["LoadState"] == "not-found"


def test_foreign_unit_with_our_name_is_refused(node: Container) -> None:
    assert install(node, manifest({"tick": tick_job()})).returncode == 0
    foreign = node.unit_dir / "consulrun-mine.timer"
    foreign.write_text("[Timer]\nOnCalendar=weekly\n")
    try:
        before = {p.name: p.read_bytes() for p in node.unit_dir.glob("consulrun-*")}
        result = install(node, manifest({"tick": tick_job("*:*:0/4"), "mine": tick_job("daily")}))
        assert result.returncode == 74
        assert "consulrun-mine.timer: exists and was not generated by consulrun" in result.stderr
        assert {p.name: p.read_bytes() for p in node.unit_dir.glob("consulrun-*")} == before
    finally:
        foreign.unlink()


def test_systemctl_failure_midway_restores_previous_units(node: Container, tmp_path: Path) -> None:
    assert install(node, manifest({"tick": tick_job()})).returncode == 0
    before = {p.name: p.read_bytes() for p in node.unit_dir.glob("consulrun-*")}
    broken = node.shared / "broken-templates"
    broken.mkdir(exist_ok=True)
    (broken / "timer.j2").write_text("{{ header }}\n[Timer]\nOnCalendar=not a calendar\nUnit={{ service_name }}\n"
                                     "[Install]\nWantedBy=timers.target\n")
    result = install(node, manifest({"tick": tick_job("*:*:0/4"), "extra": tick_job("daily")}),
                     "--templates", "/shared/broken-templates")
    assert result.returncode == 1
    assert "install failed, previous units restored" in result.stderr
    assert {p.name: p.read_bytes() for p in node.unit_dir.glob("consulrun-*")} == before
    # systemd itself is back on the old units: the old calendar, the extra timer unknown.
    state = show(node, "consulrun-tick.timer", "ActiveState", "TimersCalendar")
    assert state["ActiveState"] == "active"
    assert "OnCalendar=*-*-* *:*:00/2" in state["TimersCalendar"] and "00/4" not in state["TimersCalendar"], state
    assert show(node, "consulrun-extra.timer", "LoadState")["LoadState"] == "not-found"


def test_unwritable_unit_dir_fails_cleanly(node: Container) -> None:
    result = install(node, manifest({"tick": tick_job()}), "--unit-dir", "/sys/consulrun-units")
    assert result.returncode == 1
    assert result.stderr.startswith("Error: install failed, previous units restored: /sys/consulrun-units")
    assert result.stderr.count("\n") == 1 and ("read-only file system" in result.stderr.lower()
                                               or "no such file" in result.stderr.lower()), result.stderr


def test_no_start_enables_without_starting(node: Container) -> None:
    result = install(node, manifest({"later": tick_job("daily")}), "--no-start")
    assert result.returncode == 0, result.stderr
    assert "systemctl enable consulrun-later.timer" in result.stdout and "--now" not in result.stdout
    state = show(node, "consulrun-later.timer", "UnitFileState", "ActiveState")
    assert state == {"UnitFileState": "enabled", "ActiveState": "inactive"}


def test_root_installs_into_an_image_offline(node: Container) -> None:
    image = "/var/tmp/image"
    node.exec("mkdir", "-p", f"{image}{Path(CONSULRUN).parent}")
    node.exec("cp", CONSULRUN, f"{image}{CONSULRUN}")  # units call the image's consulrun; it must exist there
    result = install(node, manifest({"imaged": tick_job("daily")}), "--root", image, "--consulrun-path", CONSULRUN)
    assert result.returncode == 0, result.stderr
    assert "installed: 2 added, 0 changed, 0 removed" in result.stdout
    assert "daemon-reload" not in result.stdout and "--now" not in result.stdout
    units = node.merged / image.lstrip("/") / "etc" / "systemd" / "system"
    assert sorted(p.name for p in units.glob("consulrun-*")) == ["consulrun-imaged.service", "consulrun-imaged.timer"]
    assert (units / "timers.target.wants" / "consulrun-imaged.timer").is_symlink()  # enabled in the image
    # The running system is untouched: its systemd has never heard of the unit.
    assert show(node, "consulrun-imaged.timer", "LoadState")["LoadState"] == "not-found"
    assert not (node.unit_dir / "consulrun-imaged.timer").exists()
    missing = install(node, manifest({"imaged": tick_job("daily")}), "--root", image, "--consulrun-path",
                      "/usr/bin/no-consulrun")
    assert missing.returncode == 2
    assert (f"{image}/usr/bin/no-consulrun: no executable consulrun at /usr/bin/no-consulrun inside {image}, where "
            "the units run it: install consulrun into that root\n") in missing.stderr


def test_load_credential_root_only_token_with_another_user(node: Container) -> None:
    # A system user of the container's own, who can reach (not read or write) the interpreter's folders.
    node.exec("sh", "-c", "id cruser || useradd --system --no-create-home --shell /usr/sbin/nologin cruser")
    for folder in Path(os.path.realpath(sys.executable)).parents:  # e.g. a pyenv under a 0700 /root
        if not os.stat(folder).st_mode & 0o001:
            node.exec("chmod", "o+x", str(folder))  # in the container's overlay only
    token = "5cfa3c1e-0000-4000-8000-00000000c0de"
    node.exec("sh", "-c", f"mkdir -p /etc/consulrun && umask 077 && printf '%s\\n' {token} > /etc/consulrun/token")
    assert node.exec("stat", "-c", "%a %U", "/etc/consulrun/token").stdout.split() == ["600", "root"]
    job = {"command": ["sh", "-c", 'echo "user=$(id -un) token=$(cat "$CONSUL_HTTP_TOKEN_FILE")"; '
                                   "cat /etc/consulrun/token || echo direct-read-refused"],
           "schedule": "*-01-01 00:00:00", "user": "cruser", "pass_consul_token": True}  # the job asks for it
    result = install(node, manifest({"cred": job}, consul={"token_file": "/etc/consulrun/token"}))
    assert result.returncode == 0, result.stderr
    unit = (node.unit_dir / "consulrun-cred.service").read_text()
    assert "LoadCredential=consul-token:/etc/consulrun/token" in unit and token not in unit
    started = node.systemctl("start", "consulrun-cred.service", check=False)
    assert started.returncode == 0, started.stderr + journal(node, "consulrun-cred.service")
    log = journal(node, "consulrun-cred.service")
    # The wrapper (as cruser) read the credential, took the lock, and the job saw the token; the file stays root's.
    assert "acquired consulrun/cred/lock" in log and f"user=cruser token={token}" in log, log
    assert "direct-read-refused" in log and "readable by others" not in log, log


def test_skip_exit_code_is_a_success_for_systemd(node: Container) -> None:
    job = {"command": ["true"], "schedule": "*-01-01 00:00:00", "lock": {"skip_exit_code": 42}}
    assert install(node, manifest({"skipper": job})).returncode == 0
    assert node.systemctl("start", "consulrun-skipper.service", check=False).returncode == 0
    second = node.systemctl("start", "consulrun-skipper.service", check=False)  # same occurrence: skipped, 42
    state = show(node, "consulrun-skipper.service", "Result", "ExecMainStatus", "ActiveState")
    assert second.returncode == 0 and state == {"Result": "success", "ExecMainStatus": "42", "ActiveState": "inactive"}, \
        (state, second.stderr)
    log = journal(node, "consulrun-skipper.service")
    assert log.count("acquired consulrun/skipper/lock") == 1 and log.count("skipper: skipped") == 1, log


def test_timeout_stops_the_job_and_frees_the_lock(node: Container) -> None:
    job = {"command": ["sleep", "300"], "schedule": "*-01-01 00:00:00", "timeout": "3s"}
    assert install(node, manifest({"slow": job})).returncode == 0
    unit = (node.unit_dir / "consulrun-slow.service").read_text()
    # The wrapper enforces the timeout from the job's start; systemd's TimeoutStartSec= is only a backstop.
    assert "--timeout 3s" in unit and "TimeoutStartSec=3s" not in unit and "TimeoutStartSec=" in unit, unit
    result = node.systemctl("start", "consulrun-slow.service", check=False)
    assert result.returncode != 0
    state = show(node, "consulrun-slow.service", "Result", "ActiveState", "MainPID", "TasksCurrent", "ExecMainStatus")
    assert (state["Result"], state["ActiveState"], state["MainPID"], state["ExecMainStatus"]) == \
        ("exit-code", "failed", "0", "143"), state
    assert state["TasksCurrent"] in ("0", "[not set]"), state  # nothing of the job is left
    log = journal(node, "consulrun-slow.service")
    assert "acquired consulrun/slow/lock" in log and "the job exceeded its timeout of 3s" in log, log
    lock = agent_get(node, "kv/consulrun/slow/lock")[0]
    assert "Session" not in lock and agent_get(node, "session/list") == []


# --- checks made before anything is touched, and the fan-out, without a node ---------------------------


def test_version_check_refuses_another_consulrun(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from consulrun import __version__
    from consulrun.cli import main

    major, minor = (int(x) for x in __version__.split(".")[:2])
    path = tmp_path / "jobs.yaml"
    path.write_text(manifest({"v": tick_job("daily")}))
    units = tmp_path / "units"
    for version, accepted in ((f"{major}.{minor}.999", True), (f"{major}.{minor + 1}.0", False),
                              (f"{major + 1}.{minor}.0", False)):
        fake = tmp_path / f"consulrun-{version}"
        fake.write_text(f"#!/bin/sh\necho 'consulrun, version {version}'\n")
        fake.chmod(0o755)
        result = CliRunner().invoke(main, ["install", str(path), "--unit-dir", str(units), "--consulrun-path", str(fake),
                                           "--dry-run"])
        if accepted:
            assert result.exit_code == 0 and "would run: systemctl enable --now consulrun-v.timer" in result.stdout, \
                result.stderr
        else:
            assert result.exit_code == 2
            assert f"{fake} is consulrun {version}, this is {__version__}: units and installer must be the same " \
                   "major.minor version" in result.stderr
    result = CliRunner().invoke(main, ["install", str(path), "--unit-dir", str(units), "--consulrun-path",
                                       str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "the consulrun the units would call does not exist" in result.stderr
    assert not units.exists()


FAKE_SSH = """#!/usr/bin/env python3
# Stands in for ssh: records what it was given, and meets the other copies running at the same moment.
import os, sys, time
log, parallel, total = sys.argv[0] + ".d", int(os.environ["FAKE_SSH_PARALLEL"]), int(os.environ["FAKE_SSH_HOSTS"])
args = sys.argv[1:]
host = args[args.index("--") + 1]  # ssh -o ... -- HOST COMMAND
if host.startswith("down"):
    print(f"ssh: connect to host {host} port 22: No route to host", file=sys.stderr)
    sys.exit(255)
with open(f"{log}/stdin-{host}", "w") as f:
    f.write(sys.stdin.read())
with open(f"{log}/argv-{host}", "w") as f:
    f.write("\\0".join(args))
open(f"{log}/started-{host}", "w").close()
open(f"{log}/running-{host}", "w").close()
deadline = time.monotonic() + 20
# A barrier: wait until as many copies run as --parallel allows (or every host has started).
while True:
    running = len([n for n in os.listdir(log) if n.startswith("running-")])
    started = len([n for n in os.listdir(log) if n.startswith("started-")])
    with open(f"{log}/seen", "a") as f:
        f.write(f"{running}\\n")
    if running >= parallel or started >= total:
        break
    if time.monotonic() > deadline:
        print("barrier: fewer copies ran at once than --parallel allows", file=sys.stderr)
        sys.exit(1)
    time.sleep(0.05)
os.unlink(f"{log}/running-{host}")
print(f"installed: 2 added, 0 changed, 0 removed ({host})")
"""


def test_hosts_file_and_parallel_fan_out(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    (bindir / "ssh.d").mkdir(parents=True)
    (bindir / "ssh").write_text(FAKE_SSH)
    (bindir / "ssh").chmod(0o755)
    hosts = ["root@n1", "n2", "n3", "down4", "n5"]
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("# the fleet\nroot@n1\n\nn2  # rack 2\nn3\ndown4\nn5\n")
    text = manifest({"fan": tick_job("daily")})
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_SSH_PARALLEL": "2",
           "FAKE_SSH_HOSTS": str(len(hosts) - 1)}
    result = subprocess.run([CONSULRUN, "install", str(path), "--hosts-file", str(hosts_file), "--parallel", "2",
                             "--consulrun-path", "/opt/consulrun", "--no-start", "--ssh-option", "ConnectTimeout=3"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stderr
    rows = [line.split(None, 2) for line in result.stdout.splitlines()]
    assert rows[0] == ["HOST", "RESULT", "DETAIL"] and [r[0] for r in rows[1:]] == hosts  # the file's order
    assert {r[0]: r[1] for r in rows[1:]} == {h: "FAILED" if h == "down4" else "ok" for h in hosts}
    assert "ssh failed: ssh: connect to host down4 port 22: No route to host" in result.stdout
    assert "install failed on 1 of 5 node(s): down4" in result.stderr
    assert sorted(line.split("]")[0] for line in result.stderr.splitlines() if line.startswith("[")) == \
        [f"[{i}/5" for i in range(1, 6)]
    log = bindir / "ssh.d"
    assert max(int(n) for n in (log / "seen").read_text().split()) == 2  # two at a time: never more, and really two
    for host in ("root@n1", "n2", "n3", "n5"):
        assert (log / f"stdin-{host}").read_text() == text  # only the manifest crosses, on standard input
        argv = (log / f"argv-{host}").read_text().split("\0")
        assert argv[:2] == ["-o", "BatchMode=yes"] and ["-o", "ConnectTimeout=3"] == argv[2:4]
        # The host after `--` (never read as an option), the remote command one string quoted for the remote shell.
        assert argv[argv.index("--") + 1:] == [host, "/opt/consulrun install - --no-start --unit-dir "
                                                     "/etc/systemd/system --consulrun-path /opt/consulrun --name jobs"]


def test_per_job_unit_settings_and_shell_reach_the_running_job(node: Container) -> None:
    """service: settings (from defaults and the job), a timer: setting and shell: true, on a real systemd."""
    out = node.shared / "settings"
    out.unlink(missing_ok=True)
    node.exec("sh", "-c", "printf 'hello world' > /etc/greeting")  # SetCredential= is refused: it is in the unit
    job = {"command": "echo $(nice) $(umask) $(cat \"$CREDENTIALS_DIRECTORY/greeting\") | tee -a /shared/settings",
           "shell": True, "schedule": "*:*:0/2",
           "service": {"Nice": 7, "LoadCredential": "greeting:/etc/greeting", "CPUQuota": "50%"},
           "timer": {"WakeSystem": False}}
    text = manifest({"tuned": job}, defaults={"lock": {"ttl": "10s", "lock_delay": "5s"}, "timer": {"accuracy": "1s"},
                                              "service": {"UMask": "0027", "Nice": 3}})
    result = install(node, text)
    assert result.returncode == 0, result.stderr
    try:
        wait_for(lambda: out.exists() and out.read_text().strip() != "", 30, "the job to run once")
        assert out.read_text().splitlines()[0] == "7 0027 hello world"
        shown = node.systemctl("show", "-p", "CPUQuotaPerSecUSec", "consulrun-tuned.service").stdout.strip()
        assert shown == "CPUQuotaPerSecUSec=500ms"
        assert node.systemctl("show", "-p", "WakeSystem", "consulrun-tuned.timer").stdout.strip() == "WakeSystem=no"
    finally:
        assert install(node, manifest({"tick": tick_job("daily")})).returncode == 0


# --- three nodes over ssh ------------------------------------------------------------------------------


@contextmanager
def ssh_cluster(consul_bin: str, workdir: Path, subnet: str, tag: str) -> Iterator[tuple[list[Container], Network, Path]]:
    """Three booted nodes on one bridge, sshd in each, Consul server on node1 and clients on node2/3; all gone after.

    Every node holds the key it accepts, and an ssh config that uses it for the
    others, so a consulrun on one node can reach another (`trigger --host`).
    """
    require_tool("ssh")
    network = Network(3, subnet=subnet, tag=tag).up()
    key = workdir / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    nodes: list[Container] = []
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for index in range(3):
            ctr = Container(f"cr{tag}{index + 1}-{os.getpid() % 10000}", workdir, netns=network.namespace(index),
                            binds=container_binds())
            nodes.append(ctr)
            ssh_dir = ctr.dir / "upper" / "root" / ".ssh"
            ssh_dir.mkdir(parents=True)
            (ssh_dir / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
            (ssh_dir / "id_ed25519").write_text(key.read_text())
            (ssh_dir / "id_ed25519").chmod(0o600)
            (ssh_dir / "config").write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                                            "  ConnectTimeout 3\n  LogLevel ERROR\n")
            ssh_dir.chmod(0o700)
            ctr.start()
            ctr.systemctl("start", "ssh.service")
        server_ip = network.address(0)
        for index, ctr in enumerate(nodes):
            ip = network.address(index)
            common = ["-bind", ip, "-client", "127.0.0.1", "-data-dir", f"/var/lib/c{index}",
                      "-hcl", 'ports { dns = -1 }', "-hcl", "performance { raft_multiplier = 1 }"]
            role = ["-server", "-bootstrap-expect=1", "-ui"] if index == 0 else ["-retry-join", server_ip]
            agents.append(start_agent(ctr, consul_bin, f"node{index + 1}", common + role,
                                      workdir / f"consul-node{index + 1}.log"))
        yield nodes, network, key
    finally:
        for proc in agents:  # the agent itself, not only nsenter: one left inside keeps its node from powering off
            Container.end_spawned(proc)
        for ctr in nodes:  # all three power off at once, then each is waited for
            ctr.power_off()
        for ctr in nodes:
            ctr.stop()
        network.down()


@pytest.fixture(scope="module")
def three_nodes(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Container], Network, Path]]:
    with ssh_cluster(consul_bin, tmp_path_factory.mktemp("three"), "10.213.81.0/24", "h") as cluster:
        yield cluster


def ssh_install(network: Network, key: Path, text: str, workdir: Path, hosts: list[str]) -> subprocess.CompletedProcess[str]:
    path = workdir / "cluster.yaml"
    path.write_text(text)
    return subprocess.run(
        [CONSULRUN, "install", str(path), "--consulrun-path", CONSULRUN, *[a for h in hosts for a in ("--host", h)],
         "--ssh-option", "StrictHostKeyChecking=no", "--ssh-option", "UserKnownHostsFile=/dev/null",
         "--ssh-option", f"IdentityFile={key}", "--ssh-option", "ConnectTimeout=3", "--ssh-option", "LogLevel=ERROR"],
        capture_output=True, text=True, timeout=300)


def test_three_nodes_over_ssh_every_occurrence_once(three_nodes, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    nodes, network, key = three_nodes
    hosts = [f"root@{network.address(i)}" for i in range(3)]
    text = manifest({"every5": tick_job("*:*:0/5", {"timer": {"randomized_delay": "3s"}, "history": 100})})
    result = ssh_install(network, key, text, tmp_path, hosts)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0].split() == ["HOST", "RESULT", "DETAIL"]
    assert all(f"{h}" in result.stdout for h in hosts) and "FAILED" not in result.stdout
    for ctr in nodes:
        assert "consulrun-every5.timer" in ctr.systemctl("list-timers", "--all", "--no-legend").stdout
    first = time.time()
    # Twelve consecutive 5-second occurrences, from the first one every timer surely saw, must each be run and
    # recorded; poll for that (files and Consul's history) instead of sleeping through a fixed window.
    due = {time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) for t in range(int(first) // 5 * 5 + 10, int(first) + 70, 5)}

    def runs() -> list[list[str]]:
        return [line.split() for ctr in nodes if (ctr.shared / "runs").exists()
                for line in (ctr.shared / "runs").read_text().splitlines()]

    def recorded() -> dict[str, dict]:
        exported = json.loads(nodes[0].exec(consul_bin_path(), "kv", "export", "consulrun/every5/history/").stdout)
        return {kvkeys.history_order(e["key"])[0]: json.loads(base64.b64decode(e["value"])) for e in exported}

    try:
        wait_for(lambda: due <= {occ for occ, _ in runs()} and
                 all(recorded().get(occ, {}).get("state") == "done" for occ in due), 150,
                 "every due occurrence to be run and recorded", interval=2)
    finally:
        artifact_dir(request.node).mkdir(parents=True, exist_ok=True)
        (artifact_dir(request.node) / "runs.txt").write_text("\n".join(" ".join(x) for x in runs()))
    lines, history = runs(), recorded()
    counts = Counter(occ for occ, _ in lines)
    assert max(counts.values()) == 1, counts  # no occurrence ran twice, anywhere
    assert len({host for occ, host in lines if occ in due}) >= 2  # the work really is spread over nodes
    # Consul's own record agrees: one history entry per occurrence, naming the node whose job wrote it.
    for occ, host in lines:
        if occ in due:
            assert history[occ]["state"] == "done" and history[occ]["exit_status"] == 0
            assert history[occ]["node"] == f"node{int(host.split('-')[0][3:])}"
    again = ssh_install(network, key, text, tmp_path, hosts)
    assert again.returncode == 0 and again.stdout.count("up to date") == 3, again.stdout


def test_unreachable_host_among_three(three_nodes, tmp_path: Path) -> None:
    nodes, network, key = three_nodes
    nowhere = f"root@{network.net.network_address + 99}"  # on the bridge's subnet, but no node has it
    hosts = [f"root@{network.address(0)}", f"root@{network.address(1)}", nowhere]
    result = ssh_install(network, key, manifest({"quiet": tick_job("daily")}), tmp_path, hosts)
    assert result.returncode == 1
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "ok" in rows[hosts[0]].split()[1] and "ok" in rows[hosts[1]].split()[1]
    assert rows[nowhere].split()[1] == "FAILED" and "ssh failed" in rows[nowhere]
    assert f"install failed on 1 of 3 node(s): {nowhere}" in result.stderr
    for ctr in nodes[:2]:
        assert (ctr.unit_dir / "consulrun-quiet.timer").exists()


def install_as(ctr: Container, filename: str, text: str | None, *args: str,
               command: str = "install") -> subprocess.CompletedProcess[str]:
    """`install` (or `uninstall`) of the manifest /shared/<filename>: its file name is its name."""
    if text is not None:
        (ctr.shared / filename).write_text(text)
    return ctr.exec(CONSULRUN, command, f"/shared/{filename}", *args, check=False)


def test_two_manifests_add_up_and_uninstall_removes_only_one(node: Container) -> None:
    alpha = ["consulrun-alpha.service", "consulrun-alpha.timer"]
    result = install_as(node, "a.yaml", manifest({"alpha": tick_job("daily"), "alpha2": tick_job("daily")}))
    assert result.returncode == 0, result.stderr
    result = install_as(node, "b.yaml", manifest({"beta": tick_job("daily")}))
    assert result.returncode == 0, result.stderr
    assert "installed: 2 added, 0 changed, 0 removed" in result.stdout and "removed:" not in result.stdout
    for timer in ("consulrun-alpha.timer", "consulrun-alpha2.timer", "consulrun-beta.timer"):
        assert node.systemctl("is-enabled", timer).stdout.strip() == "enabled", timer

    clash = install_as(node, "c.yaml", manifest({"alpha": tick_job("hourly")}))
    assert clash.returncode == 2 and clash.stdout == ""
    assert "consulrun-alpha.service belongs to manifest 'a', not to 'c'" in clash.stderr
    assert "OnCalendar=daily" in (node.unit_dir / "consulrun-alpha.timer").read_text()

    result = install_as(node, "a.yaml", manifest({"alpha": tick_job("daily")}))
    assert result.returncode == 0, result.stderr
    assert "removed: consulrun-alpha2.service, consulrun-alpha2.timer\n" in result.stdout

    before = {p.name: p.read_bytes() for p in node.unit_dir.glob("consulrun-*")}
    result = install_as(node, "a.yaml", None, "--dry-run", command="uninstall")
    assert result.returncode == 0, result.stderr
    assert f"would remove: {', '.join(alpha)}\n" in result.stdout
    assert "would run: systemctl disable --now consulrun-alpha.timer\n" in result.stdout
    assert {p.name: p.read_bytes() for p in node.unit_dir.glob("consulrun-*")} == before

    result = install_as(node, "a.yaml", None, command="uninstall")
    assert result.returncode == 0, result.stderr
    assert "uninstalled: 0 added, 0 changed, 2 removed" in result.stdout
    assert not any((node.unit_dir / n).exists() for n in alpha)
    assert show(node, "consulrun-alpha.timer", "LoadState")["LoadState"] == "not-found"
    assert node.systemctl("is-enabled", "consulrun-beta.timer").stdout.strip() == "enabled"
    again = install_as(node, "a.yaml", None, command="uninstall")
    assert (again.returncode, again.stdout) == (0, f"nothing to remove: no unit of manifest 'a' in {node.unit_dir}\n") \
        or again.stdout.startswith("nothing to remove: no unit of manifest 'a'"), again.stdout

    image = "/var/tmp/image-b"  # offline, into an image: disabled there, nothing stopped here
    node.exec("mkdir", "-p", f"{image}{Path(CONSULRUN).parent}")
    node.exec("cp", CONSULRUN, f"{image}{CONSULRUN}")
    assert install_as(node, "b.yaml", None, "--root", image, "--consulrun-path", CONSULRUN).returncode == 0
    units = node.merged / image.lstrip("/") / "etc" / "systemd" / "system"
    assert (units / "timers.target.wants" / "consulrun-beta.timer").is_symlink()
    result = install_as(node, "b.yaml", None, "--root", image, command="uninstall")
    assert result.returncode == 0, result.stderr
    assert "daemon-reload" not in result.stdout and "--now" not in result.stdout
    assert list(units.glob("consulrun-*")) == []
    assert not (units / "timers.target.wants" / "consulrun-beta.timer").exists()
    assert node.systemctl("is-enabled", "consulrun-beta.timer").stdout.strip() == "enabled"  # the live one stays
    assert install_as(node, "b.yaml", None, command="uninstall").returncode == 0
