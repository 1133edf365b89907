"""The lock protocol: look before writing, acquire with a session, watch it, let go.

Keys of a job live under `<prefix>/<job>/`: `lock` when one holder is
allowed, `slots/<n>` when `--concurrency N` allows N. A node that finds every
slot held decides with one read and no Raft writes.

Fencing follows DESIGN.md: Consul may free the lock at any moment after the
last answer the holder got (a health check can fail right after a renewal) and
re-grants it no earlier than lock-delay later. So the holder confirms the lock
with consistent blocking reads and must have its job dead within lock-delay of
the last confirmation, grace period included.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from consulrun import __version__
from consulrun.consulapi import Client, decoded, kv_op, readable
from consulrun.durations import LOCK_DELAY_RANGE_MS
from consulrun.errors import ConsulrunError, UsageError

log = logging.getLogger("consulrun")

SAFETY_MARGIN_S = 1.0  # slack for scheduling and process teardown beyond the grace period


@dataclass(frozen=True)
class LockSpec:
    job: str
    prefix: str = "consulrun"
    ttl_ms: int = 15_000
    lock_delay_ms: int = 15_000
    checks: tuple[str, ...] = ()
    wait_ms: int = 0
    concurrency: int = 1

    @property
    def base(self) -> str:
        return f"{self.prefix.strip('/')}/{self.job}"

    def keys(self) -> list[str]:
        if self.concurrency == 1:
            return [f"{self.base}/lock"]
        return [f"{self.base}/slots/{n}" for n in range(self.concurrency)]


@dataclass(frozen=True)
class Fencing:
    """Timings derived from lock-delay: how long a holder may go unconfirmed before killing its job."""

    grace_s: float
    fence_after_s: float
    watch_wait_s: float

    @classmethod
    def for_lock_delay(cls, lock_delay_ms: int, ttl_ms: int) -> "Fencing":
        if lock_delay_ms < LOCK_DELAY_RANGE_MS[0]:
            raise UsageError(f"lock-delay must be at least {LOCK_DELAY_RANGE_MS[0] // 1000}s: with less, a holder cut off "
                             "from Consul cannot be sure to stop its job before another node starts")
        lock_delay_s = lock_delay_ms / 1000
        grace_s = min(5.0, lock_delay_s / 3)
        fence_after_s = lock_delay_s - grace_s - SAFETY_MARGIN_S
        watch_wait_s = max(0.5, min(5.0, fence_after_s / 3, ttl_ms / 3000))
        return cls(grace_s=grace_s, fence_after_s=fence_after_s, watch_wait_s=watch_wait_s)


@dataclass
class Held:
    key: str
    session: str
    fencing_token: int
    index: int
    value: dict[str, Any]
    confirmed_at: float  # monotonic time the confirming read was sent


# Given the holder value about to be written, the operations to apply atomically with the acquisition.
Claim = Callable[[dict[str, Any]], list[dict[str, Any]]]


class Interrupted(BaseException):
    """A termination signal arrived while no job was running yet."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _systemd_unit() -> str | None:
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as handle:
            for line in handle:
                leaf = line.strip().rsplit("/", 1)[-1]
                if leaf.endswith(".service"):
                    return leaf
    except OSError:
        pass
    return None


def describe_holder(entry: dict[str, Any]) -> str:
    value = decoded(entry)
    node = value.get("node", "?")
    return f"{node} (pid {value.get('pid', '?')}, since {value.get('started', '?')}, session {entry.get('Session')})"


