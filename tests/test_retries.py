"""Retries of a failed run (`retries:`, `run --attempts`), against a real Consul agent (issue 29, item 1)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from consulrun.protocol import keys as kvkeys
from consulrun.protocol.retries import ATTEMPTS_MAX, RetryPolicy
from tests.harness.agents import Agent, wait_for
from tests.harness.healthchecks import checks, register
from tests.harness.runs import cli, consulrun, finish, kv_json

DAILY = "*-*-* 02:00:00"  # the current occurrence is in the past, the next up to a day away: never in the way


def counting_job(runs: Path, fail_until: int, code: int = 3) -> list[str]:
    """A job that appends its attempt to `runs` and exits `code` until its `fail_until`-th run, then 0."""
    script = (f'echo "$CONSULRUN_ATTEMPT $(date +%s.%N)" >> {runs}; '
              f'[ "$(wc -l < {runs})" -ge {fail_until} ] && exit 0; exit {code}')
    return ["sh", "-c", script]


def attempts(runs: Path) -> list[tuple[int, float]]:
    return [(int(a), float(t)) for a, t in (line.split() for line in runs.read_text().splitlines())] \
        if runs.exists() else []


def history(job: str) -> list[dict]:
    code, out, err = cli("history", job, "--json")
    assert code == 0, err
    return json.loads(out)["runs"]


# --- the arithmetic --------------------------------------------------------------------------------------------

def test_backoff_doubles_up_to_its_cap_and_attempts_count_the_first_run() -> None:
    policy = RetryPolicy(attempts=6, backoff_ms=1000, max_backoff_ms=5000)
    assert [policy.backoff_s(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]
    assert policy.total_backoff_ms() == 17_000  # the five waits between six attempts
    assert RetryPolicy(attempts=1).total_backoff_ms() == 0
    assert RetryPolicy(attempts=ATTEMPTS_MAX, backoff_ms=10**9, max_backoff_ms=10**10).backoff_s(99) == 10**7


def test_the_lean_reader_and_click_share_the_attempts_bound() -> None:
    from consulrun.commands.runargs import ATTEMPTS_MAX as LEAN_MAX

    assert LEAN_MAX == ATTEMPTS_MAX


# --- real runs -------------------------------------------------------------------------------------------------

@pytest.mark.consul
def test_attempts_and_backoff_are_in_history_and_success_ends_the_retries(consul: Agent, tmp_path: Path) -> None:
    """Fails twice, succeeds on the third of five allowed attempts: three runs, no fourth, the waits growing
    (1s, then 2s), each attempt a history row with its own exit status; the unit's status is the last one's."""
    runs = tmp_path / "runs"
    code, _, err = finish(consulrun("run", "--schedule", DAILY, "--attempts", "5", "--retry-backoff", "1s",
                                    "--retry-max-backoff", "10s", "flaky", "--", *counting_job(runs, 3)))
    assert code == 0, err
    seen = attempts(runs)
    assert [a for a, _ in seen] == [1, 2, 3], err
    assert seen[1][1] - seen[0][1] >= 1.0 and seen[2][1] - seen[1][1] >= 2.0, seen
    assert "attempt 1 of 5 failed (exit status 3); retrying in 1s" in err, err
    assert "attempt 2 of 5 failed (exit status 3); retrying in 2s" in err, err
    rows = history("flaky")
    assert [(r["attempt"], r["exit_status"], r["retried"]) for r in rows] == [(3, 0, False), (2, 3, True),
                                                                              (1, 3, True)], rows
    assert [r["retry_after_s"] for r in rows] == [None, 2.0, 1.0]
    assert len({r["node"] for r in rows}) == 1 and len({r["session"] for r in rows}) == 1  # same node, one lock
    assert len({r["occurrence"] for r in rows}) == 1
    record = kv_json(consul, "consulrun/flaky/occurrence")
    assert record["state"] == "done" and record["attempt"] == 3 and record["exit_status"] == 0
    code, out, _ = cli("history", "flaky")
    assert "retried after 2s" in out and "retried after 1s" in out, out


@pytest.mark.consul
def test_never_more_attempts_than_allowed_and_the_last_status_is_the_units(consul: Agent, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    code, _, err = finish(consulrun("run", "--schedule", DAILY, "--attempts", "3", "--retry-backoff", "0s",
                                    "--retry-max-backoff", "0s", "doomed", "--", *counting_job(runs, 99, code=7)))
    assert code == 7, err
    assert [a for a, _ in attempts(runs)] == [1, 2, 3]
    assert "attempt 3 of 3 failed (exit status 7); no retry: it was the last of 3 attempts" in err, err
    rows = history("doomed")
    assert [(r["attempt"], r["exit_status"], r["retried"]) for r in rows] == [(3, 7, False), (2, 7, True),
                                                                              (1, 7, True)], rows
    assert rows[0]["retries_ended"] == "it was the last of 3 attempts"
    # A second run for the same occurrence finds it done: retries never outlive the run that made them.
    code, _, err = finish(consulrun("run", "--schedule", DAILY, "--attempts", "3", "doomed", "--",
                                    *counting_job(runs, 99, code=7)))
    assert code == 0 and "already ran" in err, err
    assert len(attempts(runs)) == 3


@pytest.mark.consul
def test_a_skip_a_success_and_a_stop_are_never_retried(consul: Agent, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    code, _, err = finish(consulrun("run", "--schedule", DAILY, "--attempts", "4", "--retry-backoff", "0s",
                                    "once", "--", *counting_job(runs, 1)))
    assert code == 0 and len(attempts(runs)) == 1 and "retry" not in err, err
    started = tmp_path / "started"
    runner = consulrun("run", "--schedule", DAILY, "--attempts", "4", "--retry-backoff", "0s", "stopped", "--",
                       "sh", "-c", f"echo x >> {runs}2; touch {started}; sleep 60")
    wait_for(started.exists, 20, "the job")
    runner.send_signal(signal.SIGTERM)
    code, _, err = finish(runner)
    assert code == 128 + signal.SIGTERM, err  # a stop that reached the job: its own status, and no retry
    assert (tmp_path / "runs2").read_text().count("x") == 1
    assert "attempt 1 of 4 failed" in err and "stopped by a termination signal" in err, err


@pytest.mark.consul
def test_the_jobs_own_timeout_is_a_failure_that_is_retried(consul: Agent, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    script = f'echo "$CONSULRUN_ATTEMPT $(date +%s.%N)" >> {runs}; [ "$CONSULRUN_ATTEMPT" = 2 ] && exit 0; sleep 60'
    code, _, err = finish(consulrun("run", "--schedule", DAILY, "--timeout", "1s", "--attempts", "2",
                                    "--retry-backoff", "0s", "slow", "--", "sh", "-c", script))
    assert code == 0, err
    assert [a for a, _ in attempts(runs)] == [1, 2]
    rows = history("slow")
    assert rows[1]["retried"] and rows[1]["exit_status"] == 128 + signal.SIGTERM, rows


@pytest.mark.consul
def test_a_signal_during_the_backoff_ends_the_retries_and_the_last_status_stands(consul: Agent,
                                                                                 tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runner = consulrun("run", "--schedule", DAILY, "--attempts", "5", "--retry-backoff", "5min",
                       "--retry-max-backoff", "5min", "backingoff", "--", *counting_job(runs, 99, code=4))
    wait_for(lambda: (kv_json(consul, "consulrun/backingoff/occurrence") or {}).get("attempt") == 2, 20,
             "the failed attempt recorded and the backoff begun")
    assert runner.poll() is None
    during = history("backingoff")
    assert [(r["attempt"], r["state"]) for r in during] == [(2, "running"), (1, "done")], during
    code, out, _ = cli("history", "backingoff")
    assert "retry due" in out, out
    code, out, err = cli("status", "backingoff")
    assert code == 0 and "retrying (attempt 2) on dev1" in out, (out, err)  # held, healthy, not overdue
    runner.send_signal(signal.SIGTERM)
    code, _, err = finish(runner, timeout=30)
    assert code == 4, err  # the last attempt's status, not 128+15: no job was running to be stopped
    assert len(attempts(runs)) == 1
    assert "SIGTERM received during the backoff; no further attempt: attempt 1's exit status 4 stands" in err, err
    rows = history("backingoff")
    assert [(r["attempt"], r["exit_status"], r["state"], r["retried"]) for r in rows] == [(1, 4, "done", False)]
    assert rows[0]["retries_ended"] == "SIGTERM received", rows
    assert not consul.get("session/list")  # released: the session is gone


@pytest.mark.consul
def test_no_retry_reaches_the_next_occurrence(consul: Agent, tmp_path: Path) -> None:
    """Every minute, a backoff of two: the retry would come after the next occurrence is due, so it is not made
    and the line says so."""
    runs = tmp_path / "runs"
    code, _, err = finish(consulrun("run", "--schedule", "*-*-* *:*:00", "--attempts", "3", "--retry-backoff", "2min",
                                    "--retry-max-backoff", "2min", "dense", "--", *counting_job(runs, 99, code=5)))
    assert code == 5, err
    assert len(attempts(runs)) == 1
    assert "attempt 1 of 3 failed (exit status 5); no retry: the next occurrence (" in err, err
    assert "is due before a retry in 2m" in err, err
    rows = history("dense")
    assert len(rows) == 1 and rows[0]["retries_ended"].startswith("the next occurrence"), rows


@pytest.mark.consul
def test_ping_and_health_check_report_the_final_result_only(catalog: Agent, tmp_path: Path,  # noqa: F811
                                                            monitor: tuple[str, list[str]]) -> None:  # noqa: F811
    """Attempt 1 fails; while attempt 2 runs, the monitor has had only `/start` and the health check is still
    as it was (no critical from the failed attempt); at the end, one result ping and a passing check."""
    url, paths = monitor
    register(catalog)
    runs, go = tmp_path / "runs", tmp_path / "go"
    script = (f'echo "$CONSULRUN_ATTEMPT 0" >> {runs}; [ "$CONSULRUN_ATTEMPT" = 1 ] && exit 3; '
              f'while [ ! -e {go} ]; do sleep 0.1; done')
    runner = consulrun("run", "--schedule", DAILY, "--attempts", "3", "--retry-backoff", "0s", "--ping-url", url,
                       "--health-check", "pinged", "--", "sh", "-c", script)
    try:
        wait_for(lambda: len(attempts(runs)) == 2, 20, "the second attempt")
        time.sleep(0.5)  # a ping for the failed attempt would have been sent by now
        session = kv_json(catalog, "consulrun/pinged/occurrence")["session"]
        assert paths == [f"/ping/c0ffee/start?rid={session}"], paths
        assert checks(catalog).get("pinged", {}).get("Status") != "critical", checks(catalog)
        go.touch()
        code, _, err = finish(runner)
    finally:
        go.touch()
        if runner.poll() is None:
            runner.kill()
            finish(runner)
    assert code == 0, err
    wait_for(lambda: len(paths) >= 2, 10, "the result ping")
    assert paths == [f"/ping/c0ffee/start?rid={session}", f"/ping/c0ffee?rid={session}"], paths
    assert checks(catalog)["pinged"]["Status"] == "passing", checks(catalog)


@pytest.mark.consul
def test_the_exporter_counts_the_run_not_its_attempts(consul: Agent, tmp_path: Path) -> None:
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.report.metrics import ClusterMetrics

    runs = tmp_path / "runs"
    code, _, err = finish(consulrun("run", "--schedule", DAILY, "--attempts", "3", "--retry-backoff", "0s",
                                    "counted", "--", *counting_job(runs, 3)))
    assert code == 0, err
    metrics = ClusterMetrics("consulrun", None)
    metrics.refresh(Client(ConsulConfig(address=consul.http_addr)))
    samples = {(s.labels.get("outcome"), s.name): s.value for fam in metrics.runs.collect() for s in fam.samples
               if s.labels.get("job_name") == "counted" and s.name.endswith("_total")}
    assert samples == {("success", "consulrun_job_runs_total"): 1.0}, samples


@pytest.mark.consul
def test_a_standby_never_runs_an_attempt_the_holder_retries(consul: Agent, tmp_path: Path) -> None:
    """Same node, lock kept: under on_holder_loss: retry a second wrapper for the occurrence stands by through
    the failed attempt and the backoff, sees it running, and never runs it; every attempt is the holder's."""
    runs = tmp_path / "runs"
    holder = consulrun("run", "--schedule", DAILY, "--on-holder-loss", "retry", "--attempts", "3",
                       "--retry-backoff", "2s", "kept", "--", *counting_job(runs, 3))
    wait_for(lambda: attempts(runs), 20, "the first attempt")
    standby = consulrun("run", "--schedule", DAILY, "--on-holder-loss", "retry", "--attempts", "3",
                        "--retry-backoff", "2s", "kept", "--", "sh", "-c", f"echo standby >> {runs}")
    code, _, err = finish(holder)
    assert code == 0, err
    scode, _, serr = finish(standby)
    assert scode == 0 and "already ran" in serr, serr
    assert [a for a, _ in attempts(runs)] == [1, 2, 3]
    assert len({r["session"] for r in history("kept")}) == 1


