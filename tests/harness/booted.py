"""A booted systemd container with a Consul agent of its own, for tests of installed units.

(Moved here from tests/test_install.py, which still offers the names, so that any test module
may use them without importing another test module.)
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.harness.agents import wait_for
from tests.harness.netns import Network
from tests.harness.nspawn import Container, tear_down


def start_agent(ctr: Container, consul_bin: str, node: str, args: list[str],
                log: Path) -> subprocess.Popen[bytes]:
    """Start the node's agent; ready once the catalog (served by a leader) lists this node."""
    proc = ctr.spawn(consul_bin, "agent", "-node", node, "-hcl", "disable_update_check = true",
                     *args, log=log)
    wait_for(lambda: node in ctr.exec(consul_bin, "catalog", "nodes", check=False).stdout.split(),
             60, f"Consul on {node} to join a cluster with a leader")
    return proc


def boot(name: str, workdir: Path, netns: str) -> Container:
    from tests.conftest import container_binds, require_tool

    require_tool("systemd-nspawn")
    if os.geteuid() != 0:
        pytest.fail("booting systemd containers needs root", pytrace=False)
    return Container(name, workdir, netns=netns, binds=container_binds()).start()


@contextmanager
def agent_node(consul_bin: str, workdir: Path, subnet: str, tag: str) -> Iterator[Container]:
    """One booted container in its own network namespace with a Consul dev agent of its own; all
    gone after."""
    network = Network(1, subnet=subnet, tag=tag).up()
    ctr = None
    agent = None
    try:
        ctr = boot(f"cr{tag}{os.getpid() % 100000}", workdir, network.namespace(0))
        agent = start_agent(ctr, consul_bin, "solo",
                            ["-dev", "-client", "127.0.0.1", "-bind", "127.0.0.1"],
                            workdir / "consul.log")
        yield ctr
    finally:
        tear_down(ctr, agent, network)