class Locker:
    """Acquires one of the job's lock keys for this node, or says who holds them."""

    def __init__(self, client: Client, spec: LockSpec) -> None:
        self.client = client
        self.spec = spec
        self.session: str | None = None
        self.node: str | None = None

    def entries(self, index: int | None = None, wait_s: float | None = None) -> tuple[int, dict[str, dict[str, Any]]]:
        if self.spec.concurrency == 1:
            idx, entry = self.client.kv_get(self.spec.keys()[0], index=index, wait_s=wait_s)
            return idx, ({entry["Key"]: entry} if entry else {})
        idx, entries = self.client.kv_get(f"{self.spec.base}/slots/", index=index, wait_s=wait_s, recurse=True)
        return idx, {e["Key"]: e for e in entries or []}

    def _holder_value(self) -> dict[str, Any]:
        value = {"job": self.spec.job, "node": self.node, "host": socket.gethostname(), "pid": os.getpid(),
                 "unit": _systemd_unit(), "invocation_id": os.environ.get("INVOCATION_ID"),
                 "started": now_iso(), "session": self.session, "consulrun_version": __version__}
        return {k: v for k, v in value.items() if v is not None}

    def _create_session(self) -> str:
        if self.node is None:
            self.node = self.client.node_name()
        service_checks: list[str] = []
        if self.spec.checks:
            kinds = self.client.check_kinds()
            unknown = [c for c in self.spec.checks if c not in kinds]
            if unknown:
                raise UsageError(f"check(s) not registered on node {self.node}: {', '.join(unknown)}")
            service_checks = [c for c in self.spec.checks if kinds[c]]
        node_checks = ["serfHealth", *[c for c in self.spec.checks if c not in service_checks and c != "serfHealth"]]
        self.session = self.client.session_create(
            name=f"consulrun:{self.spec.job}@{self.node}", ttl_ms=self.spec.ttl_ms,
            lock_delay_ms=self.spec.lock_delay_ms, node_checks=node_checks, service_checks=service_checks)
        return self.session

    def try_once(self, entries: dict[str, dict[str, Any]], claim: Claim | None = None,
                 keep_session: bool = False) -> Held | None:
        """Acquire a free slot seen in `entries`; None if all were taken (cleaning up our session unless kept).

        With `claim`, its operations are applied in the same transaction as the
        acquisition, so the lock and the claim are taken together or not at all.
        """
        free = [key for key in self.spec.keys() if not entries.get(key, {}).get("Session")]
        if not free:
            return None
        session = self.session or self._create_session()
        for key in free:
            value = self._holder_value()
            if claim is None:
                acquired = self.client.kv_acquire(key, readable(value), session)
            else:
                acquired = self.client.txn([kv_op("lock", key, value, Session=session), *claim(value)]) is not None
            if acquired:
                sent = time.monotonic()
                idx, entry = self.client.kv_get(key, consistent=True)
                if entry and entry.get("Session") == session:
                    return Held(key=key, session=session, fencing_token=int(entry["ModifyIndex"]), index=idx,
                                value=value, confirmed_at=sent)
        if not keep_session:
            self.abandon()
        return None

    def acquire(self) -> tuple[Held | None, str]:
        """Acquire within the spec's wait; returns (held, why-not) and never leaves a session behind on failure.

        While lock-delay refuses a free key, the same session is tried again
        (no new session per attempt); before a long blocking wait on a held
        key it is destroyed, since nothing would renew it meanwhile.
        """
        deadline = time.monotonic() + self.spec.wait_ms / 1000
        index: int | None = None
        while True:
            remaining = deadline - time.monotonic()
            index, entries = self.entries(index=index, wait_s=remaining if index else None)
            held = self.try_once(entries, keep_session=True)
            if held:
                return held, ""
            holders = [describe_holder(e) for e in entries.values() if e.get("Session")]
            if time.monotonic() >= deadline:
                self.abandon()
                reason = f"held by {'; '.join(holders)}" if holders else "lost the race for the lock"
                return None, reason
            if holders:
                self.abandon()
            else:  # freed by invalidation: lock-delay refuses us for a while; do not spin
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
                index = None

    def release(self, held: Held, outcome: dict[str, Any], extra_ops: list[dict[str, Any]] | None = None) -> None:
        """Free the key (recording how the run ended in its value) and destroy the session.

        `extra_ops` are applied in the same transaction, which Consul rolls back
        if the lock is no longer ours.
        """
        # The run's own end time wins, so the lock's value and the occurrence record agree.
        value = {"state": "free", "last": {**held.value, "ended": now_iso(), **outcome}}
        try:
            if extra_ops:
                if self.client.txn([kv_op("unlock", held.key, value, Session=held.session), *extra_ops]) is None:
                    log.warning("%s: the lock was no longer ours; the run's result was not recorded", self.spec.job)
            else:
                self.client.kv_release(held.key, readable(value), held.session)
        except ConsulrunError as exc:
            log.warning("%s: could not release %s (%s); the session's invalidation will free it", self.spec.job,
                        held.key, exc)
        self.abandon()

    def abandon(self) -> None:
        """Destroy our session if we made one; a failure here is logged, the TTL ends it anyway."""
        if self.session is None:
            return
        session, self.session = self.session, None
        try:
            self.client.session_destroy(session)
        except ConsulrunError as exc:
            log.warning("%s: could not destroy session %s (%s); its TTL will end it", self.spec.job, session, exc)


class Watcher(threading.Thread):
    """Confirms the held lock continuously and renews the session; never touches the job itself."""

    def __init__(self, client: Client, spec: LockSpec, held: Held, fencing: Fencing) -> None:
        super().__init__(name="consulrun-watcher", daemon=True)
        self.client = client
        self.spec = spec
        self.held = held
        self.fencing = fencing
        self.last_confirmed = held.confirmed_at
        self.lost_reason: str | None = None
        self.wakeup, self._wake_writer = os.pipe()  # readable end: select() on it to hear of changes
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        if not self._stop_event.is_set():
            os.write(self._wake_writer, b"!")

    def run(self) -> None:
        index = self.held.index
        last_renew = time.monotonic()
        renew_every = self.spec.ttl_ms / 3000
        while not self._stop_event.is_set():
            sent = time.monotonic()
            try:
                if sent - last_renew >= renew_every:
                    if not self.client.session_renew(self.held.session):
                        return self._lose("the session no longer exists")
                    last_renew = sent
                new_index, entry = self.client.kv_get(self.held.key, index=index, consistent=True,
                                                      wait_s=self.fencing.watch_wait_s)
            except ConsulrunError as exc:
                log.warning("%s: cannot confirm the lock: %s", self.spec.job, exc)
                self._stop_event.wait(0.2)
                continue
            if entry is None or entry.get("Session") != self.held.session:
                holder = describe_holder(entry) if entry and entry.get("Session") else "nobody"
                return self._lose(f"the lock was released or taken over; now held by {holder}")
            self.last_confirmed = sent
            index = new_index if new_index >= index else 0
