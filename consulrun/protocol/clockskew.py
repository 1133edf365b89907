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
the two clocks is wrong. That is why this is reported (the skip line,
`status`, the exporter, the watchdog), naming both nodes, and not acted on:
refusing a claim on one node's word would let a single slow clock hold back
every correct node.
"""

from __future__ import annotations

from datetime import datetime

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
    stamps = [parse_time(record.get(k)) for k in ("occurrence", "started")]
    lead = max(((t - now).total_seconds() for t in stamps if t), default=0.0)
    return lead if lead > SKEW_TOLERANCE_S else None


def note(record: dict[str, Any], lead: float) -> str:
    """The finding, for a log line or a status problem."""
    return (f"{writer(record)}'s clock is at least {lead:.0f}s ahead of this node's: its record of occurrence "
            f"{record.get('occurrence')} carries a time {lead:.0f}s in this node's future (one of the two clocks is wrong; a clock "
            "ahead by more than the job's interval runs every occurrence early under the next one's name, and the "
            "occurrence it jumped over runs nowhere)")
