"""Occurrences never silently gone (issue #31, items 4 and 6), against a real Consul agent.

Item 4: after a lock is broken, lock-delay refuses the next occurrence's
claim; it is waited out within the occurrence's bound, or the occurrence is
recorded missed, and `status`, `history` and the exporter say so. Item 6: a
node whose clock is ahead claims occurrences before they are due; the nodes
that see its times in their future say so, and so do `status` and the
exporter. Clocks are skewed with libfaketime, as in test_occurrence.
"""

from __future__ import annotations

import base64
import json
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
    history,
    kv_json,
    skip_writes as _skip_writes,
)

pytestmark = pytest.mark.consul

EVERY_10S = "*:*:0/10"


def _at_second(low: float, high: float) -> float:
    """Wait until the wall clock's position in its 10 s cycle is in [low, high); return the cycle's start."""
    while not low <= time.time() % 10 < high:
        time.sleep(0.05)
    return time.time() // 10 * 10


def _occ(when: float) -> str:
    return datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()))


def _break_a_lock(job: str, lock_delay: str, at: float, tmp_path: Path) -> float:
    """A holder of this cycle's occurrence whose lock is broken `at` to `at` + 1.5 s into the cycle
    (`unlock --yes --force`); returns the start of the next cycle, whose occurrence lock-delay then refuses to
    everyone for a while."""
    started = tmp_path / "started"
    cycle = _at_second(0.3, 2.0)
    holder = consulrun("run", "--schedule", EVERY_10S, "--lock-delay", lock_delay, job, "--", "sh", "-c",
                       f"touch {started}; sleep 60")
    wait_for(started.exists, 5, "the holder's job")
    _until(cycle + at)
    code, _, err = finish(consulrun("unlock", "--yes", "--force", job))
    assert code == 0, err
    assert finish(holder)[0] == 75
    assert cycle + at <= time.time() < cycle + at + 1.5, "the machine is too slow for this test's timing"
    return cycle + 10


def _status(*args: str) -> tuple[int, dict]:
    code, out, err = finish(consulrun("status", "--json", *args))
    return code, json.loads(out)


def test_an_occurrence_lock_delay_refuses_is_waited_for_within_its_bound(consul: Agent, tmp_path: Path) -> None:
    """Lock-delay 10 s, broken 3-4.5 s into a 10 s cycle: the next occurrence is refused until 3-4.5 s into its
    own cycle; the node (lock-delay 15 s, the default: tried every 15/8 s) waits it out and runs it (before:
    `skipped: could not claim occurrence`)."""
    seen = tmp_path / "seen"
    next_cycle = _break_a_lock("waits", "10s", 3.0, tmp_path)
    _until(next_cycle + 0.3)
    code, _, err = finish(consulrun("run", "--schedule", EVERY_10S, "--skip-exit-code",
                                    str(SKIP), "waits", "--", "sh", "-c", f"echo $CONSULRUN_OCCURRENCE > {seen}"),
                          timeout=30)
    assert code == 0, err
    assert seen.read_text().strip() == _occ(next_cycle)
    assert "lock-delay" in err and "refuses it; trying again when it ends" in err, err
    assert kv_json(consul, "consulrun/waits/occurrence")["state"] == "done"


