"""Durations written as Consul and systemd write them: `500ms`, `15s`, `1m30s`.

One canonical rendering (`1h30m15s500ms`) is read the same by Go's
`time.ParseDuration` (Consul) and by systemd's time parser, so a parsed value
can be passed on to either without a second formatter.
"""

from __future__ import annotations

import re

TTL_RANGE_MS = (10_000, 86_400_000)  # Consul's own bounds for a session TTL
# Consul caps lock-delay at 60s; below 5s no confirmation interval fits inside the fencing window.
LOCK_DELAY_RANGE_MS = (5_000, 60_000)

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}
_PART = re.compile(r"(\d+)(ms|min|s|m|h|d)")
_WHOLE = re.compile(r"(?:\d+(?:ms|min|s|m|h|d))+")


class DurationError(ValueError):
    """Raised for text that is not a duration."""


def parse_duration(text: str) -> int:
    """Return the duration in milliseconds; `0` alone is allowed without a unit."""
    value = text.strip()
    if value == "0":
        return 0
    if not _WHOLE.fullmatch(value):
        raise DurationError(f"{text!r} is not a duration (use e.g. 500ms, 15s, 1m30s, 2h)")
    return sum(int(n) * _UNITS_MS[unit] for n, unit in _PART.findall(value))


def format_duration(ms: int) -> str:
    """Render milliseconds canonically; hours are the largest unit because Go has no days."""
    if ms == 0:
        return "0s"
    out = []
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        count, ms = divmod(ms, size)
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)
