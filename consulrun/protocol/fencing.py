"""Fencing arithmetic (docs/design.md): how long a holder may go unconfirmed before its job must be dead.

Consul may free the lock at any moment after the last answer the holder got
(a health check can fail right after a renewal) and re-grants it no earlier
than lock-delay later. So everything is counted from the send time of the last
read that confirmed the lock, and every process of the job must be gone within
lock-delay of it, grace period included. The same numbers decide the units'
`TimeoutStopSec=`, so systemd finishes the job in time if the wrapper itself dies.
"""

from __future__ import annotations

from consulrun.errors import UsageError
from consulrun.manifest.durations import LOCK_DELAY_RANGE_MS
from consulrun.records import record

SAFETY_MARGIN_S = 1.0  # slack for scheduling and process teardown beyond the grace period
START_RETRY_S = 120.0  # how long `run` retries Consul not yet ready at start (an election, an agent starting)
FINISH_RETRY_S = 30.0  # how long `run` retries recording a finished run's result


@record
class Fencing:
    """Timings derived from lock-delay: how long a holder may go unconfirmed before killing its job.

    Counted from the send time of the last read that confirmed the lock:
    SIGTERM at `fence_after_s`, SIGKILL at `kill_by_s` (= fence_after_s + grace_s),
    another node no earlier than lock-delay (= kill_by_s + SAFETY_MARGIN_S).
    """

    grace_s: float
    fence_after_s: float
    watch_wait_s: float

    @property
    def kill_by_s(self) -> float:
        return self.fence_after_s + self.grace_s

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


def stop_timeout_ms(lock_delay_ms: int) -> int:
    """systemd's SIGTERM-to-SIGKILL time for a unit whose wrapper died: the whole fencing window.

    If the wrapper is killed (OOM killer), its session may be invalidated at
    once; lock-delay later another node may start. systemd then stops the
    unit's cgroup: SIGKILL must come before that, with the same margin.
    """
    return lock_delay_ms - int(SAFETY_MARGIN_S * 1000)


def start_backstop_ms(timeout_ms: int, lock_delay_ms: int, ttl_ms: int, wait_ms: int, lateness_ms: int,
                      turns_ms: int, retry: bool, attempts: int = 1, backoffs_ms: int = 0) -> int:
    """The unit's TimeoutStartSec= for a job with a timeout: only a backstop behind the wrapper's own timeout.

    `run --timeout` counts from the job's start; the unit's timeout counts
    from the unit's start, which may be long before: the start's retries of
    an election, the timer's lateness against the other nodes, the turns,
    `--wait`, lock-delay. Under `retry` a standby also stands by through the
    first node's run (all its attempts) and its death going unnoticed (up to
    2 x TTL) before its own run: README's numbers for at least once. Then the
    run itself: each of its `attempts` (timeout and stop grace), the
    `backoffs_ms` between them and, before each retry, the fencing window
    for recording the failed attempt and confirming the lock; then recording
    the result. systemd stopping a run here is consulrun's failure, never the
    job's result.
    """
    attempt_ms = timeout_ms + stop_timeout_ms(lock_delay_ms)
    run_ms = attempts * attempt_ms + backoffs_ms + (attempts - 1) * lock_delay_ms
    standby_ms = run_ms + 2 * ttl_ms if retry else 0
    return (int(START_RETRY_S * 1000) + lateness_ms + turns_ms + wait_ms + standby_ms + lock_delay_ms + run_ms
            + int(FINISH_RETRY_S * 1000))