def test_an_occurrence_lock_delay_keeps_from_everyone_is_recorded_missed_and_reported(
        consul: Agent, tmp_path: Path) -> None:
    """Lock-delay 15 s (the default), broken 6.5-8 s into a 10 s cycle: the next occurrence cannot be claimed
    before the one after is due (a second before it, the last claim it tries). It is recorded missed (one write,
    the node's skip line says lock-delay), and `status`, `history` and the exporter report it, also once the next
    occurrence has run (before: a silent gap, status 0)."""
    ran = tmp_path / "ran"
    next_cycle = _break_a_lock("gap", "15s", 6.5, tmp_path)
    _until(next_cycle + 0.3)
    args = ["run", "--schedule", EVERY_10S, "--skip-exit-code", str(SKIP), "gap", "--", "sh", "-c",
            f"echo $CONSULRUN_OCCURRENCE >> {ran}"]
    code, _, err = finish(consulrun(*args), timeout=30)
    assert code == SKIP, err
    assert f"skipped: could not claim occurrence {_occ(next_cycle)}: lock-delay" in err, err
    assert "recorded it missed" in err, err
    entry = history(consul, "gap")[_occ(next_cycle)]
    assert entry["state"] == "missed" and "lock-delay" in entry["reason"] and entry["node"] is None
    code, report = _status()
    assert code == 3, report
    problems = report["jobs"][0]["problems"]
    assert [p["occurrence"] for p in problems if p["kind"] == "missed"] == [_occ(next_cycle)], problems

    # The occurrence after it runs (lock-delay ends 1.5-3 s into its cycle: waited for); the miss stays reported.
    assert time.time() < next_cycle + 10, "the miss was recorded after the next occurrence was due"
    _until(next_cycle + 10.3)
    code, _, err = finish(consulrun(*args), timeout=30)
    assert code == 0, err
    assert ran.read_text().split() == [_occ(next_cycle + 10)]
    code, report = _status()
    assert code == 3, report
    assert any(p["kind"] == "missed" and p["occurrence"] == _occ(next_cycle) for p in report["jobs"][0]["problems"])
    code, out, err = finish(consulrun("history", "gap"))
    assert code == 0, err
    line = next(row for row in out.splitlines() if row.startswith(_occ(next_cycle)))
    assert "missed" in line and "lock-delay" in line, out

    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.report.metrics import ClusterMetrics, exposition

    metrics = ClusterMetrics("consulrun", None)
    metrics.refresh(Client(ConsulConfig(address=consul.http_addr)))
    text = exposition(metrics).decode()
    assert 'consulrun_job_runs_total{job_name="gap",outcome="missed"} 1.0' in text, text
    assert 'consulrun_job_state{job_name="gap",state="missed"} 1.0' in text, text


def test_a_node_whose_clock_is_ahead_by_more_than_an_interval_is_reported_with_the_skew(
        consul: Agent, tmp_path: Path) -> None:
    """A node 12 s ahead on a 10 s job claims the next occurrence 12 s early; a node with the right clock skips
    saying whose clock is ahead and by how much, and `status` and the exporter report the skew (before: the
    skip said only `a later occurrence ... is already claimed`, status exited 0)."""
    cycle = _at_second(0.5, 2.5)
    args = ["run", "--schedule", EVERY_10S, "--skip-exit-code", str(SKIP), "ahead", "--", "true"]
    code, _, err = finish(consulrun(*args, env=skewed(12)))
    assert code == 0, err
    assert f"for occurrence {_occ(cycle + 10)}" in err, err  # due 10 s from now by the cluster's clocks
    code, _, err = finish(consulrun(*args))
    assert code == SKIP, err
    assert f"a later occurrence ({_occ(cycle + 10)}) is already claimed" in err, err
    assert "dev1's clock is at least" in err and "ahead of this node's" in err, err
    code, report = _status()
    assert code == 3, report
    skew = [p for p in report["jobs"][0]["problems"] if p["kind"] == "skew"]
    assert len(skew) == 1 and skew[0]["node"] == "dev1" and skew[0]["ahead_s"] > 2, skew
    assert skew[0]["occurrence"] == _occ(cycle + 10)

    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.report.metrics import ClusterMetrics, exposition

    metrics = ClusterMetrics("consulrun", None)
    metrics.refresh(Client(ConsulConfig(address=consul.http_addr)))
    text = exposition(metrics).decode()
    assert 'consulrun_job_state{job_name="ahead",state="skew"} 1.0' in text, text
    assert 'consulrun_job_clock_ahead_seconds{job_name="ahead",node="dev1"}' in text, text

    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(f"health_checks: true\njobs:\n  ahead: {{command: 'true', schedule: '{EVERY_10S}'}}\n")
    code, _, err = finish(consulrun("watchdog", str(manifest)))
    assert code == 0, err
    check = next(c for c in consul.get("health/node/consulrun") if c["CheckID"] == "job:ahead")
    assert check["Status"] == "critical" and "skew: dev1's clock is ahead of another node's" in check["Output"], check


