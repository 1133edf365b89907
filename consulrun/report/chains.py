"""`status` of a chained job's requests (`after/<parent>/<run>`, protocol/chain.py): `stalled`.

A parent's end writes the request; chain-watch on each node with the child
starts the child's unit at once, and the child's run consumes the request.
A request still there long after it could have run means no node is taking
it (chain-watch not running, the unit not installed, every node refusing it):
the run it asks for is as good as missed, and `status` says so (exit 3).

The bound (`bound_s`, docs/chains.md) is counted from when the request could
first have run: the parent's end, or the end of a run of the child that held
the lock then, whichever is later. While the child's lock is held the
request waits for it, as it should (a held lock is judged as overdue or
unhealthy). This module only reads: the skip path writes nothing more.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from consulrun.consul.client import decoded
from consulrun.errors import MalformedValue
from consulrun.protocol import keys as names
from consulrun.protocol.chainwatch import RETRY_S
from consulrun.protocol.fencing import START_RETRY_S
from consulrun.protocol.turns import TURN_MAX_S
from consulrun.timefmt import duration, parse_time

if TYPE_CHECKING:
    from consulrun.report.status import JobStatus

# "A few minutes" past what a start may take: a chain-watch restarted by systemd, a node rebooting.
STALL_AFTER_S = 300.0
DEFAULT_LOCK_DELAY_S = 15.0  # the manifest's default `lock.lock_delay`, for a job none describes


def bound_s(job: Any) -> float:
    """How long a request may wait unconsumed: STALL_AFTER_S plus the child's start budget (a
    start's retries of a Consul not ready yet, the nodes' turns, chain-watch's pauses between
    its starts of a request still pending, and the child's lock-delay)."""
    lock = getattr(job, "lock", None)
    lock_delay_s = lock.lock_delay_ms / 1000 if lock is not None else DEFAULT_LOCK_DELAY_S
    return STALL_AFTER_S + START_RETRY_S + TURN_MAX_S + sum(RETRY_S) + lock_delay_s


def requests(keys: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests under the job's `after/` ({parent, run, ended}), oldest first, each value
    through the validator; MalformedValue for one consulrun never writes (chain.py leaves such a
    request alone, so it would wait forever unseen)."""
    found = []
    for key, entry in sorted(keys.items()):
        if not key.startswith(names.AFTER):
            continue
        parent_segment, _, run_segment = key[len(names.AFTER):].partition("/")
        parent = names.unsegment(parent_segment)
        run = names.run_of_segment(run_segment) if run_segment else ""
        value = decoded(entry)
        if not run or value.get("parent") != parent or value.get("run") != run:
            raise MalformedValue(entry["Key"], "it does not name the parent run its key does")
        ended = parse_time(value.get("ended"))
        if ended is None:
            raise MalformedValue(entry["Key"], "field 'ended' is missing (every request has one)")
        found.append({"parent": parent, "run": run, "ended": ended})
    return sorted(found, key=lambda r: r["ended"])


def judge(status: JobStatus, keys: dict[str, dict[str, Any]], job: Any, now: datetime) -> None:
    """A `stalled` problem when a request has waited longer than `bound_s` while the lock was
    free: one, naming the oldest and how many wait so."""
    pending = requests(keys)
    if not pending or status.holders:
        return
    bound = bound_s(job)
    last_end = parse_time((status.last or {}).get("ended"))
    if last_end is not None and last_end > now:  # a record in the future is no reason to wait
        last_end = None
    stalled = []
    for request in pending:
        since = max(request["ended"], last_end) if last_end else request["ended"]
        if (now - since).total_seconds() > bound:
            stalled.append((request, since))
    if not stalled:
        return
    request, since = stalled[0]
    more = f"; {len(stalled) - 1} more request(s) wait as long" if len(stalled) > 1 else ""
    waited = duration((now - since).total_seconds())
    status.problem("stalled", f"the run after {request['parent']}'s run {request['run']} has "
                              f"waited {waited} (since {_iso(since)}), longer than "
                              f"{duration(bound)}, and no node took it{more}",
                   parent=request["parent"], run=request["run"], since=_iso(since),
                   pending=len(stalled))


def _iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
