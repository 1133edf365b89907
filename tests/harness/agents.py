"""Real Consul agents for tests: a dev agent on loopback, or a small cluster in network namespaces.

Everything here starts processes it owns and stops them by PID; nothing
leaves the machine (loopback, or a bridge with no uplink).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import requests

REPO = Path(__file__).resolve().parents[2]


def consul_binary() -> str:
    """Build or reuse the real Consul agent through the project's one entry point."""
    result = subprocess.run([str(REPO / "scripts" / "consul-binary")], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"scripts/consul-binary failed ({result.returncode}):\n{result.stderr}")
    return result.stdout.strip().splitlines()[-1]


# Ports come from below Linux's ephemeral range (32768-60999 by default): a port the kernel hands out at
# random (bind to 0) is free only until some process's outgoing connection takes it, which is how a dev
# agent in CI once failed with "bind: address already in use". Each xdist worker has its own slice, each
# process starts at its own place in it, and a port is handed out only when both TCP and UDP (Serf uses
# both) bind it now.
_PORTS_LOW, _PORTS_HIGH = 20000, 32000
_handed_out: set[int] = set()


def _worker_slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    width = (_PORTS_HIGH - _PORTS_LOW) // max(count, 1)
    low = _PORTS_LOW + int(worker or 0) % max(count, 1) * width
    return range(low, low + width)


def _bindable(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A loopback port no other test process is likely to take before the caller binds it."""
    ports = _worker_slice()
    start = (os.getpid() * 7919 + len(_handed_out)) % len(ports)
    for step in range(len(ports)):
        port = ports[(start + step) % len(ports)]
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


class AgentExited(RuntimeError):
    """The agent's process ended while a test waited on it (wait_for does not swallow it)."""


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll `condition` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except (requests.RequestException, OSError, ValueError) as exc:
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_error})" if last_error else ""))