# --- the manifest and the units --------------------------------------------------------------------------------

RETRYING = """\
defaults:
  retries: {backoff: 30s}
jobs:
  report:
    command: [/usr/bin/report]
    schedule: daily
    timeout: 1min
    retries: {attempts: 3, max_backoff: 1min}
  plain:
    command: [/usr/bin/plain]
    schedule: daily
    timeout: 1min
"""


def test_generate_passes_the_retries_and_the_backstop_counts_every_attempt_and_backoff(tmp_path: Path) -> None:
    from consulrun.manifest.loader import parse_manifest
    from consulrun.protocol.fencing import start_backstop_ms
    from consulrun.units.guarantees import start_timeout_ms
    from consulrun.units.render import run_argv

    manifest = parse_manifest(RETRYING, "jobs.yaml")
    report, plain = (next(j for j in manifest.jobs if j.name == n) for n in ("report", "plain"))
    assert (report.retries.attempts, report.retries.backoff_ms, report.retries.max_backoff_ms) == (3, 30_000, 60_000)
    argv = run_argv(manifest, report, "/usr/bin/consulrun")
    assert argv[argv.index("--attempts"):argv.index("--attempts") + 6] == [
        "--attempts", "3", "--retry-backoff", "30s", "--retry-max-backoff", "1m"]
    assert "--attempts" not in run_argv(manifest, plain, "/usr/bin/consulrun")  # no retries: the unit as before
    one = start_timeout_ms(plain)
    # Two more attempts (timeout + stop grace each), their backoffs (30s, then 60s), a fencing window each.
    assert start_timeout_ms(report) - one == 2 * (60_000 + 14_000) + 90_000 + 2 * 15_000
    assert start_backstop_ms(60_000, 15_000, 15_000, 0, 1_000, 6_000, retry=False) == one


