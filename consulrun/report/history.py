"""A job's runs across the cluster, newest first, from the records the runs leave in Consul.

Each `history/<occurrence>` entry (and the live `occurrence` record) is one
occurrence; its `earlier` list holds the attempts that were lost or abandoned
before a takeover, and those that failed and were retried (`retries:`), so
every attempt becomes one row. A run made without
`--schedule` leaves only the lock's `last` value: it is listed as manual.

Occurrences skipped while the job was paused left no record (the skip path
writes nothing): they are derived from the pause episodes and the schedule
(the manifest's, else the one the runs stored), and listed as `skipped`.
"""

from __future__ import annotations

from datetime import datetime, timezone

from consulrun.consul.client import Client, decoded
from consulrun.protocol import keys as names, pause
from consulrun.report.status import ABANDONED_UNRECORDED, NoState, parse_time, probe, seconds_between

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

FIELDS = ("occurrence", "attempt", "node", "started", "ended", "duration_s", "exit_status", "state", "takeover",
          "manual", "reason", "session", "paused", "host", "unit", "invocation_id", "retried", "retry_after_s",
          "retry_at", "retries_ended", "after")


def _row(record: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    row = {name: record.get(name) for name in FIELDS}
    row.update(overrides)
    row["duration_s"] = seconds_between(row["started"], row["ended"])
    row["takeover"] = bool(row["takeover"])
    row["manual"] = bool(row["manual"])
    row["retried"] = bool(row["retried"])
    if row["state"] is None and record.get("lost"):
        row["state"], row["reason"] = "lost", str(record["lost"])
    if row["state"] is None and row["ended"]:
        row["state"] = "done"
    return row


def _attempts(record: dict[str, Any]) -> list[dict[str, Any]]:
    earlier = [e for e in record.get("earlier") or [] if isinstance(e, dict)]
    rows = [_row(e, occurrence=e.get("occurrence") or record.get("occurrence"), attempt=e.get("attempt") or n + 1)
            for n, e in enumerate(earlier)]
    rows.append(_row(record, attempt=record.get("attempt") or len(earlier) + 1))
    return rows


def runs(client: Client, prefix: str, job: str, limit: int, schedules: tuple[str, ...] = (),
         now: datetime | None = None) -> list[dict[str, Any]]:
    """The newest `limit` runs of `job`, and occurrences skipped while it was paused (by `schedules`, else by
    the schedule its runs stored); NoState if it has no state at all, PermissionDenied if ACLs hide any."""
    base = f"{prefix.strip('/')}/{job}/"
    _, entries = client.kv_tree(base)
    if not entries:
        probe(client, base + "occurrence")
        raise NoState(f"job {job!r} has no state under {prefix.strip('/')}/ in Consul (wrong job name or --prefix?)")
    keys = {e["Key"][len(base):]: e for e in entries}
    rows = rows_of(keys)
    rows += skipped_rows(keys, rows, schedules or stored_schedule(keys), now or datetime.now(timezone.utc), limit)
    return newest_first(rows)[:limit]


def stored_schedule(keys: dict[str, dict[str, Any]]) -> tuple[str, ...]:
    """The schedule the newest run recorded (the live record, else the newest history entry), or ()."""
    for key in ["occurrence", *sorted((k for k in keys if k.startswith(names.HISTORY)), key=names.history_order,
                                      reverse=True)]:
        stored = decoded(keys.get(key)).get("schedule")
        if isinstance(stored, list) and stored and all(isinstance(spec, str) for spec in stored):
            return tuple(stored)
    return ()


def skipped_rows(keys: dict[str, dict[str, Any]], rows: list[dict[str, Any]], schedules: tuple[str, ...],
                 now: datetime, limit: int) -> list[dict[str, Any]]:
    """A row per occurrence that fell inside a pause and that no node ran (newest `limit`)."""
    ran = {str(r["occurrence"]) for r in rows if r["occurrence"]}
    out = []
    for occurrence, episode in pause.skipped(pause.episodes(keys, now), list(schedules), ran, now, limit):
        out.append({**{name: None for name in FIELDS}, "occurrence": occurrence, "state": "skipped",
                    "takeover": False, "manual": False, "reason": pause.why(episode),
                    "paused": {k: episode.get(k) for k in pause.EPISODE_FIELDS}})
    return out


def newest_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By start (a skipped occurrence, which never started, by its scheduled time), then attempt."""
    oldest = datetime.min.replace(tzinfo=timezone.utc)
    return sorted(rows, key=lambda r: (parse_time(r["started"] or r["occurrence"]) or oldest, r["attempt"] or 0),
                  reverse=True)


def rows_of(keys: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run the keys of one job (key below `<prefix>/<job>/` -> KV entry) record, newest first; an each-node
    job's records are each node's own (`nodes/<node>/occurrence`, `nodes/<node>/history/<occurrence>`)."""
    records: dict[tuple[str, str], dict[str, Any]] = {}
    current: dict[str, dict[str, Any]] = {}
    # Oldest write first, so that of two entries of one occurrence (an old node's key and a new node's, keys.py)
    # the later write stands; an old key and a new one name the same manual run alike.
    for key, entry in sorted(keys.items(), key=lambda item: (int(item[1].get("ModifyIndex") or 0), item[0])):
        owner, rest = _owner(key)
        if rest.startswith(names.HISTORY):
            value = decoded(entry)
            if value.get("after") and not value.get("occurrence"):  # a chained run: its own id (chain.py)
                value = {**value, "occurrence": value.get("run") or names.history_order(rest)[0]}
            if value:
                name = names.history_order(rest)[0] + (names.MANUAL if names.is_manual(rest) else "")
                records[(owner, str(value.get("occurrence") or name))] = value
        elif rest == names.OCCURRENCE:
            current[owner] = decoded(entry)
    for owner, record in current.items():
        if record.get("occurrence"):
            records[(owner, str(record["occurrence"]))] = record  # newer than its history entry while it runs
    rows = [row for record in records.values() for row in _attempts(record)]
    sessions = {r.get("session") for record in records.values() for r in [record, *(record.get("earlier") or [])]
                if isinstance(r, dict)}
    for key, entry in sorted(keys.items()):
        if key != names.LOCK and not key.startswith(names.SLOTS):
            continue
        value = decoded(entry)
        last = value.get("last")
        if isinstance(last, dict) and last.get("session") not in sessions:
            rows.append(_row(last, manual=True))  # a run without --schedule: no occurrence record
        elif value.get("session") and value.get("started") and value.get("session") not in sessions:
            if entry.get("Session"):  # a run without --schedule under way (`status` judges whether it lives)
                rows.append(_row(value, manual=True, state="running"))
            else:  # a holder's value that no session holds: its runner died, nobody recorded its end (status agrees)
                rows.append(_row(value, manual=True, state="abandoned", reason=ABANDONED_UNRECORDED))
    return newest_first(rows)


def _owner(key: str) -> tuple[str, str]:
    """("", key) for a job's own key; (node segment, the rest) for one under an each-node job's `nodes/<node>/`."""
    parts = key.split("/", 2)
    if len(parts) == 3 and parts[0] == "nodes":
        return parts[1], parts[2]
    return "", key


def table(rows: list[dict[str, Any]], now: datetime) -> list[list[str]]:
    from consulrun.timefmt import cell, duration, span

    out = [["OCCURRENCE", "ATTEMPT", "NODE", "STARTED", "DURATION", "RESULT", "NOTE"]]
    for r in rows:
        if r["state"] == "skipped":
            result = f"skipped ({r['reason']})"
        elif r["state"] in ("lost", "abandoned", "running", "missed"):
            result = r["state"]
        else:
            result = f"exit {r['exit_status']}" if r["exit_status"] is not None else (r["state"] or "-")
        notes = [n for n, on in (("takeover", r["takeover"]), ("manual", r["manual"])) if on]
        if isinstance(r["after"], dict):  # the parent run this one ran after, and how that ended
            parent = r["after"]
            ended = f"exit {parent.get('exit_status')}" if parent.get("exit_status") is not None else parent.get("state")
            notes.append(f"after {parent.get('job')} {parent.get('run')} ({ended})")
        if r["retried"]:
            notes.append(f"retried after {duration(r['retry_after_s'])}" if isinstance(r["retry_after_s"], (int, float))
                         else "retried")
        if r["state"] == "running" and r["retry_at"] and r["started"] == r["retry_at"]:
            notes.append(f"retry due {cell(r['retry_at'], now)}")
        if r["retries_ended"]:
            notes.append(f"no retry: {r['retries_ended']}")
        if r["reason"] and r["state"] != "skipped":
            notes.append(str(r["reason"]))
        out.append([r["occurrence"] or "-", str(r["attempt"] or "-"),
                    r["node"] or "-", cell(r["started"], now),
                    span(r["duration_s"]) if r["duration_s"] is not None else "-", result, "; ".join(notes) or "-"])
    return out
