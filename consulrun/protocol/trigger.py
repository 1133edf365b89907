"""Run a job once, now, on this node, through its own systemd unit: `consulrun trigger`.

The request is a KV key, `<prefix>/<job>/trigger` ({id, by, at, node}),
written only if none is pending; then the unit is started with `systemctl
start`, so the run gets the unit's user, environment, credentials and
cgroup. The unit's `consulrun run` sees the request for its node and, instead
of the scheduled occurrence, takes the lock and consumes the request in one
transaction (check-and-delete: one run per request), recording the run in
history as manual. The lock keeps it from ever running beside a scheduled
run; a job that is running already is reported, not run twice.
"""

from __future__ import annotations

import logging
import signal
import time
from datetime import datetime, timezone

from consulrun.consul.client import Client, decoded, kv_op
from consulrun.consul.values import printable
from consulrun.errors import ConsulrunError, MalformedValue
from consulrun.protocol import keys
from consulrun.protocol.lock import describe_holder
from consulrun.protocol.pause import describe, in_force, pause_key, value_of, who
from consulrun.records import record

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    import subprocess
    from typing import Any, Callable


class NotTriggered(ConsulrunError):
    """The job is running, or another trigger is pending: nothing was started."""


@record
class Outcome:
    record: dict[str, Any] | None  # the manual run's history entry, if it ran
    unit_status: int  # what `systemctl start` returned
    unit_output: str


MAX_AGE_S = 600  # a request older than this was left by a trigger that died; runs ignore it
MAX_AHEAD_S = 300  # a request from the future: the clock of the node that asked may be this far ahead
_UUID_CHARS = frozenset("0123456789abcdef-")


def fresh(request: dict[str, Any], now: datetime | None = None) -> bool:
    """Whether a well-formed request (see `problem`) is recent enough to be acted on."""
    try:
        at = datetime.fromisoformat(str(request.get("at")).replace("Z", "+00:00"))
    except ValueError:
        return False
    if at.tzinfo is None:
        return False
    age = ((now or datetime.now(timezone.utc)) - at).total_seconds()
    return -MAX_AHEAD_S < age < MAX_AGE_S


def problem(request: dict[str, Any]) -> str | None:
    """Why `request` is not one `consulrun trigger` writes, or None: only a well-formed request is consumed.

    Anyone with KV write can write the trigger key; a request we would not
    write (no zone on its time, a `by` holding a line break, an id that is not
    a UUID) is left alone and said once per run, never acted on.
    """
    rid, by, at, node = (request.get(k) for k in ("id", "by", "at", "node"))
    if not (isinstance(rid, str) and len(rid) == 36 and set(rid) <= _UUID_CHARS):
        return "its id is not a UUID"
    if not (isinstance(by, str) and 0 < len(by) <= 256 and printable(by) == by):
        return "its `by` is not a user@host without control characters"
    if not (isinstance(node, str) and 0 < len(node) <= 256 and printable(node) == node):
        return "its `node` is not a node name"
    if not isinstance(at, str) or len(at) > 40:
        return "its `at` is not a time"
    try:
        when = datetime.fromisoformat(at.replace("Z", "+00:00"))
    except ValueError:
        return "its `at` is not a time"
    return None if when.tzinfo is not None else "its `at` has no time zone"


def read_request(entry: dict[str, Any] | None, job: str) -> dict[str, Any] | None:
    """The pending request in the trigger key, if it is well formed; a malformed one is logged and ignored (so
    a forged trigger neither stops the scheduled runs nor makes one more)."""
    if not entry or not entry.get("Value"):
        return None
    try:
        request = decoded(entry)
    except MalformedValue as exc:
        why = exc.message
    else:
        why = problem(request)
        if why is None:
            return request
    logging.getLogger("consulrun").warning("%s: ignoring the trigger request in %s: %s", job,
                                           printable(entry.get("Key")), why)
    return None


def _stopped(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # through the `finally` that withdraws the request


def _wait_free(client: Client, lock_key: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    index: int | None = None
    while True:
        index, entry = client.kv_get(lock_key, index=index, wait_s=max(1.0, deadline - time.monotonic())
                                     if index else None)
        if not (entry or {}).get("Session"):
            return
        if time.monotonic() >= deadline:
            raise NotTriggered(f"the job is running: {describe_holder(entry)}; not triggered"
                               + (" (gave up waiting)" if wait_s else " (--wait waits for it)"))


def _pending(client: Client, trigger_key: str, request: dict[str, Any]) -> bool:
    _, entry = client.kv_get(trigger_key)
    return bool(entry) and decoded(entry).get("id") == request["id"]


def trigger(client: Client, base: str, unit: str, *, wait_s: float,
            start_unit: Callable[[str], subprocess.CompletedProcess[str]]) -> Outcome:
    lock_key, trigger_key = keys.lock_key(base), keys.trigger_key(base)
    deadline = time.monotonic() + wait_s
    _, paused = client.kv_get(pause_key(base))
    if paused is not None and in_force(value_of(paused)):
        raise NotTriggered(f"the job is {printable(describe(value_of(paused) or {}))}; resume it first; not triggered")
    _wait_free(client, lock_key, wait_s)
    import uuid

    request = {"id": str(uuid.uuid4()), "by": who(),
               "at": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
               "node": client.node_name()}
    _, pending = client.kv_get(trigger_key)
    if pending and not fresh(decoded(pending)):  # left by a trigger that died: it asks for nothing any more
        client.txn([kv_op("delete-cas", trigger_key, Index=int(pending["ModifyIndex"]))])
    if client.txn([kv_op("cas", trigger_key, request, Index=0)]) is None:
        _, pending = client.kv_get(trigger_key)
        raise NotTriggered(f"another trigger is pending: {printable(decoded(pending))}; not triggered")
    stop = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            started = start_unit(unit)
            if started.returncode != 0 or time.monotonic() >= deadline or not _pending(client, trigger_key, request):
                break
            # `systemctl start` joined a run the unit's timer had just begun, which ran (or skipped) its occurrence
            # and left the request alone: with time left to wait, start the unit again for it once the lock is free.
            _wait_free(client, lock_key, max(0.0, deadline - time.monotonic()))
    finally:
        for sig, handler in stop.items():
            signal.signal(sig, handler)
        # A request the run did not consume (it found the job running, or never started) must not linger.
        _, entry = client.kv_get(trigger_key)
        if entry and decoded(entry).get("id") == request["id"]:
            client.txn([kv_op("delete-cas", trigger_key, Index=int(entry["ModifyIndex"]))])
    _, entries = client.kv_get(keys.history_prefix(base), recurse=True)
    records = [decoded(e) for e in entries or [] if keys.is_manual(e["Key"])]
    mine = next((r for r in records if r.get("trigger") == request["id"]), None)
    return Outcome(record=mine, unit_status=started.returncode, unit_output=(started.stderr or started.stdout).strip())


def systemctl_start(unit: str) -> subprocess.CompletedProcess[str]:
    """Start a oneshot unit and wait for it to finish (what `systemctl start` does for Type=oneshot)."""
    import subprocess  # here: every scheduled run imports this module, only a trigger starts a unit

    try:
        return subprocess.run(["systemctl", "start", unit], capture_output=True, text=True)
    except OSError as exc:
        raise ConsulrunError(f"cannot run systemctl: {exc.strerror}") from None