def test_the_skip_paths_of_a_recorded_miss_and_of_a_skewed_record_make_no_writes(consul: Agent, tmp_path: Path) -> None:
    """Nothing was lost by a node that finds the miss already recorded: it skips on reads alone."""
    cycle = _at_second(0.5, 4.0)
    occ = _occ(cycle)
    consul.api("PUT", "kv/consulrun/quiet/occurrence", data=json.dumps(
        {"occurrence": occ, "state": "missed", "node": None, "recorded_by": "dev1", "reason": "a test's miss"}))
    deltas, errs = _skip_writes(consul, ["run", "--schedule", EVERY_10S, "--skip-exit-code", str(SKIP), "quiet",
                                         "--", "true"])
    assert min(deltas) == 0 and all(f"occurrence {occ} was recorded missed: a test's miss" in e for e in errs), \
        (deltas, errs)


@pytest.mark.cluster
def test_a_node_two_others_found_ahead_claims_only_what_is_due_by_the_cluster_clock(
        cluster: Cluster, tmp_path: Path) -> None:
    """node3 12 s ahead claims the next occurrence early; node1 and node2 each record that its clock is ahead
    (one write each); from then on node3 refuses an occurrence not yet due by the cluster's clock and claims the
    one that is, under its right name (before: it ran every occurrence ~10 s early under the next one's name).
    One node's finding alone changes nothing: that node's own clock may be the wrong one."""
    node1, (node2, node3) = cluster.server, cluster.clients
    env, ahead = {"CONSUL_HTTP_ADDR": "127.0.0.1:8500"}, {"CONSUL_HTTP_ADDR": "127.0.0.1:8500", **skewed(12)}
    seen = tmp_path / "seen"
    args = ["run", "--schedule", EVERY_10S, "--skip-exit-code", str(SKIP), "refuse", "--", "sh", "-c",
            f"echo $CONSULRUN_OCCURRENCE >> {seen}"]
    cycle = _at_second(0.3, 1.0)
    code, _, err = finish(consulrun(*args, env=ahead, netns=node3.netns))
    assert code == 0, err
    assert seen.read_text().split() == [_occ(cycle + 10)]  # 10 s before it is due
    code, _, err = finish(consulrun(*args, env=env, netns=node1.netns))
    assert code == SKIP and "node3's clock is at least" in err, err
    code, _, err = finish(consulrun(*args, env=ahead, netns=node3.netns))
    assert code == SKIP and "not due yet by the cluster's clock" not in err, err  # one finding: nothing changes
    code, _, err = finish(consulrun(*args, env=env, netns=node2.netns))
    assert code == SKIP and "node3's clock is at least" in err, err
    found = {e["Key"]: e for e in node1.get("kv/consulrun/refuse/clock/", params={"recurse": "true"})}
    assert sorted(found) == ["consulrun/refuse/clock/node3/node1", "consulrun/refuse/clock/node3/node2"], found
    code, _, err = finish(consulrun(*args, env=env, netns=node2.netns))  # a finding already fresh: no new write
    assert code == SKIP, err
    again = {e["Key"]: e["ModifyIndex"] for e in node1.get("kv/consulrun/refuse/clock/", params={"recurse": "true"})}
    assert again == {k: e["ModifyIndex"] for k, e in found.items()}

    assert time.time() < cycle + 7.5, "the machine is too slow for this test's timing"  # node3's clock: < +20
    code, _, err = finish(consulrun(*args, env=ahead, netns=node3.netns))
    assert code == SKIP, err
    assert f"occurrence {_occ(cycle + 10)} is not due yet by the cluster's clock" in err, err
    _until(cycle + 20.3)
    code, _, err = finish(consulrun(*args, env=ahead, netns=node3.netns))
    assert code == 0, err
    assert seen.read_text().split() == [_occ(cycle + 10), _occ(cycle + 20)]  # not cycle + 30, as its clock says


