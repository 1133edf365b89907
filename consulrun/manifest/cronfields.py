"""Cron's five time fields as systemd `OnCalendar=` specs.

Semantics follow Vixie cron as Debian and cronie run it: `*`, `*/n`, `a`,
`a-b`, `a-b/n` and `a/n` (from a to the field's end), comma lists, month and
weekday names, 0 and 7 both Sunday, and the `@yearly`-style macros (cron's
`@weekly` is Sunday, not systemd's Monday). Day of month and day of week
combine with AND when either field starts with `*`, and with OR otherwise;
`OnCalendar=` has no OR between fields, so the OR case becomes two specs.
tests/cron_cases.txt holds the conversion table with systemd's answer
beside each case.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
CRON_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
SYSTEMD_DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
MACROS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
          "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: list[str] | None = None
    name_base: int = 0


_FIELDS = [_Field("minute", 0, 59), _Field("hour", 0, 23), _Field("day of month", 1, 31),
           _Field("month", 1, 12, MONTHS, 1), _Field("day of week", 0, 7, CRON_DAYS, 0)]
_ELEMENT = re.compile(r"(?P<start>\*|[0-9]+|[A-Za-z]+)(?:-(?P<end>[0-9]+|[A-Za-z]+))?(?:/(?P<step>[0-9]+))?")


class CronError(ValueError):
    """The fields are not cron syntax, or have no `OnCalendar=` equivalent."""


def _number(field: _Field, text: str) -> int:
    if text.isdigit():
        value = int(text)
    elif field.names and text.lower() in field.names:
        return field.names.index(text.lower()) + field.name_base
    else:
        raise CronError(f"{field.name}: {text!r} is not a number" + (" or a name" if field.names else ""))
    if not field.low <= value <= field.high:
        raise CronError(f"{field.name}: {value} is out of range ({field.low}-{field.high})")
    return value


def parse_field(field_index: int, text: str) -> set[int]:
    """The values a cron field matches (day of week with Sunday as 0 only)."""
    field = _FIELDS[field_index]
    values: set[int] = set()
    for element in text.split(","):
        match = _ELEMENT.fullmatch(element)
        if not match:
            raise CronError(f"{field.name}: {element!r} is not cron syntax (*, N, N-M, */S, N-M/S or a list of them)")
        start, end, step = match.group("start"), match.group("end"), match.group("step")
        if start == "*":
            if end:
                raise CronError(f"{field.name}: {element!r} is not cron syntax")
            low, high = field.low, field.high
        else:
            low = _number(field, start)
            high = _number(field, end) if end else (field.high if step else low)
        if high < low:
            raise CronError(f"{field.name}: the range {element!r} runs backwards")
        stride = int(step) if step else 1
        if stride == 0:
            raise CronError(f"{field.name}: a step of 0 in {element!r}")
        values.update(range(low, high + 1, stride))
    if field_index == 4 and 7 in values:
        values = (values - {7}) | {0}
    return values


def _numbers(values: set[int], low: int, high: int) -> str:
    """A set of values in OnCalendar= syntax: *, a start/step to the end, runs as a..b, or a list."""
    ordered = sorted(values)
    if ordered == list(range(low, high + 1)):
        return "*"
    if len(ordered) >= 3:
        step = ordered[1] - ordered[0]
        # systemd 252 mis-steps a repetition that does not divide its field across a day boundary (from 23:55,
        # *:00/18 next fires at 00:18, not 00:00), so such a set is written as a list.
        if (step > 1 and (high - low + 1) % step == 0
                and ordered == list(range(ordered[0], ordered[-1] + 1, step))):
            if ordered[-1] + step > high:
                return f"{ordered[0]:02d}/{step}"
            return f"{ordered[0]:02d}..{ordered[-1]:02d}/{step}"
    parts, run = [], [ordered[0]]
    for value in ordered[1:] + [None]:
        if value is not None and value == run[-1] + 1:
            run.append(value)
            continue
        parts += [f"{run[0]:02d}..{run[-1]:02d}"] if len(run) >= 3 else [f"{v:02d}" for v in run]
        if value is not None:
            run = [value]
    return ",".join(parts)


def _weekdays(values: set[int]) -> str:
    """Cron weekdays (0 = Sunday) as systemd's, whose week runs Monday to Sunday: Mon..Fri,Sun."""
    indices = sorted((v - 1) % 7 for v in values)
    parts, run = [], [indices[0]]
    for value in indices[1:] + [None]:
        if value is not None and value == run[-1] + 1:
            run.append(value)
            continue
        if len(run) >= 3:
            parts.append(f"{SYSTEMD_DAYS[run[0]]}..{SYSTEMD_DAYS[run[-1]]}")
        else:
            parts += [SYSTEMD_DAYS[v] for v in run]
        if value is not None:
            run = [value]
    return ",".join(parts)


def expand_macro(text: str) -> str:
    """The five fields a `@daily`-style macro stands for; `@reboot` has none."""
    word = text.strip().lower()
    if word == "@reboot":
        raise CronError("@reboot runs at boot, not on a calendar; a systemd unit WantedBy=multi-user.target does that")
    if word not in MACROS:
        raise CronError(f"{text.strip()!r} is not a cron macro ({', '.join(sorted(MACROS))} or @reboot)")
    return MACROS[word]


def to_oncalendar(fields: str, zone: str | None = None) -> list[str]:
    """`OnCalendar=` specs that together fire exactly when the cron fields (or a macro) do."""
    text = expand_macro(fields) if fields.strip().startswith("@") else fields
    parts = text.split()
    if len(parts) != 5:
        raise CronError(f"expected 5 time fields (minute hour day-of-month month day-of-week), got {len(parts)}")
    minute, hour, dom, month, dow = (parse_field(i, part) for i, part in enumerate(parts))
    suffix = f" {zone}" if zone else ""
    time = f"{_numbers(hour, 0, 23)}:{_numbers(minute, 0, 59)}:00"
    months = _numbers(month, 1, 12)
    days = _numbers(dom, 1, 31)
    weekdays = "" if dow == set(range(7)) else _weekdays(dow) + " "
    if parts[2].startswith("*") or parts[4].startswith("*"):  # cron ANDs the two day fields
        return [f"{weekdays}*-{months}-{days} {time}{suffix}"]
    if days == "*" or not weekdays:  # OR with a field that matches every day: every day
        return [f"*-{months}-* {time}{suffix}"]
    return [f"{weekdays}*-{months}-* {time}{suffix}", f"*-{months}-{days} {time}{suffix}"]


def looks_like_cron(spec: str) -> bool:
    """True for five cron fields or a cron macro, which `OnCalendar=` never takes."""
    if spec.strip().lower() in MACROS or spec.strip().lower() == "@reboot":
        return True
    parts = spec.split()
    return len(parts) == 5 and all(re.fullmatch(r"[0-9A-Za-z*/,-]+", part) for part in parts)
