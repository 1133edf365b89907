"""Exactly once per scheduled occurrence: the per-job record, its history, and the decisions on them.

Keys under `<prefix>/<job>/`:
  occurrence          the latest claimed occurrence: {occurrence, state, node, session, started, ...}
  history/<occurrence> one record per run, the newest N kept

A node whose timer fired computes the occurrence (the latest scheduled time at
or before now) and reads `occurrence`: if that occurrence, or a later one, is
claimed already, it skips without writing. Otherwise it acquires the lock and
claims the occurrence in one transaction that also checks the record has not
changed since it was read (check-and-set on its ModifyIndex), so two nodes
that both saw the old record cannot both claim. The run's result, its history
entry and the release of the lock are again one transaction, which fails if
the lock is no longer ours: a fenced holder cannot overwrite a takeover.
"""

from __future__ import annotations

from dataclasses import dataclass
import time
from datetime import datetime, timezone
from typing import Any

from consulrun import calendar
from consulrun.consulapi import Client, decoded, kv_op
from consulrun.errors import ConsulrunError
from consulrun.lock import Held, Locker, describe_holder

POLICIES = ("skip", "retry")


@dataclass(frozen=True)
class Occurrence:
    when: datetime
    id: str
    next_when: datetime | None  # when the following occurrence is due; standbys give up then


def current(specs: list[str], now: datetime) -> Occurrence | None:
    when = calendar.previous(specs, now)
    if when is None:
        return None
    return Occurrence(when=when, id=calendar.occurrence_id(when), next_when=calendar.following(specs, when))


class Ledger:
    """Reads and writes one job's occurrence record and history."""

    def __init__(self, client: Client, base: str, history_size: int) -> None:
        self.client = client
        self.record_key = f"{base}/occurrence"
        self.history_prefix = f"{base}/history/"
        self.history_size = history_size

    def read(self, consistent: bool = False) -> tuple[int, dict[str, Any] | None]:
        """(ModifyIndex of the record, 0 if absent; the record)."""
        _, entry = self.client.kv_get(self.record_key, consistent=consistent)
        return (int(entry["ModifyIndex"]) if entry else 0), decoded(entry) or None

    @staticmethod
    def verdict(record: dict[str, Any] | None, occ: Occurrence) -> str:
        """'free' (nobody has it), 'done', 'running', or 'later' (a newer occurrence is claimed)."""
        if record is None or record.get("occurrence", "") < occ.id:
            return "free"
        if record["occurrence"] > occ.id:
            return "later"
        return "done" if record.get("state") == "done" else "running"

    def claim_ops(self, occ: Occurrence, record_index: int, record: dict[str, Any] | None,
                  holder: dict[str, Any], takeover: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Operations that claim `occ`, valid only if the record is still at `record_index`."""
        claim = {"occurrence": occ.id, "state": "running", "node": holder.get("node"), "session": holder.get("session"),
                 "started": holder.get("started"), "takeover": takeover}
        ops = [kv_op("cas", self.record_key, claim, Index=record_index)]
        if record and record.get("state") == "running" and record.get("occurrence") != occ.id:
            # Its runner died before recording a result: say so in the history rather than leave a gap.
            ops.append(kv_op("set", self.history_prefix + record["occurrence"], {**record, "state": "abandoned"}))
        return ops, claim

    def finish_ops(self, claim: dict[str, Any], outcome: dict[str, Any]) -> list[dict[str, Any]]:
        """Operations that record the run's result and its history entry, pruning the oldest entries."""
        done = {**claim, **outcome, "state": "done" if "lost" not in outcome else "lost"}
        ops = [kv_op("set", self.record_key, done), kv_op("set", self.history_prefix + claim["occurrence"], done)]
        try:
            _, keys = self.client.kv_get(self.history_prefix, recurse=True)
        except ConsulrunError:  # pruning can wait for the next run; recording the result cannot
            keys = []
        names = sorted({e["Key"] for e in keys or []} | {self.history_prefix + claim["occurrence"]})
        ops += [kv_op("delete", key) for key in names[:max(0, len(names) - self.history_size)][:50]]
        return ops


def acquire(locker: Locker, ledger: Ledger, occ: Occurrence, policy: str,
            wait_s: float) -> tuple[Held | None, dict[str, Any] | None, str]:
    """Claim `occ` for this node: (held lock, claim record, "") or (None, None, why this node skips).

    Reads decide every skip; writes happen only when the record shows the
    occurrence unclaimed and the lock free. With policy "retry" a node that
    finds the occurrence running stands by on blocking reads of the lock until
    the next occurrence is due, and takes the occurrence over if its runner's
    session dies before recording a result.
    """
    deadline = time.monotonic() + wait_s
    if policy == "retry" and occ.next_when is not None:
        deadline = max(deadline, time.monotonic() + (occ.next_when - datetime.now(timezone.utc)).total_seconds())
    consistent = False
    while True:
        record_index, record = ledger.read(consistent=consistent)
        consistent = True  # the first look may be stale; every later one decides a takeover
        state = ledger.verdict(record, occ)
        if state == "later":
            return None, None, f"a later occurrence ({record['occurrence']}) is already claimed; {occ.id} is past"
        if state == "done":
            return None, None, (f"occurrence {occ.id} already ran on {record.get('node')} "
                                f"(exit status {record.get('exit_status', '?')})")
        if state == "running" and policy == "skip":
            return None, None, f"occurrence {occ.id} was claimed by {record.get('node')} (on_holder_loss=skip)"
        lock_index, entries = locker.entries()
        holders = [e for e in entries.values() if e.get("Session")]
        if not holders:
            claimed: dict[str, Any] = {}

            def claim(value: dict[str, Any]) -> list[dict[str, Any]]:
                ops, claimed["record"] = ledger.claim_ops(occ, record_index, record, value, takeover=state == "running")
                return ops

            held = locker.try_once(entries, claim=claim, keep_session=True)
            if held:
                return held, claimed["record"], ""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            locker.abandon()
            who = "; ".join(describe_holder(e) for e in holders)
            return None, None, (f"the previous run still holds the lock: {who}" if holders
                                else f"could not claim occurrence {occ.id}")
        if holders:
            locker.abandon()  # a session must not outlive its TTL unrenewed while we wait
            locker.entries(index=lock_index, wait_s=remaining)
        else:  # lock-delay after an invalidation, or a lost race: look again shortly
            time.sleep(min(0.5, remaining))
