"""Times for people at 3 a.m.: local clock time and how long ago (or how soon), e.g. `02:00:00 (3h ago)`.

JSON keeps absolute UTC; only tables use these.
"""

from __future__ import annotations

from datetime import datetime, timezone

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any


def parse_time(text: Any) -> datetime | None:
    """An ISO 8601 time as Consul records hold it (`...Z`, or naive meaning UTC); None if it is not one."""
    try:
        when = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def seconds_between(start: Any, end: Any) -> float | None:
    """Seconds from one recorded time to another; None unless both are times."""
    began, ended = parse_time(start), parse_time(end)
    return (ended - began).total_seconds() if began and ended else None


def span(seconds: float) -> str:
    """A duration in its largest sensible unit: 42s, 7m, 3h, 2d."""
    seconds = abs(seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def duration(seconds: float) -> str:
    """A duration for a log line, written as Consul and systemd write them: `942ms`, `5.3s`, `15s`, `1m30s`, `2h`.

    Every log line that says how long something waits or took goes through this, so none prints `0.94226s`:
    milliseconds below a second, a tenth of a second below ten, whole seconds above.
    """
    seconds = max(0.0, seconds)
    if seconds < 1:
        ms = round(seconds * 1000)
        return f"{ms}ms" if 0 < ms < 1000 else ("0s" if ms == 0 else "1s")
    if seconds < 10:
        tenths = round(seconds * 10)
        return f"{tenths // 10}s" if tenths % 10 == 0 else f"{tenths / 10:.1f}s"
    left = round(seconds)
    out = []
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        count, left = divmod(left, size)
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)


def relative(when: datetime, now: datetime) -> str:
    delta = (when - now).total_seconds()
    if abs(delta) < 1:
        return "now"
    return f"in {span(delta)}" if delta > 0 else f"{span(delta)} ago"


def local(when: datetime, now: datetime) -> str:
    """Clock time in the local zone; the date too when it is not today."""
    mine, today = when.astimezone(), now.astimezone()
    return mine.strftime("%H:%M:%S") if mine.date() == today.date() else mine.strftime("%Y-%m-%d %H:%M")


def cell(text: Any, now: datetime) -> str:
    """An ISO time from Consul as `local (relative)`, or `-`; text that is not a time is shown as it is."""
    if not text:
        return "-"
    when = parse_time(text)
    return f"{local(when, now)} ({relative(when, now)})" if when else str(text)