@pytest.mark.cluster
def test_after_the_holders_agent_stops_the_next_occurrence_is_run_or_recorded_missed(
        cluster: Cluster, tmp_path: Path) -> None:
    """The issue's second way to break a lock: the holder's agent stops (its session is invalidated when
    serfHealth goes critical, lock-delay 15 s). The next occurrence is waited for within its bound, or, if
    lock-delay outlasts that, recorded missed: never `could not claim` and nothing else."""
    node2, node3 = cluster.clients
    env = {"CONSUL_HTTP_ADDR": "127.0.0.1:8500"}
    started, seen = tmp_path / "started", tmp_path / "seen"
    common = ["run", "--schedule", EVERY_10S, "--skip-exit-code", str(SKIP), "agentgone"]
    cycle = _at_second(0.3, 1.5)
    holder = consulrun(*common, "--", "sh", "-c", f"touch {started}; sleep 60", env=env, netns=node2.netns)
    wait_for(started.exists, 5, "the holder's job")
    node2.kill()
    _until(cycle + 10.3)
    code, _, err = finish(consulrun(*common, "--", "sh", "-c", f"echo $CONSULRUN_OCCURRENCE > {seen}", env=env,
                                    netns=node3.netns), timeout=30)
    assert finish(holder, timeout=90)[0] == 75  # fenced: its agent is gone
    assert "lock-delay" in err, err
    if code == 0:
        assert seen.read_text().strip() == _occ(cycle + 10)
    else:
        assert code == SKIP and "recorded it missed" in err, err
        assert history(cluster.server, "agentgone")[_occ(cycle + 10)]["state"] == "missed"


def test_a_late_write_about_the_previous_occurrence_does_not_keep_a_miss_from_being_recorded(consul: Agent) -> None:
    """The red team forced it: between the look and the miss's check-and-set, the previous holder recorded its
    occurrence `lost` (it retries that write for 30 s); the check-and-set failed, nothing retried it, and the skip
    line said another node had recorded or claimed it: the occurrence was gone without a word."""
    from consulrun.consul.client import Client, ConsulConfig, kv_op
    from consulrun.protocol import occurrence
    from consulrun.protocol.lock import Locker, LockSpec

    client = Client(ConsulConfig(address=consul.http_addr))
    spec = LockSpec(job="latewrite")
    ledger = occurrence.Ledger(client, spec.base, 20)
    previous, due = "2026-12-01T10:00:00Z", "2026-12-01T10:00:10Z"
    running = {"occurrence": previous, "state": "running", "node": "gone", "session": "s1",
               "started": "2026-12-01T10:00:00Z"}
    assert client.txn([kv_op("set", ledger.record_key, running)]) is not None
    stale = ledger.snapshot(consistent=True)
    late = {**running, "state": "lost", "reason": "fenced"}  # as the fenced runner writes it: record and history
    assert client.txn([kv_op("set", ledger.record_key, late), kv_op("set", ledger.history_key(previous), late)])
    occ = occurrence.Occurrence(id=due, when=datetime(2026, 12, 1, 10, 0, 10, tzinfo=timezone.utc),
                                specs=("*:*:0/10",), next_when=None)
    said = occurrence._record_missed(Locker(client, spec), ledger, occ, stale)
    assert said.endswith("; recorded it missed"), said
    record = kv_json(consul, "consulrun/latewrite/occurrence")
    assert (record["occurrence"], record["state"]) == (due, "missed"), record
    late_entry = kv_json(consul, kvkeys.history_key("consulrun/latewrite", previous))
    assert late_entry["state"] == "lost"  # the late write stands too


