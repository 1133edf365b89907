"""Where features meet: retries x takeovers x chains x each-node x start deadlines, against a real agent.

Each test is one break an independent review found (issue 37), decided by a kill, an unlock or a restart
landing inside a retry's backoff, or by a job outliving its interval; none depends on timing luck: the tests
wait for the state that decides the break (a record in its backoff, a job running, the next occurrence due)
before they act. The rules they hold (docs/design.md, *Core and features*): a live holder is settled only by
its session's death; an attempt is counted from the record, not from the process.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime, timezone
from pathlib import Path

import pytest

from consulrun.manifest import calendar
from tests.harness.agents import Agent, wait_for
from tests.harness.runs import cli, consulrun, finish, kv_json, kv_keys

DAILY = "*-*-* 02:00:00"  # the current occurrence is in the past, the next up to a day away: never in the way
EVERY_10S = "*:*:0/10"

pytestmark = pytest.mark.consul


def history(job: str) -> list[dict]:
    code, out, err = cli("history", job, "--json")
    assert code == 0, err
    return json.loads(out)["runs"]


def counting_job(runs: Path, code: int) -> list[str]:
    """A job that appends `<its CONSULRUN_ATTEMPT> <CONSULRUN_TAKEOVER>` to `runs` and exits `code`."""
    return ["sh", "-c", f'echo "$CONSULRUN_ATTEMPT ${{CONSULRUN_TAKEOVER:-0}}" >> {runs}; exit {code}']


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def gated(started: Path, go: Path, code: int = 0) -> list[str]:
    """A job that says it started and runs until the test lets it end, then exits `code`."""
    return ["sh", "-c", f"touch {started}; while [ ! -e {go} ]; do sleep 0.1; done; exit {code}"]


def occurrence_now(spec: str) -> str:
    return calendar.occurrence_id(calendar.previous([spec], datetime.now(timezone.utc)))


def wait_for_next_occurrence(spec: str, after: str, timeout: float = 30) -> str:
    """Wait until an occurrence later than `after` is the current one, and return it."""
    return wait_for(lambda: occurrence_now(spec) if occurrence_now(spec) > after else None, timeout,
                    f"an occurrence of {spec} after {after}")


def fresh_occurrence(spec: str, within_s: float = 2.0) -> str:
    """Wait until an occurrence of `spec` began at most `within_s` ago (a run started now starts in time)."""
    def fresh() -> str | None:
        now = datetime.now(timezone.utc)
        when = calendar.previous([spec], now)
        return calendar.occurrence_id(when) if (now - when).total_seconds() <= within_s else None
    return wait_for(fresh, 15, f"a fresh occurrence of {spec}", interval=0.05)


def second_waits_for_first(consul: Agent, job: str, base: tuple[str, ...], started: Path, command: list[str],
                           log: Path) -> tuple[str, str, object]:
    """Once the node's first run of `job` has started: wait for the next occurrence, start a second wrapper
    (its stderr to `log`) and wait until it says it waits for the first. (first's occurrence, the next one,
    the second wrapper)."""
    wait_for(started.exists, 20, "the first run")
    first_occ = kv_json(consul, f"consulrun/{job}/nodes/{consul.name}/occurrence")["occurrence"]
    later = wait_for_next_occurrence(EVERY_10S, first_occ)
    with log.open("w") as handle:
        second = consulrun(*base, "--", *command, stderr=handle)
    try:
        wait_for(lambda: "still running" in log.read_text(), 10, "the second wrapper to wait for the first")
    except BaseException:
        kill_wrapper(second)
        raise
    return first_occ, later, second


def release_all(go: Path, *procs) -> None:
    """Let every gated job end and SIGKILL any wrapper still running (a failed test leaves none behind)."""
    go.touch()
    for proc in procs:
        if proc is not None and proc.poll() is None:
            kill_wrapper(proc)


def kill_wrapper(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)


# --- 1. a chained child whose retry cannot start ----------------------------------------------------------------

def test_a_chained_retry_that_cannot_start_is_a_failed_attempt_not_a_request_given_back(
        consul: Agent, tmp_path: Path) -> None:
    """Attempt 1 of the chained child exits 1, attempt 2 cannot be exec'd (the script lost its x bit): the job
    ran, so the run after the parent is done (its history entry stays, no request comes back) and a second
    chain-watch start finds nothing pending."""
    parent = finish(consulrun("run", "--schedule", DAILY, "--then", "c:always", "p", "--", "true"))
    assert parent[0] == 0, parent[2]
    assert kv_keys(consul, "consulrun/c/after/"), "the parent's end asked for no run of c"
    script, runs = tmp_path / "child.sh", tmp_path / "runs"
    script.write_text(f"#!/bin/sh\necho run >> {runs}\nchmod -x {script}\nexit 1\n")
    script.chmod(0o755)
    code, _, err = finish(consulrun("run", "--after", "p", "--attempts", "2", "--retry-backoff", "1s", "c", "--",
                                    str(script)))
    assert lines(runs) == ["run"], err
    assert code == 127, err  # the last attempt's: it could not be started (exec: permission denied)
    assert kv_keys(consul, "consulrun/c/after/") == [], "the request came back: another node would run c again"
    rows = sorted(history("c"), key=lambda r: r["attempt"])  # one row per attempt
    assert [(r["attempt"], r["state"], r["exit_status"]) for r in rows] == [(1, "done", 1), (2, "done", 127)], rows
    assert rows[1]["started"] is None and rows[1]["duration_s"] is None, rows  # it never started
    again = finish(consulrun("run", "--after", "p", "c", "--", "true"))
    assert again[0] == 0 and "no run after p is pending" in again[2], again[2]
    assert lines(runs) == ["run"]


# --- 2. attempts after a takeover ---------------------------------------------------------------------------------

def test_a_takeover_in_the_backoff_never_exceeds_attempts_and_the_job_knows_its_attempt(
        consul: Agent, tmp_path: Path) -> None:
    """attempts: 2, a job that always fails; the holder's wrapper is SIGKILLed in the backoff after attempt 1
    (attempt 2 never started) and reaped: the standby takes over and runs once more - two runs in all - and its
    job's CONSULRUN_ATTEMPT is the number history gives that run, with CONSULRUN_TAKEOVER=1."""
    runs = tmp_path / "runs"
    args = ("run", "--schedule", DAILY, "--on-holder-loss", "retry", "--attempts", "2", "--retry-backoff", "20s",
            "--lock-delay", "5s", "--ttl", "10s", "budget", "--", *counting_job(runs, 4))
    holder = consulrun(*args)
    try:
        wait_for(lambda: (kv_json(consul, "consulrun/budget/occurrence") or {}).get("attempt") == 2, 30,
                 "the holder's backoff after attempt 1")
        log = tmp_path / "standby.log"
        with log.open("w") as handle:
            standby = consulrun(*args, stderr=handle)
        wait_for(lambda: "standing by" in log.read_text(), 20, "the standby to stand by")
        kill_wrapper(holder)
        code, _, err = cli("reap", "budget")
        assert code == 0, err
        scode = finish(standby, timeout=90)[0]
        serr = log.read_text()
    finally:
        for proc in (holder,):
            if proc.poll() is None:
                kill_wrapper(proc)
    assert scode == 4, serr
    assert len(lines(runs)) == 2, (lines(runs), serr)  # attempts: 2 is two runs in all
    record = kv_json(consul, "consulrun/budget/occurrence")
    assert record["state"] == "done" and record["takeover"] is True, record
    assert lines(runs)[1] == f"{record['attempt']} 1", (lines(runs), record)
    # The attempt abandoned in its backoff claims no start: its record said only when the retry was due.
    assert [("started" in e, e.get("retried")) for e in record["earlier"]] == [(True, True), (False, None)], record


