"""`consulrun run`: take the lock, run the job while the lock is confirmed, let go.

Phases and what a termination signal does in each:
  waiting for the lock  -> stop waiting at once, clean up, exit 128+N
  job running           -> forward the signal to the job's whole group, wait for it
  lock lost             -> the job's group is killed (SIGTERM, then SIGKILL), exit 75
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from types import FrameType

from consulrun.child import Job, become_subreaper
from consulrun.consulapi import Client, ConsulConfig
from consulrun import occurrence
from consulrun.errors import ExitCode, JobNotStarted, UsageError
from consulrun.lock import Fencing, Held, Interrupted, Locker, LockSpec, Watcher, now_iso as _now

log = logging.getLogger("consulrun")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True)
class RunRequest:
    spec: LockSpec
    command: tuple[str, ...]
    skip_exit_code: int = 0
    schedules: tuple[str, ...] = ()  # with schedules, each occurrence runs once (occurrence.py)
    on_holder_loss: str = "skip"
    history: int = 20


class _Signals:
    """Signal handling that changes with the phase: interrupt the wait, or forward to the job."""

    def __init__(self) -> None:
        self.job: Job | None = None
        self.received: list[int] = []
        self._previous = {sig: signal.getsignal(sig) for sig in FORWARDED}
        for sig in FORWARDED:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)
        if self.job is None:
            raise Interrupted(signum)
        log.info("%s received; forwarding it to the job's process group", signal.Signals(signum).name)
        self.job.signal(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _supervise(job: Job, watcher: Watcher, fencing: Fencing, name: str) -> tuple[int, str | None]:
    """Wait for the job while the watcher confirms the lock; kill the group as soon as it may be lost.

    Sleeps in select() on the job's pidfd and the watcher's wake-up pipe, so a job
    exit or a lost lock is acted on at once, and the fencing deadline bounds every sleep.
    """
    pidfd = os.pidfd_open(job.pgid)
    try:
        while True:
            status = job.poll()
            if status is not None:
                return status, None
            reason = watcher.lost_reason
            unconfirmed = time.monotonic() - watcher.last_confirmed
            if reason is None and unconfirmed > fencing.fence_after_s:
                reason = (f"lock not confirmed for {unconfirmed:.1f}s; another node may acquire it "
                          f"{fencing.fence_after_s + fencing.grace_s + 1:.0f}s after the last confirmation")
            if reason:
                log.error("%s: lock lost: %s; killing the job's process group", name, reason)
                job.kill_group(fencing.grace_s)
                return ExitCode.LOCK_LOST, reason
            timeout = max(0.0, fencing.fence_after_s - unconfirmed) + 0.01
            readable, _, _ = select.select([pidfd, watcher.wakeup], [], [], timeout)
            if watcher.wakeup in readable:
                os.read(watcher.wakeup, 64)
    finally:
        os.close(pidfd)


def _job_environment(held: Held, spec: LockSpec, claim: dict[str, object] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"CONSULRUN_JOB": spec.job, "CONSULRUN_SESSION": held.session, "CONSULRUN_LOCK_KEY": held.key,
                "CONSULRUN_FENCING_TOKEN": str(held.fencing_token)})
    if claim:
        env["CONSULRUN_OCCURRENCE"] = str(claim["occurrence"])
    return env


def run(request: RunRequest, config: ConsulConfig) -> int:
    """Run the job on this node if the lock is ours; return the process exit status."""
    spec = request.spec
    fencing = Fencing.for_lock_delay(spec.lock_delay_ms, spec.ttl_ms)
    if not shutil.which(request.command[0]):  # fail before touching the lock, not after taking it
        raise JobNotStarted(f"cannot start {request.command[0]}: not found or not executable")
    client = Client(config)
    locker = Locker(client, spec)
    signals = _Signals()
    try:
        try:
            ledger, claim = None, None
            if request.schedules:
                occ = occurrence.current(list(request.schedules), datetime.now(timezone.utc))
                if occ is None:
                    raise UsageError("the schedule has no occurrence at or before now; nothing to run")
                ledger = occurrence.Ledger(client, spec.base, request.history)
                held, claim, why = occurrence.acquire(locker, ledger, occ, request.on_holder_loss, spec.wait_ms / 1000)
            else:
                held, why = locker.acquire()
        except Interrupted as exc:
            log.info("%s: %s while waiting for the lock; not running", spec.job, signal.Signals(exc.signum).name)
            locker.abandon()
            return 128 + exc.signum
        except BaseException:
            locker.abandon()
            raise
        if held is None:
            log.info("%s: skipped: %s", spec.job, why)
            return request.skip_exit_code
        return _run_held(request, locker, held, fencing, signals, ledger, claim)
    finally:
        signals.restore()


def _run_held(request: RunRequest, locker: Locker, held: Held, fencing: Fencing, signals: _Signals,
              ledger: occurrence.Ledger | None, claim: dict[str, object] | None) -> int:
    spec = request.spec
    which = ""
    if claim:
        which = f" for occurrence {claim['occurrence']}" + (" (taking over from a dead runner)" if claim["takeover"] else "")
    log.info("%s: acquired %s%s (session %s, fencing token %d)", spec.job, held.key, which, held.session,
             held.fencing_token)
    watcher = Watcher(locker.client, spec, held, fencing)
    outcome: dict[str, object] = {}
    try:
        become_subreaper()
        job = Job(list(request.command), _job_environment(held, spec, claim))
        signals.job = job
        watcher.start()
        status, lost = _supervise(job, watcher, fencing, spec.job)
        if not lost and job.group_alive():
            log.warning("%s: the job exited but left processes in its group; stopping them", spec.job)
            job.kill_group(fencing.grace_s)
        outcome = {"exit_status": status, "ended": _now(), **({"lost": lost} if lost else {})}
        if not lost:
            log.info("%s: job exited with status %d", spec.job, status)
        return status
    finally:
        watcher.stop()
        extra = ledger.finish_ops(claim, outcome) if ledger and claim and outcome and not outcome.get("lost") else None
        locker.release(held, outcome, extra)
        log.info("%s: released %s", spec.job, held.key)
