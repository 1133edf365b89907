"""The harness is real: sessions live and die with the node's agent, as Consul decides."""

from __future__ import annotations

import pytest

from tests.harness.agents import Cluster, wait_for


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
