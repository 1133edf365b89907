"""A chained run asked of a job that no node took (issue 37, weak point 6): `stalled` in `status`,
the exporter and the watchdog, against the real dev agent.

The requests are written as the parent's finish writes them (protocol/chain.py's `then_ops`),
with no chain-watch serving: nothing consumes them, as on a cluster where it is not running.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from collections.abc import Iterator
from typing import Any

import pytest

from consulrun.protocol import keys as kvkeys
from consulrun.protocol.health import check_id, node_name
from tests.harness.agents import Agent
from tests.harness.holders import iso
from tests.harness.runs import cli

pytestmark = pytest.mark.consul


def put(agent: Agent, key: str, value: dict[str, Any], **params: str) -> None:
    assert agent.api("PUT", f"kv/{key}", data=json.dumps(value), params=params).json() is True


def request(agent: Agent, ended: datetime, child: str = "c", parent: str = "p") -> str:
    """A request for `child`'s run after `parent`'s run that ended at `ended` (then_ops' shape)."""
    run = iso(ended - timedelta(seconds=30))
    put(agent, kvkeys.chain_request_key(f"consulrun/{child}", parent, run),
        {"parent": parent, "run": run, "state": "done", "exit_status": 0, "node": "n1",
         "ended": iso(ended)})
    return run


def checks(agent: Agent) -> dict[str, dict[str, Any]]:
    return {c["CheckID"]: c for c in agent.get(f"health/node/{node_name('consulrun')}")}


def test_a_request_nobody_took_for_two_hours_is_stalled_exit_3(consul: Agent) -> None:
    run = request(consul, datetime.now(timezone.utc) - timedelta(hours=2))
    code, out, err = cli("status", "--json")
    assert code == 3, (out, err)
    data = json.loads(out)
    job = next(j for j in data["jobs"] if j["job"] == "c")
    assert data["verdict"] == "missed" and job["verdict"] == "missed", out
    [problem] = job["problems"]
    assert (problem["kind"], problem["parent"], problem["run"]) == ("stalled", "p", run), problem
    assert problem["pending"] == 1, problem
    assert "has waited 2h" in problem["detail"], problem
    assert "no node took it" in problem["detail"], problem

    code, out, _ = cli("status")
    assert code == 3, out
    row = next(line for line in out.splitlines() if line.startswith("c "))
    assert row.split()[1] == "stalled", out
    assert f"c: stalled: the run after p's run {run} has waited 2h" in out, out


def test_a_fresh_request_and_one_waiting_for_a_running_child_are_not_stalled(
        consul: Agent) -> None:
    request(consul, datetime.now(timezone.utc) - timedelta(seconds=30))
    code, out, _ = cli("status", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "ok", out

    # An old request while the child's lock is held: it waits for that run, as it should.
    request(consul, datetime.now(timezone.utc) - timedelta(hours=2), child="held")
    sid = consul.api("PUT", "session/create", json={
        "Name": "test-holder", "TTL": "600s", "LockDelay": "1ms",
        "NodeChecks": ["serfHealth"]}).json()["ID"]
    put(consul, "consulrun/held/lock", {"job": "held", "node": consul.name, "session": sid,
                                        "started": iso(datetime.now(timezone.utc))}, acquire=sid)
    code, out, _ = cli("status", "--json", "held")
    assert code == 0, out


def test_the_wait_counts_from_the_end_of_the_child_run_it_waited_behind(consul: Agent) -> None:
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.report import status as state
    from consulrun.report.chains import bound_s

    now = datetime.now(timezone.utc)
    request(consul, now - timedelta(hours=2))
    # The child's previous run held the lock until a minute ago: the request could not run before.
    earlier = f"{iso(now - timedelta(hours=3))}~after~p"
    put(consul, "consulrun/c/" + kvkeys.chained_history_key("", earlier).lstrip("/"),
        {"run": earlier, "state": "done", "exit_status": 0, "node": "n1",
         "started": iso(now - timedelta(hours=3)), "ended": iso(now - timedelta(minutes=1))})
    code, out, _ = cli("status", "--json", "c")
    assert code == 0, out
    later = datetime.now(timezone.utc) + timedelta(seconds=bound_s(None) + 60)
    client = Client(ConsulConfig.from_env())
    _, [judged] = state.collect(client, "consulrun", None, only=("c",), now=later)
    assert [p["kind"] for p in judged.problems] == ["stalled"], judged.problems


@pytest.fixture
def catalog(consul: Agent) -> Iterator[Agent]:
    """The agent, the watchdog's external node removed afterwards (wipe() keeps the catalog, and
    other modules count that node's checks)."""
    yield consul
    consul.api("PUT", "catalog/deregister", json={"Node": node_name("consulrun")})


def test_the_exporter_and_the_watchdog_say_stalled(catalog: Agent) -> None:
    consul = catalog
    run = request(consul, datetime.now(timezone.utc) - timedelta(hours=2))
    code, out, err = cli("exporter", "--textfile", "-")
    assert code == 0, err
    assert 'consulrun_job_state{job_name="c",state="stalled"} 1.0' in out, out
    assert 'consulrun_job_health{job_name="c"} 3.0' in out, out

    code, out, err = cli("watchdog", "--jobs", "{}")
    assert code == 0, (out, err)
    check = checks(consul)[check_id("c")]
    assert check["Status"] == "critical", check
    said = f"stalled: the run after p's run {run} has waited since "
    assert check["Output"].startswith(said), check
    # Its text does not change by the minute: the next tick writes nothing.
    assert cli("watchdog", "--jobs", "{}")[0] == 0
    assert checks(consul)[check_id("c")]["ModifyIndex"] == check["ModifyIndex"]


def test_the_bound_is_minutes_past_the_parent_s_end_plus_the_child_s_start_budget() -> None:
    from consulrun.report.chains import bound_s

    # 5 minutes, a start's retries (120 s), the turns (6 s), chain-watch's pauses (52 s), and
    # the default lock-delay (15 s).
    assert bound_s(None) == 300 + 120 + 6 + 52 + 15
