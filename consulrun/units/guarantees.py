"""When a manifest asks for a guarantee its own settings cannot give, say so before it is installed.

`on_holder_loss: retry` promises at least once per occurrence only if a dead
run can be noticed and run again before the next occurrence replaces it:
the occurrences must be more than the timer's accuracy and randomized delay +
the nodes' turns (turns.py: 6 s, at most a tenth of the interval) + 2 x TTL
(the longest a dead wrapper's session may live) + lock-delay + the job's run
time (its timeout) apart.
"""

from __future__ import annotations

from datetime import datetime, timezone

from consulrun.manifest import calendar
from consulrun.manifest.durations import format_duration
from consulrun.manifest.loader import Job, Manifest
from consulrun.protocol.fencing import start_backstop_ms
from consulrun.protocol.retries import RetryPolicy
from consulrun.protocol.turns import turn_at_most_s

LOOK_AHEAD = 200  # occurrences examined for the densest gap (a daily spec with one dense day, DST)


def turn_ms(gap_ms: int | None) -> int:
    """The longest the nodes' turns delay the first attempt (turns.py: 6 s, at most a tenth of the gap)."""
    return int(turn_at_most_s(gap_ms / 1000 if gap_ms is not None else None) * 1000)


def retry_takeover_needs_ms(job: Job, gap_ms: int | None = None) -> int:
    """The timer's own lateness (accuracy + randomized delay), the nodes' turns, the longest a dead run goes
    unnoticed (2 x TTL), lock-delay, and the second attempt's run time."""
    return (job.timer.accuracy_ms + job.timer.randomized_delay_ms + turn_ms(gap_ms) + 2 * job.lock.ttl_ms
            + job.lock.lock_delay_ms + (job.timeout_ms or 0))


def start_timeout_ms(job: Job) -> int | None:
    """The unit's TimeoutStartSec= (a backstop: `run --timeout` enforces the job's own timeout), None without one.

    The turns are counted at their most (6 s), not for the schedule's gap, so
    the unit's text does not depend on when it was generated. An each-node
    job has none: each node waits for a slot up to its next occurrence (the
    other nodes' runs), then runs its whole timeout; a sum for one run would
    stop it while it waits or runs, and the wrapper bounds both itself.
    """
    if not job.timeout_ms or job.mode == "each-node":
        return None
    return start_backstop_ms(job.timeout_ms, job.lock.lock_delay_ms, job.lock.ttl_ms, job.lock.wait_ms,
                             job.timer.accuracy_ms + job.timer.randomized_delay_ms, turn_ms(None),
                             retry=job.on_holder_loss == "retry" and job.lock.concurrency == 1,
                             attempts=job.retries.attempts, backoffs_ms=RetryPolicy(
                                 job.retries.attempts, job.retries.backoff_ms, job.retries.max_backoff_ms
                             ).total_backoff_ms())


def densest_gap_ms(specs: list[str], start: datetime) -> int | None:
    """The shortest time between consecutive occurrences among the next LOOK_AHEAD, or None if fewer than two
    (a chained job, `after:` without `schedule:`, has none)."""
    if not specs:
        return None
    gaps, when = [], calendar.following(specs, start)
    for _ in range(LOOK_AHEAD):
        if when is None:
            break
        after = calendar.following(specs, when)
        if after is None:
            break
        gaps.append(int((after - when).total_seconds() * 1000))
        when = after
    return min(gaps) if gaps else None


def retries_warning(job: Job, gap_ms: int | None) -> str | None:
    """A line if the schedule leaves no room for all of a job's `retries.attempts`: a retry whose backoff would
    reach the next occurrence is not made (retries.py), so fewer attempts than asked would ever run."""
    policy = RetryPolicy(job.retries.attempts, job.retries.backoff_ms, job.retries.max_backoff_ms)
    if policy.attempts <= 1 or gap_ms is None:
        return None
    run_ms = job.timeout_ms or 0  # without a timeout, the job's run time is unknown: counted as nothing
    waited, possible = 0, 1
    while possible < policy.attempts:
        waited += run_ms + int(policy.backoff_s(possible) * 1000)
        if waited >= gap_ms:
            break
        possible += 1
    if possible >= policy.attempts:
        return None
    return (f"job {job.name}: retries: occurrences are {format_duration(gap_ms)} apart, so at most {possible} of "
            f"the {policy.attempts} attempts can run before the next occurrence ends the retries (backoff "
            f"{format_duration(policy.backoff_ms)}, doubling to {format_duration(policy.max_backoff_ms)}"
            f"{', each attempt up to its timeout ' + format_duration(run_ms) if run_ms else ''})")


def warnings(manifest: Manifest, now: datetime | None = None) -> list[str]:
    """One line per `retry` job whose schedule is too dense for a takeover to finish before the next occurrence,
    and per job whose schedule leaves no room for all its retries."""
    now = now or datetime.now(timezone.utc)
    found = []
    for job in manifest.jobs:
        if job.retries.attempts > 1:
            line = retries_warning(job, densest_gap_ms(list(job.schedules), now))
            found += [line] if line else []
        if job.on_holder_loss != "retry" or job.lock.concurrency != 1:
            continue
        gap = densest_gap_ms(list(job.schedules), now)
        needs = retry_takeover_needs_ms(job, gap)
        if gap is not None and gap <= needs:
            run_time = f" + timeout {format_duration(job.timeout_ms)}" if job.timeout_ms else " + the job's run time"
            found.append(f"job {job.name}: on_holder_loss: retry cannot promise at least once: occurrences are "
                         f"{format_duration(gap)} apart, but noticing a dead run and running it again can take "
                         f"{format_duration(needs)} (timer accuracy + randomized delay "
                         f"{format_duration(job.timer.accuracy_ms + job.timer.randomized_delay_ms)} + the nodes' "
                         f"turns {format_duration(turn_ms(gap))} + 2 x ttl "
                         f"{format_duration(job.lock.ttl_ms)} + lock_delay {format_duration(job.lock.lock_delay_ms)}"
                         f"{run_time}); a lost run may be superseded by the next")
    return found
