"""The checker: reads the host's history and the nemesis log and says what the locks guaranteed.

A run is one start line of the job; its interval is [start, end] or, if it
never ended, [start, last heartbeat]. Per job it reports overlapping runs
(pause overlaps apart, with whether a fencing-token guarded store would have
rejected the stale holder's writes), occurrences run twice under `skip`,
occurrences never completed under `retry` although a client node was free of
faults, wrapper exit statuses, fencing latency (fault start -> the holder's
job dead) and takeover latency (holder's job dead -> a standby's job start) as
percentiles, and Raft writes per occurrence. Heartbeats come every 100 ms, so
"dead" times are late by at most 0.1 s.

Usage: python -m bench.chaos.checker OUTDIR   (re-checks a finished run; exit 1 on a violation)
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.chaos.logs import read

CLIENT_FAULTS = {"agent-kill", "partition-client", "wrapper-kill", "pause", "skew"}
FENCING_FAULTS = ("agent-kill", "partition-client", "wrapper-kill", "partition-server", "leader-kill")
RECOVERY_S = 1.0  # slack after a node's recovery (its agent reads through the servers again)
HEARTBEAT_S = 0.15  # heartbeat period and some slack
HOLDER_SEEN_S = 1.0  # a fault may hit a holder between its acquisition and its job's first line


@dataclass
class Run:
    job: str
    node: str
    pid: int
    wrapper: int
    occ: str
    token: int
    start: float
    last: float
    ended: bool = False
    lines: list[dict[str, Any]] = field(default_factory=list)  # start, last heartbeat, end: the evidence
    writes: list[tuple[float, bool]] = field(default_factory=list)  # (time, rejected by a token-guarded store)
    paused: list[int] = field(default_factory=list)  # ids of pause faults that froze it


@dataclass
class Fault:
    id: int
    kind: str
    node: str
    start: float
    end: float
    line: dict[str, Any]
    healed: float = 0.0  # when the heal action ran (SIGCONT, link up, agent restarted)

    def pids(self) -> list[int]:
        return list(self.line.get("pids", []))

    def label(self) -> str:
        return f"{self.kind}@{self.node}#{self.id}"


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return round(ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)], 2)

    return {"n": len(ordered), "p50": rank(50), "p90": rank(90), "p99": rank(99), "max": round(ordered[-1], 2)}


def load_faults(path: Path, end_of_run: float) -> list[Fault]:
    faults: dict[int, Fault] = {}
    for line in read(path):
        if line["ev"] == "fault":
            faults[line["id"]] = Fault(line["id"], line["kind"], line.get("node", ""), line["t"], end_of_run, line)
        elif line["ev"] == "heal" and line["id"] in faults:
            # A node is back when its agent reads through the servers again, not when the link came up.
            faults[line["id"]].end = line.get("recovered") or line["t"]
            faults[line["id"]].healed = line.get("healed") or line["t"]
    return sorted(faults.values(), key=lambda f: f.start)


def load_runs(path: Path) -> tuple[dict[str, list[Run]], list[dict[str, Any]]]:
    """Runs per job from the history, with the token-guarded store simulated in log order."""
    runs: dict[str, list[Run]] = defaultdict(list)
    active: dict[tuple[str, int], Run] = {}
    highest: dict[str, int] = defaultdict(int)
    timer_events: list[dict[str, Any]] = []
    for line in read(path):
        event = line["ev"]
        if event in ("fire", "busy", "exit"):
            timer_events.append(line)
            continue
        job, pid, token, t = line["job"], line["pid"], line.get("token", 0), line["t"]
        if event == "start":
            run = Run(job, line["node"], pid, line["wrapper"], line.get("occ") or "", token, t, t, lines=[line])
            runs[job].append(run)
            active[(job, pid)] = run
        else:
            run = active.get((job, pid))
            if run is None:
                continue
            run.last = t
            if event == "end":
                run.ended = True
                run.lines.append(line)
                del active[(job, pid)]
            elif len(run.lines) > 1 and run.lines[-1]["ev"] == "hb":
                run.lines[-1] = line
            else:
                run.lines.append(line)
        run.writes.append((t, token < highest[job]))
        highest[job] = max(highest[job], token)
    return runs, timer_events


def active_faults(faults: list[Fault], start: float, end: float, node: str | None = None) -> list[Fault]:
    return [f for f in faults if f.start <= end and f.end >= start and (node is None or f.node == node)]


def check(out: Path) -> dict[str, Any]:
    meta = json.loads((out / "run.json").read_text())
    ttl, lock_delay = meta["ttl_s"], meta["lock_delay_s"]
    horizon = 2 * ttl + lock_delay  # how long a fault can still act after it started
    runs_by_job, timer_events = load_runs(out / "history.log")
    faults = load_faults(out / "nemesis.log", meta.get("t_end") or meta["fire_until"])
    for fault in faults:
        if fault.kind == "pause":
            for runs in runs_by_job.values():
                for run in runs:
                    if run.pid in fault.pids() or run.wrapper in fault.pids():
                        run.paused.append(fault.id)
    report: dict[str, Any] = {"command": meta.get("command"), "duration_s": meta.get("duration_s"),
                              "ttl_s": ttl, "lock_delay_s": lock_delay,
                              "faults": dict(Counter(f.kind for f in faults)), "jobs": {}, "violations": []}
    clients = meta["clients"]
    all_fired = 0
    for spec in meta["jobs"]:
        job, policy, interval = spec["name"], spec["policy"], spec["interval_s"]
        runs = sorted(runs_by_job.get(job, []), key=lambda r: r.start)
        fires = [e for e in timer_events if e.get("job") == job]
        occurrences = sorted({e["sched"] for e in fires if e["ev"] in ("fire", "busy")})
        all_fired += len(occurrences)
        by_occ: dict[str, list[Run]] = defaultdict(list)
        for run in runs:
            by_occ[run.occ].append(run)
        entry: dict[str, Any] = {"policy": policy, "schedule": spec["schedule"], "interval_s": interval,
                                 "job_seconds": spec["seconds"], "retry_condition_holds": spec.get("condition_holds"),
                                 "occurrences": len(occurrences), "runs": len(runs),
                                 "completed": sum(r.ended for r in runs)}
        # Overlaps: any two runs of the job at once, whatever their occurrences.
        overlaps, pause_overlaps = [], []
        for i, first in enumerate(runs):
            for second in runs[i + 1:]:
                if second.start >= first.last:
                    break
                end = min(first.last, second.last)
                stale, fresh = (first, second) if first.token <= second.token else (second, first)
                # The stale holder's writes once a newer holder started, to the end of its run (a paused
                # holder's tail often comes after the newer run ended).
                stale_writes = [w for w in stale.writes if w[0] > fresh.start]
                item = {"runs": [_describe(first), _describe(second)], "seconds": round(end - second.start, 3),
                        "from": second.start, "to": end,
                        "faults": [f.label() for f in active_faults(faults, second.start - horizon, end)],
                        "stale_writes": len(stale_writes),
                        "stale_writes_rejected_by_token": sum(rejected for _, rejected in stale_writes),
                        "evidence": [*first.lines, *second.lines]}
                (pause_overlaps if first.paused or second.paused else overlaps).append(item)
        entry["overlaps"] = overlaps
        entry["pause_overlaps"] = pause_overlaps
        entry["pause_overlaps_all_rejected_by_token"] = all(
            o["stale_writes_rejected_by_token"] == o["stale_writes"] for o in pause_overlaps)
        for item in overlaps:
            report["violations"].append({"kind": "overlap", "job": job, **item})
        # Occurrence outcomes.
        ran_twice = {occ: rs for occ, rs in by_occ.items() if len(rs) > 1}
        completed_twice = {occ: rs for occ, rs in by_occ.items() if sum(r.ended for r in rs) > 1}
        entry["started_more_than_once"] = len(ran_twice)
        entry["completed_more_than_once"] = len(completed_twice)
        entry["never_started"] = sum(1 for occ in occurrences if occ not in by_occ)
        entry["started_never_completed"] = sum(1 for occ in occurrences if occ in by_occ
                                               and not any(r.ended for r in by_occ[occ]))
        if policy == "skip":
            entry["duplicates"] = [{"occurrence": occ, "runs": [_describe(r) for r in rs],
                                    "evidence": [ln for r in rs for ln in r.lines]} for occ, rs in ran_twice.items()]
            for dup in entry["duplicates"]:
                report["violations"].append({"kind": "duplicate under skip", "job": job, **dup})
        else:
            entry["completed_twice"] = [{"occurrence": occ, "runs": [_describe(r) for r in rs]}
                                        for occ, rs in completed_twice.items()]
            lost, lost_no_healthy, lost_repeated = [], [], []
            attempts_killed = Counter(r.occ for r in runs if not r.ended)
            logged = {r.wrapper for r in runs}
            fired = {e["wrapper"]: e["sched"] for e in fires if e["ev"] == "fire"}
            attempts_killed.update(fired[f.line["wrapper"]] for f in faults if f.kind == "wrapper-kill"
                                   and f.line.get("wrapper") in fired and f.line["wrapper"] not in logged)
            for occ in occurrences:
                if any(r.ended for r in by_occ.get(occ, [])):
                    continue
                t0 = _epoch(occ)
                window = (t0, t0 + interval)
                sick = [f for f in faults if f.kind in CLIENT_FAULTS
                        and f.start <= window[1] and f.end + RECOVERY_S >= window[0]]
                always_healthy = [c for c in clients if c not in {f.node for f in sick}]
                # As the issue puts it: at every instant of the occurrence's interval some client node had no fault.
                healthy = always_healthy or _some_node_healthy_throughout(sick, clients, window)
                item = {"occurrence": occ, "healthy_nodes": always_healthy,
                        "faults": [f.label() for f in active_faults(faults, window[0] - horizon, window[1])],
                        "wrappers": [{k: e.get(k) for k in ("ev", "node", "status", "ran", "last")}
                                     for e in fires if e["sched"] == occ and e["ev"] in ("exit", "busy")],
                        "evidence": [ln for r in by_occ.get(occ, []) for ln in r.lines]}
                item["attempts_killed"] = attempts_killed[occ]
                if not healthy:
                    lost_no_healthy.append(item)
                elif attempts_killed[occ] >= 2:  # the condition allows for one holder death per occurrence
                    lost_repeated.append(item)
                else:
                    lost.append(item)
            entry["lost_with_healthy_node"] = lost
            entry["lost_without_healthy_node"] = len(lost_no_healthy)
            entry["lost_after_repeated_holder_deaths"] = lost_repeated
            if spec.get("condition_holds"):
                for item in lost:
                    report["violations"].append({"kind": "lost under retry", "job": job, **item})
        entry["wrapper_exit_statuses"] = dict(sorted(Counter(str(e["status"]) for e in fires
                                                             if e["ev"] == "exit").items(), key=lambda kv: int(kv[0])))
        entry["timer_busy"] = sum(e["ev"] == "busy" for e in fires)
        # Fencing latency: a fault hit a running holder, whose job then died without ending.
        fencing: dict[str, list[float]] = defaultdict(list)
        fenced_runs: set[int] = set()
        for fault in faults:
            if fault.kind not in FENCING_FAULTS:
                continue
            for run in runs:
                # The job may have died before its next heartbeat was due: the last one is up to 0.1 s old. The
                # nemesis sees a holder when its job is forked, a little before the job's start line.
                if (run.ended or not run.start - HOLDER_SEEN_S <= fault.start <= run.last + HEARTBEAT_S
                        or run.pid in fenced_runs):
                    continue
                if fault.kind in ("agent-kill", "partition-client") and run.node != fault.node:
                    continue
                if fault.kind == "wrapper-kill" and run.wrapper != fault.line.get("wrapper"):
                    continue
                fencing[fault.kind].append(max(0.0, run.last - fault.start))
                fenced_runs.add(run.pid)
        pause_wake = []
        for run in runs:
            if run.paused:  # the tail of a pause: from SIGCONT to the paused job's last line
                fault = next(f for f in faults if f.id == run.paused[-1])
                pause_wake.append(max(0.0, run.last - (fault.healed or fault.end)))
                fenced_runs.add(run.pid)
        entry["fencing_latency_s"] = {kind: percentiles(v) for kind, v in sorted(fencing.items())}
        entry["fencing_latency_s"]["all (pauses apart)"] = percentiles([x for v in fencing.values() for x in v])
        entry["fenced_after_pause_s"] = percentiles(pause_wake)
        entry["died_unexplained"] = [_describe(r) for r in runs if not r.ended and r.pid not in fenced_runs]
        # Takeover latency: a standby's job starts for the occurrence of a job that died.
        takeovers, not_taken_over = [], 0
        for run in runs:
            if run.ended or policy != "retry":
                continue
            after = [r for r in by_occ[run.occ] if r.start > run.start]
            if after:
                takeovers.append(after[0].start - run.last)
            else:
                not_taken_over += 1
        # A wrapper killed between its acquisition and its job's first line left no run: count from the kill.
        logged = {r.wrapper for r in runs}
        fired = {e["wrapper"]: e["sched"] for e in fires if e["ev"] == "fire"}
        for fault in faults:
            killed = fault.line.get("wrapper")
            if policy != "retry" or fault.kind != "wrapper-kill" or killed in logged or killed not in fired:
                continue
            after = [r for r in by_occ.get(fired[killed], []) if r.start > fault.start]
            if after:
                takeovers.append(after[0].start - fault.start)
            else:
                not_taken_over += 1
        entry["takeover_latency_s"] = percentiles(takeovers)
        entry["died_not_taken_over"] = not_taken_over
        report["jobs"][job] = entry
    before, after = meta.get("applied_before"), meta.get("applied_after")
    report["raft_writes"] = (after - before) if before is not None and after is not None else None
    report["occurrences"] = all_fired
    report["raft_writes_per_occurrence"] = (round(report["raft_writes"] / all_fired, 1)
                                            if report["raft_writes"] is not None and all_fired else None)
    report["goals"] = {"fencing_p100_below_lock_delay": all(
        (e["fencing_latency_s"]["all (pauses apart)"]["max"] or 0) < lock_delay for e in report["jobs"].values()),
        "takeover_p99_limit_s": 2 * ttl + lock_delay + 2,
        "takeover_p99_within_limit": all((e["takeover_latency_s"]["p99"] or 0) <= 2 * ttl + lock_delay + 2
                                         for e in report["jobs"].values())}
    return report


def _some_node_healthy_throughout(sick: list[Fault], clients: list[str], window: tuple[float, float]) -> bool:
    """True if at no instant of `window` every client node had a fault (sampled every 0.1 s)."""
    t = window[0]
    while t <= window[1]:
        down = {f.node for f in sick if f.start <= t <= f.end + RECOVERY_S}
        if len(down) >= len(clients):
            return False
        t += 0.1
    return True


def _epoch(occ: str) -> float:
    return datetime.strptime(occ, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def _describe(run: Run) -> str:
    how = "ended" if run.ended else "died"
    return (f"{run.node} pid {run.pid} occ {run.occ} token {run.token} {run.start:.3f}-{run.last:.3f} {how}"
            + (f" paused#{','.join(map(str, run.paused))}" if run.paused else ""))


def markdown(report: dict[str, Any]) -> str:
    """The report as the tables docs/chaos.md shows."""
    out = [f"Command: `{report.get('command')}`", "",
           f"TTL {report['ttl_s']}s, lock-delay {report['lock_delay_s']}s; {report['occurrences']} occurrences fired; "
           f"Raft writes {report['raft_writes']} ({report['raft_writes_per_occurrence']} per occurrence, faults' "
           "own writes included)", "",
           "Faults: " + ", ".join(f"{k} {v}" for k, v in sorted(report["faults"].items())), "",
           "| job | policy | schedule | occurrences | runs | completed | overlaps (outside pauses) | pause overlaps "
           "(stale writes rejected by token) | started twice | completed twice | lost with a healthy node | "
           "never started | wrapper exit statuses |", "|" + "---|" * 13]
    for job, e in report["jobs"].items():
        stale = sum(o["stale_writes"] for o in e["pause_overlaps"])
        rejected = sum(o["stale_writes_rejected_by_token"] for o in e["pause_overlaps"])
        lost: object = "n/a"
        if e["policy"] == "retry":
            lost = len(e["lost_with_healthy_node"])
            if e["lost_after_repeated_holder_deaths"]:
                lost = f"{lost} (+{len(e['lost_after_repeated_holder_deaths'])} after 2+ holder deaths)"
        if e["policy"] == "retry" and not e.get("retry_condition_holds"):
            lost = f"{lost} (condition does not hold)"
        statuses = ", ".join(f"{k}: {v}" for k, v in e["wrapper_exit_statuses"].items())
        out.append(f"| {job} | {e['policy']} | `{e['schedule']}` | {e['occurrences']} | {e['runs']} | {e['completed']} "
                   f"| {len(e['overlaps'])} | {len(e['pause_overlaps'])} ({rejected}/{stale}) "
                   f"| {e['started_more_than_once']} | {e['completed_more_than_once']} | {lost} | {e['never_started']} "
                   f"| {statuses} |")
    out += ["", "| job | latency (s) | n | p50 | p90 | p99 | max |", "|---|---|---|---|---|---|---|"]
    for job, e in report["jobs"].items():
        rows = [(f"fencing: {k}", v) for k, v in e["fencing_latency_s"].items()]
        rows.append(("pause tail (SIGCONT to the paused job's last line)", e["fenced_after_pause_s"]))
        if e["policy"] == "retry":
            rows.append(("takeover", e["takeover_latency_s"]))
        for name, p in rows:
            out.append(f"| {job} | {name} | {p['n']} | {p['p50']} | {p['p90']} | {p['p99']} | {p['max']} |")
    out += ["", f"Goals: fencing p100 < lock-delay: {report['goals']['fencing_p100_below_lock_delay']}; takeover p99 <= "
            f"{report['goals']['takeover_p99_limit_s']}s: {report['goals']['takeover_p99_within_limit']}",
            "", f"Violations: {len(report['violations'])}"]
    for v in report["violations"]:
        out.append(f"- {v['kind']} ({v['job']}): " + json.dumps({k: x for k, x in v.items()
                                                                  if k not in ("kind", "job", "evidence")}))
        out += [f"    {json.dumps(ln)}" for ln in v.get("evidence", [])[:8]]
    return "\n".join(out) + "\n"


def main() -> int:
    out = Path(sys.argv[1])
    report = check(out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