# --- 3. a lock lost in the backoff --------------------------------------------------------------------------------

def test_a_lock_lost_in_the_backoff_still_records_the_last_attempts_result(consul: Agent, tmp_path: Path) -> None:
    """A forced unlock one moment into the backoff ends the retries; nobody took the occurrence over, so the
    failed attempt's result is recorded: done, its exit status, a history entry - never left `running`."""
    runs = tmp_path / "runs"
    runner = consulrun("run", "--schedule", DAILY, "--attempts", "3", "--retry-backoff", "30s", "lb", "--",
                       *counting_job(runs, 6))
    try:
        wait_for(lambda: (kv_json(consul, "consulrun/lb/occurrence") or {}).get("attempt") == 2, 20, "the backoff")
        code, _, err = cli("unlock", "lb", "--yes", "--force")
        assert code == 0, err
        code, _, err = finish(runner, timeout=30)
    finally:
        if runner.poll() is None:
            kill_wrapper(runner)
    assert code == 6, err
    assert "taken over meanwhile" not in err, err
    record = kv_json(consul, "consulrun/lb/occurrence")
    assert record["state"] == "done" and record["exit_status"] == 6 and record["attempt"] == 1, record
    assert record.get("retries_ended"), record
    [entry] = history("lb")
    assert entry["state"] == "done" and entry["exit_status"] == 6, entry
    assert len(lines(runs)) == 1


