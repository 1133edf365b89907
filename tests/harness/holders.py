"""Locks held and values written as the runner writes them, with no runner: a real session holding a
job's lock, a value put in KV.

The status, health and history tests make lost, abandoned and held states this way (the occurrence
module documents the shapes).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from tests.harness.agents import Agent


def iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def put(agent: Agent, key: str, value: dict[str, Any], token: str | None = None, **params: str) -> bool:
    headers = {"X-Consul-Token": token} if token else {}
    return agent.api("PUT", f"kv/{key}", data=json.dumps(value), params=params, headers=headers).json()


def session(agent: Agent, checks: tuple[str, ...] = ("serfHealth",), token: str | None = None) -> str:
    headers = {"X-Consul-Token": token} if token else {}
    return agent.api("PUT", "session/create", headers=headers, json={
        "Name": "test-holder", "TTL": "600s", "LockDelay": "1ms", "NodeChecks": list(checks)}).json()["ID"]


def hold(agent: Agent, job: str, token: str | None = None, checks: tuple[str, ...] = ("serfHealth",),
         **value: Any) -> str:
    """A real session holding <job>'s lock, the lock's value in the runner's shape (plus `value`)."""
    sid = session(agent, checks, token)
    holder = {"job": job, "node": agent.name, "host": "h", "pid": 1, "started": iso(datetime.now(timezone.utc)),
              "session": sid, **value}
    assert put(agent, f"consulrun/{job}/lock", holder, token, acquire=sid)
    return sid
