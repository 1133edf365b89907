"""The chaos suite: its checker judges histories correctly, and a short run under faults keeps the guarantees.

The short run uses the schedules where docs/guarantees.md's condition for `retry` holds
(bench.chaos.run.condition_holds); docs/chaos.md has a long run and a denser
schedule. On failure the run's history, nemesis log, wrapper and agent logs
and report are kept in test-artifacts/.
"""

from __future__ import annotations

import argparse

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos.checker import check
from bench.chaos.logs import read
from tests.conftest import artifact_dir, require_tool
from tests.harness.agents import wait_for
from tests.harness.chaos import (
    OCC,
    T0,
    fire_lines as _fires,
    kept_on_failure,
    our_namespaces as _our_namespaces,
    processes_mentioning as _processes_mentioning,
    run_chaos,
    run_lines as _run,
    write_and_check as _write,
)

REPO = Path(__file__).resolve().parents[1]


def _probes(down_from: float, down_to: float, nodes: tuple[str, ...] = ("c1", "c2", "c3")) -> list[dict]:
    """probes.log: every client served from T0 - 1; `nodes` not served from `down_from` until `down_to`."""
    lines = [{"t": T0 - 1, "ev": "probe", "node": n, "served": True, "why": "404"} for n in ("c1", "c2", "c3")]
    lines += [{"t": down_from, "ev": "probe", "node": n, "served": False, "why": "500 No cluster leader"}
              for n in nodes]
    lines += [{"t": down_to, "ev": "probe", "node": n, "served": True, "why": "404"} for n in nodes]
    return sorted(lines, key=lambda line: line["t"])


def test_checker_passes_a_clean_history(tmp_path: Path) -> None:
    history = [*_fires("s", 0), *_fires("r", 0), *_run("s", "c1", 100, OCC[0], 10, T0 + 0.5, 10),
               *_run("r", "c2", 200, OCC[0], 11, T0 + 0.6, 10)]
    report = _write(tmp_path, history, [])
    assert report["violations"] == []
    assert report["jobs"]["s"]["completed"] == 1
    assert report["raft_writes_per_occurrence"] == 15.0


def test_checker_finds_an_overlap_and_a_duplicate_under_skip(tmp_path: Path) -> None:
    history = [*_fires("s", 0), *_run("s", "c1", 100, OCC[0], 10, T0 + 0.5, 10),
               *_run("s", "c2", 200, OCC[0], 12, T0 + 1.0, 10)]
    history.sort(key=lambda line: line["t"])
    nemesis = [{"t": T0 + 0.7, "ev": "fault", "id": 1, "kind": "partition-client", "node": "c1"},
               {"t": T0 + 3, "ev": "heal", "id": 1, "kind": "partition-client", "recovered": T0 + 4}]
    report = _write(tmp_path, history, nemesis)
    kinds = sorted(v["kind"] for v in report["violations"])
    assert kinds == ["duplicate under skip", "overlap"]
    overlap = report["jobs"]["s"]["overlaps"][0]
    assert overlap["faults"] == ["partition-client@c1#1"]
    assert 0.4 < overlap["seconds"] < 0.6
    assert overlap["stale_writes"] == overlap["stale_writes_rejected_by_token"] > 0


def test_checker_counts_pause_overlaps_apart(tmp_path: Path) -> None:
    stale = _run("s", "c1", 100, OCC[0], 10, T0 + 0.5, 60, ended=False)
    fresh = _run("s", "c2", 200, OCC[1], 14, T0 + 5.5, 10)
    history = sorted([*_fires("s", 0), *_fires("s", 1), *stale, *fresh], key=lambda line: line["t"])
    nemesis = [{"t": T0 + 0.55, "ev": "fault", "id": 1, "kind": "pause", "node": "c1", "pids": [100, 99]},
               {"t": T0 + 6, "ev": "heal", "id": 1, "kind": "pause", "healed": T0 + 6, "recovered": T0 + 6}]
    report = _write(tmp_path, history, nemesis)
    assert report["violations"] == []
    job = report["jobs"]["s"]
    assert len(job["pause_overlaps"]) == 1 and job["overlaps"] == []
    assert job["pause_overlaps_all_rejected_by_token"] is True
    assert job["fenced_after_pause_s"]["n"] == 1


