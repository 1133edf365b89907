"""How a run ends when it does not end by itself: the job's own timeout, and why a termination signal came.

The job's `timeout:` (`run --timeout`) is the wrapper's to enforce, counted from
the moment the job started: a standby's unit starts at the occurrence and may
spend a long time standing by and waiting out lock-delay before it runs
anything, so systemd's `TimeoutStartSec=` (counted from the unit's start) would
take that time from the job. The unit's own timeout is only a backstop behind
this one (units/guarantees.py derives it).

A SIGTERM that reached a running job is one of (systemd stops units with SIGTERM, consulrun's KillSignal=;
a SIGHUP or SIGINT is an operator's, never a stop of systemd's, and a run that outlives one is not asked about):
  the job's own timeout (sent by the wrapper)     a result: the job ran as long as it may
  `systemctl stop` of the unit, system running    a result: an operator ended this run on purpose
  the system stopping (shutdown, reboot)          not a result: the stop was not aimed at the job
  the unit's TimeoutStartSec= backstop            not a result: consulrun overran what it promised
Only systemd knows which, so it is asked (`systemctl show`), and only on this
path: a run that ends by itself asks nothing. If systemd cannot be asked (no
unit, no D-Bus for the unit's user), the stop counts as a result, as it did
before systemd could be asked. If it is asked but does not answer within the
time the stop leaves (the unit's TimeoutStopSec= is lock-delay less a second,
and the result must be recorded in it too), the stop is not taken as the
result: a manager that slow is one shutting down a loaded node far more often
than one answering an operator's stop, and under `retry` a run wrongly taken
as lost runs again, where one wrongly taken as done is lost for good.
"""

from __future__ import annotations

import logging
import signal

from consulrun.protocol.lock import clock
from consulrun.protocol.procinfo import own_unit
from consulrun.timefmt import duration

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from consulrun.protocol.child import Job

log = logging.getLogger("consulrun")

SYSTEMCTL_TIMEOUT_S = 5.0


class JobTimeout:
    """The job's own time limit: SIGTERM to all of it at `timeout_s` after its start, SIGKILL `grace_s` later.

    Checked from the supervising loop, so the lock stays watched through the
    grace period; a wrapper that wakes past both deadlines kills at once.
    """

    def __init__(self, name: str, timeout_s: float, grace_s: float, started: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.term_at = started + timeout_s
        self.kill_at = self.term_at + grace_s
        self.expired = False
        self.killed = False

    def check(self, job: Job, now: float) -> None:
        if not self.expired and now >= self.term_at:
            self.expired = True
            if now < self.kill_at:
                log.warning("%s: the job exceeded its timeout of %s; stopping its processes (SIGTERM, SIGKILL "
                            "after %s)", self.name, duration(self.timeout_s), duration(self.grace_s))
                job.signal(signal.SIGTERM)
                return
            log.warning("%s: the job exceeded its timeout of %s; killing its processes (SIGKILL at once: the "
                        "wrapper woke too late for a grace period)", self.name, duration(self.timeout_s))
        elif self.expired and not self.killed and now >= self.kill_at and job.alive():
            log.warning("%s: the job outlived the %s grace after its timeout; killing what is left (SIGKILL)",
                        self.name, duration(self.grace_s))
        else:
            return
        self.killed = True
        job.kill_all(0)

    def next_s(self, now: float) -> float:
        """Seconds until the next thing this limit must do (long if nothing is left)."""
        if not self.expired:
            return self.term_at - now
        return self.kill_at - now if not self.killed else 3600.0


MIN_ASK_S = 0.5  # the least time systemd is given to answer, even when the stop leaves less


class _NoAnswer(Exception):
    """systemd was asked and did not answer in time."""


def _show(name: str, *args: str, timeout_s: float) -> dict[str, str]:
    import subprocess  # only a stopped run asks: a skipping one must not pay for the import

    if timeout_s <= 0:  # the first question took it all: MIN_ASK_S is for both, not each
        raise _NoAnswer
    try:
        done = subprocess.run(["systemctl", "show", *args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise _NoAnswer from None
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s: could not ask systemd why the job was stopped (systemctl show %s: %s)", name,
                    " ".join(args), exc)
        return _unanswered()
    if done.returncode != 0:
        log.warning("%s: could not ask systemd why the job was stopped (systemctl show %s exited %d: %s)", name,
                    " ".join(args), done.returncode, " ".join(done.stderr.split())[:300])
        return _unanswered()
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def _unanswered() -> dict[str, str]:
    """systemd refused to answer. As root it answers on its own socket whenever it serves at all, so a refusal
    is its silence (a manager shutting down); a user without access to its bus gets no answer ever, and the
    stop counts as the result, as it did before systemd was asked."""
    import os

    if os.geteuid() == 0:
        raise _NoAnswer
    return {}


def not_a_result(name: str, unit: str | None = None, within_s: float = SYSTEMCTL_TIMEOUT_S) -> str | None:
    """Why the termination signal job `name`'s run got is not the run's result, or None if it is (see the
    docstring). systemd is given `within_s` (at least MIN_ASK_S) to answer both questions together."""
    unit = unit or own_unit()
    if unit is None:
        return None
    until = clock() + max(MIN_ASK_S, within_s)
    try:
        state = _show(name, "--property=SystemState", timeout_s=until - clock()).get("SystemState", "")
        if state == "stopping":
            return "the system is shutting down (a stop not aimed at the job)"
        result = _show(name, unit, "--property=Result", timeout_s=until - clock()).get("Result", "")
        if result == "timeout":
            return f"{unit}'s TimeoutStartSec= backstop expired (consulrun overran it; not the job's own timeout)"
    except _NoAnswer:
        return (f"systemd did not say within {duration(max(MIN_ASK_S, within_s))} why the job was stopped (a node "
                "shutting down answers that late, or not at all; not taken as a stop aimed at the job)")
    # What systemd said, in the journal: a run recorded done after a stop says why it counts as its result.
    if state and result:
        log.info("%s: systemd says the system is %s and %s's result is %s: the stop was aimed at the job, so the "
                 "job's status is the run's result", name, state, unit, result)
    else:
        log.info("%s: without systemd's answer the stop counts as the run's result", name)
    return None
    until = clock() + max(MIN_ASK_S, within_s)
    try:
        state = _show("--property=SystemState", timeout_s=until - clock()).get("SystemState", "")
        if state == "stopping":
            return "the system is shutting down (a stop not aimed at the job)"
        if _show(unit, "--property=Result", timeout_s=until - clock()).get("Result", "") == "timeout":
            return f"{unit}'s TimeoutStartSec= backstop expired (consulrun overran it; not the job's own timeout)"
    except _NoAnswer:
        return (f"systemd did not say within {duration(max(MIN_ASK_S, within_s))} why the job was stopped (a node "
                "shutting down answers that late, or not at all; not taken as a stop aimed at the job)")
    return None
