"""Chaos client nodes as booted systemd containers: real timers, real units, each node with its own agent.

Each client node is a container (tests.harness.nspawn: systemd as PID 1 on an
overlay of the host's root) in its own network namespace on the run's
bridge, beside the 3 servers of tests.harness.bigcluster. Its Consul client
agent is an enabled unit of the node (`consul.service`, `Type=notify`, as
Consul's package has it, without `Restart=` so that a killed agent stays dead
until the nemesis, or a job's `Wants=consul.service`, starts it): it starts
when the node boots and dies with it. The jobs are one manifest, installed on
every node with `consulrun install`; the timers are the units' own
(`AccuracySec=1s`, `RandomizedDelaySec=1s`, `Persistent=true`), and
`ExecStopPost=` reap, `TimeoutStopSec=`, `OnFailure=` and the watchdog
(`health_checks: true`) are systemd's doing, not the runner's.

The run's directory is bound at /chaos in every node: the jobs (bench/chaos/
job.py) append to /chaos/history.log as they do on the emulated fleet, and a
drop-in beside each job's service (bench/chaos/unit_hook.py) adds the `fire`
and `exit` lines the emulated timers write. Pids in the history are the
node's own plus a base of 10,000,000 x node number + 100,000 x boot number
(see `boot`): PID namespaces, and a node booted again, would otherwise make
them collide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from bench.chaos.logs import read
from bench.chaos.timers import JOB_SCRIPT, JobSpec, LockSettings
from tests.harness.agents import _FAST_GOSSIP, REPO, Agent, wait_for
from tests.harness.bigcluster import BigCluster
from tests.harness.nspawn import Container

HOOK = Path(__file__).resolve().with_name("unit_hook.py")
INSIDE = Path("/chaos")  # the run's directory inside every node
NODEFILE = "/etc/consulrun-chaos-node.json"
AGENT_UNIT = "consul.service"
NODE_PIDS, BOOT_PIDS = 10_000_000, 100_000  # pid bases: a node's, and each of its boots'
CONSULRUN = str(Path(sys.executable).with_name("consulrun"))

_AGENT_UNIT_TEXT = """[Unit]
Description=Consul client agent of chaos node {name}
Wants=network-online.target
After=network-online.target

[Service]
Type=notify
ExecStart={consul} agent -config-file /etc/consul-chaos.json
TimeoutStartSec=3min

[Install]
WantedBy=multi-user.target
"""


class NodeAgent(Agent):
    """A node's agent, seen from the host: reached through the bridge; alive while it answers."""

    def alive(self) -> bool:
        try:
            return requests.get(f"{self.url}/v1/agent/self", timeout=2).status_code == 200
        except requests.RequestException:
            return False


@dataclass
class SystemdCluster(BigCluster):
    """BigCluster's 3 servers, and client agents that are units of booted nodes: killed with `systemctl kill`."""

    nodes: list[Container] = field(default_factory=list)

    def node_of(self, agent: Agent) -> Container:
        return self.nodes[self.clients.index(agent)]  # type: ignore[arg-type]

    def kill(self, agent: Agent) -> None:
        if agent in self.clients:
            self.node_of(agent).systemctl("kill", "-s", "KILL", AGENT_UNIT, check=False)
        else:
            agent.kill()

    def restart(self, agent: Agent) -> None:
        if agent not in self.clients:
            super().restart(agent)
            return
        node = self.node_of(agent)
        if node.process is not None and node.process.poll() is None and not node.powering_off:
            node.systemctl("start", "--no-block", AGENT_UNIT, check=False)

    def stop(self) -> None:
        for agent in self.servers:
            super().kill(agent)


def _write_node_config(ctr: Container, index: int, name: str, ip: str, servers: list[str], consul: str) -> None:
    """The node's own disk (its upper layer): agent unit and configuration, who it is, its drop-ins."""
    etc = ctr.dir / "upper" / "etc"
    units = etc / "systemd" / "system"
    (units / "multi-user.target.wants").mkdir(parents=True, exist_ok=True)
    config = {"node_name": name, "datacenter": "dc1", "data_dir": "/var/lib/consul-chaos", "bind_addr": ip,
              "client_addr": f"{ip} 127.0.0.1", "ports": {"dns": -1, "grpc": -1, "grpc_tls": -1},
              "log_level": "info", "disable_update_check": True, "disable_coordinates": True,
              "performance": {"raft_multiplier": 1}, "retry_join": servers, "retry_interval": "1s",
              "leave_on_terminate": False, **_FAST_GOSSIP}
    (etc / "consul-chaos.json").write_text(json.dumps(config))
    (units / AGENT_UNIT).write_text(_AGENT_UNIT_TEXT.format(name=name, consul=consul))
    wants = units / "multi-user.target.wants" / AGENT_UNIT
    if not wants.is_symlink():
        wants.symlink_to(f"/etc/systemd/system/{AGENT_UNIT}")
    # The console is quiet for every booted container (tests/harness/nspawn.py Container._prepare).
    (etc / NODEFILE.removeprefix("/etc/")).write_text(json.dumps({"node": name, "index": index, "boot": 0}))


