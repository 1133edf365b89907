"""The scale benchmark (bench/scale.py): its plan, its arithmetic, its node timers, and a short real run.

The published figures are in bench/RESULTS.md; these tests hold what they
rest on: jobs spread evenly over the minute with the occurrence ids consulrun
itself computes, lags and losers counted from the right records, node timers
that never fire early, start nothing for a job still running and leave no
process behind when stopped, and a real run on a small cluster in which
consulrun ran every occurrence exactly once and left no namespace behind,
also when interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from bench.scale import plan_jobs, plan_occurrences
from bench.scale_report import knee, markdown, parse_runs, percentile, phase_figures
from consulrun.manifest import calendar
from consulrun.manifest.schema import name_problem, schedule_problem
from tests.conftest import require_tool
from tests.harness.agents import wait_for
from tests.harness.chaos import our_namespaces, processes_mentioning

REPO = Path(__file__).resolve().parents[1]
NODE_SCRIPT = REPO / "bench" / "scale_node.py"


@pytest.mark.parametrize("jobs", [25, 100, 1000])
def test_jobs_are_spread_evenly_over_the_minute(jobs: int) -> None:
    planned = plan_jobs(jobs, "r")
    per_second = Counter(second for _, second in planned)
    assert len({name for name, _ in planned}) == jobs
    assert all(0 <= second < 60 for second in per_second)
    if jobs >= 60:
        assert set(per_second) == set(range(60))
    assert max(per_second.values()) - min(per_second.values()) <= 1
    for name, second in planned:
        assert not name_problem(name)
        assert not schedule_problem(f"*-*-* *:*:{second:02d} UTC")


def test_occurrences_are_the_ones_consulrun_computes() -> None:
    jobs = plan_jobs(100, "r")
    t0 = 1_893_456_017  # 2030-01-01T00:00:17Z: not on a minute
    one = plan_occurrences(jobs, t0, 60)
    assert len(one) == 100  # each job once in a minute's window
    assert len(plan_occurrences(jobs, t0, 120)) == 200
    seconds = dict(jobs)
    for (job, occ), when in one.items():
        assert t0 <= when < t0 + 60
        spec = f"*-*-* *:*:{seconds[job]:02d} UTC"
        at = datetime.fromtimestamp(when, timezone.utc)
        assert calendar.following([spec], at - timedelta(seconds=1)) == at
        assert calendar.occurrence_id(at) == occ


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 61)], 99) == 60.0
    assert percentile([float(i) for i in range(1, 201)], 99) == 198.0


def _wrapper(node: str, job: str, occ: str, planned: float, spawned: float | None, ended: float | None,
             cpu: float, status: int | str = 0) -> dict:
    return {"node": node, "job": job, "occ": occ, "planned": planned, "spawned": spawned, "ended": ended, "cpu": cpu,
            "status": status}


def test_figures_count_runs_lags_and_losers_from_the_right_records() -> None:
    occurrences = {("a", "o1"): 100.0, ("b", "o1"): 200.0, ("c", "o1"): 300.0}
    wrappers = [
        _wrapper("n1", "a", "o1", 100.05, 100.06, 100.5, 0.080),  # wins a, job at 100.30
        _wrapper("n2", "a", "o1", 100.01, 100.02, 100.2, 0.040),
        _wrapper("n1", "b", "o1", 200.02, 200.03, 200.4, 0.070),  # b ran twice: first on n2 at 200.50
        _wrapper("n2", "b", "o1", 200.08, 200.10, 200.9, 0.090),
        _wrapper("n1", "c", "o1", 300.01, 300.02, 300.3, 0.050),  # c ran nowhere
        _wrapper("n2", "c", "o1", 300.03, None, None, 0.0, "busy"),
    ]
    runs = parse_runs("100.30 consulrun a o1 n1 o1\n200.70 consulrun b o1 n1 -\n200.50 consulrun b o1 n2 o2\n"
                      "truncated line\n")
    got = phase_figures(occurrences, wrappers, runs)
    assert (got["ran_once"], got["ran_more"], got["ran_none"], got["runs"]) == (1, 1, 1, 3)
    assert got["misattributed"] == 1  # n2's consulrun thought b's run was for o2
    assert got["lag_s"]["n"] == 2 and got["lag_s"]["p50"] == pytest.approx(0.30)
    assert got["lag_s"]["max"] == pytest.approx(0.50)
    assert sorted(got["lag_from_fire_s"][k] for k in ("p50", "max")) == [pytest.approx(0.24), pytest.approx(0.40)]
    assert got["loser_cpu_ms"]["n"] == 2  # n2 on a, n1 on c; the busy one was never started
    assert got["loser_cpu_ms"]["max"] == pytest.approx(50.0)
    assert got["skip_cpu_s"] == pytest.approx(0.090)
    assert got["winner_cpu_ms"]["n"] == 3
    assert got["statuses"] == {"won:0": 3, "lost:0": 2, "not fired:busy": 1}


def _phase(tool: str, clients: int, load: int, p99: float, aborted: str = "", none: int = 0) -> dict:
    return {"tool": tool, "clients": clients, "jobs_per_minute": load, "lag_s": {"p50": p99 / 2, "p99": p99,
            "max": p99}, "aborted": aborted, "ran_none": none, "occurrences": 100}


def test_the_knee_is_the_first_load_whose_lag_p99_passes_a_second() -> None:
    phases = [_phase("consulrun", 10, 50, 0.3), _phase("consulrun", 10, 100, 0.9), _phase("consulrun", 10, 250, 4.0),
              _phase("consul lock", 10, 50, 0.2), _phase("consul lock", 10, 100, 0.5, aborted="stopped: memory"),
              _phase("consulrun", 30, 25, 0.5), _phase("consulrun", 30, 50, 0.6, none=2)]
    assert knee(phases, "consulrun", 10) == (100, 250)
    assert knee(phases, "consul lock", 10) == (50, 100)
    assert knee(phases, "consulrun", 30) == (25, 50)  # 2 % of the occurrences never ran
    assert knee(phases, "consul lock", 30) == (None, None)
    assert knee([_phase("consulrun", 3, 10, 0.2), {**_phase("consulrun", 3, 20, 0.2), "shed": 1}],
                "consulrun", 3) == (10, 20)  # a node could not start every wrapper: the emulation ran out


def test_the_report_has_a_row_per_phase_and_the_ratios(tmp_path: Path) -> None:
    base = phase_figures({("a", "o1"): 100.0}, [_wrapper("n1", "a", "o1", 100.0, 100.0, 100.2, 0.05),
                                                _wrapper("n2", "a", "o1", 100.0, 100.0, 100.1, 0.04)],
                         parse_runs("100.1 x a o1 n1 o1\n"))
    phases = []
    for tool, writes in (("consulrun", 4), ("consul lock", 16)):
        phases.append({**base, "tool": tool, "clients": 2, "jobs_per_minute": 1, "aborted": "", "writes": writes,
                       "writes_per_s": writes / 60, "writes_per_occurrence": float(writes), "load_start": 0.5,
                       "load_end": 0.6, "skip_cpu_per_node_pct": 1.0, "leader_cpu_ms_per_occurrence": 2.5,
                       "wrappers_cpu_per_node_pct": 2.0,
                       "cpu_pct": {"leader": 2.0, "other_servers": 1.0, "clients": 1.0, "wrappers": 3.0,
                                   "timers": 0.1, "machine": 10.0, "not_ours": 2.9}})
    text = markdown(phases, {"command": "bench/scale.py --out x", "spread_s": 0.1, "window_s": 60, "python": "3",
                             "cpus": 2})
    assert "| 2 | 1 | consulrun | 1 | 1 / 0 / 0 | 1 | 0.1 | 4.00 |" in text
    assert "| 2 | 1 | 1.00 | 0.25 | 0.25 | 1.00 |" in text  # one run each; writes per occurrence 4 against 16
    assert "2 clients, consulrun: under the knee up to 1 jobs/min" in text


def _node_timers(tmp_path: Path, firings: list[list], drain_s: float = 30,
                 max_live: int = 100) -> subprocess.Popen[bytes]:
    plan = {"node": "n1", "env": {"PATH": "/usr/bin:/bin"}, "stderr": str(tmp_path / "stderr"), "drain_s": drain_s,
            "max_live": max_live, "firings": firings}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return subprocess.Popen([sys.executable, str(NODE_SCRIPT), str(tmp_path / "plan.json"), str(tmp_path / "out")])


def _records(tmp_path: Path) -> dict[tuple[str, str], dict]:
    return {(r["job"], r["occ"]): r for r in map(json.loads, (tmp_path / "out").read_text().splitlines())}


def test_node_timers_fire_no_earlier_than_planned_and_count_the_job_in_the_cpu(tmp_path: Path) -> None:
    t = time.time() + 0.5
    burn = [sys.executable, "-c", "import time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass"]
    firings = [[t, "a", "o1", ["/bin/sh", "-c", " ".join(f"'{w}'" for w in burn)]],  # the CPU is the child's
               [t + 0.05, "b", "o1", ["/bin/sh", "-c", "sleep 1"]],
               [t + 0.1, "b", "o2", ["/bin/true"]],  # b's previous run still lives: not started
               [t + 0.15, "c", "o1", ["/bin/sh", "-c", "exit 3"]]]
    timers = _node_timers(tmp_path, firings)
    assert timers.wait(timeout=60) == 0
    got = _records(tmp_path)
    assert got[("a", "o1")]["status"] == 0 and got[("a", "o1")]["cpu"] >= 0.2
    assert got[("b", "o2")]["status"] == "busy" and got[("b", "o2")]["spawned"] is None
    assert got[("c", "o1")]["status"] == 3
    for key in (("a", "o1"), ("b", "o1"), ("c", "o1")):
        assert got[key]["spawned"] >= got[key]["planned"] and got[key]["ended"] >= got[key]["spawned"]


def test_node_timers_shed_firings_while_the_node_has_its_most_wrappers_alive(tmp_path: Path) -> None:
    t = time.time() + 0.3
    firings = [[t, "a", "o1", ["/bin/sh", "-c", "sleep 3"]], [t + 0.01, "b", "o1", ["/bin/sh", "-c", "sleep 3"]],
               [t + 0.02, "c", "o1", ["/bin/true"]]]
    timers = _node_timers(tmp_path, firings, max_live=2)
    assert timers.wait(timeout=60) == 0
    got = _records(tmp_path)
    assert [got[(job, "o1")]["status"] for job in "abc"] == [0, 0, "shed"]


def test_stopped_node_timers_kill_every_wrapper_and_its_descendants(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild"
    t = time.time() + 0.2
    firings = [[t, "a", "o1", ["/bin/sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"]],
               [t + 3600, "b", "o1", ["/bin/true"]]]
    timers = _node_timers(tmp_path, firings)
    try:
        grandchild = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 30, "the job's sleep"))
        timers.send_signal(signal.SIGTERM)
        assert timers.wait(timeout=30) == 0
    finally:
        if timers.poll() is None:
            timers.kill()
    wait_for(lambda: not Path(f"/proc/{grandchild}").exists()
             or Path(f"/proc/{grandchild}/stat").read_text().split(") ")[1].startswith("Z"), 10,
             "the job's descendant to be killed")
    got = _records(tmp_path)
    assert got[("a", "o1")]["status"] == "killed"
    assert got[("b", "o1")]["status"] == "not fired"


@pytest.mark.cluster
@pytest.mark.consul
def test_a_short_run_runs_every_occurrence_once_and_leaves_nothing(consul_bin: str, tmp_path: Path) -> None:
    """3 servers and 2 clients, 12 jobs a minute for 10 s, with consul lock beside: a report, consulrun's
    occurrences each run once at 4 Raft writes or a few more, and no namespace left."""
    require_tool("ip")
    if os.geteuid() != 0:
        pytest.fail("the scale run needs root for network namespaces", pytrace=False)
    out = tmp_path / "scale"
    proc = subprocess.Popen([sys.executable, "bench/scale.py", "--out", str(out), "--clients", "2",
                             "--jobs-per-minute", "12", "--duration", "10s"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert not our_namespaces(f"s{proc.pid % 100000}"), "the run left network namespaces behind"
    assert not processes_mentioning(str(out))
    phases = {p["tool"]: p for p in map(json.loads, (out / "phases.jsonl").read_text().splitlines())}
    ours = phases["consulrun"]
    assert ours["occurrences"] == 2 and ours["ran_once"] == 2 and ours["misattributed"] == 0, ours
    assert 8 <= ours["writes"] <= 14, ours  # 4 per occurrence; a contender that read before the claim adds 2
    assert ours["loser_cpu_ms"]["n"] == 2 and ours["lag_s"]["n"] == 2
    assert phases["consul lock"]["runs"] >= 2 and phases["consul lock"]["writes"] > 0
    assert "| 2 | 12 | consulrun | 2 | 2 / 0 / 0 |" in (out / "report.md").read_text()


@pytest.mark.cluster
@pytest.mark.consul
def test_ctrl_c_stops_the_run_and_removes_its_namespaces(consul_bin: str, tmp_path: Path) -> None:
    require_tool("ip")
    if os.geteuid() != 0:
        pytest.fail("the scale run needs root for network namespaces", pytrace=False)
    out = tmp_path / "scale"
    proc = subprocess.Popen([sys.executable, "bench/scale.py", "--out", str(out), "--clients", "2",
                             "--jobs-per-minute", "60", "--duration", "10m", "--peer", "none"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        runs = out / "2c-60-consulrun" / "runs.log"
        wait_for(lambda: runs.exists() and runs.read_text().strip(), 180, "a job to start under the scale run")
        assert our_namespaces(f"s{proc.pid % 100000}")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert not our_namespaces(f"s{proc.pid % 100000}"), "the run left network namespaces behind"
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert f"-s{proc.pid % 100000}" not in links and f"crbrs{proc.pid % 100000}" not in links
    assert not processes_mentioning(str(out))
    assert (out / "report.md").exists()


@pytest.mark.cluster
@pytest.mark.consul
def test_a_phase_stopped_for_memory_says_so_and_kills_its_wrappers(consul_bin: str, tmp_path: Path) -> None:
    """The guard that keeps an overloaded phase from taking the machine's memory: with a threshold no machine
    meets, the phase stops at its first look, the report says why, and no wrapper or agent is left."""
    require_tool("ip")
    if os.geteuid() != 0:
        pytest.fail("the scale run needs root for network namespaces", pytrace=False)
    out = tmp_path / "scale"
    proc = subprocess.run([sys.executable, "bench/scale.py", "--out", str(out), "--clients", "2",
                           "--jobs-per-minute", "60,120", "--duration", "30s", "--peer", "none",
                           "--min-memory-gib", "1000000"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]
    assert [p["jobs_per_minute"] for p in phases] == [60], "a stopped phase is past the knee: no higher load runs"
    assert phases[0]["aborted"].startswith("stopped: memory available below")
    assert phases[0]["ran_once"] < 30
    statuses = Counter(r["status"] for node in ("client1", "client2")
                       for r in map(json.loads, (out / "2c-60-consulrun" / f"{node}.jsonl").read_text().splitlines()))
    assert statuses["not fired"] > 0
    assert "stopped: memory available below" in (out / "report.md").read_text()
    assert not processes_mentioning(str(out))


def test_the_projection_takes_one_nodes_share_of_every_tick() -> None:
    from bench.scale_report import projection

    phase = {"tool": "consulrun", "clients": 10, "jobs_per_minute": 100, "loser_cpu_ms": {"p50": 40.0},
             "winner_cpu_ms": {"p50": 130.0}, "leader_cpu_ms_per_occurrence": 6.0, "occurrences": 100}
    # a tick costs a node (130 + 9 x 40) / 10 = 49 ms; 1,000 ticks a minute 816.7 ms a second; 60,000 / 6 = 10,000
    assert projection(phase) == ("- 10 clients, consulrun (from 100 jobs/min): one node's wrappers take 8 % of a core "
                                 "at 100 jobs/min and 82 % at 1,000 (49 ms per timer tick); the leader, at 6.0 ms per "
                                 "occurrence, would fill one core at about 10,000 jobs/min.")
    assert projection({**phase, "loser_cpu_ms": {"p50": None}}) == ""
    assert projection({**phase, "occurrences": 7}).endswith("too few occurrences to tell the leader's share from "
                                                            "its idle CPU (7, at least 30).")
