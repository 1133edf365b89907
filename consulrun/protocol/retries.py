"""Retries of a failed run (`retries:`, `run --attempts`): the same occurrence run again, on the same node,
under the same lock, after a growing backoff.

`attempts` counts every run of the occurrence, the first included: `attempts: 3` is one run and up to two
retries (dkron's `retries: 2`, Kubernetes' `backoffLimit: 2`). The key says attempts, so it counts them;
its default, 1, is no retry.

Which runs are retried: a job that exited non-zero by itself, or was stopped by its own `timeout:`. Never a
skip, a lost lock, a job that never started, or a run the wrapper got a termination signal for (an operator's
`systemctl stop`, a shutdown, the unit's backstop): those end the run as they did before.

Why the same node, holding the lock throughout: the failure is the job's own (a node's fault is what
`on_holder_loss: retry` already hands to another node). Keeping the lock means that between two attempts no
other node can claim the occurrence or a later one, the fencing token stays the job's, the backoff is timed
on one clock, and nothing new is written for a skipping node to read: standbys and skipping nodes see the
occurrence running, as it is. Releasing it between attempts would let a second node start an attempt while
the first one's leftover processes could still be alive, and turn every retry into a race.

Between attempts: the failed attempt is written into the occurrence record's `earlier` list (one
check-and-set, with a check that the lock is still this session's; no health-check update, no ping), the
backoff is waited with the watcher still confirming the lock and renewing the session, and the lock is
confirmed again just before the next attempt starts. A retry whose backoff would reach the next occurrence is
not made; a termination signal or a lost lock during the backoff ends the retries: the last attempt's result
stands.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

from consulrun.consul.client import kv_op
from consulrun.errors import ConsulrunError
from consulrun.manifest import calendar
from consulrun.protocol.lock import clock
from consulrun.records import record
from consulrun.timefmt import duration

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any, Callable

    from consulrun.protocol.lock import Held, Locker
    from consulrun.protocol.occurrence import Ledger

log = logging.getLogger("consulrun")

ATTEMPTS_MAX = 100
DEFAULT_BACKOFF_MS = 10_000
DEFAULT_MAX_BACKOFF_MS = 300_000


@record
class RetryPolicy:
    """At most `attempts` runs of one occurrence, the k-th retry after backoff x 2^(k-1), at most max_backoff."""

    attempts: int = 1
    backoff_ms: int = DEFAULT_BACKOFF_MS
    max_backoff_ms: int = DEFAULT_MAX_BACKOFF_MS

    def backoff_s(self, failed: int) -> float:
        """The wait after the `failed`-th failed attempt (1: after the first run)."""
        return min(self.backoff_ms * 2 ** min(failed - 1, 40), self.max_backoff_ms) / 1000

    def total_backoff_ms(self) -> int:
        """Every backoff of a run that uses all its attempts: what the unit's backstop adds for them."""
        return int(sum(self.backoff_s(n) for n in range(1, self.attempts)) * 1000)


def next_due(schedules: tuple[str, ...], claim: dict[str, Any] | None) -> datetime | None:
    """When the occurrence after the claimed one is due (for a manual run, the next one from now), or None."""
    if not schedules:
        return None
    occurrence = (claim or {}).get("occurrence")
    try:
        when = datetime.strptime(str(occurrence), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc) \
            if occurrence and not (claim or {}).get("manual") and not (claim or {}).get("after") \
            else datetime.now(timezone.utc)
    except ValueError:
        when = datetime.now(timezone.utc)
    return calendar.following(list(schedules), when)


def runs_made(claim: dict[str, Any] | None) -> int:
    """The runs of the claimed occurrence its record counts before this attempt: each earlier attempt that
    failed by itself (`retried`). An attempt lost or abandoned (killed, its node dead, never started) did not
    end by itself: `on_holder_loss: retry` runs it again, and it does not count (docs/guarantees.md)."""
    return sum(1 for entry in (claim or {}).get("earlier", []) if entry.get("retried"))


def why_not(policy: RetryPolicy, ran: int, status: int, stopped: bool, due: datetime | None,
            now: datetime) -> str | None:
    """None if the failed attempt, the `ran`-th run of the occurrence, is to be retried now that it ended with
    `status`, else why not ('' if the run is simply over: it succeeded, or it may be run only once)."""
    if status == 0 or policy.attempts <= 1:
        return ""
    if stopped:
        return "the run was stopped by a termination signal, which ends it"
    if ran >= policy.attempts:
        return f"it was the last of {policy.attempts} attempts"
    backoff = policy.backoff_s(ran)
    if due is not None and now + timedelta(seconds=backoff) >= due:
        return (f"the next occurrence ({calendar.occurrence_id(due)}) is due before a retry in "
                f"{duration(backoff)}")
    return None


