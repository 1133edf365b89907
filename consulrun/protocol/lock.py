"""The lock protocol: look before writing, acquire with a session, watch it, let go.

Keys of a job live under `<prefix>/<job>/`: `lock` when one holder is
allowed, `slots/<n>` when `--concurrency N` allows N. A node that finds every
slot held decides with one read and no Raft writes.

Fencing follows docs/design.md: Consul may free the lock at any moment after the
last answer the holder got (a health check can fail right after a renewal) and
re-grants it no earlier than lock-delay later. So the holder confirms the lock
with consistent blocking reads and must have its job dead within lock-delay of
the last confirmation, grace period included.

Why this module is long: acquiring, confirming, fencing and releasing one session lock are
one state machine whose every step must be read with the others to see what holds at each
instant (docs/design.md); the mutation groups name its functions in place.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import datetime, timezone

from consulrun import __version__
from consulrun.consul.client import Client, SessionInvalid, decoded, kv_op
from consulrun.consul.values import is_invocation_id, printable
from consulrun.errors import ConsulrunError, ConsulUnavailable, UsageError
from consulrun.protocol import keys, testhook
from consulrun.protocol.fencing import Fencing
from consulrun.protocol.procinfo import (
    boot_id,
    hold_marker,
    own_unit,
    pid_namespace,
    process_start,
    provably_dead,
    time_namespace,
)
from consulrun.records import record
from consulrun.timefmt import duration

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any, Callable

    from consulrun.manifest.placement import Placement

log = logging.getLogger("consulrun")

@record
class LockSpec:
    job: str
    prefix: str = "consulrun"
    ttl_ms: int = 15_000
    lock_delay_ms: int = 15_000
    checks: tuple[str, ...] = ()
    wait_ms: int = 0
    concurrency: int = 1
    placement: Placement | None = None  # the nodes that may run the job (the manifest's `nodes:`); None: any

    @property
    def base(self) -> str:
        return keys.job_base(self.prefix, self.job)

    def keys(self) -> list[str]:
        if self.concurrency == 1:
            return [keys.lock_key(self.base)]
        return [keys.slot_key(self.base, n) for n in range(self.concurrency)]


@record
class Held:
    key: str
    session: str
    fencing_token: int
    index: int
    value: dict[str, Any]
    confirmed_at: float  # clock() when the confirming read was sent
    results: list[dict[str, Any]] | tuple[()] = ()  # the acquiring transaction's results


if TYPE_CHECKING:
    # Given the holder value about to be written, the operations to apply atomically with the acquisition.
    Claim = Callable[[dict[str, Any]], list[dict[str, Any]]]


class Interrupted(BaseException):
    """A termination signal arrived while no job was running yet."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def clock() -> float:
    """Seconds on CLOCK_BOOTTIME: monotonic, and it keeps counting across system suspend.

    Every fencing deadline is measured on it: a holder that slept through a
    suspend must see that its lock-delay window has passed.
    """
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _invocation_id() -> str | None:
    """The id systemd gave this run of the unit (journald tags the run's lines with it; `consulrun logs` finds
    them by it); None outside systemd, or if INVOCATION_ID is not one (32 hex digits), which every reader refuses."""
    given = os.environ.get("INVOCATION_ID", "")
    return given if is_invocation_id(given) else None


def describe_holder(entry: dict[str, Any]) -> str:
    """The holder for a log line; its fields come from a value anyone with KV write may have written."""
    value = decoded(entry)
    return printable(f"{value.get('node', '?')} (pid {value.get('pid', '?')}, since {value.get('started', '?')}, "
                     f"session {entry.get('Session')})")


