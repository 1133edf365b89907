"""The manifest's JSON Schema, loaded without the validator so light commands stay fast to start."""

from __future__ import annotations

import functools
import json
import os
import re

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

with open(os.path.join(os.path.dirname(__file__), "manifest.schema.json"), encoding="utf-8") as _file:
    SCHEMA: dict[str, Any] = json.load(_file)  # a plain open: importlib.resources costs `run` more than the read


def conforms(data: Any) -> bool:
    """True if `data` conforms to SCHEMA, by a validator compiled from it (fastjsonschema).

    Only the answer comes from here: a manifest that does not conform is
    checked again by jsonschema, whose errors carry the paths our messages
    name. The compiled check is ~20 times faster on a valid 10,000-job
    manifest; tests hold the two to the same verdict.
    """
    import fastjsonschema

    global _compiled
    if _compiled is None:
        _compiled = fastjsonschema.compile(SCHEMA, use_default=False)  # check only: never fill data in
    try:
        _compiled(data)
    except Exception:  # noqa: BLE001 - any doubt (a rejection, or data it cannot handle) goes to jsonschema
        return False
    return True


_compiled: Any = None


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a job name (unit-name and KV-key material), or None if it can."""
    rule = SCHEMA["$defs"]["name"]
    return None if re.fullmatch(rule["pattern"], name) else f"job name {name!r} {rule['x-message']}"


def kv_prefix_problem(prefix: str) -> str | None:
    """Why `prefix` cannot be a KV prefix (the manifest's `kv_prefix`, `--prefix`), or None if it can."""
    rule = SCHEMA["properties"]["kv_prefix"]
    if re.fullmatch(rule["pattern"], prefix) and len(prefix) <= rule["maxLength"]:
        return None
    return f"{prefix!r} {rule['x-message']}"


@functools.lru_cache(maxsize=4096)  # pure; a big manifest repeats a few specs
def schedule_problem(spec: str) -> str | None:
    """Why `spec` is not an `OnCalendar=` line systemd would take, or None.

    A spec ending in a word that looks like a zone (`Area/Place`) but is not
    one says so, rather than the calendar parser's guess at a day of week.
    """
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    from consulrun.manifest import calendar

    if len(spec.split()) == 5 or spec.strip().startswith("@"):  # all cron can be: five fields or an @macro
        from consulrun.manifest import cronfields  # only then: a timer tick need not load the converter

        if cronfields.looks_like_cron(spec):
            try:
                specs = cronfields.to_oncalendar(spec)
            except cronfields.CronError as exc:
                return (f"{spec!r} looks like cron syntax, which schedule: does not take, and cannot be converted: "
                        f"{exc}")
            said = repr(specs[0]) if len(specs) == 1 else "the list [" + ", ".join(repr(s) for s in specs) + "]"
            return (f"{spec!r} is cron syntax; schedule: takes systemd OnCalendar= specs, and in that syntax it is "
                    f"{said}")
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
