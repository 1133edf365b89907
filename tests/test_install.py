"""`consulrun install` on real systemd (nspawn containers) and over real ssh to three nodes."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import artifact_dir, container_binds, require_tool
from tests.harness.agents import consul_binary as consul_bin_path
from tests.harness.agents import wait_for
from tests.harness.netns import Network
from tests.harness.nspawn import Container

pytestmark = [pytest.mark.systemd, pytest.mark.consul]

CONSULRUN = str(Path(sys.prefix) / "bin" / "consulrun")


def manifest(jobs: dict[str, dict], **top: object) -> str:
    base = {"defaults": {"lock": {"ttl": "10s", "lock_delay": "5s"}, "timer": {"accuracy": "1s"}}}
    return yaml.safe_dump({**base, **top, "jobs": jobs})


def tick_job(every: str = "*:*:0/2", extra: dict | None = None) -> dict:
    return {"command": ["sh", "-c", "echo $CONSULRUN_OCCURRENCE $(hostname) >> /shared/runs"], "schedule": every,
            **(extra or {})}


def start_agent(ctr: Container, consul_bin: str, node: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start the node's agent; ready once the catalog (served by a leader) lists this node."""
    proc = ctr.spawn(consul_bin, "agent", "-node", node, "-hcl", "disable_update_check = true", *args, log=log)
    wait_for(lambda: node in ctr.exec(consul_bin, "catalog", "nodes", check=False).stdout.split(), 60,
             f"Consul on {node} to join a cluster with a leader")
    return proc


def boot(name: str, workdir: Path, netns: str) -> Container:
    require_tool("systemd-nspawn")
    if os.geteuid() != 0:
        pytest.fail("booting systemd containers needs root", pytrace=False)
    return Container(name, workdir, netns=netns, binds=container_binds()).start()


@pytest.fixture(scope="module")
def node(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """One booted node with a Consul dev agent of its own."""
    network = Network(1, subnet="10.213.80.0/24", tag="i").up()
    workdir = tmp_path_factory.mktemp("install")
    ctr = None
    agent = None
    try:
        ctr = boot(f"cri{os.getpid() % 100000}", workdir, network.namespace(0))
        agent = start_agent(ctr, consul_bin, "solo", ["-dev", "-client", "127.0.0.1", "-bind", "127.0.0.1"],
                            workdir / "consul.log")
        yield ctr
    finally:
        if agent:
            agent.terminate()
            agent.wait(timeout=20)
        if ctr:
            ctr.stop()
        network.down()


def install(ctr: Container, text: str, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    path = ctr.shared / "jobs.yaml"
    path.write_text(text)
    return ctr.exec(CONSULRUN, "install", "/shared/jobs.yaml", *args, check=check)


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
    again = install(node, text)
    assert again.returncode == 0 and again.stdout.startswith("up to date"), again.stdout + again.stderr


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
    result = install(node, manifest({"tick": tick_job("*:*:0/4"), "new": tick_job("daily")}), "--dry-run")
    assert result.returncode == 0
    assert "+OnCalendar=*:*:0/4" in result.stdout
    assert "would run: systemctl enable --now consulrun-new.timer" in result.stdout
    assert {p.name: p.read_bytes() for p in node.unit_dir.glob("consulrun-*")} == before


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
    assert node.systemctl("is-active", "consulrun-tick.timer", check=False).stdout.strip() == "active"


def test_unwritable_unit_dir_fails_cleanly(node: Container) -> None:
    result = install(node, manifest({"tick": tick_job()}), "--unit-dir", "/sys/consulrun-units")
    assert result.returncode == 1
    assert result.stderr.startswith("Error: install failed, previous units restored: /sys/consulrun-units")


def test_per_job_unit_settings_and_shell_reach_the_running_job(node: Container) -> None:
    """service: settings (from defaults and the job), a timer: setting and shell: true, on a real systemd."""
    out = node.shared / "settings"
    out.unlink(missing_ok=True)
    job = {"command": "echo $(nice) $(umask) $(cat \"$CREDENTIALS_DIRECTORY/greeting\") | tee -a /shared/settings",
           "shell": True, "schedule": "*:*:0/2",
           "service": {"Nice": 7, "SetCredential": "greeting:hello world", "CPUQuota": "50%"},
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


@pytest.fixture(scope="module")
def three_nodes(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Container], Network, Path]]:
    """Three booted nodes on one bridge, sshd in each, Consul server on node1 and clients on node2/3."""
    require_tool("ssh")
    network = Network(3, subnet="10.213.81.0/24", tag="h").up()
    workdir = tmp_path_factory.mktemp("three")
    key = workdir / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    nodes: list[Container] = []
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for index in range(3):
            ctr = Container(f"crh{index + 1}-{os.getpid() % 10000}", workdir, netns=network.namespace(index),
                            binds=container_binds())
            nodes.append(ctr)
            ssh_dir = ctr.dir / "upper" / "root" / ".ssh"
            ssh_dir.mkdir(parents=True)
            (ssh_dir / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
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
        for proc in agents:
            proc.terminate()
            proc.wait(timeout=20)
        for ctr in nodes:
            ctr.stop()
        network.down()


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
    time.sleep(120)
    lines = [line.split() for ctr in nodes if (ctr.shared / "runs").exists()
             for line in (ctr.shared / "runs").read_text().splitlines()]
    (artifact_dir(request.node)).mkdir(parents=True, exist_ok=True)
    (artifact_dir(request.node) / "runs.txt").write_text("\n".join(" ".join(x) for x in lines))
    counts = Counter(occ for occ, _ in lines)
    assert counts and max(counts.values()) == 1, counts
    assert len({host for _, host in lines}) >= 2  # the work really is spread over nodes
    # Every 5-second occurrence between the first full one and the end ran (none lost), each exactly once.
    due = {time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) for t in range(int(first) // 5 * 5 + 10, int(first) + 100, 5)}
    assert due <= set(counts), sorted(due - set(counts))
    # Consul's own record agrees: one history entry per occurrence, naming the node whose job wrote it.
    exported = json.loads(nodes[0].exec(consul_bin_path(), "kv", "export", "consulrun/every5/history/").stdout)
    recorded = {e["key"].rsplit("/", 1)[1]: json.loads(base64.b64decode(e["value"])) for e in exported}
    for occ, host in lines:
        assert recorded[occ]["state"] == "done" and recorded[occ]["exit_status"] == 0
        assert recorded[occ]["node"] == f"node{int(host.split('-')[0][3:])}"
    again = ssh_install(network, key, text, tmp_path, hosts)
    assert again.returncode == 0 and again.stdout.count("up to date") == 3, again.stdout


def test_unreachable_host_among_three(three_nodes, tmp_path: Path) -> None:
    nodes, network, key = three_nodes
    hosts = [f"root@{network.address(0)}", f"root@{network.address(1)}", "root@10.213.81.99"]
    result = ssh_install(network, key, manifest({"quiet": tick_job("daily")}), tmp_path, hosts)
    assert result.returncode == 1
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "ok" in rows[hosts[0]].split()[1] and "ok" in rows[hosts[1]].split()[1]
    assert rows["root@10.213.81.99"].split()[1] == "FAILED" and "ssh failed" in rows["root@10.213.81.99"]
    assert "install failed on 1 of 3 node(s): root@10.213.81.99" in result.stderr
    for ctr in nodes[:2]:
        assert (ctr.unit_dir / "consulrun-quiet.timer").exists()