def _two_hours_ago() -> str:
    """A daily spec whose latest occurrence was 2h to 2h59m ago, whenever the test runs."""
    hour = (datetime.now(timezone.utc).hour - 2) % 24
    return f"*-*-* {hour:02d}:00:00 UTC"


def test_an_occurrence_past_its_start_deadline_is_recorded_missed_not_run(consul: Agent, tmp_path: Path) -> None:
    """#29's start_deadline (Kubernetes' startingDeadlineSeconds): a catch-up long after its time is not run."""
    spec, ran = _two_hours_ago(), tmp_path / "ran"
    code, _, err = finish(consulrun("run", "--schedule", spec, "--start-deadline", "1h", "--skip-exit-code",
                                    str(SKIP), "latecomer", "--", "touch", str(ran)))
    assert code == SKIP and not ran.exists(), err
    assert "not started within its start_deadline (1h after its time); it would have started 2h" in err, err
    assert err.rstrip().endswith("; recorded it missed"), err
    record = kv_json(consul, "consulrun/latecomer/occurrence")
    assert (record["state"], record["node"], record["recorded_by"]) == ("missed", None, "dev1"), record
    code, data = _status("latecomer")
    assert code == 3 and [p["kind"] for p in data["jobs"][0]["problems"]] == ["missed"], data
    assert [r["state"] for r in history(consul, "latecomer").values()] == ["missed"]
    # A second node, or the same one again, skips on reads alone.
    code, _, err = finish(consulrun("run", "--schedule", spec, "--start-deadline", "1h", "latecomer", "--",
                                    "touch", str(ran)))
    assert code == 0 and "was recorded missed: not started within its start_deadline" in err and not ran.exists()


def test_an_occurrence_within_its_start_deadline_runs(consul: Agent, tmp_path: Path) -> None:
    spec, ran = _two_hours_ago(), tmp_path / "ran"
    code, _, err = finish(consulrun("run", "--schedule", spec, "--start-deadline", "3h", "intime", "--",
                                    "touch", str(ran)))
    assert code == 0 and ran.exists(), err
    code, _, err = finish(consulrun("run", "--start-deadline", "3h", "plain", "--", "true"))
    assert code == 2 and "--start-deadline is about a scheduled occurrence: it needs --schedule" in err, err


def test_a_lead_past_the_tolerance_never_reads_as_within_it() -> None:
    """A lead of 2.04 s is past the 2 s tolerance (ahead_of_us reports it); recorded and shown as 2.0 it read as
    within it (a booted test saw `ahead_s: 2.0` for a node found ahead). Rounded up to 0.1 s; "at least" in the
    line rounds down."""
    from datetime import timedelta

    from consulrun.protocol import clockskew

    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    for lead, shown in ((2.04, 2.1), (2.1, 2.1), (2.15, 2.2), (12.0, 12.0), (11.99, 12.0)):
        record = {"node": "node3", "occurrence": "2030-01-01T00:00:00Z",
                  "started": (now + timedelta(seconds=lead)).isoformat()}
        measured = clockskew.ahead_of_us(record, now)
        assert measured is not None and abs(measured - lead) < 1e-6, (lead, measured)
        assert clockskew.reported(measured) == shown > clockskew.SKEW_TOLERANCE_S
        ops = clockskew.finding_ops({}, "p/j", record, measured, "node1", now)
        assert json.loads(base64.b64decode(ops[0]["KV"]["Value"]))["ahead_s"] == shown, ops
        assert f"at least {int(lead)}s ahead" in clockskew.note(record, measured)
    assert clockskew.ahead_of_us({"node": "node3", "started": (now + timedelta(seconds=2.0)).isoformat()}, now) is None
