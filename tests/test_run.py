"""`consulrun run` against a real Consul agent: exclusivity, cheap losers, fencing, signals."""

from __future__ import annotations

import base64
import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.harness.agents import Agent, Cluster, wait_for
from tests.harness.runs import (
    SKIP,
    consulrun,
    finish,
    kv_json,
    lock_entry,
    pid_alive,
    raft_applied as _raft_applied,
)

pytestmark = pytest.mark.consul


def test_twenty_simultaneous_contenders_one_runs(consul: Agent, tmp_path: Path) -> None:
    for round_no in range(5):
        runs, release = tmp_path / f"runs-{round_no}", tmp_path / f"go-{round_no}"
        # The winner's job holds the lock until every loser has decided: no race with slow starters.
        job = f"echo $$ >> {runs}; while [ ! -e {release} ]; do sleep 0.05; done"
        procs = [consulrun("run", "--skip-exit-code", str(SKIP), "race", "--", "sh", "-c", job) for _ in range(20)]
        wait_for(lambda: sum(p.poll() is not None for p in procs) >= 19, 120, "19 contenders to skip")
        release.touch()
        results = [finish(p) for p in procs]
        codes = sorted(code for code, _, _ in results)
        assert codes == [0] + [SKIP] * 19, [(c, e) for c, _, e in results if c not in (0, SKIP)]
        assert len(runs.read_text().split()) == 1
        skipped_lines = [e for c, _, e in results if c == SKIP]
        assert all("skipped:" in e for e in skipped_lines)
        assert consul.get("session/list") == []


def test_loser_decides_with_reads_only(consul: Agent, tmp_path: Path) -> None:
    started = tmp_path / "started"
    holder = consulrun("run", "cheap", "--", "sh", "-c", f"touch {started}; sleep 30")
    try:
        wait_for(started.exists, 20, "the holder's job to start")
        kv_index = int(consul.api("GET", "kv/consulrun/cheap/lock").headers["X-Consul-Index"])
        sessions_index = int(consul.api("GET", "session/list").headers["X-Consul-Index"])
        deltas = []
        for _ in range(3):  # the agent's own periodic writes (coordinates) may land in one window, not in all
            raft_before = _raft_applied(consul)
            code, _, err = finish(consulrun("run", "--skip-exit-code", str(SKIP), "cheap", "--", "true"))
            deltas.append(_raft_applied(consul) - raft_before)
            assert code == SKIP, err
            assert "held by dev1" in err
            assert int(consul.api("GET", "kv/consulrun/cheap/lock").headers["X-Consul-Index"]) == kv_index
            assert int(consul.api("GET", "session/list").headers["X-Consul-Index"]) == sessions_index
        assert min(deltas) == 0, deltas
    finally:
        holder.send_signal(signal.SIGTERM)
        finish(holder)


def test_lock_value_and_child_environment(consul: Agent, tmp_path: Path) -> None:
    seen = tmp_path / "env.json"
    script = (f"import json, os; json.dump({{k: v for k, v in os.environ.items() if k.startswith('CONSULRUN_')}}, "
              f"open({str(seen)!r}, 'w'))")
    code, _, err = finish(consulrun("run", "--prefix", "ops/cr", "envjob", "--", sys.executable, "-c", script))
    assert code == 0, err
    env = json.loads(seen.read_text())
    assert env["CONSULRUN_JOB"] == "envjob" and env["CONSULRUN_NODE"] == "dev1"  # Consul's name, as status gives it
    assert env["CONSULRUN_LOCK_KEY"] == "ops/cr/envjob/lock"
    entry = lock_entry(consul, "ops/cr/envjob/lock")
    assert entry is not None and "Session" not in entry
    value = json.loads(base64.b64decode(entry["Value"]))
    assert value["state"] == "free"
    assert value["last"]["node"] == "dev1" and value["last"]["exit_status"] == 0
    assert value["last"]["session"] == env["CONSULRUN_SESSION"]
    # Every field, and no other: what `status`, `reap` and operators read (docs/guarantees.md, the lock's value).
    assert set(value) == {"state", "last"}
    assert set(value["last"]) == {"boot_id", "consulrun_version", "ended", "exit_status", "host", "job", "node", "pid",
                                  "pid_ns", "pid_start", "session", "started", "time_ns"}, value
    assert value["last"]["job"] == "envjob" and value["last"]["ended"] >= value["last"]["started"]
    assert "left processes behind" not in err and "warning" not in err.lower(), err
    # The acquired line, whole: a plain run names no occurrence.
    acquired = [line for line in err.splitlines() if " acquired " in line]
    assert len(acquired) == 1 and re.fullmatch(
        r"consulrun: envjob: acquired ops/cr/envjob/lock \(node dev1, session [0-9a-f-]{36}, fencing token \d+\)",
        acquired[0]), err
    # The fencing token grows with every acquisition.
    code, _, _ = finish(consulrun("run", "--prefix", "ops/cr", "envjob", "--", sys.executable, "-c", script))
    assert code == 0
    assert int(json.loads(seen.read_text())["CONSULRUN_FENCING_TOKEN"]) > int(env["CONSULRUN_FENCING_TOKEN"])


