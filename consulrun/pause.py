"""Pause and resume jobs cluster-wide: one KV key per job, one transaction for all of them.

`<prefix>/<job>/pause` holds {"by", "at", "reason", "until"}. While it is in
force (no `until`, or `until` still ahead) every node skips the job; the
runner reads it in the same read-only transaction as the lock and the
occurrence record, so the skip path stays one round trip and no Raft write.
A pause with `until` ends by itself: nothing needs to delete the key.
"""

from __future__ import annotations

import getpass
import socket
from datetime import datetime, timedelta, timezone
from typing import Any

from consulrun.consulapi import Client, decoded, kv_op
from consulrun.errors import ConsulProtocolError


def pause_key(base: str) -> str:
    return f"{base}/pause"


def value_of(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    """The pause key's value; a key someone wrote that is not a readable pause still pauses (fail closed)."""
    if entry is None:
        return None
    return decoded(entry) or {"reason": "the pause key holds no readable value"}


def in_force(value: dict[str, Any] | None, now: datetime | None = None) -> bool:
    """True while `value` (a decoded pause key) pauses the job."""
    if not value:
        return False
    until = value.get("until")
    if not until:
        return True
    try:
        ends = datetime.fromisoformat(str(until).replace("Z", "+00:00"))
    except ValueError:
        return True  # an unreadable end is no reason to run a job someone paused
    if ends.tzinfo is None:
        ends = ends.replace(tzinfo=timezone.utc)  # written by hand without a zone: read as UTC
    return (now or datetime.now(timezone.utc)) < ends


def describe(value: dict[str, Any]) -> str:
    until = f" until {value['until']}" if value.get("until") else ""
    reason = f": {value['reason']}" if value.get("reason") else ""
    return f"paused by {value.get('by', '?')} at {value.get('at', '?')}{until}{reason}"


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"


def _iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def pause(client: Client, prefix: str, jobs: list[str], *, for_ms: int | None, reason: str | None,
          now: datetime | None = None) -> dict[str, Any]:
    """Pause `jobs` in one transaction (one Raft write); returns the value written."""
    now = now or datetime.now(timezone.utc)
    value: dict[str, Any] = {"by": who(), "at": _iso(now)}
    if reason:
        value["reason"] = reason
    if for_ms:
        value["until"] = _iso(now + timedelta(milliseconds=for_ms))
    if client.txn([kv_op("set", pause_key(f"{prefix}/{job}"), value) for job in jobs]) is None:
        raise ConsulProtocolError("Consul refused the pause transaction")
    return value


def resume(client: Client, prefix: str, jobs: list[str]) -> None:
    """End the pause of `jobs` in one transaction (deleting a key that is absent is no error)."""
    if client.txn([kv_op("delete", pause_key(f"{prefix}/{job}")) for job in jobs]) is None:
        raise ConsulProtocolError("Consul refused the resume transaction")
