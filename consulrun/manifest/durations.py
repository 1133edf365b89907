"""Durations written as systemd (and Consul) write them: `500ms`, `15s`, `1m30s`, `1h 30min`, `10 min`.

Parsing follows systemd's time-span grammar (`systemd.time(7)`, checked
against `systemd-analyze timespan`): parts of a number (fractions allowed) and
an optional unit, spaces allowed anywhere between them; a part without a unit
is seconds. One canonical rendering (`1h30m15s500ms`) is read the same by Go's
`time.ParseDuration` (Consul) and by systemd's time parser, so a parsed value
can be passed on to either without a second formatter, and every message
writes durations that way.
"""

from __future__ import annotations

import functools
import re
from decimal import Decimal

TTL_RANGE_MS = (10_000, 86_400_000)  # Consul's own bounds for a session TTL
# Consul caps lock-delay at 60s; below 5s no confirmation interval fits inside the fencing window.
LOCK_DELAY_RANGE_MS = (5_000, 60_000)
DURATION_MAX_MS = 366 * 86_400_000  # any duration a manifest or option holds; more is surely a typo

_SECOND = Decimal(1000)
# systemd's suffix table (src/basic/time-util.c), in milliseconds; a month is 30.44 days, a year 365.25 days.
UNITS_MS: dict[str, Decimal] = {
    **dict.fromkeys(("seconds", "second", "sec", "s"), _SECOND),
    **dict.fromkeys(("minutes", "minute", "min", "m"), 60 * _SECOND),
    **dict.fromkeys(("hours", "hour", "hr", "h"), 3600 * _SECOND),
    **dict.fromkeys(("days", "day", "d"), 86_400 * _SECOND),
    **dict.fromkeys(("weeks", "week", "w"), 7 * 86_400 * _SECOND),
    **dict.fromkeys(("months", "month", "M"), 2_629_800 * _SECOND),
    **dict.fromkeys(("years", "year", "y"), 31_557_600 * _SECOND),
    **dict.fromkeys(("msec", "ms"), Decimal(1)),
    **dict.fromkeys(("usec", "us", "\u00b5s", "\u03bcs"), Decimal("0.001")),
}
_UNIT = "|".join(sorted(UNITS_MS, key=len, reverse=True))
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
# One part: a number, optional spaces, an optional unit that is not the start of a longer word.
_PART = re.compile(rf" *({_NUMBER}) *({_UNIT})?(?![A-Za-z\u00b5\u03bc])")
# The same grammar as one regular expression; the manifest schema carries a copy (a test keeps them equal).
PATTERN = rf"^ *(?:{_NUMBER} *(?:{_UNIT})?(?![A-Za-z\u00b5\u03bc]) *)+$(?!\n)"  # $ alone matches before a final newline
EXAMPLES = "e.g. 500ms, 15s, 1m30s, 1h 30min"


class DurationError(ValueError):
    """Raised for text that is not a duration."""


@functools.lru_cache(maxsize=4096)  # pure; a big manifest repeats a few durations
def parse_duration(text: str) -> int:
    """Return the duration in milliseconds, reading `text` as systemd reads a time span."""
    pos, total = 0, Decimal(0)
    value = text.rstrip(" ")
    if not value.strip():
        raise DurationError(f"{text!r} is not a duration ({EXAMPLES})")
    while pos < len(value):
        match = _PART.match(value, pos)
        if not match:
            raise DurationError(f"{text!r} is not a duration ({EXAMPLES})")
        total += Decimal(match.group(1)) * UNITS_MS[match.group(2) or "s"]
        pos = match.end()
    if total != total.to_integral_value():
        raise DurationError(f"{text!r} is finer than a millisecond")
    return int(total)


def unit_hint(text: str) -> str:
    """For a message about a duration out of range: a note if it was written with `M`, which systemd reads as
    months (`5M` is 3652h30m) where minutes (`m`) were surely meant; '' otherwise."""
    if any(match.group(2) == "M" for match in _PART.finditer(text)):
        return "; `M` is months, `m` minutes"
    return ""


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


def range_text(bounds: tuple[int, int]) -> str:
    """`10s to 24h`: bounds in the one style every message uses."""
    return f"{format_duration(bounds[0])} to {format_duration(bounds[1])}"
