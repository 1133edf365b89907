"""The checker: reads the host's history and the nemesis log and says what the locks guaranteed.

A run is one start line of the job; its interval is [start, end] or, if it
never ended, [start, last heartbeat]. Per job it reports overlapping runs
(pause overlaps apart, with whether a fencing-token guarded store would have
rejected the stale holder's writes), occurrences run twice under `skip`,
occurrences never completed under `retry` although a client node was free of
faults, one holder running an occurrence more often than its `retries.attempts` allow
(1 without retries), an attempt number run twice (a takeover's count started afresh), an each-node job's
node running two of its occurrences at once, a chained job's run without its parent's end or twice for one parent run
(chains.py), wrapper exit statuses, fencing latency (fault start -> the holder's
job dead) and takeover latency (holder's job dead -> a standby's job start) as
percentiles, and Raft writes per occurrence. A `retry` occurrence lost because
every wrapper on a fault-free node gave up with 69 while no client's agent
could serve a consistent read (probe.py) for as long as it tried (at most the
start budget) is counted apart: the guarantee is at least once while a node
can reach Consul. Heartbeats come every 100 ms, so
"dead" times are late by at most 0.1 s. What follows a snapshot restore (an
occurrence started again, an overlap, a retry occurrence not completed) is
counted apart: the guarantees state it, so it is no violation.

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

from bench.chaos import chains
from bench.chaos import consul_faults
from bench.chaos.consul_faults import RESTORE_KINDS
from bench.chaos.logs import read
from bench.chaos.probe import PERIOD_S, unserved_spans
from bench.chaos.report import markdown
from consulrun.protocol.fencing import START_RETRY_S

# Booted systemd nodes add unit-kill, freeze, poweroff and power-cut (bench/chaos/systemd_faults.py).
CLIENT_FAULTS = {"agent-kill", "partition-client", "wrapper-kill", "pause", "skew",
                 "unit-kill", "freeze", "poweroff", "power-cut"}
FENCING_FAULTS = ("agent-kill", "partition-client", "wrapper-kill", "partition-server", "leader-kill",
                  "rolling-restart", "snapshot-restore", "unit-kill", "poweroff", "power-cut")
NODE_FAULTS = {"agent-kill", "partition-client", "poweroff", "power-cut"}  # hit every run on their node
WRAPPER_FAULTS = {"wrapper-kill", "unit-kill"}  # hit the run of one wrapper
PAUSE_FAULTS = {"pause", "freeze"}  # stop runs (their `pids`) without killing them
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
    attempt: int | None = None  # its CONSULRUN_ATTEMPT (histories from before it was logged have none)


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
        if event in ("fire", "busy", "exit", "stop-post", "on-failure"):
            timer_events.append(line)
            continue
        job, pid, token, t = line["job"], line["pid"], line.get("token", 0), line["t"]
        if event == "start":
            run = Run(job, line["node"], pid, line["wrapper"], line.get("occ") or "", token, t, t, lines=[line],
                      attempt=int(line["attempt"]) if str(line.get("attempt") or "").isdigit() else None)
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
    """The report of the run in `out` (run.json, history.log, nemesis.log); `violations` lists broken guarantees."""
    meta = json.loads((out / "run.json").read_text())
    ttl, lock_delay = meta["ttl_s"], meta["lock_delay_s"]
    runs_by_job, timer_events = load_runs(out / "history.log")
    faults = load_faults(out / "nemesis.log", meta.get("t_end") or meta["fire_until"])
    # Runs before the probe existed have no probes.log: every node counts as served (the old, stricter model).
    unserved = unserved_spans(out / "probes.log", meta.get("t_end") or meta["fire_until"])
    for fault in faults:
        if fault.kind in PAUSE_FAULTS:
            for run in (r for runs in runs_by_job.values() for r in runs):
                # Pids come back (a node booted again numbers from 1): only a run alive at the pause was paused.
                alive = run.start - HOLDER_SEEN_S <= fault.start <= run.last + HEARTBEAT_S
                if alive and (run.pid in fault.pids() or run.wrapper in fault.pids()):
                    run.paused.append(fault.id)
    report: dict[str, Any] = {"command": meta.get("command"), "duration_s": meta.get("duration_s"),
                              "ttl_s": ttl, "lock_delay_s": lock_delay,
                              "faults": dict(Counter(f.kind for f in faults)), "jobs": {}, "violations": []}
    for spec in meta["jobs"]:
        job = _Job(spec, runs_by_job.get(spec["name"], []), timer_events, faults, meta, unserved)
        chained, chain_violations = chains.judge(spec, runs_by_job)
        report["jobs"][spec["name"]] = {**job.entry, **chained}
        report["violations"] += job.violations + chain_violations
    report["consul_faults"] = consul_faults.summary(list(read(out / "nemesis.log")), list(read(out / "history.log")),
                                                    lock_delay, consul_faults.leadership_acquired(out / "agents"))
    fired = sum(e["occurrences"] for e in report["jobs"].values())
    before, after = meta.get("applied_before"), meta.get("applied_after")
    report["raft_writes"] = (after - before) if before is not None and after is not None else None
    report["occurrences"] = fired
    report["raft_writes_per_occurrence"] = (round(report["raft_writes"] / fired, 1)
                                            if report["raft_writes"] is not None and fired else None)
    limit = 2 * ttl + lock_delay + 2
    report["goals"] = {
        "fencing_p100_below_lock_delay": all((e["fencing_latency_s"]["all (pauses apart)"]["max"] or 0) < lock_delay
                                             for e in report["jobs"].values()),
        "takeover_p99_limit_s": limit,
        "takeover_p99_within_limit": all((e["takeover_latency_s"]["p99"] or 0) <= limit
                                         for e in report["jobs"].values())}
    return report


class _Job:
    """One job's history judged: its `entry` in the report and its `violations`."""

    def __init__(self, spec: dict[str, Any], runs: list[Run], timer_events: list[dict[str, Any]],
                 faults: list[Fault], meta: dict[str, Any],
                 unserved: dict[str, list[tuple[float, float]]] | None = None) -> None:
        self.spec, self.faults, self.clients = spec, faults, meta["clients"]
        self.unserved = unserved or {}
        self.name, self.policy = spec["name"], spec["policy"]
        self.horizon = 2 * meta["ttl_s"] + meta["lock_delay_s"]  # how long a fault can still act after it started
        self.runs = sorted(runs, key=lambda r: r.start)
        self.fires = [e for e in timer_events if e.get("job") == self.name]
        self.restores = [f for f in faults if f.kind in RESTORE_KINDS]
        # A chained job's fires (its emulated chain-watch) are for no scheduled time: chains.py judges its runs.
        self.occurrences = sorted({e["sched"] for e in self.fires if e["ev"] in ("fire", "busy")}) \
            if spec.get("schedule") else []
        self.by_occ: dict[str, list[Run]] = defaultdict(list)
        for run in self.runs:
            self.by_occ[run.occ].append(run)
        # Wrappers killed between acquisition and their job's first line left no run: occurrence of each.
        logged = {r.wrapper for r in self.runs}
        fired = {e["wrapper"]: e["sched"] for e in self.fires if e["ev"] == "fire"}
        self.killed_unlogged = [(f, fired[f.line["wrapper"]]) for f in faults if f.kind == "wrapper-kill"
                                and f.line.get("wrapper") in fired and f.line["wrapper"] not in logged]
        self.violations: list[dict[str, Any]] = []
        self.entry: dict[str, Any] = {
            "policy": self.policy, "schedule": spec["schedule"], "interval_s": spec["interval_s"],
            "job_seconds": spec["seconds"], "retry_condition_holds": spec.get("condition_holds"),
            "occurrences": len(self.occurrences), "runs": len(self.runs), "completed": sum(r.ended for r in self.runs)}
        if spec.get("each_node"):
            self._each_node(int(spec["each_node"]), meta)
        else:
            self._overlaps()
            self._outcomes()
        self.entry["wrapper_exit_statuses"] = dict(sorted(
            Counter(str(e["status"]) for e in self.fires if e["ev"] == "exit").items(), key=lambda kv: int(kv[0])))
        self.entry["timer_busy"] = sum(e["ev"] == "busy" for e in self.fires)
        self._fencing()
        self._takeovers()

    def _overlaps(self) -> None:
        """Any two runs of the job at once, whatever their occurrences; those with a paused run apart."""
        overlaps, pause_overlaps, restore_overlaps = [], [], []
        for i, first in enumerate(self.runs):
            for second in self.runs[i + 1:]:
                if second.start >= first.last:
                    break
                end = min(first.last, second.last)
                stale, fresh = (first, second) if first.token <= second.token else (second, first)
                # The stale holder's writes once a newer holder started, to the end of its run (a paused
                # holder's tail often comes after the newer run ended).
                stale_writes = [w for w in stale.writes if w[0] > fresh.start]
                item = {"runs": [_describe(first), _describe(second)], "seconds": round(end - second.start, 3),
                        "from": second.start, "to": end,
                        "faults": [f.label() for f in active_faults(self.faults, second.start - self.horizon, end)],
                        "stale_writes": len(stale_writes),
                        "stale_writes_rejected_by_token": sum(rejected for _, rejected in stale_writes),
                        "evidence": [*first.lines, *second.lines]}
                if first.paused or second.paused:
                    pause_overlaps.append(item)
                elif self._restored_between(first.start, second.start):
                    restore_overlaps.append(item)
                else:
                    overlaps.append(item)
        self.entry["overlaps"] = overlaps
        self.entry["restore_overlaps"] = restore_overlaps
        self.entry["pause_overlaps"] = pause_overlaps
        self.entry["pause_overlaps_all_rejected_by_token"] = all(
            o["stale_writes_rejected_by_token"] == o["stale_writes"] for o in pause_overlaps)
        self.violations += [{"kind": "overlap", "job": self.name, **item} for item in overlaps]

    def _each_node(self, limit: int, meta: dict[str, Any]) -> None:
        """`mode: each-node` with lock.concurrency `limit`: never more than `limit` runs at once (a paused run's
        crowd counted apart, as pause overlaps are), never two holders of one occurrence on one node, and every
        node that fired for an occurrence and had no fault in its interval ran it, where the schedule leaves room
        for every node's turn plus one holder's death (`each_node_condition_holds`)."""
        self._attempts()
        crowds, pause_crowds, active = [], [], []
        for run in self.runs:  # sorted by start
            active = [r for r in active if r.last > run.start] + [run]
            if len(active) > limit:
                item = {"at": run.start, "limit": limit, "runs": [_describe(r) for r in active],
                        "faults": [f.label() for f in active_faults(self.faults, run.start - self.horizon, run.start)],
                        "evidence": [ln for r in active for ln in r.lines]}
                (pause_crowds if any(r.paused for r in active) else crowds).append(item)
        self.entry["each_node"] = limit
        self.entry["overlaps"], self.entry["pause_overlaps"] = crowds, pause_crowds
        self.entry["pause_overlaps_all_rejected_by_token"] = True  # slots have tokens of their own: not compared
        self.violations += [{"kind": f"more than {limit} at once", "job": self.name, **item} for item in crowds]
        by_node: dict[tuple[str, str], list[Run]] = defaultdict(list)
        for run in self.runs:
            by_node[(run.occ, run.node)].append(run)
        twice = [{"occurrence": occ, "node": node, "runs": [_describe(r) for r in rs],
                  "evidence": [ln for r in rs for ln in r.lines]}
                 for (occ, node), rs in by_node.items() if len({r.token for r in rs}) > 1]
        self.entry["duplicates"] = twice
        self.violations += [{"kind": "twice on one node", "job": self.name, **item} for item in twice]
        # A node runs one of its occurrences at a time: its run of the next waits for its run of the last.
        at_once = []
        for node in sorted({r.node for r in self.runs}):
            mine = [r for r in self.runs if r.node == node]
            at_once += [{"node": node, "runs": [_describe(a), _describe(b)], "evidence": [*a.lines, *b.lines]}
                        for i, a in enumerate(mine) for b in mine[i + 1:]
                        if b.start < a.last and a.occ != b.occ and not (a.paused or b.paused)]
        self.entry["two_occurrences_at_once_on_one_node"] = at_once
        self.violations += [{"kind": "two occurrences at once on one node", "job": self.name, **item}
                            for item in at_once]
        self.entry["started_more_than_once"] = len(twice)
        self.entry["completed_more_than_once"] = sum(sum(r.ended for r in rs) > 1 for rs in by_node.values())
        clients = meta["clients"]
        worst = (meta.get("max_delay_s", 2.0) + math.ceil(len(clients) / limit) * (self.spec["seconds"] + 1.0)
                 + 2 * meta["ttl_s"] + meta["lock_delay_s"] + self.spec["seconds"])
        holds = self.spec["interval_s"] > worst
        self.entry["each_node_condition_holds"] = holds
        skipped, excused = [], 0
        for occ in self.occurrences:
            t0 = _epoch(occ)
            window = (t0, t0 + self.spec["interval_s"])
            fired = sorted({e["node"] for e in self.fires if e["sched"] == occ and e["ev"] == "fire"})
            for node in fired:
                if any(r.ended for r in by_node.get((occ, node), [])):
                    continue
                sick = [f for f in self.faults if f.start <= window[1] and f.end + RECOVERY_S >= window[0]
                        and (f.node == node or f.kind not in CLIENT_FAULTS)]
                holder_deaths = sum(1 for r in self.runs if r.occ == occ and not r.ended)
                if sick or holder_deaths > 1 or not holds:
                    excused += 1
                    continue
                skipped.append({"occurrence": occ, "node": node,
                                "wrappers": [{k: e.get(k) for k in ("ev", "status", "last")} for e in self.fires
                                             if e["sched"] == occ and e.get("node") == node and e["ev"] == "exit"]})
        self.entry["healthy_node_not_run"] = skipped
        self.entry["not_run_with_faults_or_no_room"] = excused
        self.entry["never_started"] = sum(1 for occ in self.occurrences if occ not in self.by_occ)
        self.entry["lost_with_healthy_node"] = skipped
        self.entry["lost_after_repeated_holder_deaths"] = []
        self.violations += [{"kind": "each-node: a healthy node did not run", "job": self.name, **item}
                            for item in skipped]

    def _outcomes(self) -> None:
        by_occ = self.by_occ
        self._attempts()
        ran_twice = {occ: rs for occ, rs in by_occ.items() if len(rs) > 1}
        # Under skip, a duplicate is a second holder (another fencing token); one holder's retries are judged by
        # _attempts.
        held_twice = {occ: rs for occ, rs in ran_twice.items() if len({r.token for r in rs}) > 1}
        completed_twice = {occ: rs for occ, rs in by_occ.items() if sum(r.ended for r in rs) > 1}
        # A snapshot restore between a run and the next run of its occurrence took the claim back (counted apart).
        restored = {occ for occ, rs in ran_twice.items() if self._restored_between(rs[0].start, rs[-1].start)}
        self.entry["repeated_after_restore"] = [{"occurrence": occ, "runs": [_describe(r) for r in by_occ[occ]],
                                                 "restores": [f.label() for f in self.restores
                                                              if by_occ[occ][0].start - HOLDER_SEEN_S <= f.start
                                                              <= by_occ[occ][-1].start],
                                                 "evidence": [ln for r in by_occ[occ] for ln in r.lines]}
                                                for occ in sorted(restored)]
        held_twice = {occ: rs for occ, rs in held_twice.items() if occ not in restored}
        self.entry["started_more_than_once"] = len(ran_twice)
        self.entry["completed_more_than_once"] = len(completed_twice)
        self.entry["never_started"] = sum(1 for occ in self.occurrences if occ not in by_occ)
        self.entry["started_never_completed"] = sum(1 for occ in self.occurrences if occ in by_occ
                                                    and not any(r.ended for r in by_occ[occ]))
        if self.policy == "skip":
            duplicates = [{"occurrence": occ, "runs": [_describe(r) for r in rs],
                           "evidence": [ln for r in rs for ln in r.lines]} for occ, rs in held_twice.items()]
            self.entry["duplicates"] = duplicates
            self.violations += [{"kind": "duplicate under skip", "job": self.name, **d} for d in duplicates]
            return
        self.entry["completed_twice"] = [{"occurrence": occ, "runs": [_describe(r) for r in rs]}
                                         for occ, rs in completed_twice.items()]
        self._lost()

    def _attempts(self) -> None:
        """Never more attempts than allowed: the runs one holder (one fencing token) made of one occurrence are
        its retries (`retries.attempts`, the first run included; 1 without retries)."""
        allowed = int(self.spec.get("attempts", 1))
        per_holder: dict[tuple[str, int], list[Run]] = defaultdict(list)
        for run in self.runs:
            per_holder[(run.occ, run.token)].append(run)
        too_many = [{"occurrence": occ, "token": token, "attempts": len(rs), "allowed": allowed,
                     "runs": [_describe(r) for r in rs], "evidence": [ln for r in rs for ln in r.lines]}
                    for (occ, token), rs in per_holder.items() if len(rs) > allowed]
        # Across holders: each run of an occurrence has its own attempt number (CONSULRUN_ATTEMPT, counted from
        # the record), so a takeover goes on from the attempts before it; a number seen twice is a count that
        # started afresh, and with it the budget (per node for each-node; a restore apart).
        numbered: dict[tuple[str, str, int], list[Run]] = defaultdict(list)
        for run in self.runs:
            if run.attempt is not None:
                numbered[(run.occ, run.node if self.spec.get("each_node") else "", run.attempt)].append(run)
        repeated = [{"occurrence": occ, "node": node or None, "attempt": number,
                     "runs": [_describe(r) for r in rs], "evidence": [ln for r in rs for ln in r.lines]}
                    for (occ, node, number), rs in numbered.items()
                    if len(rs) > 1 and not self._restored_between(rs[0].start, rs[-1].start)]
        self.entry["attempt_numbers_repeated"] = repeated
        self.violations += [{"kind": "an attempt number run twice", "job": self.name, **item} for item in repeated]
        self.entry["attempts_allowed"] = allowed
        self.entry["more_attempts_than_allowed"] = too_many
        self.violations += [{"kind": "more attempts than allowed", "job": self.name, **item} for item in too_many]

    def _lost(self) -> None:
        """Occurrences no run completed, judged against the client nodes' health during their interval."""
        lost, lost_no_healthy, lost_repeated, lost_after_restore, lost_unserved = [], [], [], [], []
        # A wrapper retries an unavailable Consul this long at start, then exits 69 (runner._start_retry_budget).
        budget = min(START_RETRY_S, self.spec["interval_s"] / 2)
        attempts_killed = Counter(r.occ for r in self.runs if not r.ended)
        attempts_killed.update(occ for _, occ in self.killed_unlogged)
        for occ in self.occurrences:
            if any(r.ended for r in self.by_occ.get(occ, [])):
                continue
            t0 = _epoch(occ)
            window = (t0, t0 + self.spec["interval_s"])
            if self._restored_between(window[0] - self.horizon, window[1]):
                lost_after_restore.append(occ)
                continue
            sick = [f for f in self.faults if f.kind in CLIENT_FAULTS
                    and f.start <= window[1] and f.end + RECOVERY_S >= window[0]]
            always_healthy = [c for c in self.clients if c not in {f.node for f in sick}]
            # As the issue puts it: at every instant of the occurrence's interval some client node had no fault.
            healthy = always_healthy or _some_node_healthy_throughout(sick, self.clients, window)
            item = {"occurrence": occ, "healthy_nodes": always_healthy, "attempts_killed": attempts_killed[occ],
                    "faults": [f.label() for f in active_faults(self.faults, window[0] - self.horizon, window[1])],
                    "wrappers": [{k: e.get(k) for k in ("ev", "node", "status", "ran", "last")}
                                 for e in self.fires if e.get("sched") == occ and e["ev"] in ("exit", "busy")],
                    "evidence": [ln for r in self.by_occ.get(occ, []) for ln in r.lines]}
            # The longest span of the interval in which every client had a fault or could not be served: one
            # past the start budget leaves every wrapper that fired in it exiting 69.
            item["no_client_served_s"] = round(_longest_all_down(sick, self.unserved, self.clients, window), 1)
            if not healthy:
                lost_no_healthy.append(item)
            elif self._gave_up_unserved(occ, sick, budget):
                lost_unserved.append(item)
            elif attempts_killed[occ] >= 2:  # the condition allows for one holder death per occurrence
                lost_repeated.append(item)
            else:
                lost.append(item)
        self.entry["lost_with_healthy_node"] = lost
        self.entry["lost_without_healthy_node"] = len(lost_no_healthy)
        self.entry["lost_while_no_client_served"] = lost_unserved
        self.entry["lost_after_repeated_holder_deaths"] = lost_repeated
        self.entry["lost_around_a_restore"] = lost_after_restore
        if self.spec.get("condition_holds"):
            self.violations += [{"kind": "lost under retry", "job": self.name, **item} for item in lost]

    def _gave_up_unserved(self, occ: str, sick: list[Fault], budget: float) -> bool:
        """Every wrapper of `occ` on a fault-free node exited 69 after trying the whole time Consul served no
        client: from its fire to its exit, an all-down span as long as its attempt (at most the start budget),
        less the probe's resolution. A wrapper that gave up early, exited otherwise, or tried while a client was
        served is no excuse."""
        faulted = {f.node for f in sick}
        judged = [e for e in self.fires if e.get("sched") == occ and e["ev"] == "exit" and e["node"] not in faulted]
        if not judged or any(e.get("status") != 69 for e in judged):
            return False
        for exit_ in judged:
            ran = float(exit_.get("ran") or 0.0)
            if ran <= 0:  # how long it tried is unknown
                return False
            window = (exit_["t"] - ran, exit_["t"])
            if _longest_all_down(sick, self.unserved, self.clients, window) < min(ran, budget) - 2 * PERIOD_S:
                return False
        return True

    def _restored_between(self, t0: float, t1: float) -> bool:
        """A snapshot restore began in [t0 - HOLDER_SEEN_S, t1]: what ran before it may run again after it."""
        return any(t0 - HOLDER_SEEN_S <= f.start <= t1 for f in self.restores)

    def _fencing(self) -> None:
        """Fault start -> the hit holder's job dead (it never ended); and the tail of each pause."""
        fencing: dict[str, list[float]] = defaultdict(list)
        fenced: set[int] = set()
        for fault in (f for f in self.faults if f.kind in FENCING_FAULTS):
            for run in self.runs:
                # The job may have died before its next heartbeat was due: the last one is up to 0.1 s old. The
                # nemesis sees a holder when its job is forked, a little before the job's start line.
                if (run.ended or not run.start - HOLDER_SEEN_S <= fault.start <= run.last + HEARTBEAT_S
                        or run.pid in fenced):
                    continue
                if fault.kind in NODE_FAULTS and run.node != fault.node:
                    continue
                if fault.kind in WRAPPER_FAULTS and run.wrapper != fault.line.get("wrapper"):
                    continue
                fencing[fault.kind].append(max(0.0, run.last - fault.start))
                fenced.add(run.pid)
        pause_tail = []
        for run in (r for r in self.runs if r.paused):  # from SIGCONT to the paused job's last line
            fault = next(f for f in self.faults if f.id == run.paused[-1])
            pause_tail.append(max(0.0, run.last - (fault.healed or fault.end)))
            fenced.add(run.pid)
        self.entry["fencing_latency_s"] = {kind: percentiles(v) for kind, v in sorted(fencing.items())}
        self.entry["fencing_latency_s"]["all (pauses apart)"] = percentiles([x for v in fencing.values() for x in v])
        self.entry["fenced_after_pause_s"] = percentiles(pause_tail)
        self.entry["died_unexplained"] = [_describe(r) for r in self.runs if not r.ended and r.pid not in fenced]

    def _takeovers(self) -> None:
        """A dead holder's last line (or its wrapper's kill) -> the next run of the same occurrence starts."""
        deaths = [(run.occ, run.start, run.last) for run in self.runs if not run.ended]
        deaths += [(occ, fault.start, fault.start) for fault, occ in self.killed_unlogged]
        takeovers, not_taken_over = [], 0
        for occ, began, died in deaths if self.policy == "retry" else []:
            after = [r for r in self.by_occ.get(occ, []) if r.start > began]
            if after:
                takeovers.append(after[0].start - died)
            else:
                not_taken_over += 1
        self.entry["takeover_latency_s"] = percentiles(takeovers)
        self.entry["died_not_taken_over"] = not_taken_over


