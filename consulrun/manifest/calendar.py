"""systemd `OnCalendar=` expressions: validation now, occurrence arithmetic later.

The `oncalendar` package implements systemd's calendar grammar and iteration;
tests compare it with `systemd-analyze calendar`, the reference.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import oncalendar


class CalendarError(ValueError):
    """The expression is not one systemd would accept."""


def validate(spec: str) -> None:
    """Raise `CalendarError` with systemd-like wording when `spec` does not parse."""
    if not spec.strip() or spec != spec.strip() or any(ord(ch) < 0x20 for ch in spec):
        raise CalendarError(f"{spec!r} is not a valid calendar expression")
    if spec.startswith("@"):
        raise CalendarError(f"{spec!r}: a one-off @EPOCH time is not a schedule; use a calendar expression")
    try:
        iterator = oncalendar.OnCalendar(spec, datetime(2000, 1, 1, tzinfo=timezone.utc))
        next(iterator, None)
    except oncalendar.OnCalendarError as exc:
        if "." in spec:
            raise CalendarError(f"{spec!r}: fractional seconds are not supported; occurrences are whole seconds") from None
        raise CalendarError(f"{spec!r} is not a valid calendar expression: {_span_hint(spec) or exc}") from None


def _span_hint(spec: str) -> str | None:
    """What to say of a schedule written as a time span (`5m`): a schedule says when, and how to write "every"."""
    from consulrun.manifest.durations import DurationError, parse_duration

    if not any(ch.isalpha() for ch in spec):
        return None
    try:
        seconds, fraction = divmod(parse_duration(spec), 1000)
    except DurationError:
        return None
    every = None
    if not fraction and 0 < seconds < 60 and 60 % seconds == 0:
        every = f"*:*:0/{seconds}"
    elif not fraction and seconds % 60 == 0 and 0 < seconds // 60 < 60 and 60 % (seconds // 60) == 0:
        every = f"*:0/{seconds // 60}"
    elif not fraction and seconds % 3600 == 0 and 0 < seconds // 3600 < 24 and 24 % (seconds // 3600) == 0:
        every = f"0/{seconds // 3600}:00"
    elif (seconds, fraction) == (86_400, 0):
        every = "daily"
    how = f"every {spec.strip()} is {every!r}" if every else "e.g. every 5 minutes is '*:0/5'"
    return f"it looks like a time span; a schedule is a calendar expression (systemd.time(7)): {how}"


LOCALTIME = "/etc/localtime"
LOOKBACK_START = timedelta(minutes=2)
LOOKBACK_MAX = timedelta(days=366 * 500)  # "Mon *-02-29" recurs every 28 years


def local_zone() -> tzinfo:
    """The zone systemd's timers evaluate specs without a zone in: the system's, /etc/localtime (else UTC).

    Deliberately not $TZ: a job's `environment` reaches the wrapper too, while
    the timer that fired it ran in PID 1, in the system zone. Every node must
    compute the occurrence the timer fired for.
    """
    try:
        with open(LOCALTIME, "rb") as handle:
            return ZoneInfo.from_file(handle, key="localtime")
    except (OSError, ValueError, ZoneInfoNotFoundError):
        return timezone.utc


def local_zone_name() -> str:
    """The system zone's name as /etc/localtime points at it ("Europe/Berlin"), for messages."""
    target = os.path.realpath(LOCALTIME)
    return target.split("/zoneinfo/", 1)[1] if "/zoneinfo/" in target else target


def zone_offsets(when: datetime) -> str:
    """How the system zone behaves around `when` (its UTC offsets then and half a year either side).

    Nodes that compute the same offsets compute the same occurrences, whatever
    their zone is called or their tzdata's version; compared across nodes.
    """
    zone = local_zone()
    moments = (when - timedelta(days=182), when, when + timedelta(days=182))
    return ",".join(str(int(m.astimezone(zone).utcoffset().total_seconds())) for m in moments)  # type: ignore[union-attr]


def names_zone(spec: str) -> bool:
    """True if `spec` ends in a time zone, so the system zone does not matter for it."""
    last = spec.split()[-1] if spec.split() else ""
    if last == "UTC":
        return True
    if "/" not in last:
        return False
    try:
        ZoneInfo(last)
    except (ValueError, ZoneInfoNotFoundError):
        return False
    return True


def _iterate(specs: list[str], start: datetime) -> oncalendar.OnCalendar:
    return oncalendar.OnCalendar("\n".join(specs), start.astimezone(local_zone()))


def previous(specs: list[str], now: datetime) -> datetime | None:
    """The latest scheduled time of any of `specs` at or before `now` (UTC), or None if there is none.

    The iterator only goes forward, so look back over a window that widens
    until it holds an occurrence: a minutely spec is found in the first window,
    a yearly one after a few widenings.
    """
    now = now.astimezone(timezone.utc)
    window = LOOKBACK_START
    while window <= LOOKBACK_MAX:
        latest = None
        for when in _iterate(specs, now - window):
            if when > now:
                break
            latest = when
        if latest is not None:
            return latest.astimezone(timezone.utc)
        window *= 8
    return None


def following(specs: list[str], after: datetime) -> datetime | None:
    """The first scheduled time strictly after `after` (UTC), or None if the schedule has ended."""
    for when in _iterate(specs, after.astimezone(timezone.utc)):
        if when > after:
            return when.astimezone(timezone.utc)
    return None


def occurrence_id(when: datetime) -> str:
    """A sortable, human-readable name for a scheduled time: 2026-11-29T02:00:00Z."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
