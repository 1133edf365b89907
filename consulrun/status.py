"""What Consul knows about each job: who holds it, since when, is that holder healthy, how did runs go.

`collect` reads everything under the prefix in one (optionally blocking)
query, plus the health of each holding session's node, and returns plain
data that the CLI prints as a table or as JSON (the JSON shape is documented
in the README and kept stable).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from consulrun import calendar
from consulrun.consulapi import Client, decoded
from consulrun.manifest import Manifest


class Health(enum.IntEnum):
    """Overall verdict, as the exit status of `consulrun status` (for monitoring checks)."""

    OK = 0
    LAST_RUN_FAILED = 1
    HOLDER_UNHEALTHY = 5


@dataclass
class JobStatus:
    job: str
    state: str  # held | free | never run | orphaned
    in_manifest: bool
    holders: list[dict[str, Any]] = field(default_factory=list)
    last: dict[str, Any] | None = None
    next: str | None = None

    def failed(self) -> bool:
        last = self.last or {}
        return last.get("state") in ("lost", "abandoned") or last.get("exit_status") not in (None, 0)


def _iso(when: datetime | None) -> str | None:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if when else None


def _seconds_between(start: str | None, end: str | None) -> float | None:
    try:
        return (datetime.fromisoformat(end.replace("Z", "+00:00")) -  # type: ignore[union-attr]
                datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        return None


def session_health(client: Client, session_id: str) -> tuple[bool, str]:
    """(healthy, why): a session is healthy if it exists and every check bound to it passes."""
    info = client.session_info(session_id)
    if not info:
        return False, "session no longer exists"
    bound = set(info.get("NodeChecks") or []) | {c.get("ID") for c in info.get("ServiceChecks") or []}
    checks = {c["CheckID"]: c["Status"] for c in client.node_health(info["Node"])}
    failing = sorted(cid for cid in bound if checks.get(cid) != "passing")
    if failing:
        return False, f"check(s) not passing on {info['Node']}: {', '.join(failing)}"
    return True, "passing"


def _jobs_from_entries(prefix: str, entries: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    jobs: dict[str, dict[str, dict[str, Any]]] = {}
    for entry in entries:
        rest = entry["Key"][len(prefix):].split("/", 1)
        if len(rest) == 2 and rest[0]:
            jobs.setdefault(rest[0], {})[rest[1]] = entry
    return jobs


def collect(client: Client, prefix: str, manifest: Manifest | None, *, index: int | None = None,
            wait_s: float | None = None, now: datetime | None = None) -> tuple[int, list[JobStatus]]:
    """(Consul index for a blocking follow-up, one JobStatus per job); manifest jobs first, then orphans."""
    base = prefix.strip("/") + "/"
    idx, entries = client.kv_get(base, recurse=True, index=index, wait_s=wait_s)
    found = _jobs_from_entries(base, entries or [])
    now = now or datetime.now(timezone.utc)
    wanted = {job.name: job for job in manifest.jobs} if manifest else {}
    statuses = []
    for name in list(wanted) + sorted(set(found) - set(wanted)):
        keys = found.get(name, {})
        status = JobStatus(job=name, state="never run", in_manifest=name in wanted)
        if name in wanted:
            status.next = _iso(calendar.following(list(wanted[name].schedules), now))
        elif manifest is not None:
            status.state = "orphaned"
        for key, entry in sorted(keys.items()):
            if (key == "lock" or key.startswith("slots/")) and entry.get("Session"):
                value = decoded(entry)
                healthy, why = session_health(client, entry["Session"])
                status.holders.append({"key": entry["Key"], "node": value.get("node"), "since": value.get("started"),
                                       "session": entry["Session"], "pid": value.get("pid"), "unit": value.get("unit"),
                                       "healthy": healthy, "health": why})
        record = decoded(keys["occurrence"]) if "occurrence" in keys else None
        if record is None:
            lock_values = [decoded(e) for k, e in keys.items() if k == "lock" or k.startswith("slots/")]
            record = next((v["last"] for v in lock_values if isinstance(v.get("last"), dict)), None)
        if record:
            status.last = {k: record.get(k) for k in ("occurrence", "state", "node", "exit_status", "started", "ended",
                                                      "takeover")}
            status.last["duration_s"] = _seconds_between(record.get("started"), record.get("ended"))
        if status.state != "orphaned" and keys:
            status.state = "held" if status.holders else "free"
        statuses.append(status)
    return idx, statuses


def verdict(statuses: list[JobStatus]) -> Health:
    if any(not h["healthy"] for s in statuses for h in s.holders):
        return Health.HOLDER_UNHEALTHY
    if any(s.failed() for s in statuses):
        return Health.LAST_RUN_FAILED
    return Health.OK


def as_json(prefix: str, statuses: list[JobStatus], health: Health) -> dict[str, Any]:
    return {"prefix": prefix, "verdict": health.name.lower(), "jobs": [
        {"job": s.job, "state": s.state, "in_manifest": s.in_manifest, "holders": s.holders, "last": s.last,
         "next": s.next} for s in statuses]}


def table(statuses: list[JobStatus]) -> list[list[str]]:
    rows = [["JOB", "STATE", "HOLDER", "SINCE", "SESSION", "HEALTH", "LAST OCCURRENCE", "LAST RESULT", "NEXT"]]
    for s in statuses:
        holder = s.holders[0] if s.holders else {}
        last = s.last or {}
        result = ""
        if last:
            took = f" in {last['duration_s']:.0f}s" if last.get("duration_s") is not None else ""
            code = f"exit {last['exit_status']}" if last.get("exit_status") is not None else (last.get("state") or "")
            result = f"{code}{took} on {last.get('node') or '?'}"
        rows.append([s.job, s.state + (f" ({len(s.holders)})" if len(s.holders) > 1 else ""),
                     holder.get("node") or "-", holder.get("since") or "-", (holder.get("session") or "-")[:8],
                     holder.get("health", "-") if holder else "-", last.get("occurrence") or "-", result or "-",
                     s.next or "-"])
    return rows
