"""Fencing arithmetic (DESIGN.md): how long a holder may go unconfirmed before its job must be dead.

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
