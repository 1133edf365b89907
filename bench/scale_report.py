"""bench/scale.py's arithmetic: one phase's records into figures, and the figures into Markdown.

A phase is one tool (consulrun, or consul lock as the anchor) at one load on
one cluster. Its inputs: the occurrences planned (job, occurrence id, time),
every wrapper's record from the nodes' timers (bench/scale_node.py), the job
starts the jobs themselves logged, and CPU and Raft counters read before and
after. No I/O here, so tests can feed it made-up records.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

KNEE_LAG_S = 1.0  # the issue's knee: the load at which the lag's p99 passes 1 s
TOOLS = ("consulrun", "consul lock")
LEADER_PROJECTION_AT_LEAST = 30  # occurrences: fewer, and the leader's idle CPU (heartbeats, gossip) drowns theirs


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank (no interpolation): the p99 of 60 values is their maximum, as it should be."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def parse_runs(text: str) -> list[dict[str, Any]]:
    """The job starts: `EPOCH TOOL JOB OCC NODE CONSULRUN_OCCURRENCE` per line (what the job script prints)."""
    runs = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 6:
            runs.append({"start": float(parts[0]), "tool": parts[1], "job": parts[2], "occ": parts[3],
                         "node": parts[4], "their_occ": parts[5]})
    return runs


def phase_figures(occurrences: dict[tuple[str, str], float], wrappers: list[dict[str, Any]],
                  runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the tables show for one phase (CPU counters are added by the caller)."""
    by_occ: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_occ[(run["job"], run["occ"])].append(run)
    spawned = {(w["node"], w["job"], w["occ"]): w for w in wrappers if w.get("spawned") is not None}
    ran_on = {(r["node"], r["job"], r["occ"]) for r in runs}
    lags, from_fire, counts = [], [], {"once": 0, "more": 0, "none": 0}
    for key, when in occurrences.items():
        started = sorted(by_occ.get(key, []), key=lambda r: r["start"])
        counts["once" if len(started) == 1 else "more" if started else "none"] += 1
        if started:
            first = started[0]
            lags.append(first["start"] - when)
            fired = spawned.get((first["node"], *key))
            if fired:
                from_fire.append(first["start"] - fired["spawned"])
    fired = [w for w in wrappers if w.get("spawned") is not None]
    losers = [w for w in fired if (w["node"], w["job"], w["occ"]) not in ran_on]
    winners = [w for w in fired if (w["node"], w["job"], w["occ"]) in ran_on]
    statuses: dict[str, int] = defaultdict(int)
    for w in wrappers:
        side = ("not fired" if w.get("spawned") is None
                else "won" if (w["node"], w["job"], w["occ"]) in ran_on else "lost")
        statuses[f"{side}:{w['status']}"] += 1
    loser_cpu = [w["cpu"] for w in losers]
    return {
        "occurrences": len(occurrences), "ran_once": counts["once"], "ran_more": counts["more"],
        "ran_none": counts["none"], "runs": len(runs),
        "misattributed": sum(1 for r in runs if r["their_occ"] not in ("-", r["occ"])),
        "lag_s": summary(lags), "lag_from_fire_s": summary(from_fire),
        "timer_late_s": summary([w["spawned"] - w["planned"] for w in fired]),
        "loser_cpu_ms": summary([c * 1000 for c in loser_cpu]),
        "loser_wall_s": summary([w["ended"] - w["spawned"] for w in losers if w.get("ended")]),
        "winner_cpu_ms": summary([w["cpu"] * 1000 for w in winners]),
        "tick_cpu_ms": summary([w["cpu"] * 1000 for w in fired]),
        "skip_cpu_s": sum(loser_cpu),
        "wrappers_cpu_s": sum(w["cpu"] for w in fired), "wrappers": len(fired), "statuses": dict(statuses),
        "shed": sum(1 for w in wrappers if w["status"] == "shed"),
    }


