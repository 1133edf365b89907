"""Pause and resume jobs cluster-wide: one KV key per job, one transaction for all of them.

`<prefix>/<job>/pause` holds {"by", "at", "reason", "until"}. While it is in
force (no `until`, or `until` still ahead) every node skips the job; the
runner reads it in the same read-only transaction as the lock and the
occurrence record, so the skip path stays one round trip and no Raft write.
A pause with `until` ends by itself: nothing needs to delete the key.

When a pause ends, it is kept as an episode, `<prefix>/<job>/ended-pauses/<at>.<index>` (keys.py)
({"by", "at", "reason", "until", "ended", "ended_by"}), so `history` and
`status` can name the occurrences it skipped. Skipping writes nothing, so those
are derived, not recorded: the schedule's occurrences inside an episode that no
node ran. `resume` writes the episode in the transaction that deletes the key;
a pause that ended by itself stays in its key (readers take an expired key for
an ended episode) until the next `pause` or `resume` of the job files it.
The newest KEPT_EPISODES are kept. The name does not begin with `pause`, so
the runner's read of the pause key (a get-tree) never carries the episodes.
"""

from __future__ import annotations

import getpass
import socket
from datetime import datetime, timedelta, timezone

from consulrun.consul.client import Client, decoded, kv_op
from consulrun.errors import ConsulProtocolError, MalformedValue
from consulrun.protocol import keys
from consulrun.timefmt import parse_time

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

EPISODES = keys.EPISODES
KEPT_EPISODES = 20
EPISODE_FIELDS = ("by", "at", "reason", "until", "ended", "ended_by")


pause_key = keys.pause_key


def unchanged_op(base: str, index: int) -> dict[str, Any]:
    """A transaction operation that fails unless the pause key is as a look read it (`index`, 0: absent): a
    claim carrying it is refused when a pause landed between the look and the claim."""
    key = pause_key(base)
    return kv_op("check-index", key, Index=index) if index else kv_op("check-not-exists", key)


