"""Three Consul servers and N client agents, each in its own network namespace, for fault injection.

Grows the small harness (tests.harness.agents, tests.harness.netns) without
changing it: the same Network and Agent classes, plus what a long chaos run
needs — agents that can be killed and restarted with their data directory (a
node rebooting, not a new node), the current Raft leader, and the servers'
applied Raft index. Every process here is started by this module and stopped
by PID; logs are appended across restarts so one file tells an agent's story.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tests.harness.agents import _FAST_GOSSIP, Agent, wait_for
from tests.harness.netns import Network


def _spawn(cmd: list[str], log_path: Path, netns: str) -> subprocess.Popen[bytes]:
    """Start `cmd` in `netns`, appending to its log, in its own session (a Ctrl-C reaches only the runner)."""
    with log_path.open("ab") as log:
        return subprocess.Popen(["ip", "netns", "exec", netns, *cmd], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


@dataclass
class BigCluster:
    """Servers at network indices 0..S-1, clients after them; node names server<i> and client<i>."""

    binary: str
    workdir: Path
    network: Network
    servers: list[Agent]
    clients: list[Agent]

    @property
    def agents(self) -> list[Agent]:
        return [*self.servers, *self.clients]

    def index_of(self, agent: Agent) -> int:
        return self.agents.index(agent)

    def by_name(self, name: str) -> Agent:
        return next(a for a in self.agents if a.name == name)

    def command(self, agent: Agent) -> list[str]:
        return [self.binary, "agent", "-config-file", str(self.workdir / f"{agent.name}.json")]

    def kill(self, agent: Agent) -> None:
        """SIGKILL, as a crash or power loss: no leave, no goodbye to the servers."""
        agent.kill()

    def restart(self, agent: Agent) -> None:
        """Start a killed agent again with its data directory (the node comes back)."""
        if agent.alive():
            return
        assert agent.netns is not None
        agent.process = _spawn(self.command(agent), agent.log_path, agent.netns)

    def leader(self) -> Agent | None:
        """The server that is the Raft leader now, asked of any live server; None during an election."""
        for server in self.servers:
            if not server.alive():
                continue
            try:
                address = requests.get(f"{server.url}/v1/status/leader", timeout=2).json()
            except (requests.RequestException, ValueError):
                continue
            ip = address.rsplit(":", 1)[0] if address else ""
            for candidate in self.servers:
                if candidate.extra["ip"] == ip:
                    return candidate
        return None

    def applied_index(self) -> int | None:
        """The highest Raft index applied by any live server (every write goes through Raft)."""
        best = None
        for server in self.servers:
            if not server.alive():
                continue
            try:
                stats = requests.get(f"{server.url}/v1/agent/self", timeout=2).json()["Stats"]["raft"]
            except (requests.RequestException, ValueError, KeyError):
                continue
            best = max(best or 0, int(stats["applied_index"]))
        return best

    def wait_ready(self, timeout: float = 90) -> None:
        """A leader, every agent an alive member, every client in the catalog."""
        wait_for(lambda: self.leader(), timeout, "a Raft leader among the servers")
        server = self.servers[0]
        wait_for(lambda: sum(m["Status"] == 1 for m in server.get("agent/members")) == len(self.agents), timeout,
                 "every agent to join the cluster")
        for agent in self.clients:
            wait_for(lambda a=agent: a.get("catalog/node/" + a.name), timeout, f"{agent.name} in the catalog")

    def stop(self) -> None:
        """Stop every agent this cluster started (paused ones are woken first so they can die)."""
        for agent in self.agents:
            if agent.alive():
                try:
                    os.kill(agent.process.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                agent.kill()


def start_big_cluster(binary: str, workdir: Path, network: Network, servers: int = 3,
                      clients: int = 3, fast_gossip: bool = True) -> BigCluster:
    """Start `servers` servers (bootstrap_expect = servers) and `clients` clients on `network`.

    `network` needs servers + clients namespaces. Coordinates are off so the
    servers' Raft log counts what the cluster's users and faults write.
    Gossip is fast (failures noticed in about a second) unless `fast_gossip`
    is False: then Consul's own LAN defaults, which a scale run wants, since
    a CPU-starved agent that misses 100 ms probes would be marked failed and
    its sessions invalidated, and the run would measure the harness.
    """
    server_ips = [network.address(i) for i in range(servers)]
    agents: list[Agent] = []
    cluster = BigCluster(binary=binary, workdir=workdir, network=network, servers=[], clients=[])
    try:
        for index in range(servers + clients):
            is_server = index < servers
            name = f"server{index + 1}" if is_server else f"client{index - servers + 1}"
            ip = network.address(index)
            data_dir = workdir / name
            data_dir.mkdir(parents=True, exist_ok=True)
            config: dict[str, Any] = {
                "node_name": name, "datacenter": "dc1", "data_dir": str(data_dir), "bind_addr": ip,
                "client_addr": f"{ip} 127.0.0.1", "ports": {"dns": -1, "grpc": -1, "grpc_tls": -1},
                "log_level": "info", "disable_update_check": True, "disable_coordinates": True,
                "performance": {"raft_multiplier": 1}, "retry_join": [s for s in server_ips if s != ip],
                "retry_interval": "1s", "leave_on_terminate": False, **(_FAST_GOSSIP if fast_gossip else {}),
            }
            if is_server:
                config.update({"server": True, "bootstrap_expect": servers})
            (workdir / f"{name}.json").write_text(json.dumps(config))
            agent = Agent(name=name, http_addr=f"{ip}:8500", log_path=workdir / f"{name}.log",
                          process=None, netns=network.namespace(index), extra={"ip": ip})  # type: ignore[arg-type]
            agent.process = _spawn(cluster.command(agent), agent.log_path, agent.netns)
            agents.append(agent)
            (cluster.servers if is_server else cluster.clients).append(agent)
        cluster.wait_ready()
        return cluster
    except BaseException:
        for agent in agents:
            agent.kill()
        raise