def summary(values: list[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": max(values) if values else None, "mean": statistics.fmean(values) if values else None}


def note(phase: dict[str, Any]) -> str:
    parts = [phase.get("aborted") or ""]
    if phase.get("shed"):
        parts.append(f"{phase['shed']} firings shed (a node had its most wrappers alive)")
    return "; ".join(p for p in parts if p)


def _n(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def knee(phases: list[dict[str, Any]], tool: str, clients: int) -> tuple[int | None, int | None]:
    """(the highest load measured under the knee, the first load past it) for `tool` on `clients` clients."""
    below, past = None, None
    for phase in sorted((p for p in phases if p["tool"] == tool and p["clients"] == clients),
                        key=lambda p: p["jobs_per_minute"]):
        if past_knee(phase):
            past = past or phase["jobs_per_minute"]
        elif past is None:
            below = phase["jobs_per_minute"]
    return below, past


def past_knee(phase: dict[str, Any]) -> bool:
    p99 = phase["lag_s"]["p99"]
    return bool(phase.get("aborted")) or phase["ran_none"] > 0.01 * phase["occurrences"] or p99 is None \
        or p99 > KNEE_LAG_S or bool(phase.get("shed"))


def markdown(phases: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The report: how it was run, the protocol table, the CPU table, the ratios, the knee."""
    out = [f"Command: `{meta['command']}`\n",
           f"3 Consul servers and N client agents (Consul v1.16.3), each in its own network namespace, Consul's "
           f"default gossip timing, coordinates off. Every job is on every client: each occurrence has N "
           f"contenders, each firing `--spread` ({meta['spread_s']:g} s) at most after the occurrence, uniformly "
           f"at random. Jobs `*:*:SS` spread evenly over the minute; each phase is {meta['window_s']:g} s of "
           f"firings, then a drain. Python {meta['python']}; {meta['cpus']} CPUs.\n"]
    out.append("| clients | jobs/min | tool | occurrences | ran once / more / not | job runs | Raft writes per s "
               "| per occurrence | lag p50 / p99 / max (s) | from the winner's fire p50 / p99 (s) | timer late p99 (s) "
               "| load start / end | note |")
    out.append("|---" * 13 + "|")
    for p in phases:
        lag, fire = p["lag_s"], p["lag_from_fire_s"]
        out.append(f"| {p['clients']} | {p['jobs_per_minute']} | {p['tool']} | {p['occurrences']} | {p['ran_once']} / "
                   f"{p['ran_more']} / {p['ran_none']} | {p['runs']} | {p['writes_per_s']:.1f} | "
                   f"{p['writes_per_occurrence']:.2f} | {_n(lag['p50'])} / {_n(lag['p99'])} / {_n(lag['max'])} | "
                   f"{_n(fire['p50'])} / {_n(fire['p99'])} | {_n(p['timer_late_s']['p99'])} | "
                   f"{p['load_start']:.1f} / {p['load_end']:.1f} | {note(p)} |")
    out.append("\nCPU in % of one core, over the phase (from its first occurrence until its last wrapper ended); a "
               "loser is a wrapper whose node did not run the occurrence; \"not ours\" is the machine's busy time "
               "that none of this run's processes account for:\n")
    out.append("| clients | jobs/min | tool | loser CPU per wrapper p50 / p99 (ms) | loser wall p50 / p99 (s) "
               "| skip-path CPU per node | winner CPU p50 (ms) | leader | leader per occurrence, idle less (ms) "
               "| other servers "
               "| client agents | wrappers (all) | node timers | machine (all cores: %) | not ours |")
    out.append("|---" * 15 + "|")
    for p in phases:
        cpu = p["cpu_pct"]
        out.append(f"| {p['clients']} | {p['jobs_per_minute']} | {p['tool']} | {_n(p['loser_cpu_ms']['p50'], '.0f')} / "
                   f"{_n(p['loser_cpu_ms']['p99'], '.0f')} | {_n(p['loser_wall_s']['p50'])} / "
                   f"{_n(p['loser_wall_s']['p99'])} | {p['skip_cpu_per_node_pct']:.1f} % | "
                   f"{_n(p['winner_cpu_ms']['p50'], '.0f')} | {cpu['leader']:.0f} % | "
                   f"{p['leader_cpu_ms_per_occurrence']:.1f} | {cpu['other_servers']:.0f} % | "
                   f"{cpu['clients']:.0f} % | {cpu['wrappers']:.0f} % | {cpu['timers']:.0f} % | "
                   f"{cpu['machine']:.0f} % ({cpu['machine'] / meta['cpus']:.0f} %) | {cpu['not_ours']:.0f} % |")
    pairs = [(p, q) for p in phases for q in phases if p["tool"] == "consulrun" and q["tool"] == "consul lock"
             and (p["clients"], p["jobs_per_minute"]) == (q["clients"], q["jobs_per_minute"])]
    if pairs:
        out.append("\nRatios consulrun / consul lock, same cluster, same load, same run:\n")
        out.append("| clients | jobs/min | job runs per occurrence | Raft writes per occurrence | Raft writes per s "
                   "| CPU per timer tick p50 (every wrapper) | wrappers' CPU per node | leader CPU | lag p50 | lag p99 |")
        out.append("|---" * 10 + "|")
        for p, q in pairs:
            out.append(f"| {p['clients']} | {p['jobs_per_minute']} | "
                       f"{_ratio(p['runs'], q['runs'])} | "
                       f"{_ratio(p['writes_per_occurrence'], q['writes_per_occurrence'])} | "
                       f"{_ratio(p['writes_per_s'], q['writes_per_s'])} | "
                       f"{_ratio(p['tick_cpu_ms']['p50'], q['tick_cpu_ms']['p50'])} | "
                       f"{_ratio(p['wrappers_cpu_per_node_pct'], q['wrappers_cpu_per_node_pct'])} | "
                       f"{_ratio(p['cpu_pct']['leader'], q['cpu_pct']['leader'])} | "
                       f"{_ratio(p['lag_s']['p50'], q['lag_s']['p50'])} | {_ratio(p['lag_s']['p99'], q['lag_s']['p99'])} |")
    out.append(f"\nThe knee (lag p99 past {KNEE_LAG_S:g} s, a phase stopped or shedding, or more than 1 % of occurrences "
               "not run):\n")
    for clients in sorted({p["clients"] for p in phases}):
        for tool in TOOLS:
            below, past = knee(phases, tool, clients)
            if below is None and past is None:
                continue
            out.append(f"- {clients} clients, {tool}: under the knee up to {below or 'none measured'} jobs/min; "
                       f"past it from {past or 'none measured'} jobs/min.")
    projections = []
    for clients in sorted({p["clients"] for p in phases}):
        for tool in TOOLS:
            below, _ = knee(phases, tool, clients)
            at = [p for p in phases if (p["tool"], p["clients"], p["jobs_per_minute"]) == (tool, clients, below)]
            if at and (line := projection(at[0])):
                projections.append(line)
    if projections:
        out.append("\nProjected from the highest load under the knee (linear in the load; each real node pays only its "
                   "own wrappers, where here every node's ran on one machine):\n")
        out.extend(projections)
    return "\n".join(out) + "\n"


def projection(phase: dict[str, Any]) -> str:
    """From one phase: one node's wrapper CPU at 100 and 1,000 jobs a minute, and the load at which the leader's
    CPU per occurrence would fill a core ("" without both a winner and a loser to go by)."""
    if phase["loser_cpu_ms"]["p50"] is None or phase["winner_cpu_ms"]["p50"] is None:
        return ""
    n = phase["clients"]
    per_tick_ms = (phase["winner_cpu_ms"]["p50"] + (n - 1) * phase["loser_cpu_ms"]["p50"]) / n
    node = {load: load / 60 * per_tick_ms / 10 for load in (100, 1000)}
    leader_ms = phase["leader_cpu_ms_per_occurrence"]
    if phase.get("occurrences", 0) < LEADER_PROJECTION_AT_LEAST or leader_ms <= 0:
        leader = ("; too few occurrences to tell the leader's share from its idle CPU"
                  f" ({phase.get('occurrences', 0)}, at least {LEADER_PROJECTION_AT_LEAST})")
    else:
        leader = (f"; the leader, at {leader_ms:.1f} ms per occurrence, would fill one core at about "
                  f"{60_000 / leader_ms:,.0f} jobs/min")
    return (f"- {n} clients, {phase['tool']} (from {phase['jobs_per_minute']} jobs/min): one node's wrappers take "
            f"{node[100]:.0f} % of a core at 100 jobs/min and {node[1000]:.0f} % at 1,000 "
            f"({per_tick_ms:.0f} ms per timer tick){leader}.")
