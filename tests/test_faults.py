"""Every guarantee at every instant: faults landed between two steps of the protocol, against a real Consul.

Where a fault must land at a precise point, the wrapper is paused there by a
test hook (consulrun/protocol/testhook.py) and the test acts while it waits: no timing luck.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import requests

from consulrun.manifest import calendar
from consulrun.errors import UsageError
from consulrun.protocol import keys as kvkeys
from consulrun.protocol.fencing import Fencing, stop_timeout_ms
from tests.harness.agents import Agent, wait_for
from tests.harness.hooks import at, go, hooks
from tests.harness.nodes import stop_agent_in
from tests.harness.runs import (
    SKIP,
    YEARLY,
    consulrun,
    finish,
    gated_job,
    kv_json,
    lock_entry,
    pid_alive,
    sessions,
)

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.consul

OCC = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"


def raft_applied(agent: Agent) -> int:
    return int(agent.get("agent/self")["Stats"]["raft"]["applied_index"])


def read_pids(path: Path, count: int) -> list[int]:
    wait_for(lambda: path.exists() and len(path.read_text().split()) >= count, 20, f"{count} pid(s) in {path}")
    return [int(p) for p in path.read_text().split()]


# A job that ignores SIGTERM and leaves a daemonised (setsid) grandchild that ignores it too.
def stubborn_job(pids: Path) -> list[str]:
    return ["sh", "-c", f"trap '' TERM; setsid sh -c 'trap \"\" TERM; echo $$ >> {pids}; while :; do sleep 0.1; done' & "
                        f"echo $$ >> {pids}; while :; do sleep 0.1; done"]


# --- 1. No lock released while the job still runs -----------------------------------------------------------

def test_failure_after_fork_kills_every_job_process_before_release(consul: Agent, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    env = {**hooks(tmp_path, "started", "releasing"), "CONSULRUN_TEST_FAIL": "started"}  # hook dir required
    proc = consulrun("run", "--schedule", YEARLY, "boom", "--", *stubborn_job(pids), env=env)
    at(tmp_path, "started")
    job_pids = read_pids(pids, 2)
    go(tmp_path, "started")
    at(tmp_path, "releasing")
    assert not any(pid_alive(p) for p in job_pids), "a job process lives while the lock is about to be released"
    assert lock_entry(consul, "consulrun/boom/lock").get("Session"), "released before the job was dead"
    go(tmp_path, "releasing")
    code, out, err = finish(proc)
    assert code == 70, err
    assert "Traceback" not in err
    assert "consulrun failed after taking the lock (RuntimeError: failure injected at started)" in err
    record = kv_json(consul, "consulrun/boom/occurrence")
    assert record["state"] == "lost" and "failure injected" in record["reason"]
    assert sessions(consul) == []


SECCOMP_LAUNCHER = """
import os, sys, seccomp
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
f.add_rule(seccomp.ERRNO(38), "pidfd_open")  # ENOSYS, as on Linux < 5.3
f.load()
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_runs_fences_and_releases_without_pidfd_open(consul: Agent, tmp_path: Path) -> None:
    """pidfd_open denied by seccomp (ENOSYS, as on RHEL 8's 4.18): the wrapper runs, fences, releases."""
    system_python = "/usr/bin/python3"
    probe = subprocess.run([system_python, "-c", SECCOMP_LAUNCHER + "", system_python, "-c",
                            "import os; os.pidfd_open(os.getpid())"], capture_output=True, text=True)
    assert "Function not implemented" in probe.stderr, probe.stderr  # the filter really denies it
    launcher = tmp_path / "launch.py"
    launcher.write_text(SECCOMP_LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def run(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([system_python, str(launcher), sys.executable, "-m", "consulrun", *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    code, _, err = finish(run("run", "nopidfd", "--", "sh", "-c", "exit 3"))
    assert code == 3, err
    pids = tmp_path / "pids"
    holder = run("run", "nopidfd", "--", *stubborn_job(pids))
    job_pids = read_pids(pids, 2)
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/nopidfd/lock')['Session']}")
    code, _, err = finish(holder)
    assert code == 75, err
    assert not any(pid_alive(p) for p in job_pids)
    assert sessions(consul) == []


# --- 2. Waiting never lets its own session die --------------------------------------------------------------

@pytest.mark.parametrize("lock_delay", ["30s", "60s"])
def test_wait_outlasts_ttl_through_lock_delay_and_acquires(consul: Agent, tmp_path: Path, lock_delay: str) -> None:
    """ttl 10s, lock-delay 30s/60s: Consul would destroy an unrenewed waiting session before lock-delay ends."""
    started = tmp_path / "started"
    common = ["--ttl", "10s", "--lock-delay", lock_delay]
    holder = consulrun("run", *common, "longdelay", "--", "sh", "-c", f"touch {started}; sleep 300")
    wait_for(started.exists, 20, "the holder's job")
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/longdelay/lock')['Session']}")
    assert finish(holder)[0] == 75
    before = raft_applied(consul)
    ran = tmp_path / "ran"
    cpu_before = _children_cpu()
    code, _, err = finish(consulrun("run", *common, "--wait", "2m", "longdelay", "--", "touch", str(ran)),
                          timeout=150)
    assert code == 0, err
    assert ran.exists()
    assert "no longer exists" not in err, err  # one session, renewed through the wait: never expired, never replaced
    # It sleeps through lock-delay (a few attempts), rather than asking again and again: seconds of CPU, not the wait.
    assert _children_cpu() - cpu_before < 5, _children_cpu() - cpu_before
    # session create, lock, release, destroy, plus a bounded number of refused attempts (not 2 per second).
    assert raft_applied(consul) - before <= 8, raft_applied(consul) - before
    assert sessions(consul) == []


def test_a_lock_delay_longer_than_our_own_is_waited_out_backing_off(consul: Agent, tmp_path: Path) -> None:
    """The lock-delay in force is the dead holder's session's (10 s), longer than the waiter's own (5 s, as while a
    manifest change rolls out): refused again when its own lock-delay is over, the waiter backs off (0.5, 1, 2, 4 s),
    a handful of attempts, each a Raft write, rather than a steady stream, and takes the lock."""
    from tests.harness.faultproxy import FaultProxy

    started, ran = tmp_path / "started", tmp_path / "ran"
    holder = consulrun("run", "--lock-delay", "10s", "mixeddelay", "--", "sh", "-c", f"touch {started}; sleep 300")
    wait_for(started.exists, 20, "the holder's job")
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/mixeddelay/lock')['Session']}")
    assert finish(holder)[0] == 75
    sent: list[float] = []
    with FaultProxy(consul.http_addr) as proxy:
        attempts = proxy.fail("PUT", '"Verb": "lock"', "forward", times=10_000,
                              then=lambda _: sent.append(time.monotonic()))
        code, _, err = finish(consulrun("run", "--lock-delay", "5s", "--wait", "40s", "mixeddelay", "--", "touch",
                                        str(ran), env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 0 and ran.exists(), err
    # refused at once, at our lock-delay's end (5.2 s), then after 0.5, 1, 2 (8.7 s), taken after 4 more (12.7 s)
    assert 4 <= len(attempts.hits) <= 7, len(attempts.hits)
    assert sent[1] - sent[0] >= 5.0, sent  # nothing is asked again before the waiter's own lock-delay is over
    assert sessions(consul) == []


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_retry_standby_takes_over_through_a_long_lock_delay(consul: Agent, tmp_path: Path) -> None:
    started, second = tmp_path / "started", tmp_path / "second"
    common = ["run", "--ttl", "10s", "--lock-delay", "30s", "--schedule", YEARLY, "--on-holder-loss", "retry",
              "--wait", "2m", "slowtake"]
    runner = consulrun(*common, "--", "sh", "-c", f"touch {started}; sleep 300")
    wait_for(started.exists, 20, "the first attempt")
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/slowtake/lock')['Session']}")
    assert finish(runner)[0] == 75
    code, _, err = finish(consulrun(*common, "--", "sh", "-c", f"echo $CONSULRUN_OCCURRENCE > {second}"), timeout=150)
    assert code == 0, err
    assert second.read_text().strip() == OCC
    record = kv_json(consul, "consulrun/slowtake/occurrence")
    assert record["state"] == "done" and record["attempt"] == 2 and record["takeover"] is True
    assert [a["state"] for a in record["earlier"]] == ["lost"]


def test_invalid_session_while_waiting_is_replaced_not_read_as_a_lost_race(consul: Agent, tmp_path: Path) -> None:
    started = tmp_path / "started"
    holder = consulrun("run", "--lock-delay", "10s", "inval", "--", "sh", "-c", f"touch {started}; sleep 300")
    wait_for(started.exists, 20, "the holder's job")
    held_by = lock_entry(consul, "consulrun/inval/lock")["Session"]
    consul.api("PUT", f"session/destroy/{held_by}")
    assert finish(holder)[0] == 75
    waiter = consulrun("run", "--lock-delay", "10s", "--wait", "1m", "inval", "--", "true",
                       env=hooks(tmp_path, "lock-delay-wait"))
    at(tmp_path, "lock-delay-wait")
    for session in sessions(consul):  # the waiter's session dies under it (as an expired TTL would)
        consul.api("PUT", f"session/destroy/{session['ID']}")
    go(tmp_path, "lock-delay-wait")
    code, _, err = finish(waiter, timeout=90)
    assert code == 0, err
    assert "no longer exists" in err and "lost the race" not in err
    assert sessions(consul) == []


# --- 3. A late wake-up fences hard ----------------------------------------------------------------------------

def test_pinned_fencing_arithmetic() -> None:
    fencing = Fencing.for_lock_delay(15_000, 15_000)
    assert (fencing.grace_s, fencing.fence_after_s, fencing.kill_by_s) == (5.0, 9.0, 14.0)
    assert stop_timeout_ms(15_000) == 14_000
    short = Fencing.for_lock_delay(5_000, 10_000)
    assert short.kill_by_s == 4.0 and round(short.grace_s, 3) == 1.667
    # How often the watcher confirms: a third of the time it may go unconfirmed, at most 5 s, at most TTL/3.
    assert fencing.watch_wait_s == 3.0
    assert round(short.watch_wait_s, 3) == 0.778
    long = Fencing.for_lock_delay(60_000, 60_000)
    assert (long.grace_s, long.fence_after_s, long.kill_by_s, long.watch_wait_s) == (5.0, 54.0, 59.0, 5.0)
    assert round(Fencing.for_lock_delay(60_000, 10_000).watch_wait_s, 3) == 3.333
    # Below Consul's own bound the arithmetic refuses (the CLI and the manifest refuse first).
    with pytest.raises(UsageError) as refused:
        Fencing.for_lock_delay(4_999, 15_000)
    assert str(refused.value) == ("lock-delay must be at least 5s: with less, a holder cut off from Consul cannot be "
                                  "sure to stop its job before another node starts")


def test_wrapper_stopped_past_its_deadline_sigkills_at_once(consul: Agent, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    holder = consulrun("run", "--ttl", "10s", "--lock-delay", "5s", "frozen", "--", *stubborn_job(pids))
    job_pids = read_pids(pids, 2)
    os.kill(holder.pid, signal.SIGSTOP)  # the wrapper only: its job keeps running, as in a starved wrapper
    try:
        consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/frozen/lock')['Session']}")
        time.sleep(6)  # past lock-delay: from here on no lock can stop the overlap, only the wrapper waking
        assert all(pid_alive(p) for p in job_pids)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    # No SIGTERM grace is left: the SIGTERM-ignoring job must be gone almost at once, not after a fresh grace.
    wait_for(lambda: not any(pid_alive(p) for p in job_pids), 1.5, "the job to be SIGKILLed on waking")
    code, _, err = finish(holder)
    assert code == 75, err
    assert "SIGKILL at once" in err


# --- 4. Every process of the job dies, not only its process group ---------------------------------------------

def test_fence_kills_a_daemonised_grandchild(consul: Agent, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    holder = consulrun("run", "--lock-delay", "5s", "daemon", "--", *stubborn_job(pids))
    job_pids = read_pids(pids, 2)
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/daemon/lock')['Session']}")
    code, _, err = finish(holder)
    assert code == 75, err
    assert not any(pid_alive(p) for p in job_pids)


def test_normal_exit_stops_a_daemonised_leftover(consul: Agent, tmp_path: Path) -> None:
    """Stopped as a fenced job is: SIGTERM and the grace to act on it (its trap runs), not SIGKILL at once."""
    pids, termed = tmp_path / "pids", tmp_path / "termed"
    leftover = f"trap 'touch {termed}; exit 0' TERM; echo $$ > {pids}; while :; do sleep 0.1; done"
    code, _, err = finish(consulrun("run", "leftover", "--", "sh", "-c",
                                    f"setsid sh -c {shlex.quote(leftover)} & sleep 0.5; exit 0"))
    assert code == 0, err
    assert "left processes behind" in err
    assert not pid_alive(read_pids(pids, 1)[0])
    assert termed.exists(), err


def test_termination_signal_reaches_a_grandchild_outside_the_shell(consul: Agent, tmp_path: Path) -> None:
    """The job's leader ignores SIGTERM; only forwarding to every process lets the grandchild hear it."""
    got = tmp_path / "got"
    grandchild = (f"import signal, time, sys\n"
                  f"signal.signal(signal.SIGTERM, lambda *a: (open({str(got)!r}, 'w').write('TERM'), sys.exit(0)))\n"
                  f"open({str(got)!r} + '.ready', 'w')\n"
                  f"while True: time.sleep(0.1)\n")
    leader = (f"import signal, subprocess, sys\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"sys.exit(subprocess.call([sys.executable, '-c', {grandchild!r}]))\n")
    holder = consulrun("run", "fwd", "--", sys.executable, "-c", leader)
    wait_for(Path(f"{got}.ready").exists, 20, "the grandchild")
    holder.send_signal(signal.SIGTERM)
    wait_for(got.exists, 5, "the grandchild to receive the forwarded SIGTERM")
    code, _, err = finish(holder)
    assert code == 0, err


# --- 5. A lost run is recorded as lost --------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["retry", "skip"])
def test_fenced_run_is_recorded_lost_and_rerun_only_under_retry(consul: Agent, tmp_path: Path, policy: str) -> None:
    started, again = tmp_path / "started", tmp_path / "again"
    common = ["run", "--lock-delay", "5s", "--schedule", YEARLY, "--on-holder-loss", policy,
              "--skip-exit-code", str(SKIP), "--wait", "30s", "lostjob"]
    runner = consulrun(*common, "--", "sh", "-c", f"touch {started}; sleep 300")
    wait_for(started.exists, 20, "the first attempt")
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/lostjob/lock')['Session']}")
    assert finish(runner)[0] == 75
    record = kv_json(consul, "consulrun/lostjob/occurrence")
    assert record["state"] == "lost" and record["reason"]
    assert kv_json(consul, kvkeys.history_key("consulrun/lostjob", OCC))["state"] == "lost"
    code, _, err = finish(consulrun(*common, "--", "touch", str(again)), timeout=60)
    if policy == "retry":
        assert code == 0, err
        assert again.exists()
        final = kv_json(consul, kvkeys.history_key("consulrun/lostjob", OCC))
        assert final["state"] == "done" and final["attempt"] == 2
        assert final["earlier"][0]["state"] == "lost" and final["earlier"][0]["node"] == "dev1"
    else:
        assert code == SKIP, err
        assert not again.exists()
        assert f"occurrence {OCC} was claimed by dev1 and ended lost; it is not run again (on_holder_loss=skip)" in err
    assert sessions(consul) == []


def test_a_fenced_run_finishing_after_a_takeover_leaves_the_new_runners_record_alone(consul: Agent,
                                                                                      tmp_path: Path) -> None:
    """The first runner loses its lock and is held just before it records its end; meanwhile another takes the
    occurrence over and is running. The first runner's late finish must not write "lost" over that run."""
    first_started, second_started = tmp_path / "first", tmp_path / "second"
    common = ["run", "--lock-delay", "5s", "--schedule", YEARLY, "--on-holder-loss", "retry", "--wait", "30s",
              "takenover"]
    first = consulrun(*common, "--", "sh", "-c", f"touch {first_started}; exec sleep 300",
                      env=hooks(tmp_path, "releasing"))
    wait_for(first_started.exists, 20, "the first attempt")
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/takenover/lock')['Session']}")
    at(tmp_path, "releasing")
    second = consulrun(*common, "--", "sh", "-c", f"touch {second_started}; exec sleep 300")
    wait_for(second_started.exists, 40, "the takeover")
    taken = kv_json(consul, "consulrun/takenover/occurrence")
    assert (taken["state"], taken["attempt"]) == ("running", 2), taken
    go(tmp_path, "releasing")
    code, _, err = finish(first)
    assert code == 75, err
    assert "was taken over meanwhile; this run's result is not recorded" in err, err
    assert "released consulrun/takenover/lock" not in err, err  # the lock is the new runner's, not ours to free
    assert kv_json(consul, "consulrun/takenover/occurrence") == taken
    second.send_signal(signal.SIGTERM)
    finish(second)
    assert sessions(consul) == []


# --- 6. No leaked sessions ---------------------------------------------------------------------------------------

def test_every_skip_path_destroys_its_session(consul: Agent, tmp_path: Path) -> None:
    common = ["run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "leak"]
    assert finish(consulrun(*common, "--", "true"))[0] == 0
    # done: the record already shows this occurrence done
    code, _, err = finish(consulrun(*common, "--", "true"))
    assert code == SKIP and "already ran" in err
    assert sessions(consul) == []
    # claimed by another node between our read and our claim (a lost race, with --wait > 0)
    runner_started = tmp_path / "started"
    consul.api("DELETE", "kv/consulrun/leak/", params={"recurse": "true"})
    late = consulrun(*common[:-1], "--wait", "5s", "leak", "--", "true", env=hooks(tmp_path, "before-claim"))
    at(tmp_path, "before-claim")
    runner = consulrun(*common, "--", "sh", "-c", f"touch {runner_started}; sleep 300")
    wait_for(runner_started.exists, 20, "the race winner's job")
    go(tmp_path, "before-claim")
    code, _, err = finish(late, timeout=60)
    assert code == SKIP, err
    assert "lost the race" in err
    assert [s["ID"] for s in sessions(consul)] == [lock_entry(consul, "consulrun/leak/lock")["Session"]]
    runner.send_signal(signal.SIGTERM)
    finish(runner)
    assert sessions(consul) == []


def test_claim_refused_when_the_record_moved_since_it_was_read(consul: Agent, tmp_path: Path) -> None:
    """Read the old record, let another node claim, run and release, then claim: the check-and-set refuses."""
    runs = tmp_path / "runs"
    common = ["run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "stale"]
    late = consulrun(*common, "--", "sh", "-c", f"echo late >> {runs}", env=hooks(tmp_path, "before-claim"))
    at(tmp_path, "before-claim")
    code, _, err = finish(consulrun(*common, "--", "sh", "-c", f"echo first >> {runs}"))
    assert code == 0, err
    assert "Session" not in lock_entry(consul, "consulrun/stale/lock")  # released: only the claim can refuse
    go(tmp_path, "before-claim")
    code, _, err = finish(late)
    assert code == SKIP, err
    assert runs.read_text().split() == ["first"]
    assert sessions(consul) == []


# --- 7. Signals at every instant ------------------------------------------------------------------------------------

@pytest.mark.parametrize("point", ["acquired", "releasing"])
def test_sigterm_at_each_step_gives_143_and_leaves_nothing_running(consul: Agent, tmp_path: Path, point: str) -> None:
    ran = tmp_path / "ran"
    proc = consulrun("run", "--schedule", YEARLY, "sigjob", "--", "touch", str(ran), env=hooks(tmp_path, point))
    at(tmp_path, point)
    proc.send_signal(signal.SIGTERM)
    if point == "releasing":
        go(tmp_path, point)
    code, _, err = finish(proc)
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert sessions(consul) == []
    record = kv_json(consul, "consulrun/sigjob/occurrence")
    if point == "acquired":
        assert not ran.exists()
        assert record["state"] == "lost" and "SIGTERM before the job started" in record["reason"]
    else:
        assert ran.exists()
        assert record["state"] == "done" and record["exit_status"] == 0
    assert "Session" not in lock_entry(consul, "consulrun/sigjob/lock")


@pytest.mark.parametrize("how", [[], ["--schedule", YEARLY, "--on-holder-loss", "retry"]], ids=["plain", "scheduled"])
def test_sigterm_while_holding_a_session_in_lock_delay_leaves_no_session(consul: Agent, tmp_path: Path,
                                                                         how: list[str]) -> None:
    """A plain run waiting for a free lock, or a retry node about to take a fenced occurrence over, is refused by
    lock-delay and waits holding its session: a SIGTERM then leaves no session behind."""
    started, job = tmp_path / "started", f"sigwait{len(how)}"
    holder = consulrun("run", *how, "--lock-delay", "10s", job, "--", "sh", "-c", f"touch {started}; sleep 300")
    wait_for(started.exists, 20, "the holder's job")
    consul.api("PUT", f"session/destroy/{lock_entry(consul, f'consulrun/{job}/lock')['Session']}")
    assert finish(holder)[0] == 75
    waiter = consulrun("run", *how, "--lock-delay", "10s", "--wait", "1m", job, "--", "true",
                       env=hooks(tmp_path, "lock-delay-wait"))
    at(tmp_path, "lock-delay-wait")
    assert len(sessions(consul)) == 1  # the waiter holds a session while lock-delay refuses it
    waiter.send_signal(signal.SIGTERM)
    code, _, err = finish(waiter, timeout=10)
    assert code == 128 + signal.SIGTERM, err
    assert sessions(consul) == []


# --- 9. The occurrence is the timer's, whatever the job's environment ----------------------------------------------

def test_occurrence_ignores_the_jobs_tz(consul: Agent, tmp_path: Path) -> None:
    seen = tmp_path / "occ"
    code, _, err = finish(consulrun("run", "--schedule", "*-*-* 00:00:00", "tzjob", "--", "sh", "-c",
                                    f"echo $CONSULRUN_OCCURRENCE > {seen}", env={"TZ": "Pacific/Kiritimati"}))
    assert code == 0, err
    expected = calendar.occurrence_id(calendar.previous(["*-*-* 00:00:00"], datetime.now(timezone.utc)))
    assert seen.read_text().strip() == expected


# --- 11. A dead holder does not block the job for 2 x TTL -------------------------------------------------------------

def test_sigkilled_wrappers_occurrence_is_taken_over_within_lock_delay(consul: Agent, tmp_path: Path) -> None:
    started, second = tmp_path / "started", tmp_path / "second"
    common = ["run", "--ttl", "60s", "--lock-delay", "5s", "--schedule", YEARLY, "--on-holder-loss", "retry",
              "--wait", "30s", "oom"]
    runner = consulrun(*common, "--", "sh", "-c", f"touch {started}; sleep 300")
    wait_for(started.exists, 20, "the first attempt")
    runner.kill()  # as the OOM killer does: no cleanup at all
    runner.wait()
    standby = consulrun(*common, "--", "sh", "-c", f"echo $CONSULRUN_OCCURRENCE > {second}")
    # TTL 60s would keep the dead session up to 120 s; noticing the dead pid frees it at once (+ lock-delay).
    wait_for(second.exists, 15, "the standby to take the occurrence over")
    code, _, err = finish(standby)
    assert code == 0, err
    assert "has exited; destroying the session" in err
    assert f" for occurrence {OCC}, taking over from a dead runner (node dev1, session " in err, err
    record = kv_json(consul, "consulrun/oom/occurrence")
    assert record["attempt"] == 2 and record["earlier"][0]["state"] == "abandoned"
    assert sessions(consul) == []


def test_renewal_keeps_a_long_job_running(consul: Agent) -> None:
    """35 s at --ttl 10s: without renewal every TTL/3 Consul would destroy the session and the job be fenced."""
    code, _, err = finish(consulrun("run", "--ttl", "10s", "longrun", "--", "sleep", "35"), timeout=90)
    assert code == 0, err
    assert "lock lost" not in err
    # Every confirmation answered: nothing to say about confirming, then or "again".
    assert "cannot confirm" not in err and "confirmed again" not in err, err


def test_fencing_token_is_the_lock_keys_modify_index(consul: Agent, tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    script = (f"import json, os, urllib.request\n"
              f"entry = json.load(urllib.request.urlopen('http://{consul.http_addr}/v1/kv/consulrun/token/lock'))[0]\n"
              f"import base64\n"
              f"open({str(seen)!r}, 'w').write(json.dumps([entry['ModifyIndex'], os.environ['CONSULRUN_FENCING_TOKEN'],"
              f" entry.get('Session'), os.environ['CONSULRUN_SESSION'], json.loads(base64.b64decode(entry['Value']))]))\n")
    code, _, err = finish(consulrun("run", "token", "--", sys.executable, "-c", script))
    assert code == 0, err
    index, token, holder, session, value = json.loads(seen.read_text())
    assert str(index) == token and holder == session
    # Every field of the holder value, as docs/guarantees.md and the status/reap checks rely on them.
    from consulrun import __version__
    from consulrun.protocol.procinfo import boot_id, pid_namespace

    assert set(value) == {"job", "node", "host", "pid", "pid_start", "boot_id", "pid_ns", "time_ns", "started",
                          "session", "consulrun_version"}  # no unit or invocation id outside systemd
    assert (value["job"], value["node"], value["session"], value["consulrun_version"]) == \
        ("token", "dev1", session, __version__)
    assert value["boot_id"] == boot_id() and value["pid_ns"] == pid_namespace()
    assert isinstance(value["pid"], int) and isinstance(value["pid_start"], int)
    assert datetime.fromisoformat(value["started"].replace("Z", "+00:00")) <= datetime.now(timezone.utc)


# --- 4, under systemd: the wrapper itself SIGKILLed -------------------------------------------------------------------

@pytest.mark.systemd
def test_sigkilled_wrapper_in_a_unit_leaves_no_job_process(systemd_container, consul_bin: str, tmp_path: Path) -> None:
    """The OOM killer takes the wrapper: systemd SIGKILLs the rest of the cgroup within lock-delay, then frees the lock.

    The job ignores SIGTERM and leaves a setsid grandchild; without a TimeoutStopSec= derived from the lock
    settings systemd would wait its default 90 s before SIGKILL; without ExecStopPost= the dead wrapper's
    session would hold the lock until its TTL ran out.
    """
    from tests.harness.nodes import CONSULRUN, manifest, start_agent

    ctr = systemd_container
    agent = start_agent(ctr, consul_bin, "unitnode", ["-dev", "-client", "127.0.0.1", "-bind", "127.0.0.1"],
                        tmp_path / "consul.log")
    try:
        pids = ctr.shared / "oom-pids"
        job = {"command": stubborn_job(Path("/shared/oom-pids")), "schedule": YEARLY,
               "lock": {"ttl": "60s", "lock_delay": "5s"}}
        (ctr.shared / "oom.yaml").write_text(manifest({"oomjob": job}))
        ctr.exec(CONSULRUN, "install", "/shared/oom.yaml", "--no-start")
        ctr.systemctl("start", "--no-block", "consulrun-oomjob.service")
        job_pids = read_pids(pids, 2)
        main = ctr.systemctl("show", "-p", "MainPID", "--value", "consulrun-oomjob.service").stdout.strip()
        assert main not in ("", "0")

        def alive(pid: int) -> bool:
            stat = ctr.exec("cat", f"/proc/{pid}/stat", check=False).stdout
            return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"

        assert all(alive(p) for p in job_pids)
        ctr.exec("kill", "-9", main)
        # lock-delay: the earliest another node could start if the dead wrapper's session ended at once.
        wait_for(lambda: not any(alive(p) for p in job_pids), 5, "every job process to be gone within lock-delay")

        def session_left() -> str:
            out = ctr.exec(consul_bin, "kv", "get", "-detailed", "consulrun/oomjob/lock").stdout
            return next(line.split()[1] for line in out.splitlines() if line.startswith("Session"))

        # ExecStopPost= frees the dead wrapper's lock at once, not after TTL 60s (up to 2 x TTL).
        wait_for(lambda: session_left() == "-", 10, "the dead wrapper's session to be destroyed by ExecStopPost=")
        journal = ctr.exec("journalctl", "-u", "consulrun-oomjob.service", "--no-pager", check=False).stdout
        assert "destroying the session" in journal
    finally:
        ctr.systemctl("stop", "consulrun-oomjob.service", check=False)
        stop_agent_in(ctr, consul_bin, agent)


# --- 5 and 12, in a cluster: leader elections are not outages ---------------------------------------------------------

def _leaderless(agent: Agent) -> bool:
    try:
        return agent.get("status/leader") in ("", None)
    except Exception:  # noqa: BLE001 - "no leader" may also be an error answer
        return True


@pytest.mark.cluster
def test_leader_killed_at_the_moment_of_finish_the_result_is_still_recorded(cluster, tmp_path: Path) -> None:
    node2 = cluster.clients[0]
    env = {"CONSUL_HTTP_ADDR": "127.0.0.1:8500", **hooks(tmp_path, "releasing")}
    proc = consulrun("run", "--schedule", YEARLY, "--on-holder-loss", "retry", "fin", "--", "true", env=env,
                     netns=node2.netns)
    at(tmp_path, "releasing", 60)
    cluster.server.kill()
    wait_for(lambda: _leaderless(node2), 30, "node2 to see no leader")
    go(tmp_path, "releasing")
    cluster.server.restart()
    code, _, err = finish(proc, timeout=90)
    assert code == 0, err
    assert "retrying for up to" in err
    record = kv_json(cluster.server, "consulrun/fin/occurrence")
    assert record["state"] == "done" and record["exit_status"] == 0 and record["attempt"] == 1
    assert "Session" not in lock_entry(cluster.server, "consulrun/fin/lock")


@pytest.mark.cluster
def test_no_leader_at_start_is_retried_then_runs(cluster, tmp_path: Path) -> None:
    node2 = cluster.clients[0]
    cluster.server.kill()
    wait_for(lambda: _leaderless(node2), 30, "node2 to see no leader")
    log = tmp_path / "stderr"
    ran = tmp_path / "ran"
    cmd = ["ip", "netns", "exec", node2.netns, sys.executable, "-m", "consulrun", "run", "--schedule", YEARLY,
           "noleader", "--", "touch", str(ran)]
    env = {**os.environ, "CONSUL_HTTP_ADDR": "127.0.0.1:8500", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with log.open("w") as err_file:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err_file)
    wait_for(lambda: "retrying for up to" in log.read_text(), 30, "the run to say it retries")
    # Once serf marks the only server failed, the client answers "No known Consul servers" instead of an
    # RPC error; the wrapper must ride that out too (CI once saw it give up there with 69).
    wait_for(lambda: _no_known_servers(node2), 60, "node2 to have no known servers")
    time.sleep(10)  # the fault lasts past two of the wrapper's longest backoffs (4 s), so it meets that answer
    assert proc.poll() is None, log.read_text()
    cluster.server.restart()
    assert proc.wait(timeout=150) == 0, log.read_text()
    assert ran.exists()
    assert "No cluster leader" in log.read_text() or "rpc error" in log.read_text()


def _no_known_servers(agent: Agent) -> bool:
    response = requests.get(f"{agent.url}/v1/kv/consulrun/noleader/lock", timeout=10)
    return response.status_code == 500 and "No known Consul servers" in response.text


def test_fencing_token_example_rejects_a_stale_holders_write(consul: Agent, tmp_path: Path) -> None:
    """examples/fenced_write.py: the later holder's write stands; the earlier (stale) holder's is refused."""
    example = Path(__file__).resolve().parents[1] / "examples" / "fenced_write.py"
    tokens = tmp_path / "tokens"
    for body in ("first", "second"):
        code, _, err = finish(consulrun("run", "fenced-write", "--", "sh", "-c",
                                        f"echo $CONSULRUN_FENCING_TOKEN >> {tokens}; "
                                        f"{sys.executable} {example} reports/latest {body}"))
        assert code == 0, err
    first, second = (int(t) for t in tokens.read_text().split())
    assert first < second
    # The first holder, frozen past lock-delay, wakes and tries to write: refused, the data unchanged.
    stale = subprocess.run([sys.executable, str(example), "reports/latest", "stale"], capture_output=True, text=True,
                           env={**os.environ, "CONSULRUN_FENCING_TOKEN": str(first)})
    assert stale.returncode == 3, stale.stderr
    assert "refused" in stale.stderr
    assert kv_json(consul, "reports/latest") == {"token": second, "data": "second"}


def test_a_node_in_another_system_zone_is_refused_not_run_twice(consul: Agent, tmp_path: Path) -> None:
    """A zone-less daily spec: a node whose /etc/localtime says Europe/Berlin would run its own 'same' occurrence."""
    ran = tmp_path / "ran"
    args = [sys.executable, "-m", "consulrun", "run", "--schedule", "*-*-* 00:00:00", "zoned", "--", "sh", "-c",
            f"echo $CONSULRUN_OCCURRENCE >> {ran}"]
    code, _, err = finish(consulrun(*args[3:]))
    assert code == 0, err
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    # Another system zone for one process only: a private mount namespace with a zone bound over /etc/localtime.
    berlin = subprocess.run(["unshare", "-m", "sh", "-c",
                             'mount --bind /usr/share/zoneinfo/Europe/Berlin "$(realpath /etc/localtime)" && exec "$@"',
                             "sh", *args], env=env, capture_output=True, text=True, timeout=60)
    assert berlin.returncode == 2, berlin.stderr
    record = kv_json(consul, "consulrun/zoned/occurrence")
    assert (f"is not the one dev1 evaluated the schedule in ({record['zone']}, {record['zone_offsets']}): nodes would "
            "disagree on the occurrence; give every node the same zone, or name a zone in the schedule "
            "(e.g. '*-*-* 02:00:00 Europe/Berlin')") in berlin.stderr, berlin.stderr
    assert len(ran.read_text().split()) == 1
    assert sessions(consul) == []


def test_lock_lost_between_acquiring_and_starting_starts_nothing(consul: Agent, tmp_path: Path) -> None:
    """A wrapper stopped after acquiring must re-confirm before the fork: another node may run by now."""
    ran = tmp_path / "ran"
    proc = consulrun("run", "--schedule", YEARLY, "--on-holder-loss", "retry", "late", "--", "touch", str(ran),
                     env=hooks(tmp_path, "acquired"))
    at(tmp_path, "acquired")
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/late/lock')['Session']}")
    go(tmp_path, "acquired")
    code, _, err = finish(proc)
    assert code == 75, err
    assert "lock lost before the job started" in err
    assert not ran.exists()
    assert kv_json(consul, "consulrun/late/occurrence")["state"] == "lost"
    assert sessions(consul) == []


def test_result_recorded_over_an_abandoned_guess_when_nobody_took_over(consul: Agent, tmp_path: Path) -> None:
    """skip: the runner's session dies as its job ends; another node guesses 'abandoned'; the truth lands."""
    common = ["run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "guess"]
    proc = consulrun(*common, "--", "true", env=hooks(tmp_path, "releasing"))
    at(tmp_path, "releasing")
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/guess/lock')['Session']}")  # a check flap
    code, _, err = finish(consulrun(*common, "--", "true"))
    assert code == SKIP and "was abandoned by dev1; recorded" in err, err
    assert kv_json(consul, "consulrun/guess/occurrence")["state"] == "abandoned"
    go(tmp_path, "releasing")
    code, _, err = finish(proc)
    assert code == 0, err
    assert "the result is recorded (exit status 0)" in err and "released" not in err
    record = kv_json(consul, "consulrun/guess/occurrence")
    assert record["state"] == "done" and record["exit_status"] == 0
    assert sessions(consul) == []


# --- logs a sysadmin can read (the CLI issue's "Logs") -----------------------------------------------------------

def test_unreachable_consul_is_logged_once_then_every_few_seconds(consul_bin: str, tmp_path: Path) -> None:
    """Not a line per retry (35 in 7 s before): one when confirmation fails, then one every 5 s with the time left."""
    from tests.harness.agents import start_dev_agent

    agent = start_dev_agent(consul_bin, tmp_path, name="quiet1")
    started = tmp_path / "started"
    holder = consulrun("run", "--lock-delay", "15s", "quiet", "--", "sh", "-c", f"touch {started}; sleep 60",
                       env={"CONSUL_HTTP_ADDR": agent.http_addr})
    try:
        wait_for(started.exists, 20, "the job")
        agent.kill()  # confirmation now fails at once, over and over, until the wrapper fences (9 s)
        code, _, err = finish(holder)
    finally:
        agent.stop()
    assert code == 75, err
    complaints = [line for line in err.splitlines() if "cannot confirm the lock" in line]
    assert 2 <= len(complaints) <= 3, complaints  # at once, then 5 s later (fenced at 9 s)
    assert all(line.startswith("consulrun: quiet: ") and "the job is stopped in" in line for line in complaints)
    # The fence's own line: how long the lock went unconfirmed (fence after 9 s, checked at least once a second),
    # when another node may take it (lock-delay 15 s: 14 s + the 1 s margin), and the grace the job is given.
    fenced = [line for line in err.splitlines() if "lock lost" in line]
    assert len(fenced) == 1 and re.fullmatch(
        r"consulrun: quiet: lock lost: lock not confirmed for (9(\.\d)?|10)s; another node may acquire it 15s after the "
        r"last confirmation; killing the job's processes \(SIGTERM, SIGKILL after [3-5](\.\d)?s\)", fenced[0]), fenced


def test_confirmations_refused_for_a_moment_are_said_once_and_so_is_their_return(consul: Agent,
                                                                                   tmp_path: Path) -> None:
    """The watcher's blocking reads are refused twice (an election), well inside the fencing deadline: one line says
    the lock cannot be confirmed, one says it is confirmed again, and the job runs to its end, unfenced."""
    from tests.harness.faultproxy import FaultProxy

    with FaultProxy(consul.http_addr) as proxy:
        refused = proxy.fail("GET", "index=", "refuse", times=2)
        code, _, err = finish(consulrun("run", "flaky", "--", "sleep", "10", env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 0 and len(refused.hits) == 2, err
    # Consistent reads: a deposed leader's answer is no confirmation.
    assert all("consistent" in hit for hit in refused.hits), refused.hits
    assert "lock lost" not in err, err
    cannot = [line for line in err.splitlines() if "cannot confirm the lock" in line]
    assert len(cannot) == 1 and re.search(r"the job is stopped in [89](\.\d)?s unless Consul answers$", cannot[0]), err
    assert err.count("consulrun: flaky: the lock is confirmed again") == 1, err


def test_an_agent_that_does_not_answer_in_time_at_start_is_waited_out_within_the_start_budget(
        consul: Agent, tmp_path: Path) -> None:
    """The first read of the job's keys held past the client's 10 s timeout, as an agent holds a request while
    the servers elect a leader (the long chaos run saw it through a leader kill: every node gave up with 69
    11 s into a 15 s start budget, and Consul answered again a second later, so the occurrence ran nowhere).
    A timeout at start is retried within the budget, as a refusal in an election is; nothing was written."""
    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"
    with FaultProxy(consul.http_addr) as proxy:
        stalled = proxy.fail("PUT", "consulrun/stalled/occurrence", "stall")
        code, _, err = finish(consulrun("run", "--schedule", YEARLY, "stalled", "--", "touch", str(ran),
                                        env={"CONSUL_HTTP_ADDR": proxy.address}), timeout=120)
    assert len(stalled.hits) == 1, (stalled.hits, err)
    assert code == 0 and ran.exists(), err
    assert "Consul agent did not answer in time" in err and "retrying for up to" in err, err
    assert kv_json(consul, "consulrun/stalled/occurrence")["state"] == "done"


def test_waiting_is_said_once_with_what_for(consul: Agent, tmp_path: Path) -> None:
    started = tmp_path / "started"
    holder = consulrun("run", "saywait", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the holder's job")
        code, _, err = finish(consulrun("run", "--wait", "3s", "--skip-exit-code", str(SKIP), "saywait", "--", "true"))
    finally:
        holder.terminate()
        finish(holder)
    assert code == SKIP, err
    waiting = [line for line in err.splitlines() if "waiting up to" in line]
    assert len(waiting) == 1 and waiting[0].startswith("consulrun: saywait: waiting up to 3s for the lock, held by dev1")


@pytest.mark.consul
def test_reap_looks_past_a_slot_held_from_another_machine(consul: Agent) -> None:
    """--concurrency 2: slot 0 held from another machine (nothing to tell from here), slot 1 by a dead wrapper of
    this node. reap destroys the dead one's session and leaves the other alone (it used to be able to stop at the
    first slot it could not judge)."""
    from consulrun.protocol.procinfo import boot_id, pid_namespace, process_start, time_namespace

    gone = subprocess.Popen(["sleep", "30"])
    started = process_start(gone.pid)
    gone.kill()
    gone.wait()
    holders = {
        "consulrun/pair/slots/0": {"node": "elsewhere", "pid": os.getpid(), "pid_start": process_start(os.getpid()),
                                   "boot_id": "another-machine", "state": "running"},
        "consulrun/pair/slots/1": {"node": "dev1", "pid": gone.pid, "pid_start": started, "boot_id": boot_id(),
                                   "pid_ns": pid_namespace(), "time_ns": time_namespace(), "state": "running"},
    }
    sessions = {}
    for key, value in holders.items():
        sessions[key] = consul.api("PUT", "session/create", json={"Name": "holder", "TTL": "600s",
                                                                  "LockDelay": "0s"}).json()["ID"]
        value = {**value, "session": sessions[key]}  # as the runner writes it: reap believes only a value naming it
        assert consul.api("PUT", f"kv/{key}", params={"acquire": sessions[key]}, data=json.dumps(value)).json() is True
    code, _, err = finish(consulrun("reap", "--concurrency", "2", "pair"))
    assert code == 0, err
    assert f"pair: the holder's session {sessions['consulrun/pair/slots/1']} lives on but its wrapper process " \
           f"(pid {gone.pid}) on this node has exited; destroying the session" in err, err
    assert consul.get(f"session/info/{sessions['consulrun/pair/slots/1']}") in ([], None)
    assert consul.get(f"session/info/{sessions['consulrun/pair/slots/0']}")[0]["ID"] == sessions["consulrun/pair/slots/0"]
    consul.api("PUT", f"session/destroy/{sessions['consulrun/pair/slots/0']}")


# --- answers lost or refused on the way (a fault proxy in front of the real agent) ----------------------------------

@pytest.mark.parametrize("how", [[], ["--schedule", YEARLY]], ids=["plain", "schedule"])
def test_an_acquisition_refused_in_an_election_is_retried_not_taken_for_a_lost_race(consul: Agent, tmp_path: Path,
                                                                                   how: list[str]) -> None:
    """The acquiring transaction answered 500 and never written: an outage to retry, not "someone else has it".

    It used to end as a skip with exit 0: the read-back found nothing committed and called it a lost race, so
    every node meeting one election would have skipped the occurrence.
    """
    from tests.harness.faultproxy import FaultProxy

    ran, job = tmp_path / "ran", f"elect{len(how)}"
    with FaultProxy(consul.http_addr) as proxy:
        refused = proxy.fail("PUT", '"Verb": "lock"', "refuse", times=2)
        code, _, err = finish(consulrun("run", *how, "--skip-exit-code", str(SKIP), job, "--", "touch", str(ran),
                                        env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 0, err
    assert len(refused.hits) == 2 and ran.exists()
    assert "Consul is not ready (" in err and "skipped" not in err and "Traceback" not in err, err
    if how:
        assert kv_json(consul, f"consulrun/{job}/occurrence")["state"] == "done"
    assert sessions(consul) == []


@pytest.mark.parametrize("schedule", [None, YEARLY], ids=["plain", "scheduled"])
def test_a_release_whose_answer_was_lost_is_known_to_have_gone_through(consul: Agent, tmp_path: Path,
                                                                        schedule: str | None) -> None:
    """The unlock was applied and its answer lost: the retry finds the key free with this run's result, says
    released (it used to say the lock was no longer ours). Under a schedule the retry finds the occurrence
    recorded by this attempt with this exit status, and does not take it for a takeover."""
    from tests.harness.faultproxy import FaultProxy

    args = ["--schedule", schedule] if schedule else []
    with FaultProxy(consul.http_addr) as proxy:
        lost = proxy.fail("PUT", '"Verb": "unlock"', "lose-answer")
        code, _, err = finish(consulrun("run", *args, "lostanswer", "--", "sh", "-c", "exit 3",
                                        env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 3, err
    assert len(lost.hits) == 1
    assert "released consulrun/lostanswer/lock" in err and "no longer ours" not in err, err
    assert "taken over" not in err and "not recorded" not in err, err
    value = kv_json(consul, "consulrun/lostanswer/lock")
    assert value["state"] == "free" and value["last"]["exit_status"] == 3
    assert "Session" not in lock_entry(consul, "consulrun/lostanswer/lock") and sessions(consul) == []
    if schedule:
        record = kv_json(consul, "consulrun/lostanswer/occurrence")
        assert (record["state"], record["exit_status"]) == ("done", 3), record


def test_a_fenced_runs_finish_whose_answer_was_lost_is_known_to_have_gone_through(consul: Agent, tmp_path: Path) -> None:
    """Cut off from its confirming reads, the run is fenced and its result is "lost"; that finish is applied and
    its answer lost: the retry finds the occurrence recorded "lost" by this attempt for this reason, and says
    released, not taken over."""
    from tests.harness.faultproxy import FaultProxy

    started = tmp_path / "started"
    with FaultProxy(consul.http_addr) as proxy:
        lost = proxy.fail("PUT", '"Verb": "unlock"', "lose-answer")
        proc = consulrun("run", "--lock-delay", "5s", "--ttl", "10s", "--schedule", YEARLY, "fencedfinish", "--",
                         "sh", "-c", f"touch {started}; exec sleep 60", env={"CONSUL_HTTP_ADDR": proxy.address})
        wait_for(started.exists, 30, "the job to start")
        cut = proxy.fail("GET", "/v1/kv/consulrun/fencedfinish/lock", "refuse", times=10 ** 6)
        code, _, err = finish(proc)
    assert code == 75, err
    assert cut.hits and len(lost.hits) == 1, err
    record = kv_json(consul, "consulrun/fencedfinish/occurrence")
    assert record["state"] == "lost" and record["reason"] in err, (record, err)
    assert "released consulrun/fencedfinish/lock" in err, err
    assert "taken over" not in err and "not recorded" not in err and "no longer ours" not in err, err
    assert "Session" not in lock_entry(consul, "consulrun/fencedfinish/lock") and sessions(consul) == []


def test_descriptors_numbered_past_1024_are_no_trouble(consul: Agent) -> None:
    """Started with a thousand inherited files (a unit with a high LimitNOFILE=): every socket and pipe of the
    wrapper is numbered past 1024, which select(2) refuses ("filedescriptor out of range"; exit 70, or a job
    fenced for nothing) and poll(2) takes."""
    shim = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096)); "
            "fd = os.open('/dev/null', os.O_RDONLY); [os.dup2(fd, n) for n in range(3, 1100)]; "
            "os.execv(sys.executable, [sys.executable, '-m', 'consulrun', *sys.argv[1:]])")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", shim, "run", "--lock-delay", "5s", "--ttl", "10s", "manyfds", "--",
                             "sh", "-c", "ls /proc/$$/fd | wc -l; sleep 5"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "job exited with status 0" in result.stderr and "lock lost" not in result.stderr, result.stderr
    assert int(result.stdout.split()[0]) < 10  # the job inherits none of them
    assert sessions(consul) == []


def test_a_token_an_http_header_cannot_carry_is_refused_unshown(consul: Agent, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t\nsecond-line\n")
    token_file.chmod(0o600)
    # No option takes a token (it would show in `ps`): the message names the variable it came from.
    for args, env, where in (([], {"CONSUL_HTTP_TOKEN": "s3cr3t\n"}, "the Consul token in CONSUL_HTTP_TOKEN"),
                             ([], {"CONSUL_HTTP_TOKEN": "s3cr 3t"}, "the Consul token in CONSUL_HTTP_TOKEN"),
                             (["--token-file", str(token_file)], {}, f"Consul token file {token_file}")):
        code, _, err = finish(consulrun("run", *args, "tokjob", "--", "true", env=env))
        assert code == 2, err
        assert err == (f"Error: {where}: the token holds a space, a line break or a character outside printable "
                       "ASCII, which an HTTP header cannot carry (the token is not shown)\n"), err
    assert lock_entry(consul, "consulrun/tokjob/lock") is None


@pytest.mark.parametrize("how", [[], ["--schedule", YEARLY]], ids=["plain", "schedule"])
def test_an_acquisition_whose_answer_was_lost_is_read_back_and_run(consul: Agent, tmp_path: Path,
                                                                   how: list[str]) -> None:
    """Applied by Consul, answered 500: the read-back finds the lock (and the claim) ours, and the job runs once."""
    from tests.harness.faultproxy import FaultProxy

    ran, job = tmp_path / "ran", f"lostack{len(how)}"
    with FaultProxy(consul.http_addr) as proxy:
        lost = proxy.fail("PUT", '"Verb": "lock"', "lose-answer")
        # The election goes on a moment: the first read-back fails too, and is asked again, not given up on.
        unread = proxy.fail("GET", f"/v1/kv/consulrun/{job}/lock?consistent", "refuse")
        code, _, err = finish(consulrun("run", *how, "--skip-exit-code", str(SKIP), job, "--", "sh", "-c",
                                        f"echo x >> {ran}", env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 0, err
    assert len(lost.hits) == 1 and len(unread.hits) == 1 and ran.read_text() == "x\n"
    assert "the acquisition was answered with an error but went through" in err and "retrying" not in err, err
    value = kv_json(consul, f"consulrun/{job}/lock")
    assert value["state"] == "free" and value["last"]["exit_status"] == 0
    if how:
        record = kv_json(consul, f"consulrun/{job}/occurrence")
        assert record["state"] == "done" and record["session"] == value["last"]["session"]
    assert sessions(consul) == []


def test_sigterm_after_a_retried_start_still_ends_the_wait_at_once(consul: Agent, tmp_path: Path) -> None:
    """An election refused the acquisition (the session is given up, the start retried) and meanwhile another
    node took the lock: a SIGTERM while this node then waits must end it at once. Giving the session up shields
    signals for a moment; it must not leave them held back for the rest of the run."""
    from tests.harness.faultproxy import FaultProxy

    other: dict[str, str] = {}

    def another_node_takes_the_lock(_request: str) -> None:
        other["session"] = consul.api("PUT", "session/create", json={"Name": "other", "TTL": "60s",
                                                                     "LockDelay": "0s"}).json()["ID"]
        assert consul.api("PUT", "kv/consulrun/retrywait/lock", params={"acquire": other["session"]},
                          data=b'{"node": "other"}').json() is True

    with FaultProxy(consul.http_addr) as proxy:
        refused = proxy.fail("PUT", '"Verb": "lock"', "refuse", then=another_node_takes_the_lock)
        waiter = consulrun("run", "--wait", "5m", "retrywait", "--", "true",
                           env={**hooks(tmp_path, "waiting"), "CONSUL_HTTP_ADDR": proxy.address})
        at(tmp_path, "waiting")
        waiter.send_signal(signal.SIGTERM)
        code, _, err = finish(waiter, timeout=10)
    assert len(refused.hits) == 1
    assert code == 128 + signal.SIGTERM, err
    assert "Consul is not ready (" in err and "SIGTERM while waiting" in err, err
    consul.api("PUT", f"session/destroy/{other['session']}")
    assert sessions(consul) == []


def test_a_read_back_that_fails_past_its_budget_is_exit_69_not_a_skip(consul: Agent, tmp_path: Path) -> None:
    """Applied, answer lost, and no read answers for a TTL: the node cannot know whether it holds the lock. It
    gives the session up (freeing whatever it held) and exits 69, nothing started. It used to retry, meet its
    own lock-delay, and skip with exit 0."""
    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"
    with FaultProxy(consul.http_addr) as proxy:
        proxy.fail("PUT", '"Verb": "lock"', "lose-answer")
        proxy.fail("GET", "/v1/kv/consulrun/unknowable/lock?consistent", "refuse", times=1000)
        code, _, err = finish(consulrun("run", "--ttl", "10s", "--skip-exit-code", str(SKIP), "unknowable", "--",
                                        "touch", str(ran), env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 69, err
    assert "whether the acquisition went through is unknown" in err and "skipped" not in err, err
    assert not ran.exists()
    assert sessions(consul) == [] and "Session" not in lock_entry(consul, "consulrun/unknowable/lock")


def test_a_confirmation_that_needed_retries_is_as_fresh_as_its_answer(consul: Agent, tmp_path: Path) -> None:
    """The read confirming a fresh acquisition is refused for about 3 s, longer than --lock-delay 5s allows
    between a confirmation and the fork (2.3 s). The confirmation dates from the read that was answered, not the
    first one asked: the job runs. It used to be judged stale: exit 75, the occurrence recorded lost, the job
    never started."""
    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"
    with FaultProxy(consul.http_addr) as proxy:
        refused = proxy.fail("GET", "/v1/kv/consulrun/slowconfirm/lock?consistent", "refuse", times=6)
        code, _, err = finish(consulrun("run", "--lock-delay", "5s", "--schedule", YEARLY, "slowconfirm", "--",
                                        "touch", str(ran), env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 0, err
    assert len(refused.hits) == 6 and ran.exists()
    assert kv_json(consul, "consulrun/slowconfirm/occurrence")["state"] == "done"
    assert sessions(consul) == []


def test_sigterm_while_the_read_back_is_refused_ends_the_run_at_once(consul: Agent, tmp_path: Path) -> None:
    """Between an unanswered acquisition and its read-back the signal is held, not lost; it ends the read-back
    at its next retry (the session given up, which frees the lock if it was taken), not after the whole budget."""
    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"
    with FaultProxy(consul.http_addr) as proxy:
        proxy.fail("PUT", '"Verb": "lock"', "lose-answer")
        refused = proxy.fail("GET", "/v1/kv/consulrun/termread/lock?consistent", "refuse", times=1000)
        proc = consulrun("run", "--ttl", "60s", "termread", "--", "touch", str(ran),
                         env={"CONSUL_HTTP_ADDR": proxy.address})
        wait_for(lambda: len(refused.hits) >= 2, 20, "the read-back to be refused")
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc, timeout=5)
    assert code == 128 + signal.SIGTERM, err
    assert "SIGTERM while waiting for the lock" in err and "Traceback" not in err, err
    assert not ran.exists()
    assert sessions(consul) == [] and "Session" not in lock_entry(consul, "consulrun/termread/lock")


def test_a_lock_lost_between_its_acquisition_and_its_confirmation_is_not_taken_for_ours(consul: Agent,
                                                                                       tmp_path: Path) -> None:
    """The acquisition is answered, then the session dies before the confirming read (an operator's destroy, a
    check flapping): the read finds the key free, so the lock is not ours and nothing starts; the run skips after
    the lock-delay that the invalidation set, never reports a lost lock or runs the job."""
    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"

    def session_dies(_request: str) -> None:
        consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/flap/lock')['Session']}")

    with FaultProxy(consul.http_addr) as proxy:
        dying = proxy.fail("GET", "/v1/kv/consulrun/flap/lock?consistent", "forward", then=session_dies)
        code, _, err = finish(consulrun("run", "--lock-delay", "5s", "--skip-exit-code", str(SKIP), "flap", "--",
                                        "touch", str(ran), env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert len(dying.hits) == 1
    assert code == SKIP, err
    assert "skipped: the lock is free but Consul refused it" in err and "lock lost" not in err, err
    assert not ran.exists() and sessions(consul) == []


@pytest.mark.parametrize("how", [[], ["--schedule", YEARLY]], ids=["plain", "schedule"])
def test_a_finish_refused_in_an_election_is_retried_until_it_lands(consul: Agent, tmp_path: Path,
                                                                   how: list[str]) -> None:
    """The releasing transaction is refused three times (a leader election): the wrapper says so once, keeps its
    session alive, retries with backoff, and the result lands; the job is not rerun."""
    from tests.harness.faultproxy import FaultProxy

    ran, job = tmp_path / "ran", f"finishretry{len(how)}"
    with FaultProxy(consul.http_addr) as proxy:
        refused = proxy.fail("PUT", '"Verb": "unlock"', "refuse", times=3)
        code, _, err = finish(consulrun("run", *how, job, "--", "sh", "-c", f"echo x >> {ran}",
                                        env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 0, err
    assert len(refused.hits) == 3 and ran.read_text() == "x\n"
    warnings = [line for line in err.splitlines() if "cannot record the result yet" in line]
    assert len(warnings) == 1 and "retrying for up to" in warnings[0], err
    assert f"released consulrun/{job}/lock" in err, err
    value = kv_json(consul, f"consulrun/{job}/lock")
    assert value["state"] == "free" and value["last"]["exit_status"] == 0
    if how:
        assert kv_json(consul, f"consulrun/{job}/occurrence")["state"] == "done"
    assert sessions(consul) == []


def test_a_stop_during_a_refused_finish_retries_only_for_what_the_stop_leaves(consul: Agent, tmp_path: Path) -> None:
    """systemd stops the unit (SIGTERM) while the finish is refused: the wrapper retries only for the part of
    the stop timeout its fencing leaves (about 1 s at --lock-delay 5s), not the 30 s an unstopped finish gets,
    so it ends before systemd's SIGKILL; the session's invalidation frees the lock."""
    from tests.harness.faultproxy import FaultProxy

    with FaultProxy(consul.http_addr) as proxy:
        refused = proxy.fail("PUT", '"Verb": "unlock"', "refuse", times=1000)
        proc = consulrun("run", "--lock-delay", "5s", "stopfinish", "--", "true",
                         env={"CONSUL_HTTP_ADDR": proxy.address})
        wait_for(lambda: len(refused.hits) >= 1, 20, "the finish to be refused")
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc, timeout=10)  # 30 s of retries would not fit
    assert code == 128 + signal.SIGTERM, err
    assert "could not record the result or release consulrun/stopfinish/lock" in err, err
    assert "Traceback" not in err
    wait_for(lambda: sessions(consul) == [], 20, "the session to be gone")


def test_a_session_gone_before_its_acquisition_is_replaced_once_and_the_run_goes_on(consul: Agent,
                                                                                   tmp_path: Path) -> None:
    """The session dies between its creation and the acquiring transaction (Consul answers "invalid session"):
    the node makes one new session and acquires with it; it is neither a lost race nor a failure."""
    import re as regex

    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"

    def the_session_dies(request: str) -> None:
        session = regex.search(r'"Session": "([0-9a-f-]{36})"', request).group(1)
        consul.api("PUT", f"session/destroy/{session}")

    with FaultProxy(consul.http_addr) as proxy:
        gone = proxy.fail("PUT", '"Verb": "lock"', "forward", then=the_session_dies)
        code, _, err = finish(consulrun("run", "--skip-exit-code", str(SKIP), "newsession", "--", "touch", str(ran),
                                        env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert len(gone.hits) == 1
    assert code == 0 and ran.exists(), err
    assert "no longer exists; making a new one" in err, err
    assert sessions(consul) == []


def test_every_termination_signal_reaches_the_job_not_only_the_first(consul: Agent, tmp_path: Path) -> None:
    """systemd may signal twice (a stop, then a second stop or a restart): each SIGTERM is forwarded once, in
    order, and the wrapper stays responsive between them."""
    heard, ready = tmp_path / "heard", tmp_path / "ready"
    # Counted in the shell itself: a command substitution's subshell would be in the job's group and die of it.
    job = (f"n=0; trap 'n=$((n + 1)); echo TERM >> {heard}' TERM; touch {ready}; "
           f"while [ $n -lt 2 ]; do sleep 0.1; done; exit 0")
    proc = consulrun("run", "twice", "--", "sh", "-c", job)
    wait_for(ready.exists, 20, "the job")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: heard.exists() and heard.read_text().count("TERM") == 1, 10, "the first SIGTERM to reach the job")
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, timeout=20)
    assert heard.read_text() == "TERM\nTERM\n", err
    assert code == 0 and err.count("SIGTERM received; forwarding it to the job's processes") == 2, err
    assert sessions(consul) == []


@pytest.mark.parametrize("how", [[], ["--schedule", YEARLY]], ids=["plain", "occurrence"])
def test_a_wait_on_a_held_lock_is_blocking_reads_not_a_busy_loop(consul: Agent, tmp_path: Path,
                                                                 how: list[str]) -> None:
    """A waiter looks, then blocks on the lock key until it changes or its wait ends: a handful of requests, not a
    poll. Mutants that lost the index to block on (so every look returned at once) passed every other test."""
    from tests.harness.faultproxy import FaultProxy

    started, job = tmp_path / "started", f"busy{len(how)}"
    holder = consulrun("run", *how, job, "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the holder's job")
        with FaultProxy(consul.http_addr) as proxy:
            looks = proxy.fail("PUT", "/v1/txn", "forward", times=10_000)
            blocks = proxy.fail("GET", "index=", "forward", times=10_000)
            env = {"CONSUL_HTTP_ADDR": proxy.address}
            if how:  # a retry standby waits until the next occurrence (a year away): stopped after 4 s
                code, _, err = _stopped_after(consulrun("run", *how, "--on-holder-loss", "retry", job, "--", "true",
                                                        env=env), 4)
            else:
                code, _, err = finish(consulrun("run", "--wait", "4s", "--skip-exit-code", str(SKIP), job, "--",
                                                "true", env=env))
        assert code == (SKIP if not how else 143), err
        assert ("held by" if not how else "standing by") in err, err
        assert 1 <= len(blocks.hits) <= 3 and len(looks.hits) <= 4, (len(looks.hits), blocks.hits)
    finally:
        holder.send_signal(signal.SIGTERM)
        finish(holder)


def test_a_standby_outlives_refused_answers_and_a_first_look_refused_is_exit_69(consul: Agent,
                                                                                 tmp_path: Path) -> None:
    """retry: Consul refusing a standby's blocking reads (an election) does not end its standing by: it says so,
    tries again, and sees the run through. A run that has not yet found anyone to stand by for does not wait out
    a failure until the next occurrence (a year away): its first look failing (a 500 that is not an election,
    which the start would retry for a while) is exit 69, at once."""
    from tests.harness.faultproxy import FaultProxy

    started, go, ran = tmp_path / "started", tmp_path / "go", tmp_path / "ran"
    args = ["run", "--schedule", YEARLY, "--on-holder-loss", "retry", "--skip-exit-code", str(SKIP)]
    holder = consulrun(*args, "refusedwait", "--", *gated_job(started, go))
    try:
        wait_for(started.exists, 20, "the holder's job")
        code, err = _through_two_refused_reads(consul, [*args, "refusedwait", "--", "touch", str(ran)], go)
        assert code == SKIP and not ran.exists(), err
        assert err.count("Consul cannot answer while standing by") == 1 and "already ran on dev1" in err, err
        assert f"occurrence {OCC} runs on dev1; standing by for up to " in err, err
        assert finish(holder)[0] == 0

        with FaultProxy(consul.http_addr) as proxy:
            looks = proxy.fail("PUT", "/v1/txn", "refuse", times=10_000, answer=b"internal error: disk full")
            first = consulrun(*args, "refusedfirst", "--", "touch", str(ran), env={"CONSUL_HTTP_ADDR": proxy.address})
            try:
                code, _, err = finish(first, timeout=30)
            finally:
                first.kill()
        assert code == 69 and not ran.exists() and looks.hits, err
        assert "Consul cannot serve the request: 500 internal error: disk full" in err and "standing by" not in err, err
        assert sessions(consul) == []
    finally:
        go.touch()
        holder.kill()


def _through_two_refused_reads(consul: Agent, args: list[str], go: Path) -> tuple[int, str]:
    """Run consulrun `args` through a proxy that refuses its first two blocking reads (an election); once it blocks
    on a third, let the holder's job end (`go`); its exit status and log."""
    from tests.harness.faultproxy import FaultProxy

    with FaultProxy(consul.http_addr) as proxy:
        refused = proxy.fail("GET", "index=", "refuse", times=2)
        blocking = proxy.fail("GET", "index=", "forward", times=10_000)
        waiter = consulrun(*args, env={"CONSUL_HTTP_ADDR": proxy.address})
        try:
            wait_for(lambda: blocking.hits, 30, "the waiter to block on the lock after two refused reads")
            assert len(refused.hits) == 2 and waiter.poll() is None
            go.touch()
            code, _, err = finish(waiter, timeout=30)
        finally:
            waiter.kill()
    return code, err


def test_a_wait_for_the_previous_run_outlives_refused_answers(consul: Agent, tmp_path: Path) -> None:
    """A new occurrence, unclaimed, while the previous run still holds the lock: the node waits (--wait) on blocking
    reads, and Consul refusing them (an election) does not end the wait; once the lock is free the node runs it."""
    started, go, ran = tmp_path / "started", tmp_path / "go", tmp_path / "ran"
    holder = consulrun("run", "prevwait", "--", *gated_job(started, go))
    try:
        wait_for(started.exists, 20, "the previous run's job")
        code, err = _through_two_refused_reads(
            consul, ["run", "--schedule", YEARLY, "--wait", "60s", "prevwait", "--", "touch", str(ran)], go)
        assert code == 0 and ran.exists(), err
        assert err.count("Consul cannot answer while standing by") == 1, err
        assert "the previous run holds the lock: dev1 (pid " in err, err
        assert finish(holder)[0] == 0
    finally:
        go.touch()
        holder.kill()


@pytest.mark.parametrize("ended", ["running", "lost"])
def test_a_standbys_takeover_whose_outcome_could_not_be_read_back_is_recognised_as_its_own(consul: Agent,
                                                                                            tmp_path: Path,
                                                                                            ended: str) -> None:
    """retry: a node takes over an occurrence whose runner died (its record still `running`) or was fenced (`lost`);
    Consul applies the takeover but its answer is lost, and the read-back is refused past its budget. Standing by,
    the node looks again: the lock and the record name its own session, so the claim is its own, and it runs it,
    as attempt 2, once (not a third attempt after giving its own claim up, nor a wait on itself)."""
    from tests.harness.faultproxy import FaultProxy

    dead = {"occurrence": OCC, "state": "running", "node": "gone", "session": "5b8f2f83-0000-4000-8000-000000000001",
            "started": OCC, "takeover": False, "attempt": 1, "earlier": []}
    if ended == "lost":
        dead |= {"state": "lost", "reason": "fenced", "ended": OCC}
    consul.api("PUT", "kv/consulrun/ownclaim/occurrence", data=json.dumps(dead))
    ran, log = tmp_path / "ran", tmp_path / "standby.log"
    with FaultProxy(consul.http_addr) as proxy, log.open("w") as sink:
        lost = proxy.fail("PUT", '"Verb": "lock"', "lose-answer")
        reads = proxy.fail("GET", "consistent", "refuse", times=10_000)
        standby = consulrun("run", "--schedule", YEARLY, "--on-holder-loss", "retry", "--ttl", "10s", "ownclaim", "--",
                            "sh", "-c", f"echo x >> {ran}", env={"CONSUL_HTTP_ADDR": proxy.address},
                            stdout=subprocess.DEVNULL, stderr=sink)
        try:
            wait_for(lambda: "Consul cannot answer while standing by" in log.read_text(), 40,
                     "the read-back to give up and the standby to look again")
            assert lost.hits and not ran.exists()
            proxy.retire(reads)  # Consul answers again
            assert standby.wait(timeout=60) == 0, log.read_text()
        finally:
            standby.kill()
    err = log.read_text()
    assert "whether the acquisition went through is unknown" in err, err
    assert err.count(f" for occurrence {OCC}, taking over from a dead runner (node dev1, session ") == 1, err  # said of both
    assert ran.read_text() == "x\n"
    record = kv_json(consul, "consulrun/ownclaim/occurrence")
    assert (record["state"], record["attempt"], len(record["earlier"])) == ("done", 2, 1), record
    assert sessions(consul) == []


def test_the_confirmation_before_the_start_is_a_consistent_read_asked_again_while_consul_cannot_answer(
        consul: Agent, tmp_path: Path) -> None:
    """Between acquiring and forking, the lock is read once more, consistently (a leader's default read can be
    stale); an election's refusal is not a lost lock: asked again, the job starts."""
    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"
    with FaultProxy(consul.http_addr) as proxy:
        acquired = proxy.fail("GET", "/v1/kv/consulrun/confirmstart/lock?consistent", "forward", times=1)
        refused = proxy.fail("GET", "/v1/kv/consulrun/confirmstart/lock?consistent", "refuse", times=2)
        code, _, err = finish(consulrun("run", "confirmstart", "--", "touch", str(ran),
                                        env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 0 and ran.exists(), err
    assert len(acquired.hits) == 1 and len(refused.hits) == 2, (acquired.hits, refused.hits)
    asked = [line for line in err.splitlines() if "cannot confirm the lock before starting the job" in line]
    assert len(asked) == 2 and all(line.endswith("No cluster leader); asking again") for line in asked), err


def test_a_confirmation_answered_past_the_fencing_deadline_starts_nothing(consul: Agent, tmp_path: Path) -> None:
    """The read that confirms the lock just before the fork is answered, "ours", but only after the fencing deadline
    (9 s at lock-delay 15 s): by then another node may hold the lock, so the answer is stale and nothing starts."""
    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"
    with FaultProxy(consul.http_addr) as proxy:
        proxy.fail("GET", "/v1/kv/consulrun/slowconfirm/lock?consistent", "forward", times=1)  # the acquisition's
        slow = proxy.fail("GET", "/v1/kv/consulrun/slowconfirm/lock?consistent", "forward", times=1,
                          then=lambda _: time.sleep(9.5))
        code, _, err = finish(consulrun("run", "--schedule", YEARLY, "slowconfirm", "--", "touch", str(ran),
                                        env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert len(slow.hits) == 1 and not ran.exists(), err
    assert code == 75 and re.search(r"the confirmation took (9|10)\.\ds, past the fencing deadline", err), err
    assert kv_json(consul, "consulrun/slowconfirm/occurrence")["state"] == "lost"
    assert sessions(consul) == []


def _stopped_after(proc: subprocess.Popen[str], seconds: float) -> tuple[int, str, str]:
    """`proc` given SIGTERM after `seconds` (a standby waits for the next occurrence, a year away)."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
    return finish(proc)


def test_an_agent_whose_node_is_not_registered_yet_is_waited_for_then_runs(consul: Agent, tmp_path: Path) -> None:
    """An agent that has just started (at boot) is in the cluster before the servers have its node in the catalog:
    session create answers `Missing node registration`. That is retried within the start budget, with one line
    saying what for and how long at most, and the job runs."""
    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"
    with FaultProxy(consul.http_addr) as proxy:
        unregistered = proxy.fail("PUT", "/v1/session/create", "refuse", times=3,
                                  answer=b"rpc error making call: Missing node registration")
        code, _, err = finish(consulrun("run", "--schedule", YEARLY, "booting", "--", "touch", str(ran),
                                        env={"CONSUL_HTTP_ADDR": proxy.address}), timeout=90)
    assert code == 0 and ran.exists(), err
    assert len(unregistered.hits) == 3, err
    waits = [line for line in err.splitlines() if "retrying for up to" in line]
    assert len(waits) == 1, err  # said once, not once per attempt
    assert re.fullmatch(r"consulrun: booting: Consul is not ready \(.*Missing node registration\); retrying for up "
                        r"to (2m|1m[0-9]+s), as an agent still starting or servers electing a leader answer so "
                        r"\(exit 69 if it is not ready by then\)", waits[0]), waits


def test_nothing_listening_long_after_boot_is_an_outage_at_once(tmp_path: Path) -> None:
    """Refused at the agent's address on a system up for longer than BOOTING_S: the agent is down, not starting
    (the cold boot, where it is starting, is tests/test_coldboot.py): exit 69 at once, one line."""
    from consulrun.protocol.procinfo import system_age
    from consulrun.protocol.runner import BOOTING_S

    age = system_age()
    assert age is None or age > BOOTING_S, "this host booted too recently for this test"
    code, _, err = finish(consulrun("run", "--schedule", YEARLY, "downagent", "--", "true",
                                    env={"CONSUL_HTTP_ADDR": "127.0.0.1:9"}), timeout=30)
    assert code == 69 and err.count("\n") == 1 and "connection refused" in err, err


def test_a_fresh_pid_namespace_is_no_boot(tmp_path: Path) -> None:
    """A command that is PID 1 of a new PID namespace (`unshare -p`, a one-off container) has a young PID 1 that
    boots nothing: nothing listening is an outage at once, not an agent still starting (red team, session 10)."""
    from consulrun.protocol.procinfo import INIT_NAMES

    script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from consulrun.protocol.procinfo import system_age; "
              "print(open('/proc/1/comm').read().strip(), system_age())")
    seen = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=30)
    assert seen.returncode == 0, seen.stderr
    comm, age = seen.stdout.split()
    assert comm not in INIT_NAMES and age == "None", seen.stdout  # PID 1 is that python, just started
    run = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "consulrun", "run",
                          "--schedule", YEARLY, "freshns", "--", "true"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "CONSUL_HTTP_ADDR": "127.0.0.1:9", "PYTHONPATH": str(REPO)})
    assert run.returncode == 69 and run.stderr.count("\n") == 1 and "connection refused" in run.stderr, run.stderr
