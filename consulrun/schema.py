"""The manifest's JSON Schema, loaded without the validator so light commands stay fast to start."""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

SCHEMA: dict[str, Any] = json.loads(resources.files("consulrun").joinpath("manifest.schema.json").read_text())


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a job name (unit-name and KV-key material), or None if it can."""
    rule = SCHEMA["$defs"]["name"]
    return None if re.fullmatch(rule["pattern"], name) else f"job name {name!r} {rule['x-message']}"


def schedule_problem(spec: str) -> str | None:
    """Why `spec` is not an `OnCalendar=` line systemd would take, or None.

    A spec ending in a word that looks like a zone (`Area/Place`) but is not
    one says so, rather than the calendar parser's guess at a day of week.
    """
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    from consulrun import calendar

    words = spec.split()
    if len(words) > 1 and re.fullmatch(r"[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)+", words[-1]):
        try:
            ZoneInfo(words[-1])
        except (ZoneInfoNotFoundError, ValueError):
            return f"{spec!r}: unknown time zone {words[-1]!r}"
    try:
        calendar.validate(spec)
    except calendar.CalendarError as exc:
        return str(exc)
    return None
