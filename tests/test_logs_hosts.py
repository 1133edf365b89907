"""`consulrun logs` reaches only nodes the Consul catalog knows, never a host a record names, and
shows what comes back over ssh escaped (issue 37, weak point 7).

The KV side is the real dev agent: records are written as a holder of KV write could rewrite
them, and the nodes are registered in its catalog. ssh and journalctl are fakes on PATH that
record their arguments and answer with a terminal's escape sequences (a real remote host is
test_logs.py's container).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.agents import Agent

pytestmark = pytest.mark.consul

HOSTILE = "\\033]0;x\\007\\033[2J"  # set the title, clear the screen (printf's escapes)
SHOWN = b"\\x1b]0;x\\x07\\x1b[2J"  # as `logs` must print it
OCCURRENCE = "2026-12-01T02:00:00Z"
INVOCATION = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    """A bin directory whose ssh and journalctl write their argv to <name>.args and answer
    hostile bytes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("ssh", "journalctl"):
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/{name}.args\n"
                          f"printf 'line from {name} {HOSTILE} end\\n'\n"
                          f"printf 'to stderr {HOSTILE}\\n' >&2\n")
        script.chmod(0o755)
    return bin_dir


@pytest.fixture
def nodes(consul: Agent) -> Iterator[dict[str, str]]:
    """Two more nodes in the catalog, each with a passing serfHealth (a session can live there)."""
    registered = {"far1": "127.0.0.9", "far2": "127.0.0.10"}
    for node, address in registered.items():
        consul.api("PUT", "catalog/register", json={
            "Node": node, "Address": address,
            "Check": {"CheckID": "serfHealth", "Name": "Serf Health Status", "Status": "passing"}})
    yield registered
    for node in registered:
        consul.api("PUT", "catalog/deregister", json={"Node": node})


def record(agent: Agent, node: str, session: str = "11111111-2222-3333-4444-555555555555") -> None:
    """A finished run's record whose `host` a holder of KV write has rewritten."""
    value = {"occurrence": OCCURRENCE, "state": "done", "exit_status": 0, "node": node,
             "host": "ops@attacker.example", "unit": "consulrun-jl.service",
             "invocation_id": INVOCATION,
             "session": session, "started": "2026-12-01T02:00:01Z", "ended": "2026-12-01T02:00:02Z"}
    assert agent.api("PUT", "kv/consulrun/jl/occurrence", data=json.dumps(value)).json() is True


def logs(agent: Agent, fakes: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PATH": f"{fakes}:{os.environ['PATH']}",
           "CONSUL_HTTP_ADDR": agent.http_addr}
    return subprocess.run([sys.executable, "-m", "consulrun", "logs", "jl", *args], env=env,
                          capture_output=True, timeout=60)


def called(fakes: Path, name: str) -> list[str] | None:
    path = fakes.parent / f"{name}.args"
    return path.read_text().splitlines() if path.exists() else None


def test_a_rewritten_host_is_not_followed_the_catalog_address_is_and_the_answer_is_escaped(
        consul: Agent, nodes: dict[str, str], fakes: Path) -> None:
    record(consul, "far1")
    done = logs(consul, fakes)
    assert done.returncode == 0, done.stderr
    argv = called(fakes, "ssh")
    assert argv is not None and not any("attacker" in arg for arg in argv), argv
    assert argv[argv.index("--") + 1] == nodes["far1"], argv  # the catalog's address of the node
    assert "HostKeyAlias=far1" in argv, argv  # known_hosts entries name the node, as before
    assert f"_SYSTEMD_INVOCATION_ID={INVOCATION}" in argv[-1], argv
    for out in (done.stdout, done.stderr):
        assert b"\x1b" not in out and b"\x07" not in out, out
        assert SHOWN in out, out
    assert done.stdout == b"line from ssh " + SHOWN + b" end\n", done.stdout


def test_a_node_the_catalog_does_not_know_is_refused_and_nothing_is_reached(
        consul: Agent, nodes: dict[str, str], fakes: Path) -> None:
    record(consul, "ops@attacker.example")
    done = logs(consul, fakes)
    assert done.returncode == 2, done
    said = b"names node ops@attacker.example, which is not a node of the Consul catalog"
    assert said in done.stderr, done
    assert called(fakes, "ssh") is None and called(fakes, "journalctl") is None


def test_a_live_session_s_node_wins_over_the_node_the_record_names(
        consul: Agent, nodes: dict[str, str], fakes: Path) -> None:
    sid = consul.api("PUT", "session/create", json={
        "Node": "far2", "Name": "consulrun:jl@far2", "TTL": "600s", "LockDelay": "1ms",
        "NodeChecks": ["serfHealth"]}).json()["ID"]
    record(consul, "far1", session=sid)
    done = logs(consul, fakes)
    assert done.returncode == 0, done.stderr
    argv = called(fakes, "ssh")
    assert argv is not None and argv[argv.index("--") + 1] == nodes["far2"], argv


def test_a_run_on_this_agent_s_node_is_read_here_whatever_its_host_says(
        consul: Agent, nodes: dict[str, str], fakes: Path) -> None:
    record(consul, consul.name)
    done = logs(consul, fakes, "-o", "cat")
    assert done.returncode == 0, done.stderr
    assert called(fakes, "ssh") is None
    assert called(fakes, "journalctl") == ["--no-pager", "--quiet", "--output=cat",
                                           f"_SYSTEMD_INVOCATION_ID={INVOCATION}"]