def _some_node_healthy_throughout(sick: list[Fault], clients: list[str], window: tuple[float, float]) -> bool:
    """True if at no instant of `window` every client node had a fault."""
    return not _all_down_spans(sick, {}, clients, window)


def _longest_all_down(sick: list[Fault], unserved: dict[str, list[tuple[float, float]]], clients: list[str],
                      window: tuple[float, float]) -> float:
    """The longest span of `window` in which every client had a fault or a failing probe."""
    return max((end - start for start, end in _all_down_spans(sick, unserved, clients, window)), default=0.0)


def _all_down_spans(sick: list[Fault], unserved: dict[str, list[tuple[float, float]]], clients: list[str],
                    window: tuple[float, float]) -> list[tuple[float, float]]:
    """The spans of `window` (first and last sample, every 0.1 s) in which every client had a fault (until its
    recovery, and RECOVERY_S more) or a failing probe; a single all-down sample is a span of length 0."""
    spans: list[tuple[float, float]] = []
    since: float | None = None
    t = window[0]
    while t <= window[1]:
        down = {f.node for f in sick if f.start <= t <= f.end + RECOVERY_S}
        down |= {node for node, gaps in unserved.items() if any(a <= t <= b for a, b in gaps)}
        if down >= set(clients):
            since = t if since is None else since
            if spans and spans[-1][0] == since:
                spans[-1] = (since, t)
            else:
                spans.append((since, t))
        else:
            since = None
        t += 0.1
    return spans


def _epoch(occ: str) -> float:
    return datetime.strptime(occ, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def _describe(run: Run) -> str:
    how = "ended" if run.ended else "died"
    return (f"{run.node} pid {run.pid} occ {run.occ} token {run.token} {run.start:.3f}-{run.last:.3f} {how}"
            + (f" paused#{','.join(map(str, run.paused))}" if run.paused else ""))


def main() -> int:
    out = Path(sys.argv[1])
    report = check(out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