def test_job_exit_status_passes_through(consul: Agent) -> None:
    code, _, err = finish(consulrun("run", "status", "--", "sh", "-c", "exit 7"))
    assert code == 7
    assert "job exited with status 7" in err


def test_session_destroyed_kills_whole_group(consul: Agent, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    holder = consulrun("run", "fenced", "--", "sh", "-c", f"sleep 300 & echo $$ $! > {pids}; wait")
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2, 20, "the job and its grandchild")
    shell, grandchild = (int(p) for p in pids.read_text().split())
    session = lock_entry(consul, "consulrun/fenced/lock")["Session"]
    consul.api("PUT", f"session/destroy/{session}")
    code, _, err = finish(holder, timeout=30)
    assert code == 75, err
    # Fenced at once, for what the watcher saw, not 9 s later for want of a confirmation.
    assert "lock lost: the lock was released or taken over; now held by nobody; killing the job's processes" in err, err
    assert not pid_alive(shell) and not pid_alive(grandchild)


def test_a_lost_lock_gives_the_job_sigterm_and_its_grace_before_sigkill(consul: Agent, tmp_path: Path) -> None:
    """Fenced with time left (the watcher saw the loss at once): SIGTERM first, and the grace to act on it (5 s
    at this lock-delay; the job's cleanup takes 2 s of it, so a SIGKILL sent before the grace is over stops it)."""
    started, termed = tmp_path / "started", tmp_path / "termed"
    holder = consulrun("run", "--lock-delay", "15s", "graceful", "--", "sh", "-c",
                       f"trap 'sleep 2; touch {termed}; exit 0' TERM; touch {started}; while :; do sleep 0.1; done")
    wait_for(started.exists, 20, "the job")
    consul.api("PUT", f"session/destroy/{lock_entry(consul, 'consulrun/graceful/lock')['Session']}")
    code, _, err = finish(holder, timeout=30)
    assert code == 75, err
    assert termed.exists(), err  # it got SIGTERM and the time to run its trap
    # The grace the line names is the one the job gets (it said 9.9s, the time left to the fencing deadline).
    assert "killing the job's processes (SIGTERM, SIGKILL after 5s)" in err, err


def test_kill_9_of_wrapper_kills_child_and_lock_frees_after_ttl(consul: Agent, tmp_path: Path) -> None:
    pids = tmp_path / "pid"
    holder = consulrun("run", "--ttl", "10s", "orphan", "--", "sh", "-c", f"echo $$ > {pids}; exec sleep 300")
    wait_for(lambda: pids.exists() and pids.read_text().strip(), 20, "the job to start")
    child = int(pids.read_text())
    holder.kill()
    holder.wait()
    wait_for(lambda: not pid_alive(child), 5, "the child to die with its wrapper")
    # Consul may take up to twice the TTL to notice a session that is no longer renewed.
    wait_for(lambda: "Session" not in (lock_entry(consul, "consulrun/orphan/lock") or {}), 25,
             "the lock to be freed by TTL expiry")