def test_checker_finds_a_lost_occurrence_under_retry_only_where_the_condition_holds(tmp_path: Path) -> None:
    killed = _run("r", "c1", 100, OCC[0], 10, T0 + 0.5, 5, ended=False)
    history = sorted([*_fires("r", 0), *killed], key=lambda line: line["t"])
    nemesis = [{"t": T0 + 1.05, "ev": "fault", "id": 1, "kind": "wrapper-kill", "node": "c1", "wrapper": 99},
               {"t": T0 + 1.05, "ev": "heal", "id": 1, "kind": "wrapper-kill", "recovered": T0 + 1.1}]
    report = _write(tmp_path / "holds", history, nemesis)
    assert [v["kind"] for v in report["violations"]] == ["lost under retry"]
    assert report["violations"][0]["healthy_nodes"] == ["c2", "c3"]
    assert report["jobs"]["r"]["fencing_latency_s"]["wrapper-kill"]["n"] == 1
    dense = _write(tmp_path / "dense", history, nemesis, retry_condition=False)
    assert dense["violations"] == []
    assert len(dense["jobs"]["r"]["lost_with_healthy_node"]) == 1


def test_a_retry_occurrence_lost_while_consul_served_no_client_past_the_start_budget_is_counted_apart(
        tmp_path: Path) -> None:
    """The guarantee is at least once while a node can reach Consul: the availability probe's spans tell an
    unavailable cluster from a node that could have run it; shorter or partial spans are still violations."""
    from bench.chaos.report import totals

    exits = [{"t": T0 + 3.5, "ev": "exit", "node": n, "job": "r", "sched": OCC[0], "status": 69, "ran": 3.3}
             for n in ("c1", "c2", "c3")]
    history = sorted([*_fires("r", 0), *exits], key=lambda line: line["t"])

    # The wrappers' start budget for a 5 s interval is 2.5 s.
    unavailable = _write(tmp_path / "all", history, [], probes=_probes(T0 + 0.2, T0 + 4.2))
    assert unavailable["violations"] == []
    job = unavailable["jobs"]["r"]
    assert job["lost_with_healthy_node"] == []
    assert [item["occurrence"] for item in job["lost_while_no_client_served"]] == [OCC[0]]
    assert job["lost_while_no_client_served"][0]["no_client_served_s"] >= 3.5
    row = next(line for line in totals(unavailable) if line.startswith("| retry |"))
    assert "| 0 (+1 while Consul served no client) |" in row
    for name, nodes, down_s in (("short", ("c1", "c2", "c3"), 1.0), ("partial", ("c1", "c2"), 4.0),
                                ("unprobed", (), 0.0)):
        probes = _probes(T0 + 0.2, T0 + 0.2 + down_s, nodes) if nodes else None
        report = _write(tmp_path / name, history, [], probes=probes)
        assert [v["kind"] for v in report["violations"]] == ["lost under retry"], name
        assert report["jobs"]["r"]["lost_while_no_client_served"] == [], name


def test_an_outage_after_every_wrapper_gave_up_does_not_excuse_a_lost_retry_occurrence(tmp_path: Path) -> None:
    """Every wrapper fired at T0 and exited 0 at T0 + 0.3 having run nothing (a consulrun bug: Consul served
    every client then); Consul then served no client from T0 + 3 to T0 + 5, after every wrapper's start budget
    (2.5 s for a 5 s interval) had ended. The outage cannot have lost the occurrence: it is a violation."""
    exits = [{"t": T0 + 0.3, "ev": "exit", "node": n, "job": "r", "sched": OCC[0], "status": 0}
             for n in ("c1", "c2", "c3")]
    history = sorted([*_fires("r", 0), *exits], key=lambda line: line["t"])
    report = _write(tmp_path, history, [], probes=_probes(T0 + 3.0, T0 + 5.0))
    assert report["jobs"]["r"]["lost_while_no_client_served"] == [], report["jobs"]["r"]
    assert [v["kind"] for v in report["violations"]] == ["lost under retry"]