def boot(ctr: Container, timeout: float = 240) -> Container:
    """Boot a node (again), its history pids based anew: a booted node's PID namespace numbers from 1 again."""
    if int(Path("/proc/sys/kernel/pid_max").read_text()) >= BOOT_PIDS:
        raise RuntimeError(f"pid_max is {BOOT_PIDS} or more: a node's pids would not fit under its pid base")
    path = ctr.dir / "upper" / NODEFILE.removeprefix("/")
    identity = json.loads(path.read_text())
    identity["boot"] += 1
    if identity["boot"] * BOOT_PIDS >= NODE_PIDS:
        raise RuntimeError(f"{identity['node']} booted {identity['boot']} times: its pids would reach the next node's")
    identity["pid_base"] = identity["index"] * NODE_PIDS + identity["boot"] * BOOT_PIDS
    path.write_text(json.dumps(identity))
    return ctr.start(timeout)


def drop_in(job: JobSpec) -> str:
    """The chaos run's own lines beside consulrun's unit: its history's `fire` and `exit` (unit_hook.py)."""
    hook = [sys.executable, str(HOOK)]
    args = [str(INSIDE / "history.log"), NODEFILE, job.name, job.schedule]
    fire = " ".join(hook + ["fire", *args])
    done = " ".join(hook + ["exit", *args])
    if any(c in job.schedule for c in " %$\"'\\"):
        raise ValueError(f"{job.schedule!r}: a schedule with blanks, quotes or specifiers cannot go into the drop-in")
    return f"# chaos run instrumentation (bench/chaos/nodes.py)\n[Service]\nExecStartPre=-{fire}\nExecStopPost=-{done}\n"


def manifest_text(jobs: list[JobSpec], lock: LockSettings) -> str:
    """One manifest for every node: the jobs of the run, at the run's lock settings, with the watchdog."""
    log = str(INSIDE / "history.log")
    return yaml.safe_dump({
        "name": "chaos", "kv_prefix": lock.prefix, "health_checks": True,
        "defaults": {"lock": {"ttl": f"{lock.ttl_s}s", "lock_delay": f"{lock.lock_delay_s}s"},
                     "timer": {"accuracy": "1s", "randomized_delay": f"{lock.max_delay_s - 1:g}s", "persistent": True},
                     "on_failure": [sys.executable, str(HOOK), "on-failure", log, NODEFILE]},
        "jobs": {j.name: {"command": [sys.executable, "-S", str(JOB_SCRIPT), log, j.name, f"@{NODEFILE}",
                                      str(j.seconds)],
                          "schedule": j.schedule, "on_holder_loss": j.policy} for j in jobs}})


@dataclass
class Holder:
    """A run the history says has started and not ended: what the nemesis aims at."""

    node: str
    job: str
    pid: int  # with the node's pid base
    wrapper: int
    occ: str
    started: float
    seen: float