def test_consul_down_at_start_fails_closed(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code, out, err = finish(consulrun("run", "down", "--", "touch", str(marker),
                                      env={"CONSUL_HTTP_ADDR": "127.0.0.1:9"}))
    assert code == 69
    assert out == ""
    assert err.count("\n") == 1 and "not reachable" in err
    assert not marker.exists()


def test_sigterm_while_waiting_exits_promptly_and_leaves_no_session(consul: Agent, tmp_path: Path) -> None:
    started = tmp_path / "started"
    holder = consulrun("run", "waitjob", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the holder's job")
        (tmp_path / "hooks").mkdir()
        waiter = consulrun("run", "--wait", "5m", "waitjob", "--", "true",
                           env={"CONSULRUN_TEST_PAUSE": "waiting", "CONSULRUN_TEST_HOOK_DIR": str(tmp_path / "hooks")})
        wait_for((tmp_path / "hooks" / "waiting").exists, 20, "the waiter to start waiting")
        assert waiter.poll() is None
        waiter.send_signal(signal.SIGTERM)
        code, _, err = finish(waiter, timeout=5)
        assert code == 128 + signal.SIGTERM, err
        assert "SIGTERM while waiting" in err
        assert len(consul.get("session/list")) == 1
    finally:
        holder.send_signal(signal.SIGTERM)
        code, _, err = finish(holder)
    assert code == 128 + signal.SIGTERM  # forwarded to the job: sleep died of it
    assert consul.get("session/list") == []


def test_concurrency_three_of_ten(consul: Agent, tmp_path: Path) -> None:
    log = tmp_path / "spans"
    job = f"start=$(date +%s.%N); sleep 1; echo $start $(date +%s.%N) >> {log}"
    procs = [consulrun("run", "--concurrency", "3", "--wait", "2m", "sem", "--", "sh", "-c", job) for _ in range(10)]
    results = [finish(p, timeout=120) for p in procs]
    assert [c for c, _, _ in results] == [0] * 10, [e for _, _, e in results]
    spans = [tuple(map(float, line.split())) for line in log.read_text().splitlines()]
    assert len(spans) == 10
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 3


def test_a_free_slot_is_taken_while_another_is_held(consul: Agent, tmp_path: Path) -> None:
    """--concurrency 2 with one slot held: the next run takes the other one at once (it used to skip as long as
    any slot was held); a third finds both held and skips, naming both holders."""
    runs = []
    try:
        for n in (1, 2):
            started = tmp_path / f"started{n}"
            runs.append(consulrun("run", "--concurrency", "2", "pairjob", "--", "sh", "-c", f"touch {started}; sleep 60"))
            wait_for(started.exists, 20, f"run {n} to take a slot")
        code, _, err = finish(consulrun("run", "--concurrency", "2", "--skip-exit-code", str(SKIP), "pairjob", "--",
                                        "true"))
        assert code == SKIP and "skipped: held by " in err and err.count("(pid ") == 2, err
        held = {e["Key"]: e.get("Session") for e in consul.get("kv/consulrun/pairjob/slots/?recurse")}
        assert set(held) == {"consulrun/pairjob/slots/0", "consulrun/pairjob/slots/1"} and all(held.values())
    finally:
        for run in runs:
            run.send_signal(signal.SIGTERM)
            finish(run)
    assert consul.get("session/list") == []


@pytest.mark.cluster
@pytest.mark.parametrize("failure", ["agent killed", "partitioned"])
def test_holder_cut_off_job_dies_before_anyone_else_acquires(cluster: Cluster, tmp_path: Path, failure: str) -> None:
    """Node death (agent killed) and a partition (its link down, agent alive but cut off from the servers)."""
    beat = tmp_path / "beat"
    node2, node3 = cluster.clients
    env = {"CONSUL_HTTP_ADDR": "127.0.0.1:8500"}
    # The job ignores SIGTERM, so only the SIGKILL at the end of the grace period stops it.
    # Heartbeats are renamed into place: a kill between truncating and writing must not leave an empty file.
    holder = consulrun("run", "failover", "--", "sh", "-c",
                       f"trap '' TERM; while true; do date +%s.%N > {beat}.new; mv {beat}.new {beat}; sleep 0.05; done",
                       env=env, netns=node2.netns)
    wait_for(beat.exists, 20, "the job on node2")
    took_over = tmp_path / "took-over"
    cut_at = time.time()  # the last confirmation was sent before this
    if failure == "agent killed":
        node2.kill()
    else:
        cluster.network.partition(1)
    standby = consulrun("run", "--wait", "90s", "failover", "--", "sh", "-c", f"date +%s.%N > {took_over}",
                        env=env, netns=node3.netns)
    code, _, err = finish(holder, timeout=60)
    assert code == 75, err
    assert "lock lost" in err
    code3, _, err3 = finish(standby, timeout=120)
    assert code3 == 0, err3
    last_beat, started_elsewhere = float(beat.read_text()), float(took_over.read_text())
    assert last_beat < started_elsewhere, (last_beat, started_elsewhere)
    # Default lock-delay 15s: the wrapper aims its SIGKILL at the last confirmation + 14 s (grace 5 s, margin 1 s);
    # what it guarantees is before lock-delay ends, when another node could first acquire (a loaded CI machine
    # once scheduled the kill 0.3 s past the aim, well inside it).
    assert last_beat < cut_at + 15.0, last_beat - cut_at
    value = json.loads(base64.b64decode(lock_entry(node3, "consulrun/failover/lock")["Value"]))
    assert value["last"]["node"] == "node3"


def test_timeout_stops_the_job_from_its_own_start_and_kills_it_after_the_stop_grace(consul: Agent) -> None:
    """`--timeout` is the wrapper's: SIGTERM to every process of the job at the timeout, SIGKILL lock-delay - 1s
    later (a job that ignores SIGTERM here); the run is the job's result (done, `timed_out`), not a lost one."""
    proc = consulrun("run", "--lock-delay", "5s", "--timeout", "2s", "--schedule", "*-01-01 00:00:00 UTC",
                     "slowpoke", "--", "sh", "-c", "trap '' TERM; sleep 60")
    code, _, err = finish(proc, timeout=60)
    assert code == 128 + signal.SIGKILL, err
    assert "the job exceeded its timeout of 2s; stopping its processes (SIGTERM, SIGKILL after 4s)" in err, err
    assert "outlived the 4s grace after its timeout; killing what is left (SIGKILL)" in err, err
    record = kv_json(consul, "consulrun/slowpoke/occurrence")
    assert (record["state"], record["exit_status"], record["timed_out"]) == ("done", 137, True), record


def test_skip_when_stopped_gives_the_skip_code_to_a_stop_before_the_lock(consul: Agent, tmp_path: Path) -> None:
    """`--skip-when-stopped` (every generated unit has it): a node stopped while it waited ran nothing, so it exits
    with the skip code, which systemd counts a success (no OnFailure=); the log line still says which signal."""
    started = tmp_path / "started"
    holder = consulrun("run", "stopwait", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the holder's job")
        (tmp_path / "hooks").mkdir()
        waiter = consulrun("run", "--wait", "5m", "--skip-exit-code", "42", "--skip-when-stopped", "stopwait", "--",
                           "true", env={"CONSULRUN_TEST_PAUSE": "waiting",
                                        "CONSULRUN_TEST_HOOK_DIR": str(tmp_path / "hooks")})
        wait_for((tmp_path / "hooks" / "waiting").exists, 20, "the waiter to start waiting")
        waiter.send_signal(signal.SIGTERM)
        code, _, err = finish(waiter, timeout=5)
        assert code == 42, err
        assert "SIGTERM while waiting for the lock; not running" in err, err
    finally:
        holder.send_signal(signal.SIGTERM)
        finish(holder)
    assert consul.get("session/list") == []