def value_of(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    """The pause key's value; a key someone wrote that is not a readable pause still pauses (fail closed)."""
    if entry is None:
        return None
    try:
        return decoded(entry) or {"reason": "the pause key holds no readable value"}
    except MalformedValue as exc:
        return {"reason": f"the pause key holds no readable value ({exc.message})"}


def in_force(value: dict[str, Any] | None, now: datetime | None = None) -> bool:
    """True while `value` (a decoded pause key) pauses the job."""
    if not value:
        return False
    until = value.get("until")
    if not until:
        return True
    try:
        ends = datetime.fromisoformat(str(until).replace("Z", "+00:00"))
    except ValueError:
        return True  # an unreadable end is no reason to run a job someone paused
    if ends.tzinfo is None:
        ends = ends.replace(tzinfo=timezone.utc)  # written by hand without a zone: read as UTC
    return (now or datetime.now(timezone.utc)) < ends


def describe(value: dict[str, Any]) -> str:
    until = f" until {value['until']}" if value.get("until") else ""
    reason = f": {value['reason']}" if value.get("reason") else ""
    return f"paused by {value.get('by', '?')} at {value.get('at', '?')}{until}{reason}"


def why(value: dict[str, Any]) -> str:
    """Who paused, and why: `paused by alice@ops1: database migration`."""
    return f"paused by {value.get('by', '?')}" + (f": {value['reason']}" if value.get("reason") else "")


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"


def _iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _ended(value: dict[str, Any], now: datetime) -> dict[str, Any]:
    """`value` (a pause key's) as an ended episode: at `until` if it ran out by itself, else now, by whoever ends it."""
    until = parse_time(value.get("until"))
    if until is not None and until <= now:
        return {**value, "ended": _iso(until)}
    # Rounded up to the second: a run skipped at 12:00:00.1 by a pause ended at 12:00:00.6 was skipped by it.
    ended = now.replace(microsecond=0) + timedelta(seconds=1) if now.microsecond else now
    return {**value, "ended": _iso(ended), "ended_by": who()}


def _filing_ops(base: str, entry: dict[str, Any] | None, filed: list[str], now: datetime) -> list[dict[str, Any]]:
    """Operations that file the pause in `entry` (the key as read) as an episode, and prune the oldest ones.

    The key's ModifyIndex is checked, so a pause changed since it was read
    fails the whole transaction instead of being filed wrong.
    """
    if entry is None:
        return []
    value = value_of(entry) or {}
    name = keys.episode_key(base, str(value.get("at") or "?"), entry["ModifyIndex"])
    keep = sorted({*filed, name}, key=keys.episode_order)  # old keys (`<at>~<index>`) among them by their times
    ops = [kv_op("check-index", pause_key(base), Index=int(entry["ModifyIndex"])), kv_op("set", name, _ended(value, now))]
    doomed = [old for old in keep[:max(0, len(keep) - KEPT_EPISODES)][:20] if old != name]
    return ops + keys.delete_ops(doomed, [*filed, name], keys.episodes_prefix(base))[0]


MAX_TXN_OPS = 128  # Consul refuses a transaction of more operations


def _batches(per_job: list[tuple[str, list[dict[str, Any]]]]) -> list[tuple[list[str], list[dict[str, Any]]]]:
    """Jobs' operations packed into as few transactions as Consul allows; one job's never split."""
    out: list[tuple[list[str], list[dict[str, Any]]]] = []
    for base, ops in per_job:
        if not ops:
            continue
        if not out or len(out[-1][1]) + len(ops) > MAX_TXN_OPS:
            out.append(([], []))
        out[-1][0].append(base)
        out[-1][1].extend(ops)
    return out


def _apply(client: Client, jobs: list[str], prefix: str, ops_for: Any, what: str) -> None:
    """Read each job's pause key and episodes, then write what `ops_for` makes of them: one transaction (one
    Raft write) while Consul's limit allows, else one per batch; a job whose pause changed meanwhile, again."""
    pending = [f"{prefix}/{job}" for job in jobs]
    for _ in range(5):
        found: dict[str, dict[str, Any]] = {}
        for n in range(0, len(pending), MAX_TXN_OPS // 2):
            found.update(client.read_trees([p for base in pending[n:n + MAX_TXN_OPS // 2]
                                            for p in (pause_key(base), keys.episodes_prefix(base))], consistent=True))
        per_job = [(base, ops_for(base, found.get(pause_key(base)), [k for k in found
                                                                     if k.startswith(keys.episodes_prefix(base))]))
                   for base in pending]
        pending = [base for bases, ops in _batches(per_job) if client.txn(ops) is None for base in bases]
        if not pending:
            return
    raise ConsulProtocolError(f"Consul refused the {what} transaction (the pause keys kept changing; try again)")


def pause(client: Client, prefix: str, jobs: list[str], *, for_ms: int | None, reason: str | None,
          now: datetime | None = None) -> dict[str, Any]:
    """Pause `jobs` in one transaction (one Raft write); returns the value written."""
    now = now or datetime.now(timezone.utc)
    value: dict[str, Any] = {"by": who(), "at": _iso(now)}
    if reason:
        value["reason"] = reason
    if for_ms:
        value["until"] = _iso(now + timedelta(milliseconds=for_ms))
    _apply(client, jobs, prefix, lambda base, entry, filed: [*_filing_ops(base, entry, filed, now),
                                                              kv_op("set", pause_key(base), value)], "pause")
    return value


def resume(client: Client, prefix: str, jobs: list[str], now: datetime | None = None) -> dict[str, dict[str, Any]]:
    """End the pause of `jobs` in one transaction, filing each as an episode (a job not paused is no error).

    Returns the pauses it ended, job -> the pause's value as read (a pause
    that had run out by itself included); a job not in it was not paused.
    """
    now = now or datetime.now(timezone.utc)
    found: dict[str, dict[str, Any]] = {}

    def ops_for(base: str, entry: dict[str, Any] | None, filed: list[str]) -> list[dict[str, Any]]:
        job = base[len(prefix) + 1:]
        if entry is None:
            found.pop(job, None)  # read again after a refused transaction: what the last read saw counts
            return []
        found[job] = value_of(entry) or {}
        return [*_filing_ops(base, entry, filed, now), kv_op("delete", pause_key(base))]

    _apply(client, jobs, prefix, ops_for, "resume")
    return found


def episodes(keys: dict[str, dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
    """A job's pauses, newest first, from its keys (key below `<prefix>/<job>/` -> KV entry).

    Each has `start` and `end` (datetimes; `end` is None while the pause is in
    force): the filed episodes, and the pause key itself, ended at `until` if
    it ran out by itself.
    """
    found = [decoded(entry) for key, entry in keys.items() if key.startswith(EPISODES)]
    current = value_of(keys.get("pause"))
    if current:
        found.append(current if in_force(current, now) else {**current, "ended": current.get("until")})
    out = []
    for value in found:
        start = parse_time(value.get("at"))
        if start is not None:
            out.append({**value, "start": start, "end": parse_time(value.get("ended")) if value.get("ended") else None})
    return sorted(out, key=lambda e: e["start"], reverse=True)


def skipped(found: list[dict[str, Any]], schedules: list[str], ran: set[str], now: datetime,
            limit: int, after: datetime | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(occurrence, episode) for the newest `limit` occurrences of `schedules` that fell inside a pause and that
    no node ran, newest first.

    Counted from the episode's start (its second included) to its end
    (excluded); looked for backwards, so a long pause of a dense schedule
    costs `limit` steps, not one per occurrence. Only occurrences later than
    `after` count.
    """
    from consulrun.manifest import calendar  # `run` reads the pause key on every tick; it needs none of this

    out: list[tuple[str, dict[str, Any]]] = []
    if not schedules:
        return out
    for episode in found:
        start = max(episode["start"], after + timedelta(seconds=1)) if after else episode["start"]
        cursor = (episode["end"] or now) - timedelta(seconds=1)
        while len(out) < limit:
            when = calendar.previous(schedules, cursor) if cursor >= start else None
            if when is None or when < start:
                break
            if calendar.occurrence_id(when) not in ran:
                out.append((calendar.occurrence_id(when), episode))
            cursor = when - timedelta(seconds=1)
    return out


def covers(found: list[dict[str, Any]], when: datetime, now: datetime) -> bool:
    """True if `when` fell inside one of the pauses `found`."""
    return any(e["start"] <= when < (e["end"] or now) for e in found)


def since(keys: dict[str, dict[str, Any]], schedules: list[str], last: str | None, lag_s: float, now: datetime,
          limit: int = 10) -> tuple[list[dict[str, Any]], bool]:
    """For `status`: (the newest occurrences skipped while paused after the last claimed one, `last`; whether the
    latest occurrence due, `lag_s` ago, fell inside a pause, so that not claiming it was no miss)."""
    from consulrun.manifest import calendar

    found = episodes(keys, now)
    if not found or not schedules:
        return [], False
    after = parse_time(last) if last else None
    skips = [{"occurrence": occ, "paused": {k: e.get(k) for k in EPISODE_FIELDS}}
             for occ, e in skipped(found, schedules, set(), now, limit, after)]
    due = calendar.previous(schedules, now - timedelta(seconds=lag_s))
    return skips, due is not None and (last is None or calendar.occurrence_id(due) > str(last)) and \
        covers(found, due, now)


def skipped_lines(job: str, skips: list[dict[str, Any]]) -> list[str]:
    """`nightly: skipped while paused by alice@ops1: migration: 2026-11-30T02:00:00Z, ...` (newest first)."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for skip in skips:
        groups.setdefault((skip["paused"].get("at"), skip["paused"].get("by"), skip["paused"].get("reason")),
                          []).append(skip["occurrence"])
    return [f"{job}: skipped while {why({'by': by, 'reason': reason})} (from {at}): {', '.join(occurrences)}"
            for (at, by, reason), occurrences in groups.items()]