class HistoryTail(threading.Thread):
    """Follows history.log: which runs are live now, on which node (the host cannot see a node's pids)."""

    def __init__(self, path: Path) -> None:
        super().__init__(name="history-tail", daemon=True)
        self.path = path
        self.live: dict[tuple[str, int], Holder] = {}
        self.guard = threading.Lock()
        self.stop_event = threading.Event()

    def run(self) -> None:
        offset = 0
        while not self.stop_event.is_set():
            try:
                with self.path.open("rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
            except OSError:
                chunk = b""
            complete = chunk[:chunk.rfind(b"\n") + 1]
            offset += len(complete)
            for raw in complete.splitlines():
                try:
                    self._see(json.loads(raw))
                except (ValueError, KeyError, TypeError):
                    continue
            self.stop_event.wait(0.05)

    def _see(self, line: dict[str, Any]) -> None:
        if line["ev"] not in ("start", "hb", "end"):
            return
        key = (line["job"], line["pid"])
        with self.guard:
            if line["ev"] == "start":
                self.live[key] = Holder(line["node"], line["job"], line["pid"], line["wrapper"], line.get("occ") or "",
                                        line["t"], line["t"])
            elif line["ev"] == "end":
                self.live.pop(key, None)
            elif key in self.live:
                self.live[key].seen = line["t"]

    def holders(self, job: str | None = None, node: str | None = None) -> list[Holder]:
        """Runs alive now (a line within the last second) of `job` and/or on `node`."""
        now = time.time()
        with self.guard:
            for key in [k for k, h in self.live.items() if now - h.seen > 30]:
                del self.live[key]
            return [h for h in self.live.values() if now - h.seen < 1.0 and job in (None, h.job)
                    and node in (None, h.node)]


class NodeFleet:
    """The booted client nodes and their installed jobs: what run_systemd drives and the nemesis aims at."""

    def __init__(self, cluster: SystemdCluster, jobs: list[JobSpec], lock: LockSettings, out: Path) -> None:
        self.cluster = cluster
        self.jobs = jobs
        self.lock = lock
        self.out = out
        self.tail = HistoryTail(out / "history.log")

    @property
    def nodes(self) -> list[Container]:
        return self.cluster.nodes

    def fresh_holder(self, job: str, timeout: float, stop: threading.Event) -> Holder | None:
        """The first run of `job` to start within `timeout` (seen within 0.15 s of its start line)."""
        before = {h.pid for h in self.tail.holders(job)}
        deadline = time.time() + timeout
        while time.time() < deadline and not stop.is_set():
            fresh = [h for h in self.tail.holders(job) if h.pid not in before]
            if fresh:
                return fresh[0]
            stop.wait(0.05)
        return None

    def install(self) -> None:
        """The manifest and the run's drop-ins on every node, then `consulrun install` (enables the timers)."""
        text = manifest_text(self.jobs, self.lock)
        (self.out / "chaos.yaml").write_text(text)
        for ctr in self.nodes:
            for job in self.jobs:
                extra = ctr.unit_dir / f"consulrun-{job.name}.service.d"
                extra.mkdir(parents=True, exist_ok=True)
                (extra / "chaos.conf").write_text(drop_in(job))
        self.tail.start()
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            results = list(pool.map(lambda c: c.exec(CONSULRUN, "install", str(INSIDE / "chaos.yaml"), check=False),
                                    self.nodes))
        failed = [(c.name, r.stderr) for c, r in zip(self.nodes, results) if r.returncode != 0]
        if failed:
            raise RuntimeError(f"consulrun install failed: {failed}")

    def running(self, ctr: Container) -> bool:
        return ctr.process is not None and ctr.process.poll() is None and not ctr.powering_off

    def stop_timers(self) -> None:
        for ctr in self.nodes:
            if self.running(ctr):
                ctr.systemctl("stop", "consulrun-*.timer", check=False)

    def active_units(self) -> list[str]:
        found = []
        for ctr in self.nodes:
            if not self.running(ctr):
                continue
            out = ctr.systemctl("list-units", "--no-legend", "--plain", "--state=activating,active,deactivating",
                                "consulrun-*.service", check=False).stdout
            found += [f"{ctr.name}:{line.split()[0]}" for line in out.splitlines() if line.split()]
        return found

    def drain(self, timeout: float) -> bool:
        """Wait for every job's service on every node to end by itself; True if they all did within `timeout`."""
        try:
            wait_for(lambda: not self.active_units(), timeout, "the last runs to end", interval=1)
        except TimeoutError:
            return False
        return True

    def collect(self) -> None:
        """Each node's journal of its jobs and agent into agents/ (before the nodes go)."""
        for ctr, agent in zip(self.nodes, self.cluster.clients):
            if not self.running(ctr):
                continue
            journal = ctr.exec("journalctl", "--no-pager", "-o", "short-unix", "-u", "consul*", "-u", "consulrun-*",
                               check=False, timeout=120)
            (self.out / "agents" / f"{agent.name}.journal").write_text(journal.stdout + journal.stderr)

    def stop(self) -> None:
        self.tail.stop_event.set()


def boot_nodes(network: Any, cluster: BigCluster, consul: str, out: Path, count: int) -> SystemdCluster:
    """`count` booted nodes after the servers on `network`, each with its agent joined: the cluster with them."""
    servers = [network.address(i) for i in range(len(cluster.servers))]
    binds = sorted({REPO, Path(sys.prefix), Path(consul).parent})
    nodes, clients = [], []
    for i in range(count):
        index = len(cluster.servers) + i
        name = f"client{i + 1}"
        ctr = Container(f"crx{i + 1}-{os.getpid() % 10000}", out / "nodes", netns=network.namespace(index),
                        binds=binds)
        ctr.dir.mkdir(parents=True, exist_ok=True)
        _write_node_config(ctr, i + 1, name, network.address(index), servers, consul)
        nodes.append(ctr)
        clients.append(NodeAgent(name=name, http_addr=f"{network.address(index)}:8500",
                                 log_path=out / "agents" / f"{name}.journal", process=None,  # type: ignore[arg-type]
                                 netns=network.namespace(index), extra={"ip": network.address(index)}))
    for ctr in nodes:
        ctr.bind_at[str(INSIDE)] = out
    whole = SystemdCluster(binary=cluster.binary, workdir=cluster.workdir, network=network, servers=cluster.servers,
                           clients=clients, nodes=nodes)
    with ThreadPoolExecutor(count) as pool:
        for started in [pool.submit(boot, ctr) for ctr in nodes]:
            started.result()
    whole.wait_ready(timeout=180)
    return whole
