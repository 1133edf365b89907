"""How far another node's clock is ahead of ours, as far as the times it wrote can show.

No clock a client agent can read under consulrun's ACL policy is the
servers': Consul's HTTP answers carry no server time (the `Date` header is the
local agent's own clock, and `X-Consul-LastContact` is a duration), and the
only server-written timestamps (autopilot's `StableSince`, a token's
`CreateTime`) need `operator:read` or say when something changed, not what
time it is. So the reference is the other nodes' own records: every claim
names its occurrence and its `started`, both read off the claimer's clock at
the moment it wrote them. A record is read after it was written, so a time in
it that lies in *our* future proves the writer's clock was ahead of ours by
at least that much (a lower bound: the record's age only hides skew, never
invents it). The reverse cannot be seen: a node whose clock is ahead finds
every other node's times in its past, so it cannot learn it is ahead from
them; and a node that sees another's time in its future cannot tell which of
the two clocks is wrong. So every such finding is reported (the skip line,
`status`, the exporter, the watchdog), naming both nodes, and the node that
sees it records it where the node it names reads (below); that node acts on
it only when two or more others found it ahead: refusing a claim on one
node's word would let a single slow clock hold back every correct node.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone

from consulrun.consul.client import decoded, kv_op
from consulrun.protocol import keys
from consulrun.timefmt import parse_time

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

# Stamps are whole seconds (truncated), and NTP keeps real clocks within milliseconds: beyond this, it is skew.
SKEW_TOLERANCE_S = 2.0


def writer(record: dict[str, Any]) -> str:
    """The node whose clock a record's times were read from: a miss's recorder, else its claimer."""
    return str(record.get("recorded_by") or record.get("node") or "?")


def ahead_of_us(record: dict[str, Any] | None, now: datetime) -> float | None:
    """At least how many seconds the writer's clock is ahead of `now` (ours), if more than the tolerance.

    The occurrence counts: a node claims only an occurrence at or before its own now. `ended` does not: another
    node writes it when it records a run abandoned.
    """
    if not record:
        return None
    # Between two attempts (retries.py) `started` is when the next one is due, a time ahead on purpose.
    keys = ("occurrence",) if record.get("retry_at") and record.get("retry_at") == record.get("started") \
        else ("occurrence", "started")
    stamps = [parse_time(record.get(k)) for k in keys]
    lead = max(((t - now).total_seconds() for t in stamps if t), default=0.0)
    return lead if lead > SKEW_TOLERANCE_S else None


def reported(lead: float) -> float:
    """A lead as recorded and shown, to 0.1 s: rounded up, so one past SKEW_TOLERANCE_S (2.04 s) never reads as
    within it (2.0 s)."""
    return math.ceil(round(lead * 10, 6)) / 10


def note(record: dict[str, Any], lead: float) -> str:
    """The finding, for a log line or a status problem ("at least": whole seconds, rounded down)."""
    return (f"{writer(record)}'s clock is at least {math.floor(lead)}s ahead of this node's: its record of "
            f"occurrence {record.get('occurrence')} carries a time {math.floor(lead)}s in this node's future (one "
            "of the two clocks is wrong; a clock ahead by more than the job's interval runs every occurrence early "
            "under the next one's name, and the occurrence it jumped over runs nowhere)")


# What a node's findings about others' clocks may do. Nodes that saw a node's times in their future record it
# under `<prefix>/<job>/clock/<that node>/<themselves>` (one write, refreshed at most every FINDING_REFRESH_S).
# A node that two or more others (distinct, fresh) found ahead takes the cluster's clock to be its own less the
# smallest lead they measured, and acts for the occurrence due by that clock: a claim of an occurrence not yet
# due by it is refused. One node's word is not enough: that node's clock may be the one that is behind.
FINDING_REFRESH_S = 300.0
FINDING_FRESH_S = 600.0
ACCUSERS_NEEDED = 2
MAX_CORRECTION_S = 300.0  # beyond it a record is refused as from the future (occurrence.ALLOWED_SKEW_S)
_NODE_NAME = re.compile(r"^[a-zA-Z0-9_.\-]{1,128}$")  # inside Consul's strictest key rule


clock_prefix = keys.clock_prefix


def _findings(entries: dict[str, dict[str, Any]], base: str, about: str) -> dict[str, dict[str, Any]]:
    """accuser -> finding (ahead_s, at) about node `about`, from the entries under the job's clock prefix."""
    found = {}
    prefix = keys.clock_about_prefix(base, about)
    for key, entry in entries.items():
        if not key.startswith(prefix):
            continue
        value = decoded(entry)
        ahead, at = value.get("ahead_s"), parse_time(value.get("at"))
        if isinstance(ahead, (int, float)) and not isinstance(ahead, bool) and at is not None:
            found[keys.unsegment(key[len(prefix):])] = {"ahead_s": float(ahead), "at": at}
    return found


def correction(entries: dict[str, dict[str, Any]], base: str, me: str, now: datetime) -> tuple[float, list[str]] | None:
    """(seconds this node's clock is at least ahead of the cluster's, the nodes that found it) when enough others,
    each in a finding still fresh, found it ahead; else None."""
    fresh = {}
    for accuser, finding in _findings(entries, base, me).items():
        age = (now - finding["at"]).total_seconds() - finding["ahead_s"]  # `at` is read off the accuser's clock
        if accuser != me and 0 < finding["ahead_s"] <= MAX_CORRECTION_S and -FINDING_FRESH_S < age < FINDING_FRESH_S:
            fresh[accuser] = finding["ahead_s"]
    if len(fresh) < ACCUSERS_NEEDED:
        return None
    return min(fresh.values()), sorted(fresh)


def finding_ops(entries: dict[str, dict[str, Any]], base: str, record: dict[str, Any], lead: float, me: str,
                now: datetime) -> list[dict[str, Any]]:
    """The write that records this node's finding about the record's writer, unless a fresh one of ours says as
    much already (then none: a skip costs a write only when it has something new to say)."""
    accused = writer(record)
    if accused == me or not _NODE_NAME.match(accused) or not _NODE_NAME.match(me):
        return []
    ours = _findings(entries, base, accused).get(me)
    if ours and (now - ours["at"]).total_seconds() < FINDING_REFRESH_S and ours["ahead_s"] >= lead - SKEW_TOLERANCE_S:
        return []
    value = {"node": accused, "by": me, "ahead_s": reported(lead), "at": now_iso_of(now),
             "occurrence": record.get("occurrence")}
    return [kv_op("set", keys.clock_key(base, accused, me), value)]


def now_iso_of(now: datetime) -> str:
    return now.astimezone(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