# --- 4. each-node: a node's own live run -------------------------------------------------------------------------

@pytest.mark.parametrize("concurrency", [1, 2])
def test_each_node_never_settles_its_own_live_run_nor_runs_two_occurrences_at_once(
        consul: Agent, tmp_path: Path, concurrency: int) -> None:
    """A node's run of occurrence T outlives the interval; the node's timer fires for T+10s. With a free slot
    (concurrency 2) it waits for its own run rather than run two occurrences at once; without one (1) it
    records T+10s missed for itself at its bound. Either way T's run is never written abandoned and its result
    (exit 0) is recorded."""
    started, go, runs2 = tmp_path / "started", tmp_path / "go", tmp_path / "runs2"
    base = ("run", "--each-node", "--concurrency", str(concurrency), "--schedule", EVERY_10S,
            "--lock-delay", "5s", "--ttl", "10s", "en")
    fresh_occurrence(EVERY_10S)
    first = consulrun(*base, "--", *gated(started, go))
    second = None
    try:
        wait_for(started.exists, 20, "the first run")
        record = wait_for(lambda: kv_json(consul, f"consulrun/en/nodes/{consul.name}/occurrence"), 10, "its record")
        first_occ = record["occurrence"]
        wait_for_next_occurrence(EVERY_10S, first_occ)
        log = tmp_path / "second.log"
        with log.open("w") as handle:
            second = consulrun(*base, "--", "sh", "-c", f"echo ran >> {runs2}", stderr=handle)
        if concurrency == 2:
            wait_for(lambda: "still running" in log.read_text() or second.poll() is not None, 20,
                     "the second wrapper to wait for the first run")
            assert second.poll() is None and not runs2.exists(), log.read_text()
        else:
            assert finish(second, timeout=30)[0] == 0, log.read_text()
        go.touch()
        assert finish(first, timeout=30)[0] == 0
        if second.poll() is None or concurrency == 2:
            assert finish(second, timeout=30)[0] == 0, log.read_text()
    finally:
        release_all(go, first, second)
    node_history = {e["occurrence"]: e for e in history("en")}
    assert node_history[first_occ]["state"] == "done", node_history
    assert node_history[first_occ].get("exit_status") == 0, node_history
    later = [e for occ, e in node_history.items() if occ > first_occ]
    assert len(later) == 1, node_history
    if concurrency == 2:
        assert later[0]["state"] == "done" and lines(runs2) == ["ran"], node_history
        assert later[0]["started"] >= node_history[first_occ]["ended"], node_history  # never two at once
    else:
        assert later[0]["state"] == "missed" and not runs2.exists(), node_history
        # The miss is in the node's history alone (its record is the run that ended done): status still says it.
        code, out, err = cli("status", "--json", "en")
        assert code == 3, (out, err)
        problems = [p for job in json.loads(out)["jobs"] for p in job["problems"]]
        assert any(p["kind"] == "missed" and p.get("occurrence") == later[0]["occurrence"] for p in problems), out
        assert not any("neither ran nor was recorded missed" in p["detail"] and later[0]["occurrence"] in
                       p["detail"] for p in problems), out  # it was recorded, in the node's history


# --- 5. a start deadline beside a live run ----------------------------------------------------------------------

