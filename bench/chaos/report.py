"""The checker's report as Markdown: the tables docs/chaos.md shows, and each violation with its history lines."""

from __future__ import annotations

import json
from typing import Any

from bench.chaos import consul_faults


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
            if e.get("lost_while_no_client_served"):
                lost = f"{lost} (+{len(e['lost_while_no_client_served'])} while Consul served no client)"
        if e.get("each_node"):
            lost = f"{len(e['healthy_node_not_run'])} healthy node(s) not run" + \
                ("" if e.get("each_node_condition_holds") else " (no room for every node: not judged)")
        if e["policy"] == "retry" and not e.get("retry_condition_holds"):
            lost = f"{lost} (condition does not hold)"
        statuses = ", ".join(f"{k}: {v}" for k, v in e["wrapper_exit_statuses"].items())
        out.append(f"| {job} | {e['policy']} | `{e['schedule']}` | {e['occurrences']} | {e['runs']} | {e['completed']} "
                   f"| {len(e['overlaps'])} | {len(e['pause_overlaps'])} ({rejected}/{stale}) "
                   f"| {e['started_more_than_once']} | {e['completed_more_than_once']} | {lost} | {e['never_started']} "
                   f"| {statuses} |")
    out += ["", *totals(report)]
    chained = {job: e for job, e in report["jobs"].items() if e.get("after")}
    if chained:
        out += ["", "| chained job | after | chained runs | without the parent's end | twice for one parent run |",
                "|---|---|---|---|---|"]
        out += [f"| {job} | {', '.join(f'{p} ({on})' for p, on in e['after'].items())} | {e['chained_runs']} "
                f"| {len(e['chained_without_parent_end'])} | {len(e['chained_twice'])} |" for job, e in chained.items()]
    restored = [(job, e) for job, e in report["jobs"].items() if "snapshot-restore" in report["faults"]]
    if restored:
        out += ["", "Counted apart, after a snapshot restore (the restore took back claims and locks): " + "; ".join(
            f"{job}: {len(e['repeated_after_restore'])} occurrence(s) run again, {len(e['restore_overlaps'])} "
            f"overlap(s), {len(e.get('lost_around_a_restore', []))} not completed around a restore"
            for job, e in restored)]
    out += consul_faults.markdown(report.get("consul_faults") or {"restarts": [], "restores": []})
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


def totals(report: dict[str, Any]) -> list[str]:
    """One row per policy over the jobs the guarantees are claimed for (under `retry`, those whose density
    condition holds), and the denser jobs apart: the counts the evidence issue asks for."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in report["jobs"].values():
        beyond = e["policy"] == "retry" and not e.get("retry_condition_holds")
        groups.setdefault(e["policy"] + (" (condition does not hold)" if beyond else ""), []).append(e)
    out = ["| policy | jobs | occurrences | overlaps (outside pauses) | duplicates (a second holder) | lost with a healthy node "
           "| worst fencing p100 (s) | worst takeover p99 (s) |", "|" + "---|" * 8]
    for name, jobs in groups.items():
        def worst(key: str, field: str) -> object:
            values = [e[key][k][field] if key == "fencing_latency_s" else e[key][field]
                      for e in jobs for k in (e[key] if key == "fencing_latency_s" else [None])]
            values = [v for v in values if v is not None]
            return max(values) if values else "none"
        lost: object = "n/a"
        if name.startswith("retry"):
            lost = sum(len(e["lost_with_healthy_node"]) for e in jobs)
            unserved = sum(len(e.get("lost_while_no_client_served", [])) for e in jobs)
            lost = f"{lost} (+{unserved} while Consul served no client)" if unserved else lost
        # Under retry a second holder is the guarantee at work; a holder's own retries are no duplicate either.
        dupes = "n/a" if name.startswith("retry") else sum(len(e.get("duplicates", [])) for e in jobs)
        takeover = worst("takeover_latency_s", "p99") if name.startswith("retry") else "n/a"
        out.append(f"| {name} | {len(jobs)} | {sum(e['occurrences'] for e in jobs)} "
                   f"| {sum(len(e['overlaps']) for e in jobs)} | {dupes} "
                   f"| {lost} | {worst('fencing_latency_s', 'max')} | {takeover} |")
    return out