class Locker:
    """Acquires one of the job's lock keys for this node, or says who holds them.

    The session it makes is kept alive by `keep_alive` while it waits (lock-delay
    may outlast the TTL) and destroyed by `abandon` on every path that does not
    end in a held lock.
    """

    def __init__(self, client: Client, spec: LockSpec, shield: Callable[[bool], None] = lambda on: None,
                 checkpoint: Callable[[], None] = lambda: None) -> None:
        self.client = client
        self.spec = spec
        self.shield = shield  # defers termination signals while a lock may be taken but not yet known to us
        self.checkpoint = checkpoint  # raises Interrupted for a deferred signal where giving up is safe
        self.session: str | None = None
        self.node: str | None = None
        self._renewed_at = 0.0
        self._said_at: dict[str, float] = {}
        self._marks: dict[str, socket.socket | None] = {}  # sessions that have held a lock here, and their marks

    def say_waiting(self, topic: str, text: str, every_s: float = 60.0) -> None:
        """Log a waiting line when a wait of this kind starts, then at most every `every_s` while it goes on."""
        now = clock()
        if now - self._said_at.get(topic, -every_s) >= every_s:
            self._said_at[topic] = now
            log.info("%s: %s", self.spec.job, text)

    def entries(self, index: int | None = None, wait_s: float | None = None) -> tuple[int, dict[str, dict[str, Any]]]:
        if self.spec.concurrency == 1:
            idx, entry = self.client.kv_get(self.spec.keys()[0], index=index, wait_s=wait_s)
            return idx, ({entry["Key"]: entry} if entry else {})
        idx, entries = self.client.kv_get(keys.slots_prefix(self.spec.base), index=index, wait_s=wait_s, recurse=True)
        return idx, {e["Key"]: e for e in entries or []}

    def snapshot(self) -> tuple[dict[str, dict[str, Any]], str | None, dict[str, Any]]:
        """(the lock entries, why the job is paused or None, an operation that fails a transaction if the pause
        key changed since), read together: a pause landing between this look and the acquisition stops it."""
        from consulrun.protocol.pause import describe, in_force, pause_key, unchanged_op, value_of

        key = pause_key(self.spec.base)
        lock_prefix = self.spec.keys()[0] if self.spec.concurrency == 1 else keys.slots_prefix(self.spec.base)
        found = self.client.read_trees([lock_prefix, key])
        pause_entry = found.pop(key, None)
        guard = unchanged_op(self.spec.base, int(pause_entry["ModifyIndex"]) if pause_entry else 0)
        paused = value_of(pause_entry)
        entries = {k: e for k, e in found.items() if k in self.spec.keys()}
        return entries, (describe(paused) if in_force(paused) else None), guard

    def _holder_value(self) -> dict[str, Any]:
        value = {"job": self.spec.job, "node": self.node, "host": socket.gethostname(), "pid": os.getpid(),
                 "pid_start": process_start(os.getpid()), "boot_id": boot_id(), "pid_ns": pid_namespace(),
                 "time_ns": time_namespace(),
                 "unit": own_unit(), "invocation_id": _invocation_id(), "started": now_iso(),
                 "session": self.session, "consulrun_version": __version__}
        return {k: v for k, v in value.items() if v is not None}

    def node_name(self) -> str:
        if self.node is None:
            self.node = self.client.node_name()
        return self.node

    def placement_refusal(self) -> str | None:
        """Why this node may not run the job (its `nodes:` names other nodes), or None; names the node for the
        lock on the way (the same read of the local agent)."""
        placement = self.spec.placement
        if placement is None:
            return None
        self.node, meta = self.client.node_identity()
        if placement.matches(self.node, meta):
            return None
        return f"this node ({printable(self.node)}) is not one the job runs on (nodes: {placement.describe()})"

    def _create_session(self) -> str:
        self.node_name()
        service_checks: list[str] = []
        if self.spec.checks:
            kinds = self.client.check_kinds()
            unknown = [c for c in self.spec.checks if c not in kinds]
            if unknown:
                raise UsageError(f"check(s) not registered on node {self.node}: {', '.join(unknown)}")
            service_checks = [c for c in self.spec.checks if kinds[c]]
        node_checks = ["serfHealth", *[c for c in self.spec.checks if c not in service_checks and c != "serfHealth"]]
        self.shield(True)  # a signal must not lose the answer naming a session that exists
        try:
            self.session = self.client.session_create(
                name=f"consulrun:{self.spec.job}@{self.node}", ttl_ms=self.spec.ttl_ms,
                lock_delay_ms=self.spec.lock_delay_ms, node_checks=node_checks, service_checks=service_checks)
            self._renewed_at = clock()
        finally:
            self.shield(False)  # raises a held-back signal now, with self.session set for the cleanup
        return self.session

    def keep_alive(self) -> None:
        """Renew our session if a third of its TTL has passed; forget it if Consul no longer knows it.

        Renewals are not Raft writes. A session Consul destroyed meanwhile is
        replaced by a new one at the next attempt, never read as a lost race.
        """
        if self.session is None or clock() - self._renewed_at < self.spec.ttl_ms / 3000:
            return
        if self.client.session_renew(self.session):
            self._renewed_at = clock()
        else:
            log.info("%s: session %s no longer exists (expired or destroyed)", self.spec.job, self.session)
            self.session = None

    def sleep(self, seconds: float) -> None:
        """Sleep while keeping our session alive."""
        end = clock() + seconds
        while (left := end - clock()) > 0:
            time.sleep(min(left, self.spec.ttl_ms / 3000))
            self.keep_alive()

    def reap_dead_holder(self, entries: dict[str, dict[str, Any]]) -> bool:
        """Destroy the session of a holder whose wrapper on this machine is gone; True if one was.

        Its session would otherwise live until its TTL ran out (up to 2 x TTL);
        lock-delay still applies, as for any invalidation.
        """
        reaped = False
        for entry in entries.values():
            value = decoded(entry)
            if not entry.get("Session") or value.get("boot_id") != boot_id():  # another machine: cannot tell
                continue
            # The value says "this machine"; only Consul's record of the session can say it is (procinfo).
            dead = provably_dead(value, self.node_name(), self.client.session_info(entry["Session"]))
            if dead:
                log.warning("%s: the holder's session %s lives on but %s; destroying the session", self.spec.job,
                            entry["Session"], dead)
                self.client.session_destroy(entry["Session"])
                reaped = True
                # The key's value is a run's only record when it has no occurrence record (a run without
                # --schedule): say how it ended there, as a scheduled run's next node does in its record.
                try:
                    why = f"{dead}; its session was destroyed and no result recorded"
                    if self.record_end(entry["Key"], entry["Session"], {"state": "abandoned", "reason": why}):
                        log.info("%s: the run is recorded abandoned in %s", self.spec.job, entry["Key"])
                except ConsulrunError as exc:  # the lock is free, which is what reaping is for; readers judge it
                    log.warning("%s: could not record the run abandoned in %s (%s)", self.spec.job, entry["Key"], exc)
        return reaped

    def record_end(self, key: str, session: str, end: dict[str, Any], over_abandoned: bool = False,
                   check: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> bool:
        """Record in `key`'s value how the run of `session`, which no longer holds it, ended; True if written.

        A check-and-set on the key as read: only a value still naming that run
        as its holder (no end recorded, no holder since) is replaced, so a
        later holder or an end already recorded is never overwritten; with
        `over_abandoned`, the runner's own end also replaces an `abandoned`
        guess about that same run. `check` makes the job's health check operation from the recorded run, as in
        `release`.
        """
        _, entry = self.client.kv_get(key, consistent=True)
        if not entry or entry.get("Session"):
            return False
        value = decoded(entry)
        last = value.get("last")
        if isinstance(last, dict):
            if not (over_abandoned and last.get("session") == session and last.get("state") == "abandoned"):
                return False
            value = {k: v for k, v in last.items() if k not in ("state", "reason", "ended")}
        elif value.get("session") != session:
            return False
        ended = {"state": "free", "last": {**value, "ended": now_iso(), **end}}
        return self.client.txn([kv_op("cas", key, ended, Index=int(entry["ModifyIndex"])),
                                *([check(ended["last"])] if check else [])], optional_checks=True) is not None

    def try_once(self, entries: dict[str, dict[str, Any]], claim: Claim | None = None) -> Held | None:
        """Acquire a free slot seen in `entries` (keeping our session either way); None if none was had.

        With `claim`, its operations are applied in the same transaction as the
        acquisition, so the lock and the claim are taken together or not at all.
        If Consul says our session is invalid (it expired or was destroyed while
        we waited), a new one is made and the attempt repeated once.
        """
        free = [key for key in self.spec.keys() if not entries.get(key, {}).get("Session")]
        for attempt in (1, 2):
            session = self.session or self._create_session()
            try:
                for key in free:
                    value = self._holder_value()
                    held = None
                    self.shield(True)
                    try:
                        ops = [kv_op("lock", key, value, Session=session), *(claim(value) if claim else [])]
                        # The mark before the value exists: a value forged between the acquisition and its
                        # confirmation must already meet a live mark (procinfo).
                        self._mark(session)
                        try:
                            results = self.client.txn(ops)
                        except ConsulUnavailable:
                            # The answer was lost, not necessarily the write (Raft may commit an entry whose
                            # leader failed to answer): look before concluding anything.
                            results = self._committed(ops, session)
                            if results is None:  # it did not go through: an outage (retried if an election), no lost race
                                raise
                        if results is not None:
                            testhook.pause("committed")  # the value is in Consul, not yet confirmed as ours
                            held = self.confirm_ours(key, value, results)
                    finally:
                        if held is None:  # a signal held back meanwhile is raised now
                            self.shield(False)
                    if held:
                        return held
                return None
            except SessionInvalid:
                if attempt == 2:
                    raise
                log.info("%s: session %s no longer exists; making a new one", self.spec.job, session)
                self.session = None
        return None

    def _committed(self, ops: list[dict[str, Any]], session: str) -> list[dict[str, Any]] | None:
        """After an unanswered acquisition: its results, read back, if it committed; None if it did not.

        If even that cannot be learnt, ConsulUnavailable that is not worth
        retrying: the caller destroys the session (freeing a lock it might
        hold) and exits 69, nothing started. Retrying would meet its own
        lock-delay or its own claim and call that a skip.
        """
        try:
            _, entry, _ = self._read_again(ops[0]["KV"]["Key"])
            if not entry or entry.get("Session") != session:
                return None
            log.info("%s: the acquisition was answered with an error but went through", self.spec.job)
            results = []
            for op in ops:
                _, written, _ = self._read_again(op["KV"]["Key"])
                if written:
                    results.append({"KV": written})
            return results
        except ConsulUnavailable as exc:
            raise ConsulUnavailable(f"whether the acquisition went through is unknown: {exc}") from None

    def _read_again(self, key: str) -> tuple[int, Any, float]:
        """A consistent read that a transient failure does not end: (index, entry, when the answered read was
        sent). After an acquisition the session we hold must not be given up because one read failed (that
        would free a claim we made): reads are retried for a TTL, the session renewed meanwhile, and a
        termination signal held back meanwhile ends the wait (the caller then gives the session up)."""
        give_up = clock() + max(10.0, self.spec.ttl_ms / 1000)
        while True:
            sent = clock()
            try:
                idx, entry = self.client.kv_get(key, consistent=True)
                return idx, entry, sent
            except ConsulUnavailable:
                if clock() >= give_up:
                    raise
            self.checkpoint()  # a signal that arrived meanwhile ends it here (Interrupted), not after the budget
            time.sleep(0.5)
            try:
                self.keep_alive()
            except ConsulUnavailable:
                pass  # an election: the new leader restarts every session's TTL

    def _mark(self, session: str) -> None:
        """Bind `session`'s mark once; it is kept until this process exits (procinfo.hold_marker)."""
        if session not in self._marks:
            self._marks[session] = hold_marker(session)

    def confirm_ours(self, key: str, value: dict[str, Any] | None = None,
                     results: list[dict[str, Any]] | None = None) -> Held | None:
        """Held, if `key` is held by our current session (read consistently); None otherwise.

        Also how a node recognises a lock it took itself when an answer went
        missing: the session is ours, so is the claim.
        """
        if self.session is None:
            return None
        idx, entry, sent = self._read_again(key)
        if not entry or entry.get("Session") != self.session:
            return None
        self._mark(self.session)
        return Held(key=key, session=self.session, fencing_token=int(entry["ModifyIndex"]), index=idx,
                    value=value if value is not None else decoded(entry), confirmed_at=sent, results=results or [])

    def acquire(self) -> tuple[Held | None, str]:
        """Acquire within the spec's wait; returns (held, why-not). The caller destroys the session on failure.

        After an invalidation, lock-delay refuses a free key for a while: the
        same session, kept alive, is tried again when lock-delay should be over,
        then at growing intervals, so a wait costs a bounded number of writes.
        Before a long blocking wait on a held key the session is destroyed,
        since nothing would renew it meanwhile.
        """
        deadline = clock() + self.spec.wait_ms / 1000
        index: int | None = None
        retry = LockDelayRetry(self.spec.lock_delay_ms)
        while True:
            remaining = deadline - clock()
            if index:
                index, _ = self.entries(index=index, wait_s=remaining)  # woken by a change: look again, pause too
            entries, paused, unpaused = self.snapshot()
            if paused:
                return None, paused
            if not index:  # the lock and the pause key in one read-only transaction: one round trip, no write
                index = max((int(e["ModifyIndex"]) for e in entries.values()), default=0) or None
            if self.reap_dead_holder(entries):
                index = None
                continue
            mine = next((k for k, e in entries.items() if self.session and e.get("Session") == self.session), None)
            if mine and (held := self.confirm_ours(mine)):  # taken by us, its answer lost
                return held, ""
            holders = [describe_holder(e) for e in entries.values() if e.get("Session")]
            full = len(holders) >= self.spec.concurrency  # every slot held (one, without --concurrency)
            if not full:
                testhook.pause("before-claim")
                held = self.try_once(entries, claim=lambda value: [unpaused])
                if held:
                    return held, ""
            if clock() >= deadline:
                if not full and (paused := self.snapshot()[1]):  # refused because a pause landed meanwhile
                    return None, paused
                reason = f"held by {'; '.join(holders)}" if full else \
                    "the lock is free but Consul refused it (lock-delay after an invalidation, or a lost race)"
                return None, reason
            if full:
                self.abandon()
                self.say_waiting("held", f"waiting up to {duration(deadline - clock())} for the lock, held by "
                                         f"{'; '.join(holders)}")
                testhook.pause("waiting")
            else:  # refused while free: lock-delay after an invalidation, or a lost race
                testhook.pause("lock-delay-wait")
                pause = min(retry.next_wait(), max(0.0, deadline - clock()))
                self.say_waiting("delay", f"the lock is free but refused (lock-delay after an invalidation, or a "
                                          f"lost race); trying again in {duration(pause)}", every_s=10)
                self.sleep(pause)
                index = None

    def release(self, held: Held, outcome: dict[str, Any], extra_ops: list[dict[str, Any]] | None = None,
                check: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> bool:
        """Free the key (recording how the run ended in its value), with `extra_ops` in the same transaction.

        `check` makes the job's health check operation from the run's record
        as the value keeps it; Consul refusing only that operation never
        keeps the result from being recorded. True if released; False if the
        lock was no longer ours (Consul rolled the transaction back).
        Transient failures raise ConsulUnavailable: the caller retries. The
        session is not destroyed here (see `abandon`).
        """
        # The run's own end time wins, so the lock's value and the occurrence record agree.
        value = {"state": "free", "last": {**held.value, "ended": now_iso(), **outcome}}
        try:
            return self.client.txn([kv_op("unlock", held.key, value, Session=held.session),
                                    *(extra_ops or []), *([check(value["last"])] if check else [])],
                                   optional_checks=True) is not None
        except SessionInvalid:  # our session was invalidated: the lock is not ours to release
            return False

    def released_by_us(self, held: Held) -> bool:
        """True if `held.key` is free and its value records our session's run: a release whose answer was lost
        went through (read consistently)."""
        _, entry = self.client.kv_get(held.key, consistent=True)
        value = decoded(entry)
        return bool(entry) and not entry.get("Session") and value.get("state") == "free" and \
            (value.get("last") or {}).get("session") == held.session

    def abandon(self) -> None:
        """Destroy our session if we made one; a failure here is logged, the TTL ends it anyway."""
        if self.session is None:
            return
        session = self.session
        self.shield(True)  # a signal must not cut the destroy short and leave the session behind
        try:
            self.client.session_destroy(session)
        except ConsulrunError as exc:
            log.warning("%s: could not destroy session %s (%s); its TTL will end it", self.spec.job, session, exc)
        finally:
            self.session = None
            self.shield(False)


class LockDelayRetry:
    """When to try a free-but-refused key again: once lock-delay should be over, then backing off.

    Every attempt is a Raft write; this keeps a wait through lock-delay to a
    handful of them however long lock-delay is. With `steps`, lock-delay is
    also tried that many times on the way: the invalidation may have come up to
    lock-delay before the first refusal, and a wait bounded by the next
    occurrence must not sleep past a lock-delay that already ended.
    """

    def __init__(self, lock_delay_ms: int, steps: int = 1) -> None:
        self.lock_delay_s = lock_delay_ms / 1000
        self.step_s = max(1.0, self.lock_delay_s / steps)
        self.first_refusal: float | None = None
        self.backoff = 0.5

    def next_wait(self) -> float:
        now = clock()
        if self.first_refusal is None:
            self.first_refusal = now
        due = self.first_refusal + self.lock_delay_s + 0.2
        if now < due:
            return min(due - now, self.step_s)
        wait, self.backoff = self.backoff, min(self.backoff * 2, 5.0)
        return wait


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
        try:
            self._watch()
        except BaseException as exc:  # noqa: BLE001 - whatever breaks the watcher must fence the job, not vanish
            self._lose(f"the lock watcher failed: {exc!r}")

    def _watch(self) -> None:
        index = self.held.index
        last_renew = clock()
        renew_every = self.spec.ttl_ms / 3000
        failing_since: float | None = None
        last_warned = 0.0
        while not self._stop_event.is_set():
            sent = clock()
            try:
                if sent - last_renew >= renew_every:
                    if not self.client.session_renew(self.held.session):
                        return self._lose("the session no longer exists")
                    last_renew = sent
                new_index, entry = self.client.kv_get(self.held.key, index=index, consistent=True,
                                                      wait_s=self.fencing.watch_wait_s)
            except ConsulrunError as exc:
                now = clock()
                if failing_since is None or now - last_warned >= 5:
                    left = self.last_confirmed + self.fencing.fence_after_s - now
                    log.warning("%s: cannot confirm the lock: %s; the job is stopped in %s unless Consul answers",
                                self.spec.job, exc, duration(left))
                    failing_since = failing_since or now
                    last_warned = now
                self._stop_event.wait(0.2)
                continue
            if entry is None or entry.get("Session") != self.held.session:
                holder = describe_holder(entry) if entry and entry.get("Session") else "nobody"
                return self._lose(f"the lock was released or taken over; now held by {holder}")
            if failing_since is not None:
                log.info("%s: the lock is confirmed again", self.spec.job)
                failing_since = None
            self.last_confirmed = sent
            index = new_index if new_index >= index else 0