def record_failed_attempt(locker: Locker, ledger: Ledger, held: Held, claim: dict[str, Any],
                          outcome: dict[str, Any], backoff_s: float) -> tuple[dict[str, Any], Held] | None:
    """Write the failed attempt into the record's `earlier` list and make the record the next attempt's, while
    the lock is still ours; (the next attempt's claim, `held` with the record's new index), or None if it could
    not be written (then no retry is made: an attempt history would not show must not run)."""
    retry_at = (datetime.now(timezone.utc) + timedelta(seconds=backoff_s)).isoformat(timespec="seconds") \
        .replace("+00:00", "Z")
    failed = {**{k: v for k, v in claim.items() if k not in ("earlier", "retry_at")}, **outcome,
              "state": "done", "retried": True, "retry_after_s": backoff_s}
    nxt = {**claim, "attempt": int(claim.get("attempt") or 1) + 1, "takeover": False, "retry_at": retry_at,
           "earlier": [*claim.get("earlier", []), failed]}
    check = kv_op("check-session", held.key, Session=held.session)  # the key held: `lock`, or each-node's slot
    if claim.get("manual") or claim.get("after"):
        ops = [kv_op("set", ledger.manual_key(claim), nxt), check]
    else:
        index = ledger.record_index_after_claim(held)
        ops = [kv_op("cas", ledger.record_key, {**nxt, "started": retry_at}, Index=index), check]
    try:
        results = locker.client.txn(ops)
    except ConsulrunError as exc:
        log.warning("%s: the failed attempt cannot be recorded (%s); not retrying", locker.spec.job, exc)
        return None
    if results is None:
        log.warning("%s: the failed attempt cannot be recorded (the record moved or the lock is no longer ours); "
                    "not retrying", locker.spec.job)
        return None
    return nxt, held._replace(results=results) if not (claim.get("manual") or claim.get("after")) else held


def wait_backoff(until: float, ended: Callable[[], str | None], sleep: Callable[[float], None]) -> str | None:
    """Wait until clock() reaches `until`; why the retries end if `ended` says so first (None: retry)."""
    while True:
        why = ended()
        if why:
            return why
        left = until - clock()
        if left <= 0:
            return None
        sleep(min(left, 1.0))


def between(policy: RetryPolicy, locker: Locker, ledger: Ledger | None, held: Held, claim: dict[str, Any] | None,
            outcome: dict[str, Any], attempt: int, stopped: bool, due: datetime | None,
            ended: Callable[[], str | None], sleep: Callable[[float], None]
            ) -> tuple[dict[str, Any] | None, Held, str | None]:
    """After attempt `attempt` ended with `outcome`: record it and wait out the backoff if it is to be retried.

    (claim, held, None): run the next attempt for this claim. (claim, held, why): no further attempt; the
    result in `outcome` stands and is recorded for `claim` (the ended attempt's) at the record's index in `held`
    (it moved if the failed attempt was recorded before the backoff was cut short).
    """
    status = outcome.get("exit_status")
    if outcome.get("lost") or not isinstance(status, int) or ledger is None or claim is None:
        return claim, held, ""
    job = locker.spec.job
    ran = runs_made(claim) + 1  # counted from the record, not from this process: a takeover goes on from it
    why = why_not(policy, ran, status, stopped, due, datetime.now(timezone.utc))
    # The attempt's number is the record's; after a takeover it runs ahead of the runs counted (an attempt
    # abandoned in its backoff, never started, has a number but no run).
    which = f"attempt {attempt} of {policy.attempts}" if attempt == ran else \
        f"attempt {attempt} (run {ran} of {policy.attempts})"
    if why:
        log.warning("%s: %s failed (exit status %d); no retry: %s", job, which, status, why)
    if why is not None:
        return claim, held, why
    backoff = policy.backoff_s(ran)
    made = record_failed_attempt(locker, ledger, held, claim, outcome, backoff)
    if made is None:
        return claim, held, "the failed attempt could not be recorded"
    nxt, moved = made
    log.warning("%s: %s failed (exit status %d); retrying in %s on this node, which keeps the lock",
                job, which, status, duration(backoff))
    why = wait_backoff(clock() + backoff, ended, sleep)
    if why:
        log.warning("%s: %s during the backoff; no further attempt: attempt %d's exit status %d stands", job, why,
                    attempt, status)
        return claim, moved, why
    return nxt, moved, None
