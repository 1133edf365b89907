"""Every value read from Consul's KV store passes here: checked for size, nesting and field types, or refused.

Whoever holds KV write under the prefix (every node's token does) can put
anything in any key. consulrun reads those values on every timer tick, in
`status`, `history`, the watchdog and the exporter; a value it did not write
must be one line naming its key and exit status 65 (MalformedValue), never a
traceback, a crash of a long-running exporter, or a guess. The check is a
walk over the decoded JSON and a table of the fields consulrun writes, cheap
enough for the run's skip path (no schema library is imported).

`printable` is the other half: text that came from Consul (or from a remote
host) is shown with its control characters escaped, so a value cannot clear
a terminal, set its title, or print a line that looks like one of ours.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from consulrun.errors import MalformedValue

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

MAX_BYTES = 256 * 1024  # ours are a few KB; Consul's own default limit is 512 KB
MAX_DEPTH = 8  # ours nest 4 deep (a record, its `earlier` list, an attempt, its `schedule`)
MAX_ITEMS = 10_000

# The fields consulrun writes and the type each must have when present (null is always allowed).
_TEXT = ("state", "node", "session", "reason", "zone", "zone_offsets", "job", "host", "unit", "invocation_id",
         "boot_id", "pid_ns", "time_ns", "consulrun_version", "by", "id", "requested_by", "trigger", "lost",
         "ended_by", "until", "recorded_by", "retries_ended")
_TIMES = ("occurrence", "started", "ended", "at", "requested_at", "retry_at")  # ISO 8601 with a zone, as we write
_NUMBERS = ("exit_status", "attempt", "pid", "pid_start")
_REALS = ("retry_after_s", "ahead_s")  # seconds, whole or not
_FLAGS = ("takeover", "manual", "timed_out", "retried")
_RECORDS = ("last",)  # a nested record, checked with the same table
_RECORD_LISTS = ("earlier",)
_TEXT_LISTS = ("schedule",)


def _escape_table() -> dict[int, str]:
    table = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
    table.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
    # Characters a terminal or a YAML/JSON reader takes for a line break, and the bidirectional overrides that
    # make text read in another order than it is stored.
    for c in (0x2028, 0x2029, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0xFEFF):
        table[c] = f"\\u{c:04x}"
    return table


_ESCAPES = _escape_table()


def printable(text: Any) -> str:
    """`text` (from Consul or a remote host) safe for a terminal or a log line: control characters escaped."""
    return str(text).translate(_ESCAPES)


def decode(entry: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON object a KV entry holds; {} if absent or empty; MalformedValue naming the key if it is not one
    consulrun could have written (not JSON, not an object, too large, too deep, a field of the wrong type)."""
    raw = (entry or {}).get("Value")
    if not raw:
        return {}
    key = printable((entry or {}).get("Key") or "?")
    if len(raw) > MAX_BYTES:
        raise MalformedValue(key, f"the value is larger than {MAX_BYTES // 1024} KiB")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise MalformedValue(key, f"the value nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # not UTF-8, or not JSON
        raise MalformedValue(key, f"the value is not JSON ({printable(str(exc)[:80])})") from None
    if not isinstance(value, dict):
        raise MalformedValue(key, f"the value is JSON {_kind(value)}, not an object")
    _shape(key, value)
    why = _fields(value)
    if why is None and key.endswith("/occurrence"):  # every record consulrun writes there names both
        why = next((f"field {name!r} is missing" for name in ("occurrence", "state") if name not in value), None)
    if why:
        raise MalformedValue(key, why)
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "text", bool: "true/false", type(None): "null"}.get(
        type(value), "a number")


def _shape(key: str, value: Any) -> None:
    """Depth and size, walked without recursion (the value itself may be what would exhaust the stack)."""
    stack = [(value, 1)]
    items = 0
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise MalformedValue(key, f"the value nests deeper than {MAX_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            items += 1
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
        if items > MAX_ITEMS:
            raise MalformedValue(key, f"the value holds more than {MAX_ITEMS} items")


def _fields(record: dict[str, Any], where: str = "") -> str | None:
    """Why a field of `record` has a type consulrun never writes there, or None."""
    for name, value in record.items():
        if value is None:
            continue
        field = f"{where}{printable(name)}"
        if name in _TEXT and not isinstance(value, str):
            return f"field {field!r} is {_kind(value)}, not text"
        if name in _TIMES and not _is_time(value):
            return f"field {field!r} is not a time with a zone (e.g. 2026-11-29T02:00:00Z): {_shown(value)}"
        if name == "occurrence" and parse_time(value).strftime("%Y-%m-%dT%H:%M:%SZ") != value:
            return f"field {field!r} is not an occurrence as consulrun names one (e.g. 2026-11-29T02:00:00Z): " \
                   f"{_shown(value)}"
        if name == "zone_offsets" and not _is_offsets(value):
            return f"field {field!r} is not three UTC offsets in seconds (e.g. 3600,7200,3600): {_shown(value)}"
        if name == "invocation_id" and not is_invocation_id(value):
            return f"field {field!r} is not a systemd invocation id (32 hex digits): {_shown(value)}"
        if name in _NUMBERS and type(value) is not int:
            return f"field {field!r} is {_kind(value)}, not a whole number"
        if name in _REALS and (type(value) not in (int, float) or value != value or abs(value) > 1e9):
            return f"field {field!r} is {_kind(value)}, not a number of seconds"
        if name in _FLAGS and not isinstance(value, bool):
            return f"field {field!r} is {_kind(value)}, not true/false"
        if name in _TEXT_LISTS and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return f"field {field!r} is not a list of text"
        if name in _RECORDS or name in _RECORD_LISTS:
            why = _nested(name, value, field)
            if why:
                return why
    return None


def _nested(name: str, value: Any, field: str) -> str | None:
    """Why a field that holds a record (or a list of records) does not, or why one of them is malformed."""
    nested = [value] if name in _RECORDS else value
    if not isinstance(nested, list) or not all(isinstance(v, dict) for v in nested):
        return f"field {field!r} is not {'an object' if name in _RECORDS else 'a list of objects'}"
    for n, inner in enumerate(nested):
        why = _fields(inner, f"{field}." if name in _RECORDS else f"{field}[{n}].")
        if why:
            return why
    return None


def is_invocation_id(value: str) -> bool:
    """As systemd gives INVOCATION_ID: 32 lowercase hex digits (journalctl matches lines by it)."""
    return len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def _is_offsets(value: str) -> bool:
    """As `calendar.zone_offsets` writes them: three whole seconds, each within a day (zones stay within ±26 h)."""
    parts = value.split(",")
    return len(parts) == 3 and all(p.lstrip("-").isdigit() and p.isascii() and abs(int(p)) < 86400 for p in parts)


def _is_time(value: Any) -> bool:
    if not isinstance(value, str) or len(value) > 40:
        return False
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
        # In UTC, and after 1970: a zone shift past year 1 or 9999 would overflow every reader's arithmetic.
        return when.tzinfo is not None and when.astimezone(timezone.utc).year >= 1970
    except (ValueError, OverflowError):
        return False


def _shown(value: Any) -> str:
    text = printable(json.dumps(value) if not isinstance(value, str) else repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


def parse_time(text: str) -> datetime:
    """A time `decode` accepted (`_TIMES`), as an aware datetime."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(timezone.utc)
