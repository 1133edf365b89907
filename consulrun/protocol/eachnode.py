"""`mode: each-node`: every node runs each occurrence once, at most `lock.concurrency` of them at a time.

Keys under `<prefix>/<job>/`:
  lock, or slots/<n>                 the semaphore every node's run takes (`lock` when N is 1): the same
                                     session locks, fencing and lock-delay as any job's
  nodes/<node>/occurrence            this node's latest occurrence record (the fields and states of
                                     occurrence.py's record)
  nodes/<node>/history/<occurrence>  its final records, the newest `history` kept

A node whose timer fired reads its own record and the slots in one read-only
transaction: its occurrence done, missed or later already, it skips with no
write. Otherwise it takes a free slot and claims the occurrence for itself in
one transaction (check-and-set on its own record), runs, records the result
and frees the slot in one transaction (runner.py, as for any occurrence).
With every slot held it waits on a blocking read of the slots (no write)
until one frees, and no longer than a second before its next occurrence is
due: then it records the occurrence missed for itself.

Why nobody waits for a node that is down: only held slots are waited on, and
a dead node's slot is freed by Consul when its session is invalidated
(serfHealth); lock-delay then keeps that one slot shut while the holder's
fencing runs out, so "at most N at once" holds through the death of a holder.

No other node may run a node's share (the point of each-node is that it ran
*there*): a lost run is recorded lost for that node and not run again
(`on_holder_loss: skip` only), while `retries:` reruns a failed one on the
same node as it keeps its slot. A node's record is written by that node
alone, so the turns (cheap losers) and the clock findings (agreeing on who ran
first) of a once-per-cluster job have nothing to do here.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from consulrun.consul.client import Client, decoded, kv_op
from consulrun.consul.values import printable
from consulrun.errors import ConsulUnavailable
from consulrun.protocol import keys, pause
from consulrun.protocol.lock import Held, LockDelayRetry, Locker, clock, describe_holder
from consulrun.protocol.occurrence import (
    ABANDONED_REASON,
    LAST_CLAIM_BEFORE_NEXT_S,
    LOCK_DELAY_STEPS,
    Ledger,
    Occurrence,
    Snapshot,
    _past_start_deadline,
    _record_missed,
)
from consulrun.timefmt import duration

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger("consulrun")

OWN_RUN_MISSED = ("this node's run of an earlier occurrence was still running when the node's next occurrence "
                  "was due")
SLOTS_FULL_MISSED = ("every slot was held (lock.concurrency nodes at a time) until the node's next occurrence was "
                     "due")


def node_key(node: str) -> str:
    """`node` as one KV path segment (keys.segment: a plain name is itself, any other byte `=XX`)."""
    return keys.segment(node)


def node_of_key(segment: str) -> str:
    """The node name `node_key` made `segment` from (what `status` lists; it never trusts a record's `node`)."""
    return keys.unsegment(segment)


class NodeLedger(Ledger):
    """One node's occurrence record and history for an each-node job; the lock is whichever slot it holds.

    runner.py records and releases through it as through a Ledger: `snapshot` names as the record's lock the
    slot the record's session holds, so "our session still holds it" means what it means there.
    """

    def __init__(self, client: Client, base: str, node: str, slot_keys: list[str], history_size: int,
                 health_prefix: str | None = None) -> None:
        super().__init__(client, base, history_size, health_prefix)
        own = keys.node_prefix(base, node)
        self.node = node
        self.record_key = own + keys.OCCURRENCE
        self.history_prefix = own + keys.HISTORY
        self.slot_keys = slot_keys
        self.slots_prefix = slot_keys[0] if len(slot_keys) == 1 else keys.slots_prefix(base)
        self.lock_key = slot_keys[0]  # overridden per run by the slot held (see `snapshot`)

    def look(self, consistent: bool = False) -> tuple[Snapshot, dict[str, dict[str, Any]]]:
        """(this node's record with the slot its session holds, every held slot): one read-only transaction."""
        entries = self.client.read_trees([self.record_key, self.slots_prefix, self.pause_key], consistent=consistent)
        record_entry = entries.get(self.record_key)
        record = decoded(record_entry) or None
        slots = {k: e for k, e in entries.items() if k in self.slot_keys}
        session = (record or {}).get("session")
        mine = next((e for e in slots.values() if session and e.get("Session") == session), None)
        paused = pause.value_of(entries.get(self.pause_key))
        snap = Snapshot(record_index=int(record_entry["ModifyIndex"]) if record_entry else 0, record=record,
                        lock=mine, paused=pause.describe(paused) if pause.in_force(paused) else None,
                        pause_index=int(entries[self.pause_key]["ModifyIndex"]) if self.pause_key in entries else 0)
        return snap, slots

    def snapshot(self, consistent: bool = False) -> Snapshot:
        return self.look(consistent)[0]

    def health_ops(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        # The job's one health check would say only the last node's result: status judges each node instead.
        return []


def acquire(locker: Locker, ledger: NodeLedger, occ: Occurrence, wait_s: float,
            start_deadline_s: float | None = None) -> tuple[Held | None, dict[str, Any] | None, str]:
    """Take a slot and claim `occ` for this node: (held slot, claim, "") or (None, None, why this node skips).

    Every skip is decided by reads; the caller destroys the session on every path that returns no slot. A wait
    for a slot ends a second before the next occurrence is due (without a next one, after `wait_s`).
    """
    left = (occ.next_when - datetime.now(timezone.utc)).total_seconds() if occ.next_when else None
    bound = clock() + (left - LAST_CLAIM_BEFORE_NEXT_S if left is not None else wait_s)
    retry = LockDelayRetry(locker.spec.lock_delay_ms, steps=LOCK_DELAY_STEPS)
    look: dict[str, Any] = {"offset": 0.0, "start_deadline_s": start_deadline_s, "consistent": False,
                            "refusals": 0}
    while True:
        try:
            result = _step(locker, ledger, occ, bound, retry, look)
        except ConsulUnavailable as exc:
            # A node waiting for a slot outlives a restarting agent or an election until its bound; the first look
            # failing is Consul down (exit 69), as for any run.
            if not look["consistent"] or clock() >= bound:
                raise
            locker.say_waiting("slots-error", f"Consul cannot answer while waiting for a slot ({exc}); trying "
                                              "again", every_s=10)
            time.sleep(min(1.0, max(0.0, bound - clock())))
            continue
        if result is not None:
            return result


def _own_run_fencing(locker: Locker, ledger: NodeLedger, snap: Snapshot, bound: float,
                     look: dict[str, Any]) -> bool:
    """True (having waited a while) while this node's earlier run, which lost its slot unrecorded (a forced
    unlock, its session invalidated), may still be fencing its job. Its job is dead within lock-delay of the
    moment its slot was freed, which was before this node first saw it free: lock-delay keeps that slot
    shut so long, but not the others, so the next occurrence waits as long before it takes one (and the run
    may record itself `lost` meanwhile)."""
    seen = look.setdefault("own_run_lost_at", clock())
    left = min(seen + locker.spec.lock_delay_ms / 1000, bound) - clock()
    if left <= 0:
        return False
    locker.abandon()  # a session must not outlive its TTL unrenewed while we wait
    locker.say_waiting("own-run-lost", f"this node's run of occurrence {printable((snap.record or {}).get('occurrence'))}"
                                       f" lost its slot unrecorded; waiting {duration(left)} (lock-delay) while it "
                                       "may still be stopping its job")
    ledger.await_claim(snap, left)  # its own `lost` record ends the wait
    return True


def _own_run_bound(occ: Occurrence, bound: float, look: dict[str, Any]) -> float:
    """How long one wait for the node's own earlier run lasts: to its bound, or, with a start deadline, until
    the occurrence passes it (the next look then records it missed, as any late start is)."""
    deadline = look.get("start_deadline_s")
    if deadline is None:
        return bound
    left = deadline - (datetime.now(timezone.utc) - occ.when).total_seconds()
    return min(bound, clock() + max(0.0, left) + 0.05)


def _await_own_run(locker: Locker, ledger: NodeLedger, occ: Occurrence, snap: Snapshot, bound: float,
                   until: float) -> tuple[Held | None, dict[str, Any] | None, str] | None:
    """Wait, with blocking reads of the slot that run holds (no write), for this node's run of an earlier
    occurrence to end; at the bound record `occ` missed for this node (its history entry only: the record is
    the live run's until it ends). Only the run's own end (its finish frees the slot) or its session's death
    (Consul frees it) settles it: both move the slot's index and end the read."""
    remaining = bound - clock()
    earlier = printable((snap.record or {}).get("occurrence"))
    if remaining <= 0:
        return None, None, _record_missed(locker, ledger, occ, snap, OWN_RUN_MISSED)
    locker.abandon()  # a session must not outlive its TTL unrenewed while we wait
    locker.say_waiting("own-run", f"this node's run of occurrence {earlier} is still running; waiting for it to "
                                  f"end for up to {duration(remaining)} (a node runs one occurrence at a time)")
    slot = snap.lock or {}
    wait = max(0.05, min(until - clock(), remaining, 300))
    locker.client.kv_get(str(slot.get("Key")), index=int(slot.get("ModifyIndex", 0)),
                         wait_s=wait * 16 / 17)  # Consul adds up to wait/16
    return None


def _step(locker: Locker, ledger: NodeLedger, occ: Occurrence, bound: float, retry: LockDelayRetry,
          look: dict[str, Any]) -> tuple[Held | None, dict[str, Any] | None, str] | None:
    snap, slots = ledger.look(consistent=look["consistent"])
    look["consistent"] = True  # the first look may be stale; every later one decides a write
    if snap.paused:
        return None, None, snap.paused
    if locker.reap_dead_holder(slots):
        return None
    record = snap.record or {}
    if locker.session and record.get("session") == locker.session and record.get("occurrence") == occ.id \
            and record.get("state") == "running" and snap.lock is not None:
        held = locker.confirm_ours(snap.lock["Key"], results=[{"KV": {"Key": ledger.record_key,
                                                                       "ModifyIndex": snap.record_index}}])
        if held:  # our own claim, whose answer went missing: it is ours to run
            return held, record, ""
    state = ledger.verdict(snap, occ)
    node = printable(ledger.node)
    if state == "later":
        return None, None, f"this node ({node}) already claimed a later occurrence ({record['occurrence']})"
    if state == "done":
        return None, None, (f"occurrence {occ.id} already ran on this node ({node}, exit status "
                            f"{record.get('exit_status', '?')})")
    if state == "missed":
        return None, None, f"occurrence {occ.id} was recorded missed on this node: {printable(record.get('reason'))}"
    if state == "dead":  # our own earlier run, whose session died unrecorded: say so, then skip it
        ops = ledger.failed_ops(record, snap.record_index, "abandoned", ABANDONED_REASON)
        if locker.client.txn(ops, optional_checks=True) is not None:
            log.info("%s: occurrence %s was abandoned on this node; recorded", locker.spec.job, occ.id)
        return None
    if state in ("running", "failed"):
        how = "is running on this node" if state == "running" else \
            f"ended {record.get('state')} on this node; it is not run again (each-node: no other node takes it over)"
        return None, None, f"occurrence {occ.id} {how}"
    if late := _past_start_deadline(occ, look):
        return None, None, _record_missed(locker, ledger, occ, snap, late)
    if snap.runner_alive():  # this node's run of an earlier occurrence goes on: one occurrence at a time
        return _await_own_run(locker, ledger, occ, snap, bound, _own_run_bound(occ, bound, look))
    if (snap.record or {}).get("state") == "running" and _own_run_fencing(locker, ledger, snap, bound, look):
        return None
    free = [key for key in ledger.slot_keys if not slots.get(key, {}).get("Session")]
    if free and clock() < bound:
        claimed: dict[str, Any] = {}

        def claim(value: dict[str, Any]) -> list[dict[str, Any]]:
            ops, claimed["record"] = ledger.claim_ops(occ, snap, value, takeover=False)
            return ops

        held = locker.try_once(slots, claim=claim)
        if held:
            return held, claimed["record"], ""
        look["refusals"] += 1
        if look["refusals"] == 1:  # a lost race shows its winner at the next look; lock-delay refuses again
            return None
    remaining = bound - clock()
    if remaining <= 0:
        again = ledger.snapshot(consistent=True)
        if again.paused:
            return None, None, again.paused
        why = SLOTS_FULL_MISSED if not free else "lock-delay after an invalidation refused every free slot until " \
            "the node's next occurrence was due"
        return None, None, _record_missed(locker, ledger, occ, snap, why)
    if not free:
        locker.abandon()  # a session must not outlive its TTL unrenewed while we wait
        holders = "; ".join(describe_holder(e) for e in slots.values())
        locker.say_waiting("slots", f"every slot is held ({holders}); waiting for one for up to "
                                    f"{duration(remaining)} (the next occurrence)")
        index = max(int(e.get("ModifyIndex", 0)) for e in slots.values())
        locker.client.kv_get(ledger.slots_prefix, index=index, wait_s=min(remaining, 300) * 16 / 17,
                             recurse=len(ledger.slot_keys) > 1)  # Consul adds up to wait/16
        look["refusals"] = 0
        return None
    # Free but refused: lock-delay after a holder's invalidation (or a lost race): look again when it should end.
    locker.say_waiting("delay", f"a slot is free but refused (lock-delay after an invalidation, or a lost race); "
                                f"trying again until {duration(remaining)} from now", every_s=10)
    locker.sleep(min(retry.next_wait(), remaining))
    return None