def test_the_totals_count_retry_jobs_apart_where_their_condition_does_not_hold(tmp_path: Path) -> None:
    """The evidence run's counts per policy: a lost occurrence of a dense job must not hide in the claimed row."""
    from bench.chaos.report import totals

    killed = _run("r", "c1", 100, OCC[0], 10, T0 + 0.5, 5, ended=False)
    history = sorted([*_fires("r", 0), *_fires("s", 1), *killed, *_run("s", "c2", 200, OCC[1], 11, T0 + 5.2, 3)],
                     key=lambda line: line["t"])
    nemesis = [{"t": T0 + 1.05, "ev": "fault", "id": 1, "kind": "wrapper-kill", "node": "c1", "wrapper": 99},
               {"t": T0 + 1.05, "ev": "heal", "id": 1, "kind": "wrapper-kill", "recovered": T0 + 1.1}]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in totals(
        _write(tmp_path / "dense", history, nemesis, retry_condition=False))[2:]}
    assert set(rows) == {"skip", "retry (condition does not hold)"}
    assert rows["retry (condition does not hold)"][5] == "1"  # lost with a healthy node, counted apart
    assert rows["skip"][1:5] == ["1", str(_write(tmp_path / "d2", history, nemesis)["jobs"]["s"]["occurrences"]),
                                 "0", "0"]
    claimed = {line.split(" | ")[0].lstrip("| ") for line in totals(_write(tmp_path / "holds", history, nemesis))[2:]}
    assert claimed == {"skip", "retry"}