def test_a_start_deadline_records_its_own_occurrence_missed_and_leaves_the_live_run_alone(
        consul: Agent, tmp_path: Path) -> None:
    """P's occurrence T runs past the interval; a node whose timer fires late for T+10s (past its 5s start
    deadline) records T+10s missed and nothing else: T is not written abandoned, no `failure` run is asked
    for, and when T's job exits 0 its result lands and the `success` child is asked for."""
    started, go = tmp_path / "started", tmp_path / "go"
    base = ("run", "--schedule", EVERY_10S, "--start-deadline", "5s", "--then", "s:success", "--then",
            "f:failure", "--lock-delay", "5s", "--ttl", "10s", "P")
    fresh_occurrence(EVERY_10S)
    first = consulrun(*base, "--", *gated(started, go))
    try:
        wait_for(started.exists, 20, "P's run")
        first_occ = kv_json(consul, "consulrun/P/occurrence")["occurrence"]
        later = wait_for_next_occurrence(EVERY_10S, first_occ)
        when = datetime.strptime(later, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
        wait_for(lambda: (datetime.now(timezone.utc) - when).total_seconds() > 6, 10, "the start deadline")
        code, _, err = finish(consulrun(*base, "--", "true"))
        assert code == 0 and "missed" in err, err
        record = kv_json(consul, "consulrun/P/occurrence")
        assert record["occurrence"] == first_occ and record["state"] == "running", record
        assert kv_keys(consul, "consulrun/f/after/") == [], "a failure run was asked for a run still going"
        go.touch()
        code, _, err = finish(first, timeout=30)
    finally:
        go.touch()
        if first.poll() is None:
            kill_wrapper(first)
    assert code == 0, err
    runs = {e["occurrence"]: e for e in history("P")}
    assert runs[first_occ]["state"] == "done" and runs[first_occ]["exit_status"] == 0, runs
    assert runs[later]["state"] == "missed", runs
    assert kv_keys(consul, "consulrun/s/after/"), "the success child was not asked for"
    assert kv_keys(consul, "consulrun/f/after/") == []


def test_each_node_waiting_for_its_own_run_notices_that_run_die_and_runs_its_occurrence(
        consul: Agent, tmp_path: Path) -> None:
    """The node waits on the slot its own earlier run holds, so the death of that run (its wrapper SIGKILLed,
    its session reaped) ends the wait at once, not at the bound: the dead run is recorded abandoned and the
    waiting occurrence runs, lock-delay later."""
    started, go, runs2 = tmp_path / "started", tmp_path / "go", tmp_path / "runs2"
    base = ("run", "--each-node", "--schedule", EVERY_10S, "--lock-delay", "5s", "--ttl", "10s", "ed")
    fresh_occurrence(EVERY_10S)
    first = consulrun(*base, "--", *gated(started, go))
    second = None
    log = tmp_path / "second.log"
    try:
        first_occ, later, second = second_waits_for_first(consul, "ed", base, started,
                                                          ["sh", "-c", f"echo ran >> {runs2}"], log)
        kill_wrapper(first)
        code, _, err = cli("reap", "ed")
        assert code == 0, err
        assert finish(second, timeout=30)[0] == 0, log.read_text()
    finally:
        release_all(go, first, second)
    runs = {e["occurrence"]: e for e in history("ed")}
    assert runs[first_occ]["state"] == "abandoned", runs
    assert runs[later]["state"] == "done" and lines(runs2) == ["ran"], (runs, log.read_text())


def test_takeovers_keep_the_earlier_attempts_one_flat_list() -> None:
    """Each takeover adds the attempt it took over to `earlier`, without that attempt's own `earlier` (the list
    itself): copied whole, four takeovers nested the record past what every reader accepts, and the job never
    ran again (red team, break 1)."""
    from consulrun.consul.values import decode
    from consulrun.protocol.occurrence import Ledger, Occurrence, Snapshot

    ledger = Ledger(None, "consulrun/flat", 5, policy="retry")  # type: ignore[arg-type] - claim_ops sends nothing
    when = datetime(2026, 1, 1, 2, tzinfo=timezone.utc)
    occ = Occurrence(when=when, id="2026-01-01T02:00:00Z", next_when=None, specs=(DAILY,))
    record = {"occurrence": occ.id, "state": "running", "node": "n1", "session": "s1", "attempt": 1, "earlier": []}
    for n in range(2, 8):
        snap = Snapshot(record_index=n, record=record, lock=None)
        _, record = ledger.claim_ops(occ, snap, {"node": f"n{n}", "session": f"s{n}", "started": occ.id},
                                     takeover=True)
    assert record["attempt"] == 7 and [e["attempt"] for e in record["earlier"]] == [1, 2, 3, 4, 5, 6]
    assert all("earlier" not in e for e in record["earlier"]), record
    entry = {"Key": "consulrun/flat/occurrence", "Value": json.dumps(record).encode()}
    assert decode(entry) == record  # what every reader accepts (values.py refuses a deeper nest)


def test_each_node_waiting_for_its_own_run_records_its_start_deadline_when_it_passes(
        consul: Agent, tmp_path: Path) -> None:
    """A start deadline ends the wait for the node's own earlier run, as it ends a wait for a slot: the late
    occurrence is recorded missed for its deadline (in its history entry alone), not at the bound."""
    started, go = tmp_path / "started", tmp_path / "go"
    base = ("run", "--each-node", "--concurrency", "2", "--schedule", EVERY_10S, "--start-deadline", "3s",
            "--lock-delay", "5s", "--ttl", "10s", "esd")
    fresh_occurrence(EVERY_10S)
    first = consulrun(*base, "--", *gated(started, go))
    try:
        wait_for(started.exists, 20, "the first run")
        first_occ = kv_json(consul, f"consulrun/esd/nodes/{consul.name}/occurrence")["occurrence"]
        later = wait_for_next_occurrence(EVERY_10S, first_occ)
        code, _, err = finish(consulrun(*base, "--", "true"), timeout=30)
        assert code == 0 and "start_deadline" in err, err
        go.touch()
        assert finish(first, timeout=30)[0] == 0
    finally:
        go.touch()
        if first.poll() is None:
            kill_wrapper(first)
    runs = {e["occurrence"]: e for e in history("esd")}
    assert runs[later]["state"] == "missed" and "start_deadline" in runs[later]["reason"], runs
    assert runs[first_occ]["state"] == "done", runs


def test_each_node_waits_out_its_own_fenced_run_before_taking_another_slot(consul: Agent, tmp_path: Path) -> None:
    """concurrency 2: the node's run A of an earlier occurrence loses its slot (a forced unlock) and fences
    its job, which ignores SIGTERM; lock-delay shuts only A's slot, so B, the node's next occurrence, waits as
    long before it takes the other one: A's job is dead before B's starts, and A records itself lost (red team
    2: B started beside A's dying job and wrote A abandoned over the result A was about to record)."""
    alive, events = tmp_path / "a_alive", tmp_path / "events"
    base = ("run", "--each-node", "--concurrency", "2", "--schedule", EVERY_10S, "--lock-delay", "5s", "--ttl",
            "10s", "ef")
    fresh_occurrence(EVERY_10S)
    beat = f"date +%s.%N > {alive}.tmp && mv {alive}.tmp {alive}"  # never read half-written
    first = consulrun(*base, "--", "sh", "-c", f"trap '' TERM; while :; do {beat}; sleep 0.1; done")
    second = None
    log = tmp_path / "second.log"
    try:
        first_occ, later, second = second_waits_for_first(consul, "ef", base, alive,
                                                          ["sh", "-c", f"date +%s.%N > {events}"], log)
        code, _, err = cli("unlock", "ef", "--yes", "--force")
        assert code == 0, err
        assert finish(first, timeout=30)[0] == 75
        assert finish(second, timeout=30)[0] == 0, log.read_text()
    finally:
        release_all(tmp_path / "go", first, second)
    assert float(events.read_text()) > float(alive.read_text()), "B started while A's job still ran"
    runs = {e["occurrence"]: e for e in history("ef")}
    assert runs[first_occ]["state"] == "lost" and runs[first_occ]["exit_status"] == 75, runs
    assert runs[later]["state"] == "done", runs
