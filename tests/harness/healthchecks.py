"""The jobs' Consul health checks: the `catalog` fixture (tests/conftest.py registers this module
as a plugin), and registering and reading the external node's checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from consulrun.consul.client import Client, ConsulConfig
from consulrun.report import watchdog as health
from tests.harness.agents import Agent


@pytest.fixture
def catalog(consul: Agent) -> Iterator[Agent]:
    """The shared agent, with the external nodes a test registers removed afterwards (wipe() keeps the catalog)."""
    yield consul
    for node in consul.get("catalog/nodes"):
        if (node.get("Meta") or {}).get("external-node") == "true":
            consul.api("PUT", "catalog/deregister", json={"Node": node["Node"]})


def checks(agent: Agent, node: str = "consulrun") -> dict[str, dict[str, Any]]:
    return {c["Name"]: c for c in agent.get(f"health/node/{node}")}


def register(agent: Agent, prefix: str = "consulrun") -> None:
    health.ensure_registered(Client(ConsulConfig(address=agent.http_addr)), prefix)
