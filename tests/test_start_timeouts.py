"""A write at `run`'s start that the agent did not answer in time, applied by Consul after all (red team, aa11297).

A timeout is not an answer: the agent may still hold the request and forward it once the servers have a
leader, after consulrun's read-back looked. Since aa11297 a timeout at start is retried (after the session is
given up), so what the read-back concluded ("it did not go through") decides what the retry does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.harness.agents import Agent
from tests.harness.runs import SKIP, YEARLY, consulrun, finish, kv_json, sessions


@pytest.mark.parametrize("policy", [
    "skip", "retry"])
def test_a_claim_that_timed_out_and_lands_after_its_read_back_is_not_called_a_skip(
        consul: Agent, tmp_path: Path, policy: str) -> None:
    """The claim (lock + occurrence) is held past the client's 10 s timeout; the read-back finds the lock free;
    the agent then forwards the held claim (here: just before the session's destroy reaches Consul). Nothing
    ran anywhere, so the node must either run the occurrence once or exit 69 (whether it holds the claim is
    unknown: test_a_read_back_that_fails_past_its_budget_is_exit_69_not_a_skip). Under `skip` it used to exit
    69; since aa11297 it retries, meets its own claim (its session now destroyed), records it abandoned and
    skips with the skip code, which says the lock was held elsewhere: the occurrence ran nowhere and no unit
    failed."""
    from tests.harness.faultproxy import FaultProxy

    ran, job = tmp_path / "ran", f"lateclaim{policy}"
    landed: dict[str, int] = {}

    def the_agent_forwards_the_held_claim(_request: str) -> None:
        body = claim.hits[0].split("\n", 1)[1]
        landed["status"] = requests.put(f"{consul.url}/v1/txn", data=body.encode(), timeout=10).status_code

    with FaultProxy(consul.http_addr) as proxy:
        claim = proxy.fail("PUT", '"Verb": "lock"', "stall")
        proxy.fail("PUT", "/v1/session/destroy/", "forward", then=the_agent_forwards_the_held_claim)
        code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--on-holder-loss", policy,
                                        "--skip-exit-code", str(SKIP), job, "--", "touch", str(ran),
                                        env={"CONSUL_HTTP_ADDR": proxy.address}), timeout=180)
    assert landed.get("status") == 200, (landed, err)  # the held claim did land, with the session still alive
    assert "Consul agent did not answer in time" in err, err
    record = kv_json(consul, f"consulrun/{job}/occurrence")
    assert (code == 0 and ran.exists() and record["state"] == "done") or (code == 69 and not ran.exists()), \
        (code, ran.exists(), record, err)
    assert sessions(consul) == []


def test_a_start_retried_after_a_timeout_never_claims_an_occurrence_after_the_next_is_due(
        consul: Agent, tmp_path: Path) -> None:
    """Every 30 s, started 22-24 s before the next occurrence: the budget is half that (11-12 s). The first read
    is held past the client's 10 s timeout (aa11297: retried); the retry's reads are answered slowly (9 s each,
    inside the timeout), as an agent answers through an election. The retry computed its occurrence before the
    next was due and claims it after: the run of the old occurrence then holds the lock when the next one's
    nodes look (docs/guarantees.md: the lock-delay wait stops a second before the next occurrence for that
    reason). Before aa11297 the first timeout was exit 69."""
    import time
    from datetime import datetime, timezone

    from tests.harness.faultproxy import FaultProxy

    while not 6 <= datetime.now(timezone.utc).second % 30 <= 8:
        time.sleep(0.2)
    now = datetime.now(timezone.utc).timestamp()
    next_due = now - now % 30 + 30
    ran, job = tmp_path / "ran", "lateocc"

    def slowly(_request: str) -> None:
        time.sleep(9)

    with FaultProxy(consul.http_addr) as proxy:
        proxy.fail("PUT", f"consulrun/{job}/occurrence", "stall")  # the first look
        proxy.fail("PUT", f"consulrun/{job}/occurrence", "forward", then=slowly)  # the retry's look
        proxy.fail("PUT", "/v1/session/create", "forward", then=slowly)
        code, _, err = finish(consulrun("run", "--schedule", "*:*:0/30", "--skip-exit-code", str(SKIP), job, "--",
                                        "sh", "-c", f'date +%s.%N > {ran}; echo "$CONSULRUN_OCCURRENCE" >> {ran}',
                                        env={"CONSUL_HTTP_ADDR": proxy.address}), timeout=120)
    assert "Consul agent did not answer in time" in err, err
    if ran.exists():
        started, occurrence = ran.read_text().split()
        assert float(started) < next_due, (f"occurrence {occurrence} started {float(started) - next_due:.1f}s after "
                                           f"the next one was due", code, err)
    else:
        assert code in (69, SKIP), err


def test_a_chained_claim_that_timed_out_and_lands_after_its_read_back_is_not_a_silent_skip(
        consul: Agent, tmp_path: Path) -> None:
    """As the occurrence's claim above, for a chained run: the claim consumes the request (check-and-delete) and
    writes the run's history entry `running`; the session is then destroyed by the retry. Nothing requeues the
    request (runner.py requeues only a claim its own process holds), so the run after the parent is gone; the
    retry finds no request pending and skips with the skip code. Before aa11297: exit 69 (the same loss, said)."""
    from consulrun.protocol import keys as kvkeys
    from tests.harness.faultproxy import FaultProxy

    ran, job = tmp_path / "ran", "latechild"
    base = kvkeys.job_base("consulrun", job)
    request = {"parent": "parentjob", "run": "2026-01-01T00:00:00Z", "state": "done", "exit_status": 0,
               "node": "dev1", "ended": "2026-01-01T00:00:05Z"}
    consul.api("PUT", "kv/" + kvkeys.chain_request_key(base, "parentjob", request["run"]), json=request)

    def the_agent_forwards_the_held_claim(_request: str) -> None:
        body = claim.hits[0].split("\n", 1)[1]
        landed["status"] = requests.put(f"{consul.url}/v1/txn", data=body.encode(), timeout=10).status_code

    landed: dict[str, int] = {}
    with FaultProxy(consul.http_addr) as proxy:
        claim = proxy.fail("PUT", '"Verb": "lock"', "stall")
        proxy.fail("PUT", "/v1/session/destroy/", "forward", then=the_agent_forwards_the_held_claim)
        code, _, err = finish(consulrun("run", "--after", "parentjob", "--skip-exit-code", str(SKIP), job, "--",
                                        "touch", str(ran), env={"CONSUL_HTTP_ADDR": proxy.address}), timeout=180)
    assert landed.get("status") == 200, (landed, err)
    assert "Consul agent did not answer in time" in err, err
    assert (code == 0 and ran.exists()) or (code == 69 and not ran.exists()), (code, ran.exists(), err)
