"""Exactly once per scheduled occurrence: the per-job record, its history, and the decisions on them.

Keys under `<prefix>/<job>/` (named in keys.py):
  occurrence           the latest claimed occurrence: {occurrence, state, node, session, started, attempt, ...}
  history/<occurrence> the final record of each occurrence (with its earlier attempts), the newest N kept
                       (the time as 20261129T020000Z; a manual run's as <start>.manual)

A node whose timer fired computes the occurrence (the latest scheduled time at
or before now) and reads the record and the lock in one read-only transaction
(a snapshot, no Raft write). If that occurrence, or a later one, is claimed
already, it skips without writing. Otherwise it acquires the lock and claims
the occurrence in one transaction that also checks the record has not changed
since it was read (check-and-set on its ModifyIndex), so two nodes that both
saw the old record cannot both claim. The run's result, its history entry and
the release of the lock are again one transaction, which fails if the lock is
no longer ours: a fenced holder cannot overwrite a takeover. A fenced runner
records `lost` with a check-and-set on the record as its claim left it, so it
can never overwrite a later attempt either.

Record states: running, done (with exit status), lost (fenced, or the session
destroyed), abandoned (the runner's session died before it recorded anything;
written by the next node that sees it), missed (lock-delay after an
invalidation refused every claim until the next occurrence was due; written
by a node that waited it out in vain). Under `retry`, lost and abandoned
occurrences are run again (attempt + 1); under `skip`, never; a missed one is
past its time everywhere.

Why this module is long: claiming, taking over and recording an occurrence is one
compare-and-set protocol over one record; its steps are read together to see what holds at each
instant.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone

from consulrun.consul.client import Client, decoded, kv_op
from consulrun.consul.values import printable
from consulrun.errors import ConsulrunError, ConsulUnavailable, MalformedValue, UsageError
from consulrun.manifest import calendar
from consulrun.protocol import clockskew, keys, pause, testhook, turns
from consulrun.protocol.lock import Held, LockDelayRetry, Locker, clock, describe_holder, now_iso
from consulrun.protocol.trigger import fresh as trigger_fresh, read_request
from consulrun.records import record
from consulrun.timefmt import duration

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger("consulrun")

FAILED_STATES = ("lost", "abandoned")
WHERE_IT_RAN = ("host", "unit", "invocation_id")  # of the holder's value, kept in the occurrence record
LAST_CLAIM_BEFORE_NEXT_S = 1.0
# A wait through lock-delay tries every lock-delay/8 (at least 1s); the leader turns a refused acquisition away
# before Raft (bench/RESULTS.md), so the tries cost no writes.
LOCK_DELAY_STEPS = 8
# How far ahead of this node another node's clock may be: a record later than the next occurrence plus this
# cannot have been claimed by a node whose clock agrees with ours (see Ledger.verdict).
ALLOWED_SKEW_S = 300.0
PRUNE_OPS = 50  # deletes a finish may carry: with up to 32 chained requests (chains.MAX_CHILDREN), under Consul's 128


def future_limit(next_when: datetime | None, now: datetime | None = None) -> str:
    """The latest occurrence a record may name: the next one (else now) plus the allowed skew, as an id."""
    base = next_when or now or datetime.now(timezone.utc)
    return calendar.occurrence_id(base + timedelta(seconds=ALLOWED_SKEW_S))


def future_text(occurrence: str, limit: str) -> str:
    return (f"the record claims occurrence {occurrence}, later than the next occurrence plus the allowed clock "
            f"skew ({limit}): a forged record or a clock far ahead; not obeyed (nothing runs until it is removed or "
            "the clocks agree)")


@record
class Occurrence:
    when: datetime
    id: str
    next_when: datetime | None  # when the following occurrence is due; standbys give up then
    specs: tuple[str, ...] = ()


def current(specs: list[str], now: datetime) -> Occurrence | None:
    when = calendar.previous(specs, now)
    if when is None:
        return None
    return Occurrence(when=when, id=calendar.occurrence_id(when), next_when=calendar.following(specs, when),
                      specs=tuple(specs))


@record
class Snapshot:
    """The record and the lock as one consistent view."""

    record_index: int  # ModifyIndex of the record, 0 if absent
    record: dict[str, Any] | None
    lock: dict[str, Any] | None  # the lock key's entry
    paused: str | None = None  # why the job is paused, while a pause is in force
    trigger: dict[str, Any] | None = None  # a pending `consulrun trigger` request
    trigger_index: int = 0
    pause_index: int = 0  # ModifyIndex of the pause key as read, 0 if absent
    clock: dict[str, dict[str, Any]] | None = None  # findings about nodes' clocks (clockskew), by key

    @property
    def holder_session(self) -> str | None:
        return (self.lock or {}).get("Session")

    def runner_alive(self) -> bool:
        """The record's runner still holds the lock (claim and lock are taken together, released together)."""
        return bool(self.record) and self.holder_session is not None \
            and self.holder_session == self.record.get("session")