@dataclass
class Agent:
    """One running agent: its HTTP address, node name and log."""

    name: str
    http_addr: str  # host:port reachable from the test process
    log_path: Path
    process: subprocess.Popen[bytes]
    netns: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.http_addr}"

    def api(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        response = requests.request(method, f"{self.url}/v1/{path}", timeout=10, **kwargs)
        response.raise_for_status()
        return response

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.api("GET", path, **kwargs).json()

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """A node dying: SIGKILL, no graceful leave."""
        if self.alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        """Start the agent again after `kill`/`stop`, with the same configuration and data (a node coming back)."""
        if self.alive():
            raise RuntimeError(f"{self.name} is still running")
        self.process = _start(self.extra["cmd"], self.log_path, self.netns)

    def wait_leader(self, timeout: float = 30) -> str:
        def leader() -> str:
            if not self.alive():
                raise AgentExited(f"{self.name} exited ({self.process.returncode}) before it had a leader")
            return self.get("status/leader")
        return wait_for(leader, timeout, f"a Raft leader via {self.name}")

    def wipe(self) -> None:
        """Empty the KV store, destroy every session and remove the external catalog nodes a run or a watchdog
        registered (the health checks' nodes), for a clean test: a test that expects the node not registered
        yet must not meet one an earlier test on the same agent left."""
        self.api("DELETE", "kv/", params={"recurse": "true"})
        for session in self.get("session/list"):
            self.api("PUT", f"session/destroy/{session['ID']}")
        for node in self.get("catalog/nodes"):
            if (node.get("Meta") or {}).get("external-node") == "true":
                self.api("PUT", "catalog/deregister", json={"Node": node["Node"]})


def _start(cmd: list[str], log_path: Path, netns: str | None) -> subprocess.Popen[bytes]:
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    log = log_path.open("ab")  # a restarted agent appends to its log
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        log.close()


# Fast failure detection so "a node died" is noticed in seconds, as on a LAN under load it would be in tens.
_FAST_GOSSIP = {"gossip_lan": {"probe_interval": "200ms", "probe_timeout": "100ms", "suspicion_mult": 2,
                               "gossip_interval": "100ms", "retransmit_mult": 2}}


def start_dev_agent(binary: str, workdir: Path, name: str = "dev1", extra_config: dict[str, Any] | None = None,
                    attempt: int = 1) -> Agent:
    """A single-node dev agent (server + client) on free loopback ports (fresh ones when another process took
    one first)."""
    extra = dict(extra_config or {})
    extra_config_ports = "ports" in extra
    ports = {"http": free_port(), "dns": -1, "grpc": -1, "grpc_tls": -1, "serf_lan": free_port(),
             "serf_wan": free_port(), "server": free_port(), **extra.pop("ports", {})}
    config = workdir / f"{name}.json"
    config.write_text(json.dumps({"ports": ports, "ui_config": {"enabled": True}, **extra}))
    log_path = workdir / f"{name}.log"
    process = _start([binary, "agent", "-dev", "-node", name, "-bind", "127.0.0.1", "-client", "127.0.0.1",
                      "-config-file", str(config)], log_path, None)
    agent = Agent(name=name, http_addr=f"127.0.0.1:{ports['http']}", log_path=log_path, process=process)
    agent.extra["ports"] = ports
    try:
        agent.wait_leader()
    except (TimeoutError, AgentExited):
        agent.stop()
        log = log_path.read_text()
        if "address already in use" in log and not extra_config_ports and attempt < 3:
            log_path.rename(log_path.with_suffix(f".log.{attempt}"))
            return start_dev_agent(binary, workdir, name, extra_config, attempt + 1)
        raise RuntimeError(f"dev agent did not elect itself leader; log:\n{log[-3000:]}") from None
    return agent


@dataclass
class Cluster:
    """One server and client agents, each in its own network namespace on a private bridge."""

    server: Agent
    clients: list[Agent]
    network: Any  # tests.harness.netns.Network

    @property
    def agents(self) -> list[Agent]:
        return [self.server, *self.clients]

    def by_name(self, name: str) -> Agent:
        return next(a for a in self.agents if a.name == name)

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()


def start_cluster(binary: str, workdir: Path, network: Any, clients: int = 2,
                  node_meta: dict[str, dict[str, str]] | None = None) -> Cluster:
    """Start `node1` (server) and `node2..` (clients); each agent's HTTP API also listens on its own loopback.
    `node_meta`: each named node's Consul node meta."""
    agents: list[Agent] = []
    server_ip = network.address(0)
    try:
        for index in range(clients + 1):
            name = f"node{index + 1}"
            ip = network.address(index)
            data_dir = workdir / name
            data_dir.mkdir()
            config: dict[str, Any] = {
                "node_name": name, "datacenter": "dc1", "data_dir": str(data_dir), "bind_addr": ip,
                "client_addr": f"{ip} 127.0.0.1", "ports": {"dns": -1, "grpc": -1, "grpc_tls": -1},
                "log_level": "debug", "disable_update_check": True, "ui_config": {"enabled": index == 0},
                "performance": {"raft_multiplier": 1}, **_FAST_GOSSIP,
            }
            if (node_meta or {}).get(name):
                config["node_meta"] = node_meta[name]  # type: ignore[index]
            if index == 0:
                config.update({"server": True, "bootstrap_expect": 1})
            else:
                config.update({"retry_join": [server_ip], "retry_interval": "1s"})
            config_file = workdir / f"{name}.json"
            config_file.write_text(json.dumps(config))
            log_path = workdir / f"{name}.log"
            ns = network.namespace(index)
            cmd = [binary, "agent", "-config-file", str(config_file)]
            process = _start(cmd, log_path, ns)
            agents.append(Agent(name=name, http_addr=f"{ip}:8500", log_path=log_path, process=process, netns=ns,
                                extra={"ip": ip, "cmd": cmd}))
        cluster = Cluster(server=agents[0], clients=agents[1:], network=network)
        cluster.server.wait_leader()
        wait_for(lambda: sum(m["Status"] == 1 for m in cluster.server.get("agent/members")) == len(agents),
                 60, "every agent to join the cluster")
        for agent in agents:
            wait_for(lambda a=agent: a.get("catalog/node/" + a.name), 30, f"{agent.name} in the catalog")
        return cluster
    except BaseException:
        for agent in agents:
            agent.stop()
        raise


def save_logs(agents: list[Agent], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for agent in agents:
        if agent.log_path.exists():
            shutil.copy(agent.log_path, dest / agent.log_path.name)


@contextlib.contextmanager
def cluster_up(binary: str, workdir: Path, subnet: str, tag: str, clients: int,
               node_meta: dict[str, dict[str, str]] | None = None) -> Iterator[Cluster]:
    """`start_cluster` on a bridge of its own (`subnet`, `tag`: see tests.harness.netns.Network), stopped and
    its network taken down on the way out, however the body ends."""
    from tests.harness.netns import Network

    network = Network(clients + 1, subnet=subnet, tag=tag).up()
    started = None
    try:
        started = start_cluster(binary, workdir, network, clients=clients, node_meta=node_meta)
        yield started
    finally:
        if started:
            started.stop()
        network.down()
