"""Exactly once per scheduled occurrence, against a real Consul, with real skewed clocks (libfaketime)."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from consulrun.protocol import keys as kvkeys
from tests.harness.agents import Agent, Cluster, wait_for
from tests.harness.clock import skewed
from tests.harness.runs import (
    SKIP,
    consulrun,
    finish,
    gated_job,
    history,
    kv_json,
    skip_writes as _skip_writes,
)

pytestmark = pytest.mark.consul

# The latest occurrence of a yearly schedule is the same all year: stable for a test, yet a real schedule.
YEARLY = "*-01-01 00:00:00 UTC"


def staggered(args_for: list[list[str]], gap_s: float, envs: list[dict[str, str]] | None = None) -> list[tuple[int, str, str]]:
    procs = []
    for i, args in enumerate(args_for):
        procs.append(consulrun(*args, env=(envs or [{}] * len(args_for))[i]))
        time.sleep(gap_s)
    return [finish(p, timeout=60) for p in procs]


def test_plain_mutex_runs_a_skewed_occurrence_many_times(consul: Agent, tmp_path: Path) -> None:
    """The failure the occurrence record exists for: a free lock is taken again by late nodes."""
    runs = tmp_path / "runs"
    job = ["sh", "-c", f"echo x >> {runs}; sleep 0.5"]
    results = staggered([["run", "--skip-exit-code", str(SKIP), "mutex", "--", *job] for _ in range(5)], 0.7)
    assert len(runs.read_text().split()) > 1, results


def test_five_skewed_contenders_one_run(consul: Agent, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    job = ["sh", "-c", f"echo $CONSULRUN_OCCURRENCE >> {runs}; sleep 0.5"]
    args = ["run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "skewed", "--", *job]
    results = staggered([args] * 5, 0.7)
    codes = sorted(code for code, _, _ in results)
    assert codes == [0] + [SKIP] * 4, [e for _, _, e in results]
    year = datetime.now(timezone.utc).year
    assert runs.read_text().split() == [f"{year}-01-01T00:00:00Z"]
    # Each skipper says who has the occurrence: done by then, or still running (a 0.7 s gap on a loaded machine).
    assert all("already ran on dev1" in e or "was claimed by dev1 and is running" in e for c, _, e in results if c == SKIP)
    record = kv_json(consul, "consulrun/skewed/occurrence")
    assert record["state"] == "done" and record["exit_status"] == 0
    assert list(history(consul, "skewed")) == [f"{year}-01-01T00:00:00Z"]


def test_simultaneous_catch_up_runs_once(consul: Agent, tmp_path: Path) -> None:
    """What Persistent=true does at boot on every node at once."""
    runs = tmp_path / "runs"
    procs = [consulrun("run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "catchup", "--", "sh", "-c",
                       f"echo x >> {runs}; sleep 0.5") for _ in range(10)]
    codes = sorted(finish(p)[0] for p in procs)
    assert codes == [0] + [SKIP] * 9
    assert len(runs.read_text().split()) == 1


def test_randomised_clock_skew_over_many_occurrences(consul: Agent, tmp_path: Path) -> None:
    """Five nodes with clocks up to 3 s apart fire up to 2 s late for each 10-second occurrence."""
    runs, clocks = tmp_path / "runs", tmp_path / "clocks"
    rng = random.Random(20261129)
    offsets = [rng.uniform(-3, 3) for _ in range(5)]
    start = (int(time.time()) // 10 + 1) * 10 + 10  # the occurrence after next, leaving time to launch
    occurrences = [start + 10 * k for k in range(4)]
    results: list[tuple[int, str, str]] = []
    lock = threading.Lock()

    def node(offset: float) -> None:
        for scheduled in occurrences:
            fire_at = scheduled + rng.uniform(0, 2) - offset  # real time at which this node's clock says scheduled+delay
            time.sleep(max(0.0, fire_at - time.time()))
            launched = time.time()
            proc = consulrun("run", "--schedule", "*:*:0/10", "--skip-exit-code", str(SKIP), "skew", "--", "sh", "-c",
                             f"echo $CONSULRUN_OCCURRENCE >> {runs}; echo $(date +%s.%N) {launched} {offset} >> {clocks}; "
                             "sleep 0.5", env=skewed(offset))
            with lock:
                results.append(finish(proc))

    threads = [threading.Thread(target=node, args=(o,)) for o in offsets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 20, results
    assert all(code in (0, SKIP) for code, _, _ in results), [e for c, _, e in results if c not in (0, SKIP)]
    ran = runs.read_text().split()
    expected = [datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") for t in occurrences]
    assert sorted(ran) == expected  # every occurrence exactly once
    # The skew really happened: each run's job saw its node's clock, not the host's (within start-up time).
    for line in clocks.read_text().splitlines():
        seen, launched, offset = (float(x) for x in line.split())
        assert -0.5 < seen - launched - offset < 3.0, (seen, launched, offset)


def test_late_contender_from_previous_occurrence_does_not_run(consul: Agent, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    while time.time() % 600 > 590:  # not across a 10-minute boundary between the two runs
        time.sleep(1)
    assert finish(consulrun("run", "--schedule", "*:0/10", "late", "--", "true"))[0] == 0
    code, _, err = finish(consulrun("run", "--schedule", "*:0/10", "--skip-exit-code", str(SKIP), "late", "--",
                                    "touch", str(marker), env=skewed(-600)))
    assert code == SKIP, err
    assert "is already claimed" in err and "is past" in err
    assert not marker.exists()


def test_loser_reads_only_once_the_occurrence_is_recorded(consul: Agent) -> None:
    assert finish(consulrun("run", "--schedule", YEARLY, "cheap-occ", "--", "true"))[0] == 0
    before = int(consul.get("agent/self")["Stats"]["raft"]["applied_index"])
    code, _, _ = finish(consulrun("run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "cheap-occ", "--", "true"))
    assert code == SKIP
    assert int(consul.get("agent/self")["Stats"]["raft"]["applied_index"]) == before


@pytest.mark.cluster
@pytest.mark.parametrize("policy", ["retry", "skip"])
def test_takeover_when_runners_agent_dies(cluster: Cluster, tmp_path: Path, policy: str) -> None:
    node2, node3 = cluster.clients
    env = {"CONSUL_HTTP_ADDR": "127.0.0.1:8500"}
    started, second = tmp_path / "started", tmp_path / "second"
    common = ["run", "--schedule", YEARLY, "--on-holder-loss", policy, "--skip-exit-code", str(SKIP), "billing"]
    runner = consulrun(*common, "--", "sh", "-c", f"touch {started}; sleep 300", env=env, netns=node2.netns)
    wait_for(started.exists, 20, "the job on node2")
    standby = consulrun(*common, "--", "sh", "-c", f"echo $CONSULRUN_OCCURRENCE > {second}", env=env, netns=node3.netns)
    time.sleep(1)  # let the standby read the record and start waiting (or skip)
    node2.kill()
    assert finish(runner, timeout=60)[0] == 75
    code, _, err = finish(standby, timeout=120)
    year = datetime.now(timezone.utc).year
    if policy == "retry":
        assert code == 0, err
        assert "taking over" in err
        assert second.read_text().strip() == f"{year}-01-01T00:00:00Z"
        entry = history(cluster.server, "billing")[f"{year}-01-01T00:00:00Z"]
        assert entry["takeover"] is True and entry["node"] == "node3" and entry["state"] == "done"
    else:
        assert code == SKIP, err
        assert "claimed by node2" in err
        assert not second.exists()
        assert kv_json(cluster.server, "consulrun/billing/occurrence")["state"] == "running"


def test_running_later_and_previous_skip_paths_make_no_writes(consul: Agent, tmp_path: Path) -> None:
    while time.time() % 60 > 50:  # the holder's occurrence and the skippers' must stay put during the test
        time.sleep(1)
    started = tmp_path / "started"
    minutely = ["run", "--schedule", "*:*:00", "--skip-exit-code", str(SKIP), "paths"]
    holder = consulrun(*minutely, "--", "sh", "-c", f"touch {started}; sleep 120")
    try:
        wait_for(started.exists, 20, "the holder's job")
        deltas, errs = _skip_writes(consul, [*minutely, "--", "true"])  # running
        running = "was claimed by dev1 and is running (on_holder_loss=skip)"
        assert min(deltas) == 0 and all(running in e for e in errs), \
            (deltas, errs)
        deltas, errs = _skip_writes(consul, [*minutely, "--", "true"], env=skewed(-120))  # a later one is claimed
        assert min(deltas) == 0 and all("is already claimed" in e for e in errs), (deltas, errs)
        # the next occurrence's nodes while this one still runs: occurrences never overlap
        deltas, errs = _skip_writes(consul, [*minutely, "--", "true"], env=skewed(60))
        assert min(deltas) == 0 and all("the previous run still holds the lock: dev1 (pid " in e for e in errs), \
            (deltas, errs)
    finally:
        holder.send_signal(signal.SIGTERM)
        finish(holder)
    assert consul.get("session/list") == []


def test_retry_standby_gives_up_when_the_next_occurrence_is_due_without_writing(consul: Agent, tmp_path: Path) -> None:
    while time.time() % 60 > 40:
        time.sleep(1)
    started = tmp_path / "started"
    minutely = ["run", "--schedule", "*:*:00", "--skip-exit-code", str(SKIP), "--on-holder-loss", "retry", "giveup"]
    holder = consulrun(*minutely, "--", "sh", "-c", f"touch {started}; sleep 120")
    try:
        wait_for(started.exists, 20, "the holder's job")
        to_next = 60 - time.time() % 60

        def indexes() -> tuple[int, int]:  # KV and session writes; the agent's own writes touch neither
            return (int(consul.api("GET", "kv/consulrun/giveup/", params={"recurse": "true"}).headers["X-Consul-Index"]),
                    int(consul.api("GET", "session/list").headers["X-Consul-Index"]))

        before = indexes()
        # The standby's clock says the next occurrence is 3 s away: it stands by that long, then gives up.
        code, _, err = finish(consulrun(*minutely, "--", "true", env=skewed(to_next - 3)), timeout=60)
        assert code == SKIP, err
        assert "is still running on dev1; the next occurrence is due, so this node stops standing by" in err, err
        assert indexes() == before
    finally:
        holder.send_signal(signal.SIGTERM)
        finish(holder)


def test_history_keeps_the_newest_n(consul: Agent) -> None:
    for minutes_ago in (3, 2, 1, 0):
        code, _, err = finish(consulrun("run", "--schedule", "*:*:00", "--history", "2", "pruned", "--", "true",
                                        env=skewed(-60 * minutes_ago)))
        assert code == 0, err
    kept = sorted(history(consul, "pruned"))
    assert len(kept) == 2 and kept == sorted(kept)[-2:]
    record = kv_json(consul, "consulrun/pruned/occurrence")
    assert record["occurrence"] == kept[-1]


def test_history_prunes_occurrences_and_manual_runs_apart_at_most_50_deletes_a_run(consul: Agent) -> None:
    """--history N keeps the newest N occurrences and, counted apart, the newest N manual runs; one run deletes at
    most 50 entries in all, oldest occurrences first (its transaction must stay under Consul's 64 operations), the
    next run goes on."""
    old = [f"2000-01-01T{n // 60:02d}:{n % 60:02d}:00Z" for n in range(60)]
    manual = [f"2000-01-01T00:{n:02d}:30Z" for n in range(3)]
    for name in old:
        consul.api("PUT", f"kv/{kvkeys.history_key('consulrun/prunecap', name)}", data=json.dumps({"occurrence": name}))
    for name in manual:
        consul.api("PUT", f"kv/{kvkeys.history_key('consulrun/prunecap', name, manual=True)}",
                   data=json.dumps({"manual": True, "started": name}))
    manual = [name + kvkeys.MANUAL for name in manual]  # as history() names them
    args = ["run", "--schedule", YEARLY, "--history", "2", "prunecap", "--", "true"]
    code, _, err = finish(consulrun(*args))
    assert code == 0, err
    this = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"
    kept = sorted(history(consul, "prunecap"))
    assert kept == sorted(old[50:] + [this] + manual), kept
    consul.api("DELETE", "kv/consulrun/prunecap/occurrence")  # a later occurrence, as far as the ledger knows
    code, _, err = finish(consulrun(*args))
    assert code == 0, err
    assert sorted(history(consul, "prunecap")) == sorted([old[-1], this] + manual[1:])


def test_several_schedules_with_zones_take_the_latest(consul: Agent, tmp_path: Path) -> None:
    seen = tmp_path / "occ"
    specs = ["*-01-01 00:00:00 UTC", "*-*-* 03:00:00 Asia/Tokyo", "Mon *-*-* 12:00:00 America/New_York"]
    args = [a for spec in specs for a in ("--schedule", spec)]
    code, _, err = finish(consulrun("run", *args, "multi", "--", "sh", "-c", f"echo $CONSULRUN_OCCURRENCE > {seen}"))
    assert code == 0, err
    from consulrun.manifest import calendar

    latest = max(calendar.previous([spec], datetime.now(timezone.utc)) for spec in specs)
    assert seen.read_text().strip() == calendar.occurrence_id(latest)
    acquired = [line for line in err.splitlines() if " acquired " in line]
    assert len(acquired) == 1 and re.fullmatch(
        rf"consulrun: multi: acquired consulrun/multi/lock for occurrence {calendar.occurrence_id(latest)} "
        r"\(node dev1, session [0-9a-f-]{36}, fencing token \d+\)", acquired[0]), err


def test_dead_runner_under_skip_is_marked_abandoned_and_not_rerun(consul: Agent, tmp_path: Path) -> None:
    started, again = tmp_path / "started", tmp_path / "again"
    common = ["run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "abandon"]
    runner = consulrun(*common, "--", "sh", "-c", f"touch {started}; sleep 300")
    wait_for(started.exists, 20, "the first attempt")
    runner.kill()  # no cleanup at all; the next node on this node notices the dead pid
    runner.wait()
    code, _, err = finish(consulrun(*common, "--", "touch", str(again)))
    assert code == SKIP, err
    assert not again.exists()
    record = kv_json(consul, "consulrun/abandon/occurrence")
    assert record["state"] == "abandoned" and "runner" in record["reason"]
    year = datetime.now(timezone.utc).year
    assert history(consul, "abandon")[f"{year}-01-01T00:00:00Z"]["state"] == "abandoned"


def test_a_claim_closes_a_dead_earlier_occurrence_in_the_history_and_records_its_schedule_and_zone(
        consul: Agent, tmp_path: Path) -> None:
    """A record left `running` by a runner that died in last year's occurrence: this year's claim writes last year's
    history entry as abandoned (no gap in the history), and its own record names the schedule and the zone. That
    record is as an older consulrun wrote it, with no zone offsets: a zone-less spec is not refused for it."""
    from consulrun.manifest import calendar
    from consulrun.protocol.occurrence import ABANDONED_REASON

    spec = "*-01-01 00:00:00"  # in the system zone
    when = calendar.previous([spec], datetime.now(timezone.utc))
    year = when.year
    last, this = f"{year - 1}-01-01T00:00:00Z", calendar.occurrence_id(when)
    dead = {"occurrence": last, "state": "running", "node": "gone",
            "session": "5b8f2f83-0000-4000-8000-000000000000", "started": f"{year - 1}-01-01T00:00:01Z",
            "takeover": False, "attempt": 1, "earlier": []}
    assert consul.api("PUT", "kv/consulrun/gap/occurrence", data=json.dumps(dead)).json() is True
    assert consul.get("kv/consulrun/gap/", params={"keys": "true"}) == ["consulrun/gap/occurrence"]  # no history yet
    ran = tmp_path / "ran"
    code, _, err = finish(consulrun("run", "--schedule", spec, "gap", "--", "touch", str(ran)))
    assert code == 0 and ran.exists(), err
    closed = history(consul, "gap")[last]
    assert {k: v for k, v in closed.items() if k not in ("state", "reason", "ended")} == \
        {k: v for k, v in dead.items() if k != "state"}
    assert (closed["state"], closed["reason"]) == ("abandoned", ABANDONED_REASON)
    assert closed["ended"].startswith(str(datetime.now(timezone.utc).year))
    record = kv_json(consul, "consulrun/gap/occurrence")
    assert (record["occurrence"], record["state"], record["attempt"], record["earlier"]) == (this, "done", 1, [])
    assert record["schedule"] == [spec] and record["zone"] == calendar.local_zone_name()
    assert record["zone_offsets"] == calendar.zone_offsets(when)


@pytest.mark.parametrize("second_ended", ["lost", "running"])
def test_a_second_takeover_keeps_every_earlier_attempt(consul: Agent, tmp_path: Path, second_ended: str) -> None:
    """retry: an occurrence already taken over once, whose second attempt was then lost (or whose runner died
    without a word: its record still `running`, its session gone), is taken over again as attempt 3, its record
    keeping both earlier attempts in order, in one flat list (a lost one as it was recorded, with its own
    reason)."""
    from consulrun.protocol.occurrence import ABANDONED_REASON

    year = datetime.now(timezone.utc).year
    this = f"{year}-01-01T00:00:00Z"
    first = {"occurrence": this, "state": "abandoned", "node": "n1", "session": "s1", "attempt": 1, "earlier": [],
             "reason": "its runner's session ended", "ended": f"{year}-01-01T00:00:09Z"}
    second = {"occurrence": this, "state": "lost", "node": "n2", "session": "s2", "takeover": True, "attempt": 2,
              "earlier": [first], "reason": "fenced: the lock was lost", "ended": f"{year}-01-01T00:01:00Z"}
    if second_ended == "running":
        second = {k: v for k, v in second.items() if k not in ("reason", "ended")} | {"state": "running"}
    assert consul.api("PUT", "kv/consulrun/again/occurrence", data=json.dumps(second)).json() is True
    started, go = tmp_path / "started", tmp_path / "go"
    runner = consulrun("run", "--schedule", YEARLY, "--on-holder-loss", "retry", "again", "--", *gated_job(started, go))
    wait_for(started.exists, 20, "the takeover's job to start")
    # The occurrence has no result yet: its history entry is written by the finish, not the takeover's claim.
    assert consul.get("kv/consulrun/again/", params={"keys": "true"}) == ["consulrun/again/lock",
                                                                          "consulrun/again/occurrence"]
    go.touch()
    code, _, err = finish(runner)
    assert code == 0, err
    record = kv_json(consul, "consulrun/again/occurrence")
    assert (record["state"], record["takeover"], record["attempt"]) == ("done", True, 3), record
    # One flat list: the attempt taken over joins it without its own `earlier` (the list itself); nested, a few
    # takeovers made the record deeper than every reader accepts.
    flat = {k: v for k, v in second.items() if k != "earlier"}
    if second_ended == "lost":
        assert record["earlier"] == [first, flat]
    else:
        assert record["earlier"][0] == first and record["earlier"][1]["ended"].startswith(str(year))
        assert record["earlier"][1] == flat | {"state": "abandoned", "reason": ABANDONED_REASON,
                                               "ended": record["earlier"][1]["ended"]}


def _ranked(key: str, names: list[str], servers: tuple[str, ...] = ("node1",)) -> list[str]:
    """`names` in turn order for `key` as a client sees it (the cluster fixture's node1 is a server)."""
    from consulrun.protocol import turns

    return turns.order(key, [(name, name in servers) for name in names])


def _yearly(job: str) -> str:
    return f"consulrun/{job}\n{datetime.now(timezone.utc).year}-01-01T00:00:00Z"


def test_turns_are_one_order_per_occurrence_spread_evenly_and_a_leaver_moves_only_its_share() -> None:
    from consulrun.protocol.turns import RANK_STEP_S, TURN_MAX_S, order, turn_at_most_s, wait_s

    # docs/guarantees.md: steps of 2 s, at most 3 of them, at most a tenth of the time left before the next occurrence
    assert (RANK_STEP_S, TURN_MAX_S, turn_at_most_s(None), turn_at_most_s(30), turn_at_most_s(-1)) == (2, 6, 6, 3, 0)
    assert [wait_s(place, None) for place in range(5)] == [0, 2, 4, 6, 6] and wait_s(2, 25) == 2.5

    nodes = [(f"node{i}", False) for i in range(1, 4)]
    keys = [f"consulrun/job{j}\n2026-11-30T{h:02d}:00:00Z" for j in range(10) for h in range(10)]
    first = {key: order(key, nodes)[0] for key in keys}
    assert all(sorted(order(key, nodes)) == ["node1", "node2", "node3"] for key in keys)
    assert all(order(key, list(reversed(nodes))) == order(key, nodes) for key in keys)  # each node's list order
    share = {n: sum(1 for winner in first.values() if winner == n) for n, _ in nodes}
    assert all(22 <= count <= 45 for count in share.values()), share  # 100 occurrences: a third each, give or take
    for key, winner in first.items():  # node3 leaves: who was first stays first; node3's share goes to the others
        assert order(key, nodes[:2])[0] == winner or winner == "node3", key
    servers = [("server1", True), ("server2", True)]
    for key in keys:  # each kind puts its own first, in the order it alone would have
        assert order(key, nodes + servers) == order(key, nodes) + order(key, servers, server=True)
        assert order(key, nodes + servers, server=True) == order(key, servers, server=True) + order(key, nodes)


@pytest.mark.cluster
def test_nodes_firing_together_leave_the_occurrence_to_the_first_ranked(cluster: Cluster, tmp_path: Path) -> None:
    """The first-ranked client claims; the other waits on the record with no session and skips on its claim; a
    node ranked first that does not run the job costs the next one step; a turn ends at a signal, and is at most a
    tenth of the time left; a dead node drops out of the order."""
    env = {"CONSUL_HTTP_ADDR": "127.0.0.1:8500"}
    agents = {a.name: a for a in cluster.agents}

    def start(node: str, job: str, log: Path, *extra: str, schedule: str = YEARLY,
              hook_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """consulrun on `node`, its log in a file the test can read while it runs."""
        with log.open("w") as err:
            return consulrun("run", "--schedule", schedule, "--skip-exit-code", str(SKIP), *extra, job, "--", "sh",
                             "-c", f"echo {node} >> {tmp_path / job}", env={**env, **(hook_env or {})},
                             netns=agents[node].netns, stdout=subprocess.DEVNULL, stderr=err)

    # Together: the client ranked second is waiting (no session anywhere) when the first starts. The harness's
    # fast gossip can take a member for failed for a moment on a loaded machine; a node that then cannot see
    # every member claims at once (as it must), which is no test of the turns: such a try is made again.
    for job in ("together", "together-2", "together-3"):
        wait_for(lambda: all(sum(m["Status"] == 1 for m in a.get("agent/members")) == len(agents)
                             for a in agents.values()), 90, "every member alive in every agent's view")
        first, second, last = _ranked(_yearly(job), list(agents))
        assert last == "node1"  # a server, after the clients
        logs = {n: tmp_path / f"{job}-{n}.log" for n in (first, second)}
        waiting = start(second, job, logs[second])
        wait_for(lambda: "leaving it to the nodes before it" in logs[second].read_text()
                 or "cannot see every member" in logs[second].read_text(), 30, f"{second} to wait")
        if "cannot see every member" not in logs[second].read_text():
            break
        waiting.wait(timeout=60)
    assert cluster.server.get("session/list") == []
    assert start(first, job, logs[first]).wait(timeout=60) == 0, logs[first].read_text()
    assert waiting.wait(timeout=60) == SKIP, logs[second].read_text()
    assert f"was claimed by {first}" in logs[second].read_text() and "lost the race" not in logs[second].read_text()
    assert (tmp_path / job).read_text().split() == [first]
    assert "ranked" not in logs[first].read_text()

    # A termination signal during the turn ends the run at once: 143, no session, nothing run.
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    second = _ranked(_yearly("stopped"), list(agents))[1]
    log = tmp_path / "stopped.log"
    proc = start(second, "stopped", log,
                 hook_env={"CONSULRUN_TEST_PAUSE": "turn", "CONSULRUN_TEST_HOOK_DIR": str(hooks)})
    wait_for((hooks / "turn").exists, 30, f"{second} to take its turn")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 143, log.read_text()
    assert cluster.server.get("session/list") == [] and not (tmp_path / "stopped").exists()

    # The first-ranked node does not run this job: the second claims after its step, alone.
    first, second, _ = _ranked(_yearly("elsewhere"), list(agents))
    log = tmp_path / "elsewhere.log"
    assert start(second, "elsewhere", log).wait(timeout=60) == 0, log.read_text()
    assert "ranked 2 of 3" in log.read_text() and "for up to 2s" in log.read_text(), log.read_text()
    assert (tmp_path / "elsewhere").read_text().split() == [second]

    # A dense schedule: the turn is at most a tenth of the time left before the next occurrence (here under 1 s).
    from consulrun.manifest import calendar

    while time.time() % 10 > 6:  # the occurrence must not change between the order computed here and the run
        time.sleep(0.2)
    occurrence_id = calendar.occurrence_id(calendar.previous(["*:*:0/10"], datetime.now(timezone.utc)))
    second = _ranked(f"consulrun/dense\n{occurrence_id}", list(agents))[1]
    log = tmp_path / "dense.log"
    assert start(second, "dense", log, schedule="*:*:0/10").wait(timeout=60) == 0, log.read_text()
    # Written as systemd and Consul write durations (milliseconds below a second), never `0.94226s`.
    said = re.search(r"ranked 2 of 3 for it; leaving it to the nodes before it for up to ([0-9]+)(ms|s)$", log.read_text(),
                     re.M)
    assert said and (said.group(2) == "ms" or said.group(1) == "1"), log.read_text()

    # A dead node drops out: the client ranked first is killed; the other goes first, without waiting.
    dead, heir = _ranked(_yearly("dead"), list(agents))[:2]
    agents[dead].kill()
    for name, agent in agents.items():
        if name != dead:
            wait_for(lambda a=agent: all(m["Status"] != 1 for m in a.get("agent/members") if m["Name"] == dead), 60,
                     f"{name} to see {dead} dead")
    log = tmp_path / "dead.log"
    assert start(heir, "dead", log).wait(timeout=60) == 0, log.read_text()
    assert "ranked" not in log.read_text()
    assert (tmp_path / "dead").read_text().split() == [heir]


@pytest.mark.parametrize("members", ["answered", "refused"])
def test_the_first_in_turn_and_a_node_that_cannot_list_the_members_claim_without_waiting(
        consul: Agent, tmp_path: Path, members: str) -> None:
    """One node (first in every order), or a member list Consul cannot give: the run claims at once, with no
    blocking read of the record, and runs."""
    from tests.harness.faultproxy import FaultProxy

    ran = tmp_path / "ran"
    with FaultProxy(consul.http_addr) as proxy:
        listed = proxy.fail("GET", "/v1/agent/members", "refuse" if members == "refused" else "forward")
        blocks = proxy.fail("GET", "/occurrence?index=", "forward", times=100)
        code, _, err = finish(consulrun("run", "--schedule", YEARLY, f"first-{members}", "--", "touch", str(ran),
                                        env={"CONSUL_HTTP_ADDR": proxy.address}))
    assert code == 0 and ran.exists(), err
    assert len(listed.hits) == 1 and blocks.hits == [], (listed.hits, blocks.hits)
    assert "ranked" not in err and "cannot see every member" not in err, err


def test_a_new_occurrence_waits_for_the_previous_run_only_up_to_wait(consul: Agent, tmp_path: Path) -> None:
    """The previous occurrence's run still holds the lock: the next occurrence waits `--wait` for it (occurrences
    never overlap), then skips, saying who holds it. A mutant that read --wait in other units waited for ever."""
    started, ran = tmp_path / "started", tmp_path / "ran"
    holder = consulrun("run", "--schedule", YEARLY, "overlap", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the previous occurrence's run")
        daily = consulrun("run", "--schedule", "*-*-* 00:00:00 UTC", "--wait", "2s", "--skip-exit-code", str(SKIP),
                          "overlap", "--", "touch", str(ran))
        code, _, err = finish(daily, timeout=30)
        assert code == SKIP, err
        assert "the previous run still holds the lock" in err and not ran.exists(), err
    finally:
        holder.send_signal(signal.SIGTERM)
        finish(holder)