class Ledger:
    """Reads and writes one job's occurrence record and history."""

    def __init__(self, client: Client, base: str, history_size: int, health_prefix: str | None = None,
                 thens: tuple[tuple[str, str], ...] = (), policy: str = "skip") -> None:
        """`health_prefix`: the KV prefix whose external node holds the job's health check, which every result
        written here then updates in the same transaction (see the health module); None: no check. `thens`:
        (child, on) of the jobs chained after this one, whose requests a final result writes in its own
        transaction (chain.py); under `policy` retry a lost or abandoned attempt is not final."""
        self.thens = thens
        self.policy = policy
        self.client = client
        self.base = base
        self.job = base.rsplit("/", 1)[-1]
        self.health_prefix = health_prefix
        self.record_key = keys.occurrence_key(base)
        self.lock_key = keys.lock_key(base)
        self.history_prefix = keys.history_prefix(base)
        self.pause_key = keys.pause_key(base)
        self.trigger_key = keys.trigger_key(base)
        self.history_size = history_size

    def snapshot(self, consistent: bool = False) -> Snapshot:
        entries = self.client.read_trees([self.record_key, self.lock_key, self.pause_key, self.trigger_key,
                                          clockskew.clock_prefix(self.base)], consistent=consistent)
        record_entry, lock, trigger = (entries.get(k) for k in (self.record_key, self.lock_key, self.trigger_key))
        paused = pause.value_of(entries.get(self.pause_key))
        return Snapshot(record_index=int(record_entry["ModifyIndex"]) if record_entry else 0,
                        record=decoded(record_entry) or None, lock=lock,
                        paused=pause.describe(paused) if pause.in_force(paused) else None,
                        trigger=read_request(trigger, self.job),
                        trigger_index=int(trigger["ModifyIndex"]) if trigger else 0,
                        pause_index=int(entries[self.pause_key]["ModifyIndex"]) if self.pause_key in entries else 0,
                        clock={k: e for k, e in entries.items() if k.startswith(clockskew.clock_prefix(self.base))})

    def await_claim(self, snap: Snapshot, wait_s: float) -> None:
        """Return when the record moves on from `snap` (a claim landed) or after `wait_s`: a blocking read, no write."""
        index = snap.record_index or self.client.kv_get(self.record_key)[0]
        self.client.kv_get(self.record_key, index=index, wait_s=wait_s * 16 / 17)  # Consul adds up to wait/16

    def manual_key(self, claim: dict[str, Any]) -> str:
        """The history entry of a run outside the schedule: a manual one's, or a chained one's (chain.py)."""
        if claim.get("after"):
            return keys.entry_key(self.history_prefix, str(claim["run"]))
        return keys.entry_key(self.history_prefix, str(claim["started"]), manual=True)

    def history_key(self, occurrence: str) -> str:
        """The entry under this ledger's history (a job's, or an each-node job's node's: eachnode.py)."""
        return keys.entry_key(self.history_prefix, occurrence)

    def then_ops(self, final: dict[str, Any], settled: bool = False) -> list[dict[str, Any]]:
        """The chained jobs' requests `final` makes, if it is final: a lost or abandoned attempt of an occurrence
        another node may take over (`retry`) is not, unless `settled` (a later occurrence is claimed: nobody
        takes a past one over); a chained run is never taken over."""
        if not self.thens or (final.get("state") in FAILED_STATES and self.policy == "retry"
                              and not final.get("after") and not settled):
            return []
        from consulrun.protocol.chain import then_ops  # only a job with chained jobs needs it

        return then_ops(self.base.rsplit("/", 1)[0], self.job, final, self.thens)

    def manual_claim_ops(self, snap: Snapshot, holder: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Operations that take a pending trigger for this node: consumed once (check-and-delete), recorded."""
        trigger = snap.trigger or {}
        claim = {"manual": True, "requested_by": trigger.get("by"), "requested_at": trigger.get("at"),
                 "trigger": trigger.get("id"), "state": "running", "node": holder.get("node"),
                 "session": holder.get("session"), "started": holder.get("started")}
        return [kv_op("delete-cas", self.trigger_key, Index=snap.trigger_index),
                kv_op("set", self.manual_key(claim), claim), pause.unchanged_op(self.base, snap.pause_index)], claim

    def manual_finish_ops(self, claim: dict[str, Any], outcome: dict[str, Any], state: str) -> list[dict[str, Any]]:
        final = {**claim, **outcome, "state": state, **({} if outcome.get("ended") else {"ended": now_iso()})}
        if not claim.get("after"):  # a manual run starts no chained run: it is no occurrence
            return [kv_op("set", self.manual_key(claim), {**claim, **outcome, "state": state})]
        return [kv_op("set", self.manual_key(claim), final), *self.then_ops(final),
                *self.prune_ops(self._history_entries(), keep=self.manual_key(claim)), *self.health_ops(final)]

    def verdict(self, snap: Snapshot, occ: Occurrence) -> str:
        """'free' (nobody has it), 'done', 'running', 'dead' (running, but its runner lost the lock),
        'failed' (recorded lost or abandoned), 'missed' (recorded missed), or 'later' (a newer occurrence is
        claimed).

        A record later than this node's next occurrence plus the allowed clock
        skew was claimed by no node whose clock agrees with ours: a forged
        record (anyone with KV write can put one there), or a clock far ahead.
        Obeying it would skip every occurrence until then; claiming over it
        could run an occurrence twice if it is our clock that is behind. So
        it is refused, loudly (MalformedValue, exit 65): nothing runs, and
        `status`, the exporter and the watchdog report it.
        """
        record = snap.record
        if record is None or record.get("occurrence", "") < occ.id:
            return "free"
        if record["occurrence"] > occ.id:
            limit = future_limit(occ.next_when)
            if record["occurrence"] > limit:
                raise MalformedValue(self.record_key, future_text(record["occurrence"], limit))
            return "later"
        state = record.get("state")
        if state in ("done", "missed"):
            return state
        if state in FAILED_STATES:
            return "failed"
        return "running" if snap.runner_alive() else "dead"

    def claim_ops(self, occ: Occurrence, snap: Snapshot, holder: dict[str, Any],
                  takeover: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Operations that claim `occ`, valid only if the record is still at the index read."""
        record = snap.record or {}
        earlier: list[dict[str, Any]] = []
        if takeover:  # the attempt taken over joins the list flat: its own `earlier` is the list itself
            ended = {k: v for k, v in _final(record, "abandoned", ABANDONED_REASON).items() if k != "earlier"}
            earlier = [*record.get("earlier", []), ended]
        claim = {"occurrence": occ.id, "state": "running", "node": holder.get("node"), "session": holder.get("session"),
                 "started": holder.get("started"), "takeover": takeover, "attempt": len(earlier) + 1,
                 "schedule": list(occ.specs), "zone": calendar.local_zone_name(),
                 "zone_offsets": calendar.zone_offsets(occ.when), "earlier": earlier,
                 # Where its output is: `consulrun logs` reads that host's journal by the invocation id.
                 **{k: holder[k] for k in WHERE_IT_RAN if holder.get(k)}}
        ops = [kv_op("cas", self.record_key, claim, Index=snap.record_index),
               pause.unchanged_op(self.base, snap.pause_index), *self._close_earlier(occ, snap)]
        return ops, claim

    def _close_earlier(self, occ: Occurrence, snap: Snapshot) -> list[dict[str, Any]]:
        """What claiming `occ` settles of the record's earlier occurrence: a run whose runner died before it
        recorded a result goes into the history as abandoned, and, now that nobody can take it over, the runs
        chained after its end are asked for (under `retry` also those of one recorded lost or abandoned).
        A run whose session still holds the lock is settled by nobody but itself."""
        record = snap.record or {}
        if record.get("occurrence", "") >= occ.id or snap.runner_alive():
            return []
        if record.get("state") == "running":
            final = _final(record, "abandoned", ABANDONED_REASON)
            return [kv_op("set", self.history_key(record["occurrence"]), final), *self.then_ops(final, settled=True)]
        if record.get("state") in FAILED_STATES and self.policy == "retry" and not record.get("after"):
            return self.then_ops(record, settled=True)  # its failed_ops left them to a takeover that never came
        return []

    def requeue_ops(self, claim: dict[str, Any]) -> list[dict[str, Any]]:
        """A chained run's claim given back (its job never started): its request again, its history entry gone."""
        parent = claim.get("after") or {}
        request = {"parent": parent.get("job"), "run": parent.get("run"),
                   **{k: parent.get(k) for k in ("state", "exit_status", "node", "ended")}}
        return [kv_op("delete", self.manual_key(claim)),
                kv_op("cas", keys.chain_request_key(self.base, str(parent.get("job")), str(parent.get("run"))),
                      request, Index=0)]

    def missed_ops(self, occ: Occurrence, snap: Snapshot, node: str | None, reason: str) -> list[dict[str, Any]]:
        """Record `occ` as missed (ran nowhere), valid only if the record is still at the index read: of the nodes
        that waited for it in vain, one records it; a claim that landed meanwhile stands."""
        missed = {"occurrence": occ.id, "state": "missed", "node": None, "recorded_by": node, "reason": reason,
                  "ended": now_iso(), "schedule": list(occ.specs), "zone": calendar.local_zone_name(),
                  "zone_offsets": calendar.zone_offsets(occ.when)}
        if snap.runner_alive():
            # The record is a live run's (an earlier occurrence that outlived its interval): its result is
            # written over it at its end. This occurrence's history entry alone says it was missed, once.
            return [kv_op("cas", self.history_key(occ.id), missed, Index=0)]
        return [kv_op("cas", self.record_key, missed, Index=snap.record_index),
                kv_op("set", self.history_key(occ.id), missed), *self._close_earlier(occ, snap),
                *self.health_ops(missed)]

    def finish_ops(self, claim: dict[str, Any], outcome: dict[str, Any], claim_index: int,
                   chain: bool = True) -> list[dict[str, Any]]:
        """Operations that record the run's result and its history entry, pruning the oldest entries.

        The record is check-and-set on its index as our claim left it: a result never overwrites a takeover.
        """
        done = {**claim, **outcome, "state": "done"}
        ops = [kv_op("cas", self.record_key, done, Index=claim_index),
               kv_op("set", self.history_key(claim["occurrence"]), done), *(self.then_ops(done) if chain else [])]
        return ops + self.prune_ops(self._history_entries(), keep=self.history_key(claim["occurrence"])) + \
            self.health_ops(done)

    def _history_entries(self) -> list[dict[str, Any]]:
        try:
            _, entries = self.client.kv_get(self.history_prefix, recurse=True)
        except ConsulrunError:  # pruning can wait for the next run; recording the result cannot
            entries = []
        return entries or []

    def health_ops(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The job's health check set from `record`, last in the transaction (dropped if Consul refuses it)."""
        if not self.health_prefix:
            return []
        from consulrun.protocol.health import finish_op  # the skip path does not need it

        return [finish_op(self.health_prefix, self.job, record)]

    def prune_ops(self, entries: list[dict[str, Any]], keep: str) -> list[dict[str, Any]]:
        """Deletes of the oldest history entries beyond the limit, occurrences and manual runs counted apart;
        never the entry being written (`keep`); at most PRUNE_OPS of them (the next run goes on).

        Entries of both key forms (keys.py) are ordered by the time they name, so an old one ages out as any
        other. An old key is outside Consul's strict rule, so no request can name it: it goes with a delete of
        its hour's prefix (`2026-11-29T02`) once every entry of that hour is due, and counts until then.
        """
        doomed: list[str] = []
        listed = [e["Key"] for e in entries]
        for manual in (False, True):
            names = sorted({k for k in listed if keys.is_manual(k) == manual} |
                           ({keep} if keys.is_manual(keep) == manual else set()), key=keys.history_order)
            # Counted by the time each names: an old key of the very entry being written is superseded by it.
            times = sorted({keys.history_order(k)[0] for k in names})
            old = set(times[:max(0, len(times) - self.history_size)]) | \
                ({keys.history_order(keep)[0]} if keys.is_manual(keep) == manual else set())
            doomed += [key for key in names if keys.history_order(key)[0] in old and key != keep]
        return keys.delete_ops(doomed, [*listed, keep], self.history_prefix)[0][:PRUNE_OPS]

    def failed_ops(self, record: dict[str, Any], record_index: int, state: str,
                   reason: str, chain: bool = True) -> list[dict[str, Any]]:
        """Record `record`'s attempt as lost/abandoned, only if the record is still at `record_index`."""
        final = _final(record, state, reason)
        return [kv_op("cas", self.record_key, final, Index=record_index),
                kv_op("set", self.history_key(record["occurrence"]), final),
                *(self.then_ops(final) if chain else []), *self.health_ops(final)]

    def record_index_after_claim(self, held: Held) -> int:
        """The record's ModifyIndex as our claim left it (from the claim transaction's results)."""
        for result in held.results:
            kv = result.get("KV") or {}
            if kv.get("Key") == self.record_key:
                return int(kv["ModifyIndex"])
        raise ConsulrunError("the claim transaction did not return the occurrence record")


def _manual(locker: Locker, ledger: Ledger, snap: Snapshot) -> tuple[Held | None, dict[str, Any] | None, str]:
    """A run `consulrun trigger` asked of this node: outside the schedule, never beside another run."""
    if snap.holder_session:
        return None, None, f"a manual run was asked for, but the job is running: {describe_holder(snap.lock or {})}"
    claimed: dict[str, Any] = {}

    def claim(value: dict[str, Any]) -> list[dict[str, Any]]:
        ops, claimed["record"] = ledger.manual_claim_ops(snap, value)
        return ops

    held = locker.try_once({ledger.lock_key: snap.lock} if snap.lock else {}, claim=claim)
    if held:
        return held, claimed["record"], ""
    return None, None, "a manual run was asked for, but another run took the lock first"


def _same_zone(record: dict[str, Any], occ: Occurrence) -> None:
    """Refuse to go on when another node evaluated a zone-less spec in a system zone that behaves otherwise.

    Its occurrences are other moments: both nodes would run "the same" daily
    job, each at its own local time. Naming a zone in the spec makes it moot.
    """
    theirs, when = record.get("zone_offsets"), record.get("occurrence")
    if not theirs or not when or all(calendar.names_zone(spec) for spec in occ.specs):
        return
    try:
        ours = calendar.zone_offsets(datetime.fromisoformat(str(when).replace("Z", "+00:00")))
    except ValueError:
        return
    if ours != theirs:
        raise UsageError(f"this node's system zone ({calendar.local_zone_name()}, UTC offsets {ours}) is not the one "
                         f"{printable(record.get('node'))} evaluated the schedule in ({printable(record.get('zone'))}, "
                         f"{printable(theirs)}): nodes would "
                         "disagree on the occurrence; give every node the same zone, or name a zone in the "
                         "schedule (e.g. '*-*-* 02:00:00 Europe/Berlin')")


ABANDONED_REASON = ("its runner's session ended before a result was recorded: the runner was killed, its node "
                    "died, or it lost touch with Consul and stopped its job itself (fenced, exit 75)")


def _final(record: dict[str, Any], state: str, reason: str) -> dict[str, Any]:
    """`record` closed as `state`; a state already final (lost with its own reason) is kept."""
    if record.get("state") in FAILED_STATES:
        return dict(record)
    final = {**record, "state": state, "reason": reason, "ended": now_iso()}
    if state == "abandoned" and record.get("retry_at") and record.get("started") == record["retry_at"]:
        # A retry's record says when the retry was due, not when it started: only its runner knew whether
        # it did, and it died unrecorded. Another node closing it names no start it cannot know.
        final.pop("started")
    return final


def acquire(locker: Locker, ledger: Ledger, occ: Occurrence, policy: str, wait_s: float, by_timer: bool = True,
            start_deadline_s: float | None = None) -> tuple[Held | None, dict[str, Any] | None, str]:
    """Claim `occ` for this node: (held lock, claim record, "") or (None, None, why this node skips).

    Reads decide every skip; writes happen only when the record shows the
    occurrence unclaimed (or, under "retry", its attempt failed) and the lock
    free. With policy "retry" a node that finds the occurrence running stands by
    on blocking reads of the lock until the next occurrence is due, and takes
    the occurrence over if its runner's session dies before recording a result.
    The caller destroys the session on every path that returns no lock.
    `by_timer`: the unit was started by its timer (systemd's TRIGGER_UNIT), not by `systemctl start` as
    `consulrun trigger` starts it; only a run its timer started leaves a pending trigger for an unclaimed
    occurrence. `start_deadline_s`: an unclaimed occurrence this far past its time is recorded missed, not run
    (the manifest's `start_deadline`: a catch-up after a long outage that should not run so late).
    """
    started = clock()
    look: dict[str, Any] = {"consistent": False, "raced": False, "waiting": False, "first": True, "occ": occ,
                            "offset": 0.0, "by_timer": by_timer, "start_deadline_s": start_deadline_s}
    deadline = _bounds(look, policy, started + wait_s)
    retry = LockDelayRetry(locker.spec.lock_delay_ms, steps=LOCK_DELAY_STEPS)
    while True:
        try:
            if look["occ"] is not occ:  # this node's clock is ahead of the cluster's: the cluster's occurrence
                occ = look["occ"]
                deadline = _bounds(look, policy, started + wait_s)
            result = _step(locker, ledger, occ, policy, deadline, retry, look)
        except ConsulUnavailable as exc:
            # A standby (or a node about to take a dead run over) outlives a restarting agent or an election,
            # until its deadline: giving up here would leave the occurrence to nobody.
            if not look["waiting"] or clock() >= deadline:
                raise
            locker.say_waiting("standby-error", f"Consul cannot answer while standing by ({exc}); trying again",
                               every_s=10)
            time.sleep(min(1.0, max(0.0, deadline - clock())))
            continue
        if result is not None:
            return result


class _Superseded(Exception):
    """Raised while a first claim is built: the next occurrence is already due."""


def _until_next(occ: Occurrence, look: dict[str, Any]) -> float | None:
    """Seconds until the occurrence after `occ` is due by the cluster's clock (ours less the lead found,
    `offset`); None if there is none."""
    return (occ.next_when - datetime.now(timezone.utc)).total_seconds() + look["offset"] if occ.next_when else None


def _next_due(occ: Occurrence, look: dict[str, Any]) -> bool:
    """Whether the occurrence after `occ` is already due by the cluster's clock."""
    left = _until_next(occ, look)
    return left is not None and left <= 0


def _bounds(look: dict[str, Any], policy: str, deadline: float) -> float:
    """Set the occurrence's own bound in `look` and return the deadline: lock-delay is waited out until a second
    before the next occurrence is due by the cluster's clock (a claim then would hold the lock when the next one's
    nodes look, and make them skip it), never past it; a `retry` standby stands by until it is due."""
    left = _until_next(look["occ"], look)
    look["bound"] = clock() + left - LAST_CLAIM_BEFORE_NEXT_S if left is not None else deadline
    return max(deadline, look["bound"] + LAST_CLAIM_BEFORE_NEXT_S) if policy == "retry" and left is not None \
        else deadline


def _cluster_clock(locker: Locker, ledger: Ledger, snap: Snapshot, occ: Occurrence, look: dict[str, Any]) -> bool:
    """True if other nodes found this node's clock ahead (clockskew.correction) and the occurrence due by the
    cluster's clock is another: `look` then names it, and the caller looks again for that one."""
    if not snap.clock:  # no finding about anyone: no agent read either
        return False
    now = datetime.now(timezone.utc)
    fix = clockskew.correction(snap.clock, ledger.base, locker.node_name(), now)
    if fix is None:
        return False
    lead, accusers = fix
    due = current(list(occ.specs), now - timedelta(seconds=lead))
    if due is None or due.id == occ.id:
        return False
    log.warning("%s: this node's clock is at least %.0fs ahead of the cluster's (found by %s, under %s): occurrence "
                "%s is not due yet by the cluster's clock, so this node does not claim it; it acts for %s instead",
                locker.spec.job, lead, ", ".join(printable(a) for a in accusers), clockskew.clock_prefix(ledger.base),
                occ.id, due.id)
    look.update(occ=due, offset=lead, first=True, consistent=False)
    return True


def _turn(locker: Locker, ledger: Ledger, occ: Occurrence) -> float:
    """How long this node leaves an unclaimed occurrence to the nodes before it in turn (0: it goes first)."""
    try:
        members, hidden = locker.client.alive_members()
    except ConsulrunError as exc:  # the turns only save writes: without them every node claims at once, as safely
        locker.say_waiting("rank", f"the cluster's members cannot be listed ({exc}), so this node does not take "
                                   "turns with the others: it claims at once")
        return 0.0
    me = locker.node_name()
    placement = locker.spec.placement
    if placement is not None:  # only the nodes that may run the job take turns for it
        metas: dict[str, dict[str, str]] = {}
        if placement.needs_meta():
            try:
                metas, hidden_nodes = locker.client.node_metas()
            except ConsulrunError as exc:
                locker.say_waiting("rank", f"the catalog's nodes cannot be listed ({exc}), so this node does not "
                                           "take turns with the others: it claims at once")
                return 0.0
            hidden = hidden or hidden_nodes
        members = [(name, server) for name, server in members if placement.matches(name, metas.get(name, {}))]
    kinds = dict(members)
    if hidden or me not in kinds:  # an order this node cannot see whole would not be the others' order
        why = ("its ACL token needs node:read on every node" if hidden
               else "this node is not alive in its own agent's member list")
        locker.say_waiting("rank", f"this node cannot see every member of the cluster ({why}), so it does not take "
                                   "turns with them: it claims at once")
        return 0.0
    order = turns.order(f"{ledger.base}\n{occ.id}", members, server=kinds[me])
    place = order.index(me)
    left = (occ.next_when - datetime.now(timezone.utc)).total_seconds() if occ.next_when else None
    wait = turns.wait_s(place, left)
    if wait <= 0:
        return 0.0
    locker.say_waiting("rank", f"occurrence {occ.id} is unclaimed and this node is ranked {place + 1} of "
                               f"{len(order)} for it; leaving it to the nodes before it for up to {duration(wait)}")
    return wait


def _step(locker: Locker, ledger: Ledger, occ: Occurrence, policy: str, deadline: float, retry: LockDelayRetry,
          look: dict[str, Any]) -> tuple[Held | None, dict[str, Any] | None, str] | None:
    """One look and what follows from it: a result, or None to look again."""
    snap = ledger.snapshot(consistent=look["consistent"])
    look["consistent"] = True  # the first look may be stale; every later one decides a takeover
    first, look["first"] = look["first"], False
    if first and look["offset"] == 0.0 and _cluster_clock(locker, ledger, snap, occ, look):
        return None
    if snap.paused:
        return None, None, snap.paused  # `paused by ...`, as a run without --schedule says it
    if snap.holder_session and locker.reap_dead_holder({ledger.lock_key: snap.lock}):
        return None
    record = snap.record or {}
    _same_zone(record, occ)
    if (held := _our_lost_answer(locker, ledger, occ, snap)) is not None:
        return held, record, ""  # our own claim, whose answer went missing: it is ours to run
    state = ledger.verdict(snap, occ)
    # A manual run never takes the place of an occurrence this node should run or take over, but a run its
    # timer did not start (`consulrun trigger` starts the unit itself) is the manual run, also when the latest
    # occurrence is unclaimed: one that came before the job was installed, say, which its timer never fired.
    manual_first = ("done", "later", "running") + (() if look["by_timer"] else ("free",))
    if first and snap.trigger and state in manual_first and trigger_fresh(snap.trigger) and \
            snap.trigger.get("node") == locker.node_name():
        return _manual(locker, ledger, snap)
    why = _skip_reason(locker, ledger, occ, snap, state, policy, look)
    if why is not None:
        return None, None, why
    if state == "free" and (late := _past_start_deadline(occ, look)):
        return None, None, _record_missed(locker, ledger, occ, snap, late)
    if state == "dead" and policy == "skip":
        ops = ledger.failed_ops(record, snap.record_index, "abandoned", ABANDONED_REASON)
        if locker.client.txn(ops, optional_checks=True) is not None:
            log.info("%s: occurrence %s was abandoned by %s; recorded", locker.spec.job, occ.id,
                     printable(record.get("node")))
        return None
    if state in ("running", "failed", "dead"):
        look["waiting"] = True  # retry: from here on this node stands by or takes over
    if first and state == "free" and not snap.holder_session and (wait := _turn(locker, ledger, occ)):
        testhook.pause("turn")
        ledger.await_claim(snap, wait)
        return None
    holders = [snap.lock] if snap.holder_session else []
    too_late = look["raced"] and state == "free" and clock() >= look["bound"]  # refused until its bound: missed
    if not holders and state != "running" and not too_late:
        result = _claim(locker, ledger, occ, snap, state, look)
        if result is not None:
            return result
        look["raced"] = True
    return _wait_or_end(locker, ledger, occ, snap, state, policy, deadline, retry, look)


def _our_lost_answer(locker: Locker, ledger: Ledger, occ: Occurrence, snap: Snapshot) -> Held | None:
    """The lock, if the record shows `occ` claimed by our own session: a claim whose answer went missing."""
    record = snap.record or {}
    ours = locker.session and snap.holder_session == locker.session and record.get("session") == locker.session
    if not ours or record.get("occurrence") != occ.id or record.get("state") != "running":
        return None
    return locker.confirm_ours(ledger.lock_key, results=[{"KV": {"Key": ledger.record_key,
                                                                 "ModifyIndex": snap.record_index}}])


def _skip_reason(locker: Locker, ledger: Ledger, occ: Occurrence, snap: Snapshot, state: str, policy: str,
                 look: dict[str, Any]) -> str | None:
    """Why this node skips `occ` by the record alone (reads only), or None if the record leaves it open."""
    record = snap.record or {}
    if state == "later":
        return (f"a later occurrence ({record['occurrence']}) is already claimed; {occ.id} is past"
                + _skew(locker, ledger, snap))
    if state == "done":
        return (f"occurrence {occ.id} already ran on {record.get('node')} "
                f"(exit status {record.get('exit_status', '?')})" + _skew(locker, ledger, snap))
    if state == "missed":
        return f"occurrence {occ.id} was recorded missed: {printable(record.get('reason'))}"
    if state not in ("running", "failed") or policy != "skip":
        return None
    how = {"running": f"was claimed by {record.get('node')} and is running",
           "failed": f"was claimed by {record.get('node')} and ended {record.get('state')}; it is not run again"
           }[state]
    lost_race = " (this node lost the race for it)" if look["raced"] else ""
    return f"occurrence {occ.id} {how}{lost_race} (on_holder_loss=skip)" + _skew(locker, ledger, snap)


def _claim(locker: Locker, ledger: Ledger, occ: Occurrence, snap: Snapshot, state: str,
           look: dict[str, Any]) -> tuple[Held | None, dict[str, Any] | None, str] | None:
    """Take the lock and claim `occ` in one transaction: the result, or None if Consul refused the lock."""
    claimed: dict[str, Any] = {}
    takeover = state in ("failed", "dead")

    def claim(value: dict[str, Any]) -> list[dict[str, Any]]:
        # Built once the session exists, just before the claim is sent: a first claim after the next
        # occurrence is due (a slow agent, the start's retries) would hold the lock when the next one's
        # nodes look, and make them skip it. That one is given up, not claimed.
        if state == "free" and not look["raced"] and _next_due(occ, look):
            raise _Superseded
        ops, claimed["record"] = ledger.claim_ops(occ, snap, value, takeover=takeover)
        return ops

    testhook.pause("before-claim")
    try:
        held = locker.try_once({ledger.lock_key: snap.lock} if snap.lock else {}, claim=claim)
    except _Superseded:
        return None, None, (f"occurrence {occ.id} is past: the next one ({calendar.occurrence_id(occ.next_when)})"
                            " is already due" + _skew(locker, ledger, snap))
    return (held, claimed["record"], "") if held else None


def _wait_or_end(locker: Locker, ledger: Ledger, occ: Occurrence, snap: Snapshot, state: str, policy: str,
                 deadline: float, retry: LockDelayRetry,
                 look: dict[str, Any]) -> tuple[Held | None, dict[str, Any] | None, str] | None:
    """Stand by on a held lock, or wait out lock-delay on a free one, within the bound; past it, say why."""
    record = snap.record or {}
    holders = [snap.lock] if snap.holder_session else []
    # Refused while nobody holds the lock or has claimed it: lock-delay after an invalidation (a lost race shows
    # its winner's claim at the next look). It is waited out within the occurrence's own bound.
    delayed = look["raced"] and not holders and state == "free"
    remaining = (look["bound"] if delayed else deadline) - clock()
    if remaining <= 0:
        if holders and state == "free":
            return None, None, f"the previous run still holds the lock: {describe_holder(snap.lock or {})}"
        if state == "running":
            return None, None, (f"occurrence {occ.id} is still running on {record.get('node')}; "
                                "the next occurrence is due, so this node stops standing by")
        if look["raced"] and (again := ledger.snapshot(consistent=True)).paused:  # the claim met a new pause
            return None, None, again.paused
        if delayed:
            return None, None, _record_missed(locker, ledger, occ, snap)
        return None, None, f"could not claim occurrence {occ.id}"
    if holders:
        look["waiting"] = True
        locker.abandon()  # a session must not outlive its TTL unrenewed while we wait
        what = (f"occurrence {occ.id} runs on {printable(record.get('node'))}" if state == "running"
                else f"the previous run holds the lock: {describe_holder(snap.lock or {})}")
        locker.say_waiting("standby", f"{what}; standing by for up to {duration(remaining)} (on_holder_loss={policy})")
        locker.client.kv_get(ledger.lock_key, index=int((snap.lock or {}).get("ModifyIndex", 0)),
                             wait_s=min(remaining, 300))
    else:  # lock-delay after an invalidation, or a lost race: look again when it should be over
        testhook.pause("lock-delay-wait")
        locker.say_waiting("delay", f"occurrence {occ.id} is free but lock-delay (after the previous holder's "
                                    "session was invalidated) refuses it; trying again when it ends, until "
                                    f"{remaining:.0f}s from now", every_s=10)
        locker.sleep(min(retry.next_wait(), remaining))
    return None


LOCK_DELAY_MISSED = ("lock-delay after the previous holder's session was invalidated (a forced unlock, its node's "
                     "agent stopped, a failed check) refused every claim until the next occurrence was due")


def _past_start_deadline(occ: Occurrence, look: dict[str, Any]) -> str | None:
    """Why `occ` is too late to start (its `start_deadline` has passed, by the cluster's clock), or None."""
    deadline = look.get("start_deadline_s")
    if deadline is None:
        return None
    late = (datetime.now(timezone.utc) - occ.when).total_seconds() - look["offset"]
    if late <= deadline:
        return None
    return (f"not started within its start_deadline ({duration(deadline)} after its time); it would have started "
            f"{duration(late)} late")


def _record_missed(locker: Locker, ledger: Ledger, occ: Occurrence, snap: Snapshot,
                   reason: str = LOCK_DELAY_MISSED) -> str:
    """Record `occ` missed (one write, check-and-set: the first of the nodes that waited in vain records it) and
    say why this node skips: an occurrence lock-delay kept from everyone, or one past its start deadline, is
    never silently gone."""
    node = locker.node_name()
    said = "another node recorded it, or claimed it, first"
    for _ in range(3):
        try:
            written = locker.client.txn(ledger.missed_ops(occ, snap, node, reason), optional_checks=True)
            if written is not None:
                said = "recorded it missed"
                break
            # The record moved: a claim or a miss of this occurrence (or a later one) settles it; a write about an
            # earlier one (its fenced runner recording `lost` late) does not, so the miss is written over it.
            snap = ledger.snapshot(consistent=True)
        except ConsulrunError as exc:  # the skip stands, and its line says what happened
            return f"could not claim occurrence {occ.id}: {reason}; recording it missed failed ({exc})"
        if str((snap.record or {}).get("occurrence") or "") >= occ.id:
            break
    return f"could not claim occurrence {occ.id}: {reason}; {said}"


def _skew(locker: Locker, ledger: Ledger, snap: Snapshot) -> str:
    """A skip's note when the record's own times lie in this node's future (one of the two clocks is wrong), and
    the finding recorded where the record's writer reads it (one write, only when it says something new)."""
    record, now = snap.record or {}, datetime.now(timezone.utc)
    lead = clockskew.ahead_of_us(record, now)
    if not lead:
        return ""
    try:
        ops = clockskew.finding_ops(snap.clock or {}, ledger.base, record, lead, locker.node_name(), now)
        if ops:
            locker.client.txn(ops)
    except ConsulrunError as exc:  # the finding is a courtesy to the node it names; the skip stands either way
        log.warning("%s: could not record the clock finding (%s)", locker.spec.job, exc)
    return f"; {clockskew.note(record, lead)}"