@pytest.mark.parametrize(("text", "message"), [
    ("retries: {attempts: 0}", "jobs.j.retries.attempts: must be between 1 and 100, not 0"),
    ("retries: {attempts: 2, tries: 3}", "jobs.j.retries.tries: unknown key 'tries'"),
    ("retries: {backoff: 1min, max_backoff: 30s}",
     "jobs.j.retries.max_backoff: max_backoff (30s) must be at least backoff (1m)"),
    ("retries: {backoff: 400d}", "jobs.j.retries.backoff: '400d' is out of range"),
    ("retries: {attempts: 2}\n    lock: {concurrency: 2}",
     "jobs.j.retries.attempts: retries are of one occurrence, run by one holder: they need lock.concurrency: 1"),
])
def test_bad_retries_are_one_positioned_line(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(f"jobs:\n  j:\n    command: [/bin/true]\n    schedule: daily\n    {text}\n")
    code, _, err = cli("validate", str(path))
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {path}:5:") and message in lines[0], err


def test_attempts_need_a_schedule(tmp_path: Path) -> None:
    code, _, err = finish(consulrun("run", "--attempts", "2", "unscheduled", "--", "true"))
    assert code == 2 and "--attempts retries a scheduled occurrence: it needs --schedule" in err, err
    code, _, err = finish(consulrun("run", "--schedule", DAILY, "--attempts", "2", "--retry-backoff", "1min",
                                    "--retry-max-backoff", "1s", "capped", "--", "true"))
    assert code == 2 and "--retry-max-backoff must be at least --retry-backoff" in err, err


@pytest.mark.consul
def test_a_lock_lost_during_the_backoff_ends_the_retries(consul: Agent, tmp_path: Path) -> None:
    """The watcher keeps confirming through the backoff: a forced unlock then ends the retries at once (no
    attempt starts without the lock), and the failed attempt's status stands."""
    runs = tmp_path / "runs"
    runner = consulrun("run", "--schedule", DAILY, "--attempts", "3", "--retry-backoff", "5min",
                       "--retry-max-backoff", "5min", "unlocked", "--", *counting_job(runs, 99, code=6))
    try:
        wait_for(lambda: (kv_json(consul, "consulrun/unlocked/occurrence") or {}).get("attempt") == 2, 20,
                 "the backoff")
        code, _, err = cli("unlock", "unlocked", "--yes", "--force")
        assert code == 0, err
        code, _, err = finish(runner, timeout=30)
    finally:
        if runner.poll() is None:
            runner.kill()
            finish(runner)
    assert code == 6, err
    assert len(attempts(runs)) == 1
    assert "the lock was lost (the lock was released or taken over" in err and "during the backoff" in err, err


@pytest.mark.consul
def test_a_manual_run_is_retried_and_its_history_entry_holds_every_attempt(consul: Agent, tmp_path: Path) -> None:
    """A `consulrun trigger` run (the request in the trigger key, the unit not started by its timer) gets the
    job's retries as an occurrence does: its one `~manual` history entry lists both attempts."""
    import uuid
    from datetime import datetime, timezone

    from tests.harness.holders import put

    at = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    put(consul, "consulrun/asked/trigger", {"id": str(uuid.uuid4()), "by": "op@host", "at": at, "node": "dev1"})
    runs = tmp_path / "runs"
    code, _, err = finish(consulrun("run", "--schedule", DAILY, "--attempts", "3", "--retry-backoff", "0s", "asked",
                                    "--", *counting_job(runs, 2), env={"TRIGGER_UNIT": ""}))
    assert code == 0 and "for a manual run asked for by op@host" in err, err
    assert [a for a, _ in attempts(runs)] == [1, 2]
    keys = [k for k in (consul.get("kv/consulrun/asked/history/?keys") or [])]
    assert len(keys) == 1 and kvkeys.is_manual(keys[0]), keys
    rows = history("asked")
    assert [(r["attempt"], r["exit_status"], r["retried"], r["manual"]) for r in rows if r["manual"]] == [
        (2, 0, False, True), (1, 3, True, True)], rows


def test_validate_warns_when_the_schedule_leaves_no_room_for_every_attempt(tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text("jobs:\n"
                    "  dense: {command: [/bin/false], schedule: '*:0/5', timeout: 1min,\n"
                    "          retries: {attempts: 5, backoff: 30s, max_backoff: 2min}}\n"
                    "  roomy: {command: [/bin/false], schedule: daily, retries: {attempts: 5, backoff: 30s}}\n")
    code, _, err = cli("validate", str(path))
    assert code == 0, err
    # 1m + 30s, then 1m + 1m: the third attempt starts 3m30s in; a fourth would start 6m30s in, past 5m.
    assert err.splitlines() == ["warning: job dense: retries: occurrences are 5m apart, so at most 3 of the 5 "
                                "attempts can run before the next occurrence ends the retries (backoff 30s, doubling "
                                "to 2m, each attempt up to its timeout 1m)"], err


@pytest.mark.consul
def test_the_lock_is_confirmed_again_before_a_retry_starts(consul: Agent, tmp_path: Path) -> None:
    """The backoff is over and the lock is taken away before the next attempt's fork (a test hook holds the
    wrapper there): the consistent read before the attempt finds the key no longer this session's, and nothing
    starts; the failed attempt's status stands."""
    runs, hooks = tmp_path / "runs", tmp_path / "hooks"
    hooks.mkdir()
    runner = consulrun("run", "--schedule", DAILY, "--attempts", "3", "--retry-backoff", "0s", "confirmed", "--",
                       *counting_job(runs, 99, code=6),
                       env={"CONSULRUN_TEST_PAUSE": "retry", "CONSULRUN_TEST_HOOK_DIR": str(hooks)})
    try:
        wait_for((hooks / "retry").exists, 20, "the wrapper at the retry's start")
        code, _, err = cli("unlock", "confirmed", "--yes", "--force")
        assert code == 0, err
        (hooks / "retry.go").touch()
        code, _, err = finish(runner, timeout=30)
    finally:
        if runner.poll() is None:
            runner.kill()
            finish(runner)
    assert code == 6, err
    assert len(attempts(runs)) == 1
    assert "the lock cannot be confirmed before attempt 2 (the key is no longer held by this node's session); no " \
           "further attempt: the last attempt's exit status 6 stands" in err, err
