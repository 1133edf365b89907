"""Booted systemd nodes (nspawn containers) with a Consul agent each, and what tests do on them.

Boot one node or three (a server and two clients, with or without sshd), install a manifest with the
installed `consulrun`, and read systemd's view of a unit, its journal and the node's own agent.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.conftest import container_binds, require_tool
from tests.harness.agents import wait_for
from tests.harness.netns import Network
from tests.harness.nspawn import Container, stop_nodes, tear_down


CONSULRUN = str(Path(sys.prefix) / "bin" / "consulrun")


def manifest(jobs: dict[str, dict], **top: object) -> str:
    base = {"defaults": {"lock": {"ttl": "10s", "lock_delay": "5s"}, "timer": {"accuracy": "1s"}}}
    return yaml.safe_dump({**base, **top, "jobs": jobs})


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


@contextmanager
def agent_node(consul_bin: str, workdir: Path, subnet: str, tag: str) -> Iterator[Container]:
    """One booted container in its own network namespace with a Consul dev agent of its own; all gone after."""
    network = Network(1, subnet=subnet, tag=tag).up()
    ctr = None
    agent = None
    try:
        ctr = boot(f"cr{tag}{os.getpid() % 100000}", workdir, network.namespace(0))
        agent = start_agent(ctr, consul_bin, "solo", ["-dev", "-client", "127.0.0.1", "-bind", "127.0.0.1"],
                            workdir / "consul.log")
        yield ctr
    finally:
        tear_down(ctr, agent, network)


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


@contextmanager
def three_agents(consul_bin: str, workdir: Path, subnet: str = "10.213.83.0/24", tag: str = "m",
                 name: str = "crm") -> Iterator[list[Container]]:
    """Three booted nodes on one bridge, a Consul server on node1 and clients on node2/3; all gone after. Another
    module using them passes its own subnet, network tag and container name (modules may run side by side)."""
    require_tool("systemd-nspawn")
    if os.geteuid() != 0:
        pytest.fail("booting systemd containers needs root", pytrace=False)
    network = Network(3, subnet=subnet, tag=tag).up()
    nodes: list[Container] = []
    agents = []
    try:
        for index in range(3):
            ctr = Container(f"{name}{index + 1}-{os.getpid() % 10000}", workdir, netns=network.namespace(index),
                            binds=container_binds())
            nodes.append(ctr)
            ctr.start()
        for index, ctr in enumerate(nodes):
            common = ["-bind", network.address(index), "-client", "127.0.0.1", "-data-dir", f"/var/lib/c{index}",
                      "-hcl", "ports { dns = -1 }", "-hcl", "performance { raft_multiplier = 1 }"]
            role = ["-server", "-bootstrap-expect=1"] if index == 0 else ["-retry-join", network.address(0)]
            agents.append(start_agent(ctr, consul_bin, f"node{index + 1}", common + role,
                                      workdir / f"consul-node{index + 1}.log"))
        yield nodes
    finally:
        stop_nodes(nodes, agents)
        network.down()


def node_kv(ctr: Container, key: str) -> dict | None:
    found = agent_get(ctr, f"kv/{key}?recurse=true")
    return {e["Key"]: json.loads(base64.b64decode(e["Value"])) for e in found or []}


def stop_agent_in(ctr, consul_bin: str, agent: subprocess.Popen[bytes]) -> None:
    """Stop a container's agent: `nsenter` forks into the pid namespace, so signalling it is not enough."""
    ctr.exec(consul_bin, "leave", check=False)
    agent.terminate()
    agent.wait(timeout=20)
    wait_for(lambda: ctr.exec(consul_bin, "members", check=False).returncode != 0, 20, "the container's agent to stop")