def test_a_retries_job_is_described_as_policy_plus_attempts_and_runs_with_them() -> None:
    from bench.chaos.run import parse_job
    from bench.chaos.timers import FAIL_RATE, Fleet, LockSettings

    job = parse_job("flaky:skip+a3:1:*:*:0/15")
    assert (job.policy, job.attempts, job.schedule) == ("skip", 3, "*:*:0/15")
    assert parse_job("plain:retry:1:*:*:0/30").attempts == 1
    for bad in ("x:skip+3:1:*:*:0/15", "x:skip+a1:1:*:*:0/15", "x:skip+a10:1:*:*:0/15"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_job(bad)
    fleet = Fleet.__new__(Fleet)  # only what _command reads
    fleet.jobs, fleet.lock = [job], LockSettings()
    fleet.history = type("H", (), {"path": Path("/h.log")})()
    agent = type("A", (), {"netns": "ns", "name": "c1"})()
    command = fleet._command(agent, job)
    assert command[command.index("--attempts") + 1] == "3" and command[-1] == str(FAIL_RATE), command


def test_checker_allows_a_holders_retries_up_to_its_attempts_and_no_more(tmp_path: Path) -> None:
    """Runs of one occurrence under one fencing token are one holder's attempts (retries:): within `attempts`
    they are no duplicate, even under skip; one more is a violation. Without retries (attempts 1), two runs
    under one token are already one too many."""
    retried = [*_run("s", "c1", 100, OCC[0], 10, T0 + 0.5, 5), *_run("s", "c1", 102, OCC[0], 10, T0 + 1.5, 5)]
    history = sorted([*_fires("s", 0), *retried], key=lambda line: line["t"])
    assert [v["kind"] for v in _write(tmp_path / "plain", history, [])["violations"]] == ["more attempts than allowed"]
    out = tmp_path / "retried"
    _write(out, history, [])
    meta = json.loads((out / "run.json").read_text())
    meta["jobs"][0]["attempts"] = 2
    (out / "run.json").write_text(json.dumps(meta))
    report = check(out)
    assert report["violations"] == [] and report["jobs"]["s"]["duplicates"] == []
    third = _run("s", "c1", 104, OCC[0], 10, T0 + 2.5, 5)
    (out / "history.log").write_text("".join(json.dumps(line) + "\n" for line in sorted(
        [*history, *third], key=lambda line: line["t"])))
    report = check(out)
    assert [(v["kind"], v["attempts"], v["allowed"]) for v in report["violations"]] == [
        ("more attempts than allowed", 3, 2)]


def test_checker_finds_a_chained_run_without_its_parent_s_end_and_one_run_twice(tmp_path: Path) -> None:
    """A job chained after `s` (on: success) runs once per ended run of `s`: one that started before its
    parent's end (or for a parent run that died) is a violation, and so is a second holder for one parent run."""
    out = tmp_path / "chain"
    parent = _run("s", "c1", 100, OCC[0], 10, T0 + 0.5, 5)  # ends at T0 + 1.01
    died = _run("s", "c2", 300, OCC[1], 14, T0 + 5.5, 5, ended=False)
    child = f"{OCC[0]}~after~s"
    good = _run("k", "c3", 200, child, 20, T0 + 1.5, 3)
    history = sorted([*_fires("s", 0), *_fires("s", 1), *parent, *died, *good], key=lambda line: line["t"])
    _write(out, history, [])
    meta = json.loads((out / "run.json").read_text())
    meta["jobs"].append({"name": "k", "policy": "skip", "schedule": "", "seconds": 0.3, "interval_s": 5,
                         "condition_holds": False, "after": [{"job": "s", "on": "success"}]})
    (out / "run.json").write_text(json.dumps(meta))

    def judged(*extra: list[dict]) -> dict:
        lines = sorted([*history, *(line for runs in extra for line in runs)], key=lambda line: line["t"])
        (out / "history.log").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return check(out)

    report = judged()
    assert report["violations"] == [] and report["jobs"]["k"]["chained_runs"] == 1
    early = _run("k", "c2", 210, f"{OCC[1]}~after~s", 21, T0 + 7.0, 3)  # its parent run died: no success
    report = judged(early)
    assert [v["kind"] for v in report["violations"]] == ["chained run without its parent's end"]
    assert report["violations"][0]["parent_occurrence"] == OCC[1]
    twice = _run("k", "c1", 220, child, 22, T0 + 2.5, 3)  # a second holder for the same parent run
    report = judged(twice)
    # (under skip the occurrence rule sees the same two holders: both say so)
    assert sorted(v["kind"] for v in report["violations"]) == ["chained run twice for one parent run",
                                                                "duplicate under skip"]
    before_end = _run("k", "c1", 230, child, 20, T0 + 0.9, 1)  # (same holder) started before the parent ended
    report = judged(before_end)
    assert "chained run without its parent's end" in [v["kind"] for v in report["violations"]]


def _each_node(out: Path, history: list[dict], nemesis: list[dict] | None = None, interval_s: float = 60) -> dict:
    """The checker's report of job "e", `mode: each-node` with lock.concurrency 2 (`--job e:each2:...`)."""
    _write(out, sorted(history, key=lambda line: line["t"]), nemesis or [])
    meta = json.loads((out / "run.json").read_text())
    meta["jobs"].append({"name": "e", "policy": "each2", "schedule": "*:*:00", "seconds": 1, "interval_s": interval_s,
                         "condition_holds": False, "each_node": 2})
    (out / "run.json").write_text(json.dumps(meta))
    return check(out)


def test_checker_holds_each_node_to_n_at_once_every_healthy_node_once_and_once_per_node(tmp_path: Path) -> None:
    fires = _fires("e", 0)
    rolling = [*_run("e", "c1", 100, OCC[0], 10, T0 + 0.5, 10), *_run("e", "c2", 200, OCC[0], 11, T0 + 0.6, 10),
               *_run("e", "c3", 300, OCC[0], 12, T0 + 1.7, 10)]  # c3 after c1 ended: two at once at most
    report = _each_node(tmp_path / "clean", [*fires, *rolling])
    assert report["violations"] == [] and report["jobs"]["e"]["each_node_condition_holds"] is True
    crowded = [*rolling[:-12], *_run("e", "c3", 300, OCC[0], 12, T0 + 0.7, 10)]
    report = _each_node(tmp_path / "crowded", [*fires, *crowded])
    assert [v["kind"] for v in report["violations"]] == ["more than 2 at once"]
    assert len(report["violations"][0]["runs"]) == 3
    missing = rolling[:-12]  # c3 fired, had no fault, and never ran
    report = _each_node(tmp_path / "missing", [*fires, *missing])
    assert [(v["kind"], v["node"]) for v in report["violations"]] == [("each-node: a healthy node did not run", "c3")]
    down = [{"t": T0 + 0.2, "ev": "fault", "id": 1, "kind": "agent-kill", "node": "c3"},
            {"t": T0 + 30, "ev": "heal", "id": 1, "kind": "agent-kill", "recovered": T0 + 31}]
    assert _each_node(tmp_path / "down", [*fires, *missing], down)["violations"] == []  # reported, not waited for
    assert _each_node(tmp_path / "no-room", [*fires, *missing], interval_s=10)["violations"] == []
    again = [*rolling, *_run("e", "c1", 400, OCC[0], 13, T0 + 3.0, 5)]  # a second holder on c1
    report = _each_node(tmp_path / "twice", [*fires, *again])
    assert [(v["kind"], v["node"]) for v in report["violations"]] == [("twice on one node", "c1")]


def test_checker_finds_an_attempt_number_run_twice_and_a_node_running_two_occurrences_at_once(
        tmp_path: Path) -> None:
    """A takeover goes on from the attempts recorded before it: two holders' runs of one occurrence under the
    same CONSULRUN_ATTEMPT are a count started afresh (issue 37, break 2). An each-node job's node runs one of
    its occurrences at a time (break 4)."""
    first = _run("r", "c1", 100, OCC[0], 10, T0 + 0.5, 5)
    second = _run("r", "c2", 200, OCC[0], 11, T0 + 2.0, 5)
    first[0]["attempt"], second[0]["attempt"] = "1", "2"
    history = sorted([*_fires("r", 0), *first, *second], key=lambda line: line["t"])
    assert _write(tmp_path / "counted", history, [])["violations"] == []
    second[0]["attempt"] = "1"
    history = sorted([*_fires("r", 0), *first, *second], key=lambda line: line["t"])
    report = _write(tmp_path / "afresh", history, [])
    assert [(v["kind"], v["attempt"]) for v in report["violations"]] == [("an attempt number run twice", 1)]
    fires = [*_fires("e", 0), *_fires("e", 1)]
    long_run = _run("e", "c1", 100, OCC[0], 10, T0 + 0.5, 60)  # outlives its 5 s interval
    overtaking = _run("e", "c1", 110, OCC[1], 11, T0 + 5.5, 5)
    report = _each_node(tmp_path / "at-once", [*fires, *long_run, *overtaking], interval_s=5)
    assert [(v["kind"], v["node"]) for v in report["violations"]] == [("two occurrences at once on one node", "c1")]
    after = _run("e", "c1", 110, OCC[1], 11, T0 + 6.6, 5)  # waited for its own run to end
    report = _each_node(tmp_path / "one-at-a-time", [*fires, *long_run, *after], interval_s=5)
    assert "two occurrences at once on one node" not in [v["kind"] for v in report["violations"]]


def test_checker_holds_a_chained_child_to_its_attempts_per_parent_run(tmp_path: Path) -> None:
    """One holder may retry a chained run up to the child's attempts; a run to its end beyond them (a request
    given back after the job ran, and run again under the same token) is a chained run twice (break 1)."""
    out = tmp_path / "chain"
    parent = _run("s", "c1", 100, OCC[0], 10, T0 + 0.5, 5)
    child = f"{OCC[0]}~after~s"
    runs = [*_run("k", "c3", 200, child, 20, T0 + 1.5, 3), *_run("k", "c3", 201, child, 20, T0 + 2.5, 3)]
    _write(out, sorted([*_fires("s", 0), *parent, *runs], key=lambda line: line["t"]), [])
    meta = json.loads((out / "run.json").read_text())
    meta["jobs"].append({"name": "k", "policy": "skip", "schedule": "", "seconds": 0.3, "interval_s": 5,
                         "condition_holds": False, "after": [{"job": "s", "on": "success"}], "attempts": 2})
    (out / "run.json").write_text(json.dumps(meta))
    assert check(out)["violations"] == []
    meta["jobs"][-1]["attempts"] = 1
    (out / "run.json").write_text(json.dumps(meta))
    kinds = [v["kind"] for v in check(out)["violations"]]
    assert "chained run twice for one parent run" in kinds, kinds


@pytest.mark.cluster
@pytest.mark.consul
def test_short_chaos_run_keeps_the_guarantees(consul_bin: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Two minutes of timers on 3 clients (3 servers) under random faults: no overlap outside a pause, no
    duplicate under skip, no retry occurrence lost while a client node was healthy."""
    require_tool("ip")
    if os.geteuid() != 0:
        pytest.fail("the chaos run needs root for network namespaces", pytrace=False)
    out = tmp_path / "chaos"
    cmd = [sys.executable, "-m", "bench.chaos", "--duration", "120s", "--out", str(out), "--seed",
           os.environ.get("CONSULRUN_CHAOS_SEED", "11"),
           "--job", "skip10:skip:4:*:*:0/10", "--job", "retry30:retry:1:*:*:0/30"]
    proc, stderr = run_chaos(cmd, 600, 120)
    with kept_on_failure(request, out, stderr):
        report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
        assert report is not None, f"the run made no report (exit {proc.returncode}):\n{stderr[-3000:]}"
        assert not _our_namespaces(f"x{proc.pid % 100000}"), "the run left network namespaces behind"
        assert json.loads((out / "run.json").read_text())["drained"], "wrappers were still running after the drain"
        assert sum(report["faults"].values()) >= 3, f"too few faults injected: {report['faults']}"
        assert report["jobs"]["skip10"]["completed"] > 0 and report["jobs"]["retry30"]["completed"] > 0
        assert report["jobs"]["retry30"]["retry_condition_holds"] is True
        probed = {line["node"] for line in read(out / "probes.log") if line["ev"] == "probe" and line["served"]}
        assert probed == set(json.loads((out / "run.json").read_text())["clients"]), \
            "the availability probe did not see every client served"
        assert proc.returncode == 0 and not report["violations"], \
            f"violations (history in {artifact_dir(request.node)}):\n{(out / 'report.md').read_text()[-6000:]}"


@pytest.mark.cluster
@pytest.mark.consul
def test_ctrl_c_removes_every_namespace_and_process(consul_bin: str, tmp_path: Path) -> None:
    """Ctrl-C in the middle of a run: exit 130, and no namespace, link or process of the run is left."""
    require_tool("ip")
    if os.geteuid() != 0:
        pytest.fail("the chaos run needs root for network namespaces", pytrace=False)
    out = tmp_path / "chaos"
    proc = subprocess.Popen([sys.executable, "-m", "bench.chaos", "--duration", "10m", "--out", str(out),
                             "--job", "skip10:skip:4:*:*:0/10"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: '"start"' in (out / "history.log").read_text(), 120, "a job to start under the chaos run")
        assert _our_namespaces(f"x{proc.pid % 100000}")
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert not _our_namespaces(f"x{proc.pid % 100000}")
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert f"x{proc.pid % 100000}" not in links
    assert not _processes_mentioning(str(out))
