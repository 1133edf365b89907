"""systemd `OnCalendar=` expressions: validation now, occurrence arithmetic later.

The `oncalendar` package implements systemd's calendar grammar and iteration;
tests compare it with `systemd-analyze calendar`, the reference.
"""

from __future__ import annotations

from datetime import datetime, timezone

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
        raise CalendarError(f"{spec!r} is not a valid calendar expression: {exc}") from None
