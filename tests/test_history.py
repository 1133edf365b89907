"""`history` against a real Consul agent: records in the runner's shapes, and real runs."""

from __future__ import annotations

import json

import pytest

from tests.harness.agents import Agent
from tests.test_run import consulrun, finish
from tests.test_status import cli, put

pytestmark = pytest.mark.consul


# --- History ----------------------------------------------------------------------------------------------


def test_history_lists_every_attempt_newest_first(consul: Agent) -> None:
    lost = {"occurrence": "2026-01-02T00:00:00Z", "state": "lost", "node": "n1", "session": "a1", "attempt": 1,
            "started": "2026-01-02T00:00:01Z", "lost_at": "2026-01-02T00:00:20Z", "reason": "fenced",
            "takeover": False}
    put(consul, "consulrun/hist/history/2026-01-01T00:00:00Z", {
        "occurrence": "2026-01-01T00:00:00Z", "state": "done", "exit_status": 0, "node": "n2", "session": "b",
        "attempt": 1, "started": "2026-01-01T00:00:02Z", "ended": "2026-01-01T00:00:12Z", "takeover": False})
    put(consul, "consulrun/hist/occurrence", {
        "occurrence": "2026-01-02T00:00:00Z", "state": "done", "exit_status": 3, "node": "n2", "session": "a2",
        "attempt": 2, "takeover": True, "started": "2026-01-02T00:00:40Z", "ended": "2026-01-02T00:01:40Z",
        "earlier": [lost]})
    put(consul, "consulrun/hist/lock", {"state": "free", "last": {
        "node": "n3", "session": "m", "started": "2026-01-03T00:00:00Z", "ended": "2026-01-03T00:00:05Z",
        "exit_status": 0}})
    code, out, _ = cli("history", "hist", "--json")
    runs = json.loads(out)["runs"]
    assert code == 0
    assert [(r["occurrence"], r["attempt"], r["state"], r["manual"]) for r in runs] == [
        (None, None, "done", True), ("2026-01-02T00:00:00Z", 2, "done", False),
        ("2026-01-02T00:00:00Z", 1, "lost", False), ("2026-01-01T00:00:00Z", 1, "done", False)]
    assert runs[1]["takeover"] is True and runs[1]["exit_status"] == 3 and runs[1]["duration_s"] == 60
    assert runs[2]["reason"] == "fenced"
    code, out, _ = cli("history", "hist", "-n", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["OCCURRENCE", "ATTEMPT", "NODE"] and len(lines) == 3
    assert "takeover" in lines[2] and "exit 3" in lines[2] and "manual" in lines[1]


def test_history_of_real_runs(consul: Agent) -> None:
    assert finish(consulrun("run", "--schedule", "*-*-* 02:00:00", "real", "--", "sh", "-c", "exit 2"))[0] == 2
    code, out, _ = cli("history", "real", "--json")
    runs = json.loads(out)["runs"]
    assert code == 0 and len(runs) == 1 and runs[0]["exit_status"] == 2 and runs[0]["node"] == "dev1"
