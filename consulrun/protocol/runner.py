"""`consulrun run`: take the lock, run the job while the lock is confirmed, let go.

Phases and what a termination signal does in each:
  waiting for the lock   -> stop waiting at once, destroy the session, exit 128+N (the skip code with
                            --skip-when-stopped: this node ran nothing)
  acquired, not started  -> the job is not started; the claim is recorded lost, the lock released, exit 128+N
  job running            -> forwarded to every process of the job; the job's own status is passed through;
                            recorded done, unless systemd says the stop was not aimed at the job (a
                            shutdown, the unit's backstop timeout): then lost (stops.py)
  lock lost              -> every process of the job is killed (SIGTERM, then SIGKILL), exit 75
  backoff before a retry -> no further attempt; the last attempt's result is recorded and is the exit status
                            (retries.py)
  releasing              -> the release completes, exit 128+N

The invariant every path keeps: the lock is released only after every process
of the job is gone. If that cannot be made sure, the lock is not released and
the session's invalidation frees it (lock-delay applies).

Why this module is long: it supervises one run from the lock to the release, and each
step (start, watch, fence, stop, record) must be read with the signals and failures that can land
between any two of them.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import time
from datetime import datetime, timezone
from types import FrameType

from consulrun.consul.client import CREDENTIAL_VARIABLES, SERF_CRITICAL, Client, ConsulConfig
from consulrun.consul.values import printable
from consulrun.errors import ConsulrunError, ConsulUnavailable, ExitCode, JobNotStarted, UsageError
from consulrun.protocol import testhook
from consulrun.protocol.fencing import FINISH_RETRY_S, START_RETRY_S, stop_timeout_ms
from consulrun.protocol.lock import Fencing, Held, Interrupted, Locker, LockSpec, Watcher, clock, now_iso as _now
from consulrun.protocol.stops import JobTimeout
from consulrun.records import record
from consulrun.timefmt import duration

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:  # a skipping run imports none of these (issue: lean hot path)
    from typing import Any, Callable

    from consulrun.protocol import occurrence
    from consulrun.protocol.child import Job

log = logging.getLogger("consulrun")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Nothing listening at the agent's address is an agent still starting only this soon after the system (its PID 1)
# started: a Persistent=true catch-up at boot. Later it is an agent that is down: exit 69 at once.
BOOTING_S = 600.0
NOT_STARTED = "_not_started"  # an outcome's mark (never recorded): the job was never forked


@record
class RunRequest:
    spec: LockSpec
    command: tuple[str, ...]
    skip_exit_code: int = 0
    schedules: tuple[str, ...] = ()  # with schedules, each occurrence runs once (occurrence.py)
    on_holder_loss: str = "skip"
    history: int = 20
    ping_url: str | None = None  # Healthchecks.io-style monitor (notify.py)
    ping_output_lines: int = 0  # the final ping carries this many of the run's last journal lines
    health_check: bool = False  # the result also sets the job's Consul health check (health.py)
    pass_consul_token: bool = False  # the job keeps CONSUL_HTTP_TOKEN(_FILE) (the manifest's pass_consul_token)
    timeout_ms: int | None = None  # the job's own time limit, from its start (stops.py)
    skip_when_stopped: bool = False  # a stop before the lock exits with the skip code: this node ran nothing
    attempts: int = 1  # runs of one occurrence at most, the first included (retries.py)
    retry_backoff_ms: int = 10_000  # before the first retry; doubled for each next one
    retry_max_backoff_ms: int = 300_000
    start_deadline_ms: int | None = None  # an occurrence not started this long after its time is missed, not run
    after: tuple[str, ...] = ()  # the jobs this one runs after: a pending chained run comes first (chain.py)
    thens: tuple[tuple[str, str], ...] = ()  # (job, on) of the jobs chained after this one
    each_node: bool = False  # every node runs each occurrence once, spec.concurrency at a time (eachnode.py)


class _Signals:
    """Signal handling that changes with the phase: interrupt the wait, hold for later, or forward to the job.

    Every signal also writes to a wake-up pipe, so the supervising select()
    returns at once on SIGCHLD (the job exited: no pidfd needed) and on SIGCONT
    (the wrapper was stopped: deadlines are checked again at once).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.job: Job | None = None
        self.interruptible = True
        self.received: list[int] = []
        self._forwarded = 0
        self._job_got: set[int] = set()  # indexes into `received` that reached a running job
        self._shielded: list[bool] = []
        self.first_term_at: float | None = None  # clock() of the first SIGTERM: systemd's stop, starting its timeout
        self.wakeup, writer = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._writer = writer
        self._previous_fd = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
        self._previous = {sig: signal.getsignal(sig) for sig in (*FORWARDED, signal.SIGCHLD, signal.SIGCONT)}
        for sig in FORWARDED:
            signal.signal(sig, self._handle)
        for sig in (signal.SIGCHLD, signal.SIGCONT):
            signal.signal(sig, lambda _signum, _frame: None)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and self.first_term_at is None:
            self.first_term_at = clock()
        self.received.append(signum)
        if self.job is not None:
            self.forward_pending()
        elif self.interruptible:
            raise Interrupted(signum)

    def forward_pending(self) -> None:
        if self.job is None:
            return
        while self._forwarded < len(self.received):
            index = self._forwarded  # this signal's own: a signal landing in the lines below forwards the next one
            signum = self.received[index]
            self._forwarded += 1
            if self.job.status is None:
                log.info("%s: %s received; forwarding it to the job's processes", self.name,
                         signal.Signals(signum).name)
                self.job.signal(signum)
                self._job_got.add(index)

    def settle(self) -> None:
        """The signals received so far have had their effect (they ended the retries): none is unforwarded."""
        self._job_got.update(range(len(self.received)))

    def reached_job(self, signum: int | None = None) -> bool:
        """Whether a termination signal (`signum`, if given) reached the running job (forwarded while its main
        process lived): only such a stop can be "not the run's result"; one that came after the job had exited
        ended nothing of it."""
        return any(signum in (None, self.received[i]) for i in self._job_got)

    def unforwarded(self) -> list[int]:
        """Termination signals that arrived while no job was running to receive them."""
        return [sig for i, sig in enumerate(self.received) if i not in self._job_got]

    def shield(self, on: bool) -> None:
        """While shielded, a termination signal is held for later instead of interrupting (a lock or a session
        being taken or given up); unshielding restores what was before and raises a held-back signal if that
        was interruptible. Shields nest."""
        if on:
            self._shielded.append(self.interruptible)
            self.interruptible = False
            return
        if self._shielded:
            self.interruptible = self._shielded.pop()
        self._interrupt_if(self.interruptible)

    def checkpoint(self) -> None:
        """Raise Interrupted for a held-back signal if the wait the shields interrupted was interruptible: a
        point inside a shielded step where giving up is safe (the caller then destroys the session). The
        shields stay as they are."""
        self._interrupt_if(self._shielded[0] if self._shielded else self.interruptible)

    def _interrupt_if(self, interruptible: bool) -> None:
        """Raise Interrupted for the first signal held back, if any, when no job runs to receive it."""
        if interruptible and self.job is None and self.received:
            raise Interrupted(self.received[0])

    def drain(self) -> None:
        try:
            while os.read(self.wakeup, 512):
                pass
        except BlockingIOError:
            pass

    def restore(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self.wakeup)
        os.close(self._writer)


def _supervise(job: Job, watcher: Watcher, fencing: Fencing, signals: _Signals, name: str,
               limit: JobTimeout | None = None) -> tuple[int, str | None]:
    """Wait for the job while the watcher confirms the lock; kill all of it as soon as the lock may be lost,
    and stop it when it has run for its own timeout (`limit`).

    Deadlines are absolute on CLOCK_BOOTTIME and every sleep is short, so a
    wrapper that was stopped, starved or suspended past its deadline notices at
    once on waking and, with no time left for a grace period, SIGKILLs the job.
    """
    while True:
        status = job.poll()
        if status is not None:
            return status, None
        now = clock()
        reason = watcher.lost_reason
        deadline = watcher.last_confirmed + fencing.fence_after_s
        if reason is None and now >= deadline:
            reason = (f"lock not confirmed for {duration(now - watcher.last_confirmed)}; another node may acquire "
                      f"it {duration(fencing.kill_by_s + 1)} after the last confirmation")
        if reason:
            # The grace the line names is the one given: the job's share, never past the fencing deadline.
            grace = min(fencing.grace_s, watcher.last_confirmed + fencing.kill_by_s - now)
            how = f"SIGTERM, SIGKILL after {duration(grace)}" if grace > 0 else \
                "SIGKILL at once: no time is left for a grace period"
            log.error("%s: lock lost: %s; killing the job's processes (%s)", name, reason, how)
            job.kill_all(grace, now=clock)
            return ExitCode.LOCK_LOST, reason
        if limit is not None:
            limit.check(job, now)
        wait = min(deadline - now, 1.0, limit.next_s(now) if limit is not None else 1.0)
        _wait_readable([signals.wakeup, watcher.wakeup], max(0.0, wait) + 0.01)
        signals.drain()
        try:
            os.read(watcher.wakeup, 64) if watcher.lost_reason else None
        except BlockingIOError:
            pass


def _backoff_ended(signals: _Signals, seen: int, watcher: Watcher) -> str | None:
    """Why the backoff before a retry ends early: a termination signal (the `seen`-th on), or the lock lost."""
    if len(signals.received) > seen:
        return f"{signal.Signals(signals.received[seen]).name} received"
    if watcher.lost_reason:
        return f"the lock was lost ({watcher.lost_reason})"
    return None


def _nap(signals: _Signals, watcher: Watcher, seconds: float) -> None:
    """Sleep up to `seconds`, waking at once for a signal or news from the watcher."""
    _wait_readable([signals.wakeup, watcher.wakeup], seconds)
    signals.drain()


def _wait_readable(fds: list[int], timeout_s: float) -> None:
    """Sleep until one of `fds` is readable or `timeout_s` passes: poll(2), which, unlike select(2), takes
    descriptors numbered 1024 and up (a unit with a high LimitNOFILE= and many inherited files)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll(max(0.0, timeout_s) * 1000)


def _job_environment(held: Held, spec: LockSpec, claim: dict[str, object] | None,
                     pass_consul_token: bool = False, attempt: int = 1, node: str = "") -> dict[str, str]:
    """The wrapper's environment, less its Consul credentials (`CREDENTIAL_VARIABLES`): with them any job would
    hold the node's KV and session write rights (a job that needs them says `pass_consul_token: true`). The
    credential file itself stays in $CREDENTIALS_DIRECTORY, readable by the unit's user: docs/commands/run.md
    says so."""
    env = dict(os.environ)
    for name in ("CONSULRUN_TEST_PAUSE", "CONSULRUN_TEST_HOOK_DIR", "CONSULRUN_TEST_FAIL",
                 *(() if pass_consul_token else CREDENTIAL_VARIABLES)):
        env.pop(name, None)
    env.update({"CONSULRUN_JOB": spec.job, "CONSULRUN_NODE": node, "CONSULRUN_SESSION": held.session,
                "CONSULRUN_LOCK_KEY": held.key,
                "CONSULRUN_FENCING_TOKEN": str(held.fencing_token), "CONSULRUN_ATTEMPT": str(attempt),
                "CONSULRUN_TAKEOVER": "1" if claim and claim.get("takeover") else "0"})
    if claim and claim.get("manual"):
        env["CONSULRUN_MANUAL"] = str(claim.get("requested_by"))
    elif claim and claim.get("after"):
        parent = claim["after"]
        env.update({"CONSULRUN_OCCURRENCE": str(claim["run"]), "CONSULRUN_PARENT_JOB": str(parent.get("job")),
                    "CONSULRUN_PARENT_OCCURRENCE": str(parent.get("run")),
                    "CONSULRUN_PARENT_STATE": str(parent.get("state")),
                    "CONSULRUN_PARENT_EXIT_STATUS": "" if parent.get("exit_status") is None
                    else str(parent.get("exit_status"))})
    elif claim:
        env["CONSULRUN_OCCURRENCE"] = str(claim["occurrence"])
    return env


def _start_retry_budget(request: RunRequest) -> float:
    """Transient answers at start are retried this long: START_RETRY_S, and at most half the occurrence's span."""
    if not request.schedules:
        return START_RETRY_S
    from consulrun.protocol import occurrence

    occ = occurrence.current(list(request.schedules), datetime.now(timezone.utc))
    if occ is None or occ.next_when is None:
        return START_RETRY_S
    return max(0.0, min(START_RETRY_S, (occ.next_when - datetime.now(timezone.utc)).total_seconds() / 2))


def _not_ready_yet(exc: ConsulUnavailable) -> str:
    """Why `exc` at start may be Consul not ready yet rather than an outage ('' if it is an outage): servers
    electing a leader or an agent that has just started (its node not yet registered) answer so, and nothing
    listens yet at the address of an agent still starting, which it can be only while the system boots."""
    if exc.transient and SERF_CRITICAL in str(exc):
        return "a node's own serfHealth is critical for a moment after it rejoins (a partition healed, its agent " \
            "restarted)"
    if exc.transient:  # an agent holds a request while its servers elect a leader: a read's timeout is one too
        return "an agent still starting or servers electing a leader answer so"
    if exc.not_listening:
        from consulrun.protocol.procinfo import system_age

        age = system_age()
        if age is not None and age < BOOTING_S:
            return f"the system booted {duration(age)} ago and its agent may still be starting"
    return ""


def run(request: RunRequest, config: ConsulConfig) -> int:
    """Run the job on this node if the lock is ours; return the process exit status."""
    spec = request.spec
    fencing = Fencing.for_lock_delay(spec.lock_delay_ms, spec.ttl_ms)
    if not shutil.which(request.command[0]):  # fail before touching the lock, not after taking it
        raise JobNotStarted(f"cannot start {request.command[0]}: not found or not executable")
    client = Client(config, label=spec.job)
    signals = _Signals(spec.job)
    locker = Locker(client, spec, shield=signals.shield, checkpoint=signals.checkpoint)
    try:
        held: Held | None = None
        try:
            held, ledger, claim, why = _acquire_with_retries(request, locker)
        except Interrupted as exc:
            log.info("%s: %s while waiting for the lock; not running", spec.job, signal.Signals(exc.signum).name)
            return request.skip_exit_code if request.skip_when_stopped else 128 + exc.signum
        finally:
            if held is None:
                signals.interruptible = False
                locker.abandon()
        if held is None:
            log.info("%s: skipped: %s", spec.job, printable(why))  # it quotes what others wrote in Consul
            return request.skip_exit_code
        signals.interruptible = False
        status = _run_held(request, locker, held, fencing, signals, ledger, claim)
        late = signals.unforwarded()
        return 128 + late[0] if late else status
    finally:
        signals.restore()


def _acquire_with_retries(request: RunRequest, locker: Locker) -> tuple[Held | None, occurrence.Ledger | None,
                                                                         dict[str, Any] | None, str]:
    """Acquire (and claim), retrying answers a leader election gives for a bounded time; then fail closed."""
    spec = request.spec
    give_up = clock() + _start_retry_budget(request)
    backoff = 0.25
    while True:
        try:
            refusal = locker.placement_refusal()  # one read of the local agent, no write
            if refusal:
                return None, None, None, refusal
            # systemd names the unit that started this one (a path or timer unit); `systemctl start` names none.
            by_timer = os.environ.get("TRIGGER_UNIT", "").endswith(".timer")
            if request.after and not (request.schedules and by_timer):  # chain-watch started it (or an operator)
                chained = _chained(request, locker)
                if chained is not None or not request.schedules:
                    return chained or (None, None, None, "no run after " + ", ".join(request.after) + " is pending")
            if not request.schedules:
                held, why = locker.acquire()
                return held, None, None, why
            from consulrun.protocol import occurrence

            occ = occurrence.current(list(request.schedules), datetime.now(timezone.utc))
            if occ is None:
                raise UsageError("the schedule has no occurrence at or before now; nothing to run")
            start_deadline_s = request.start_deadline_ms / 1000 if request.start_deadline_ms else None
            if request.each_node:
                from consulrun.protocol import eachnode

                ledger = eachnode.NodeLedger(locker.client, spec.base, locker.node_name(), spec.keys(),
                                             request.history)
                held, claim, why = eachnode.acquire(locker, ledger, occ, spec.wait_ms / 1000, start_deadline_s)
                return held, ledger, claim, why
            ledger = _ledger(request, locker)
            held, claim, why = occurrence.acquire(
                locker, ledger, occ, request.on_holder_loss, spec.wait_ms / 1000, by_timer=by_timer,
                start_deadline_s=start_deadline_s)
            return held, ledger, claim, why
        except ConsulUnavailable as exc:
            why = _not_ready_yet(exc)
            if not why or clock() >= give_up:
                raise
            if backoff == 0.25:  # one line: what is waited for, and how long at most
                log.warning("%s: Consul is not ready (%s); retrying for up to %s, as %s (exit 69 if it is not "
                            "ready by then)", spec.job, exc, duration(give_up - clock()), why)
            locker.abandon()
            time.sleep(min(backoff, max(0.0, give_up - clock())))  # the last look at the budget's end, not before
            backoff = min(backoff * 2, 4.0)


def _ledger(request: RunRequest, locker: Locker) -> occurrence.Ledger:
    from consulrun.protocol import occurrence

    return occurrence.Ledger(locker.client, request.spec.base, request.history,
                             health_prefix=request.spec.prefix if request.health_check else None,
                             thens=request.thens, policy=request.on_holder_loss)


def _chained(request: RunRequest, locker: Locker) -> tuple[Held | None, occurrence.Ledger | None,
                                                          dict[str, Any] | None, str] | None:
    """A pending run after one of the job's parents, claimed (chain.py); None if none is pending."""
    from consulrun.protocol import chain

    ledger = _ledger(request, locker)
    found = chain.acquire(locker, ledger, request.after,
                          request.start_deadline_ms / 1000 if request.start_deadline_ms else None)
    if found is None:
        return None
    held, claim, why = found
    return held, ledger, claim, why


def _run_held(request: RunRequest, locker: Locker, held: Held, fencing: Fencing, signals: _Signals,
              ledger: occurrence.Ledger | None, claim: dict[str, Any] | None) -> int:
    spec = request.spec
    which = ""
    if claim and claim.get("manual"):
        which = f" for a manual run asked for by {claim.get('requested_by')}"
    elif claim and claim.get("after"):
        which = f" for the run after {claim['after'].get('job')}'s {printable(claim['after'].get('run'))}"
    elif claim:
        which = f" for occurrence {claim['occurrence']}" + (", taking over from a dead runner" if claim["takeover"] else "")
    # The node is Consul's name for it (on-failure reads it from this line: it can differ from the host name).
    log.info("%s: acquired %s%s (node %s, session %s, fencing token %d)", spec.job, held.key, which,
             printable(locker.node_name()), held.session, held.fencing_token)
    watcher = Watcher(locker.client, spec, held, fencing)
    job: Job | None = None
    before: tuple[Any, ...] | None = None
    outcome: dict[str, Any] = {}
    status: int = ExitCode.SOFTWARE
    from consulrun.protocol.notify import Pings

    pings = Pings(request.ping_url, spec.job, rid=held.session, output_lines=request.ping_output_lines)
    try:
        testhook.pause("acquired", lambda: bool(signals.received))
        if signals.received:
            signum = signals.received[0]
            log.info("%s: %s after acquiring the lock; the job is not started", spec.job, signal.Signals(signum).name)
            outcome = {"lost": f"{signal.Signals(signum).name} before the job started", NOT_STARTED: True}
            return 128 + signum
        from consulrun.protocol.child import Job, become_subreaper

        become_subreaper()
        # The attempt's number is the record's (a takeover's goes on from the attempts recorded before it).
        attempt, before = int((claim or {}).get("attempt") or 1), None  # before: the previous attempt's
        # (claim, outcome, status), while retrying
        if request.attempts > 1:
            from consulrun.protocol import retries

            policy = retries.RetryPolicy(request.attempts, request.retry_backoff_ms, request.retry_max_backoff_ms)
            due = retries.next_due(request.schedules, claim)
        while True:
            if before is not None:
                testhook.pause("retry")
                try:  # as before the first: a job never starts after another node could have taken over
                    _confirm_before_start(locker, held, watcher, fencing, since=watcher.last_confirmed)
                except NotConfirmed as exc:
                    claim, outcome, status = before
                    outcome = {**outcome, "retries_ended": f"the lock could not be confirmed: {exc}"}
                    log.error("%s: the lock cannot be confirmed before attempt %d (%s); no further attempt: the "
                              "last attempt's exit status %d stands", spec.job, attempt, exc, status)
                    return status
            else:
                _confirm_before_start(locker, held, watcher, fencing)
            # From the last look at the signals to the fork, a signal waits (blocked), then reaches the job.
            signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
            try:
                if signals.received and before is not None:
                    claim, outcome, status = before
                    name = signal.Signals(signals.received[-1]).name
                    outcome = {**outcome, "retries_ended": f"{name} before attempt {attempt}"}
                    log.info("%s: %s before attempt %d started; no further attempt: the last attempt's exit "
                             "status %d stands", spec.job, name, attempt, status)
                    signals.settle()
                    return status
                if signals.received:
                    signum = signals.received[0]
                    log.info("%s: %s before the job started; the job is not started", spec.job,
                             signal.Signals(signum).name)
                    outcome = {"lost": f"{signal.Signals(signum).name} before the job started", NOT_STARTED: True}
                    return 128 + signum
                env = _job_environment(held, spec, claim, request.pass_consul_token, attempt, locker.node_name())
                job = Job(list(request.command), env)  # no other thread while forking
                signals.job = job
                limit = None if not request.timeout_ms else \
                    JobTimeout(spec.job, request.timeout_ms / 1000, stop_grace_s(spec.lock_delay_ms), clock())
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
            signals.forward_pending()
            started = _now()
            if before is None:
                watcher.start()  # if it cannot start, the except below kills the job before anything is released
                pings.start()  # once per run: monitors see the run, not its attempts
            testhook.pause("started")
            testhook.fail("started")
            status, lost = _supervise(job, watcher, fencing, signals, spec.job, limit)
            if not lost and job.alive():
                # A wrapper waking late must not give leftovers a grace period it no longer has.
                grace = min(fencing.grace_s, watcher.last_confirmed + fencing.kill_by_s - clock())
                log.warning("%s: the job exited but left processes behind; stopping them", spec.job)
                job.kill_all(grace, now=clock)
            # A stop that reached the job, or killed it (systemd's stop signals the whole cgroup), may be no result
            # (stops.py); one that came while leftovers were stopped, after the job exited, leaves its status.
            # systemd stops a unit with SIGTERM (KillSignal=, consulrun's), at shutdown too: a SIGHUP or SIGINT
            # the job outlived (`systemctl kill -s HUP`) is no stop, and a run that then ends by itself is done.
            if not lost and not (limit and limit.expired) and \
                    (signals.reached_job(signal.SIGTERM) or status == 128 + signal.SIGTERM):
                # systemd is given half of what the stop leaves for recording the result (_close's budget),
                # counted from its SIGTERM, as its TimeoutStopSec= is.
                asked_by = (signals.first_term_at or clock()) + (fencing.kill_by_s - fencing.grace_s) / 2
                lost = _stopped_not_a_result(spec.job, status, asked_by - clock())
            outcome = {"exit_status": status, "ended": _now(), **({"lost": lost} if lost else {}),
                       **({"timed_out": True} if limit and limit.expired else {}),
                       **({"started": started} if before is not None else {})}
            if not lost:
                log.info("%s: job exited with status %d", spec.job, status)
            if request.attempts <= 1 or job.alive():
                return status
            seen, cut = len(signals.received), []

            def backoff_ended() -> str | None:
                why = _backoff_ended(signals, seen, watcher)
                if why:
                    cut.append(why)
                return why

            nxt, held, ended = retries.between(
                policy, locker, ledger, held, claim, outcome, attempt, stopped=bool(signals.received),
                due=due, ended=backoff_ended, sleep=lambda s: _nap(signals, watcher, s))
            if ended is not None:
                if ended:
                    outcome = {**outcome, "retries_ended": ended}
                if cut:  # a stop during the backoff ended the retries: the last attempt's status stands
                    signals.settle()
                return status
            before, claim, attempt = (claim, outcome, status), nxt, attempt + 1
    except NotConfirmed as exc:
        outcome = {"lost": str(exc), NOT_STARTED: True}
        log.error("%s: lock lost before the job started: %s; the job is not started", spec.job, exc)
        return ExitCode.LOCK_LOST
    except JobNotStarted as exc:
        status = exc.exit_code
        log.error("%s: %s", spec.job, exc.message)
        if before is None:
            outcome = {"lost": str(exc), NOT_STARTED: True}
            return status
        # The job ran before: a retry that cannot start is a failed attempt, and the last (the run is done,
        # and a chained run's request is spent: it never comes back).
        outcome = {"exit_status": status, "started": None, "ended": _now(), "not_started": exc.message,
                   "retries_ended": f"attempt {attempt} could not be started"}
        log.warning("%s: attempt %d could not be started; no further attempt: its exit status %d stands",
                    spec.job, attempt, status)
        return status
    except Exception as exc:  # noqa: BLE001 - after the fork nothing may escape before the job is dead
        log.error("%s: consulrun failed after taking the lock (%s: %s); stopping the job", spec.job,
                  type(exc).__name__, exc)
        outcome = {"lost": f"consulrun failed: {type(exc).__name__}: {exc}"}
        return ExitCode.SOFTWARE
    finally:
        watcher.stop()
        if _job_gone(job, spec.job):
            testhook.pause("releasing")
            # Stopping (systemctl stop) leaves TimeoutStopSec=: after a termination signal, retry only briefly.
            _close(locker, held, ledger, claim, outcome, stopping=lambda: signals.first_term_at,
                   stop_budget_s=fencing.kill_by_s - fencing.grace_s, stop_end_s=fencing.kill_by_s,
                   check=_health_check(request) if ledger is None else None)
        else:
            locker.session = None  # never destroy it: the lock must outlive the job's processes
        pings.finish(outcome)  # last: a slow monitor never delays killing the job or releasing the lock


def _stopped_not_a_result(name: str, status: int, within_s: float) -> str | None:
    """After a stop that reached the job: why it is not the run's result (then the run is recorded lost, and a
    `retry` occurrence goes to another node), or None if it is (stops.py says which are); systemd is asked for
    at most `within_s`."""
    from consulrun.protocol.stops import not_a_result

    why = not_a_result(name, within_s=within_s)
    if why:
        log.warning("%s: the job was stopped (status %d): %s; this is not its result: the run is recorded lost, "
                    "not done", name, status, why)
    return why


class NotConfirmed(Exception):
    """The lock could not be confirmed right before the job would start."""


def _confirm_before_start(locker: Locker, held: Held, watcher: Watcher, fencing: Fencing,
                          since: float | None = None) -> None:
    """Confirm the lock with a consistent read just before the fork, and start nothing if it is not ours.

    The wrapper may have been stopped or starved between acquiring and
    starting (the Jepsen lesson: re-check the lease after waiting); a job must
    never *start* after another node could have taken over. A retry counts
    from the watcher's last confirmation (`since`).
    """
    deadline = (held.confirmed_at if since is None else since) + fencing.fence_after_s
    while True:
        sent = clock()
        if sent >= deadline:
            raise NotConfirmed(f"no confirmation within {duration(fencing.fence_after_s)} of the acquisition")
        try:
            _, entry = locker.client.kv_get(held.key, consistent=True)
            break
        except ConsulUnavailable as exc:  # unknown is not lost: ask again until the fencing deadline
            log.warning("%s: cannot confirm the lock before starting the job (%s); asking again", locker.spec.job,
                        exc)
            time.sleep(min(0.5, max(0.0, deadline - clock())))
        except ConsulrunError as exc:
            raise NotConfirmed(f"cannot confirm it: {exc}") from None
    if not entry or entry.get("Session") != held.session:
        raise NotConfirmed("the key is no longer held by this node's session")
    if clock() - sent > fencing.fence_after_s:
        raise NotConfirmed(f"the confirmation took {duration(clock() - sent)}, past the fencing deadline")
    watcher.last_confirmed = sent


def _job_gone(job: Job | None, name: str) -> bool:
    """Make sure no process of the job is left (SIGKILL); False if that could not be made sure."""
    if job is None:
        return True
    try:
        if job.alive():
            job.kill_all(0)
        return True
    except Exception as exc:  # noqa: BLE001 - cannot prove the job dead: keep the lock, let Consul expire it
        log.error("%s: cannot make sure the job's processes are gone (%s); not releasing the lock: its session "
                  "ends by TTL and lock-delay applies", name, exc)
        return False


def stop_grace_s(lock_delay_ms: int) -> float:
    """SIGTERM-to-SIGKILL after the job's own timeout: the unit's TimeoutStopSec=, what systemd gave it before."""
    return stop_timeout_ms(lock_delay_ms) / 1000


def _health_check(request: RunRequest) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """For a run without --schedule: the check operation its release carries (with it, the ledger's own)."""
    if not request.health_check:
        return None
    spec = request.spec
    from consulrun.protocol.health import finish_op

    return lambda last: finish_op(spec.prefix, spec.job, last)


STOP_END_MARGIN_S = 0.25  # a stopping wrapper's last request ends this long before systemd's SIGKILL


def _close(locker: Locker, held: Held, ledger: occurrence.Ledger | None, claim: dict[str, Any] | None,
           outcome: dict[str, Any], stopping: Callable[[], float | None] = lambda: None,
           stop_budget_s: float = 0.0, stop_end_s: float | None = None,
           check: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Record the outcome and release, retrying transient failures for a bounded time; destroy the session.

    Being stopped (systemd's SIGTERM at `stopping()`), it retries for `stop_budget_s` from that signal, and no
    request waits past `stop_end_s` from it, less STOP_END_MARGIN_S: there systemd's SIGKILL comes (the
    unit's TimeoutStopSec=), and a wrapper that gives up first says so and destroys what it can.

    A completed run that could not be recorded would be re-run by a `retry`
    standby, so one failed write (a leader election, a restarting agent) is not
    the end, and the session is kept alive meanwhile. If the lock is no longer
    ours, the result is still recorded with a check-and-set on the record as
    our claim left it: it lands unless another node has taken the occurrence
    over. A refusal that retrying cannot cure (ACLs) is one line; the job's
    own status stands.
    """
    job = locker.spec.job
    give_up = clock() + FINISH_RETRY_S
    shortened = False
    backoff = 0.25
    while True:
        signalled_at = stopping()
        if signalled_at is not None and not shortened:  # being stopped: only what is left of the stop timeout
            give_up, shortened = min(give_up, signalled_at + stop_budget_s), True
            if stop_end_s is not None:
                locker.client.end_by(signalled_at + stop_end_s - STOP_END_MARGIN_S - clock())
        try:
            locker.keep_alive()
            if _record_and_release(locker, held, ledger, claim, outcome, check):
                log.info("%s: released %s", job, held.key)
            break
        except ConsulUnavailable as exc:
            if clock() + backoff > give_up:
                log.warning("%s: could not record the result or release %s (%s); the session's invalidation "
                            "will free it", job, held.key, exc)
                break
            if backoff == 0.25:
                log.warning("%s: Consul cannot record the result yet (%s); retrying for up to %s", job, exc,
                            duration(give_up - clock()))
            time.sleep(backoff)
            # At most a second apart: once the agent is back, the result must land before a standby's takeover,
            # which lock-delay holds back only so long.
            backoff = min(backoff * 2, 1.0)
        except ConsulrunError as exc:
            log.warning("%s: could not record the result or release %s (%s); the session's invalidation will "
                        "free it", job, held.key, exc.message)
            break
    locker.abandon()


def _record_and_release(locker: Locker, held: Held, ledger: occurrence.Ledger | None,
                        claim: dict[str, Any] | None, outcome: dict[str, Any],
                        check: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> bool:
    """One attempt; True if the lock was released by it (or by an earlier attempt whose answer was lost)."""
    not_started = bool(outcome.get(NOT_STARTED))
    outcome = {k: v for k, v in outcome.items() if k != NOT_STARTED}  # a mark for here, never recorded
    if not (ledger and claim):
        return _finish_plain(locker, held, outcome, check)
    if claim.get("manual") or claim.get("after"):
        return _finish_unscheduled(locker, held, ledger, claim, outcome, not_started)
    return _finish_occurrence(locker, held, ledger, claim, outcome)


def _finish_plain(locker: Locker, held: Held, outcome: dict[str, Any],
                  check: Callable[[dict[str, Any]], dict[str, Any]] | None) -> bool:
    """A run without --schedule: the lock key's value is its only record."""
    job = locker.spec.job
    if locker.release(held, outcome, check=check) or locker.released_by_us(held):
        return True  # (or an earlier attempt went through and its answer was lost)
    # Fenced (a forced unlock, the session invalidated): the key's value is this run's only record.
    end = outcome or {"lost": "consulrun stopped before the job ended"}
    if locker.record_end(held.key, held.session, end, over_abandoned=True, check=check):
        log.warning("%s: the lock was no longer ours when the job ended; the result is recorded (%s)", job,
                    "lost" if end.get("lost") else f"exit status {end.get('exit_status')}")
    else:
        log.warning("%s: the lock was no longer ours when the job ended and is held again or its run's end "
                    "recorded; this run's result is not recorded", job)
    return False


def _finish_unscheduled(locker: Locker, held: Held, ledger: occurrence.Ledger, claim: dict[str, Any],
                        outcome: dict[str, Any], not_started: bool) -> bool:
    """A manual or chained run: no occurrence, its history entry is all it records."""
    if claim.get("after") and not_started:
        # A chained run claimed but never started (a stop, a lost lock, its command missing) gives its request
        # back, so a node runs it: no history entry, and no run chained after it.
        ops = ledger.requeue_ops(claim)
    else:
        state = "lost" if outcome.get("lost") or not outcome else "done"
        result = {"reason": outcome["lost"]} if outcome.get("lost") else outcome
        ops = ledger.manual_finish_ops(claim, result, state)
    if locker.release(held, outcome, ops):
        return True
    locker.client.txn(ops)
    return False


def _finish_occurrence(locker: Locker, held: Held, ledger: occurrence.Ledger, claim: dict[str, Any],
                       outcome: dict[str, Any]) -> bool:
    """A scheduled occurrence: its record check-and-set on the index our claim (or our last write) left it
    at, with the release; if the lock is gone, over the record as we left it, unless another node took the
    occurrence over."""
    job = locker.spec.job
    failed = bool(outcome.get("lost")) or not outcome
    reason = outcome.get("lost") or "consulrun stopped before the job ended"

    def ops_at(index: int, chain: bool = True) -> list[dict[str, Any]]:
        if failed:
            return ledger.failed_ops({**claim, **outcome}, index, "lost", reason, chain=chain)
        return ledger.finish_ops(claim, outcome, index, chain=chain)

    if locker.release(held, outcome, ops_at(ledger.record_index_after_claim(held))):
        return True
    snap = ledger.snapshot(consistent=True)
    record = snap.record or {}
    # Ours: our session's record of this occurrence, whichever attempt it names (a retry's record, written
    # before its backoff was cut short, names the next one). Only our session writes its id into the record.
    this_attempt = (record.get("occurrence"), record.get("session")) == (claim["occurrence"], held.session)
    if snap.holder_session == held.session:
        if not this_attempt:  # the record moved while we held the lock: never expected; free the lock anyway
            log.warning("%s: the occurrence record changed while this node held the lock; result not "
                        "recorded", job)
            return locker.release(held, outcome)
        return locker.release(held, outcome, ops_at(snap.record_index))  # it moved by a write of ours
    same_end = record.get("state") == ("lost" if failed else "done") and \
        record.get("exit_status") == outcome.get("exit_status") and \
        (not failed or record.get("reason") == reason)
    if this_attempt and same_end:
        return True  # an earlier attempt of this finish went through; its answer was lost
    if this_attempt and record.get("state") in ("running", "abandoned"):
        # The lock is gone (our session ended) but nobody took the occurrence over: record what really
        # happened, also over another node's "abandoned" guess. That guess, if final (not under `retry`, where
        # a standby may still run it), already asked for the runs chained after it: one parent end asks once.
        chain = record.get("state") != "abandoned" or ledger.policy == "retry"
        if locker.client.txn(ops_at(snap.record_index, chain), optional_checks=True) is not None:
            log.warning("%s: the lock was no longer ours when the job ended; the result is recorded (%s)", job,
                        "lost" if failed else f"exit status {outcome.get('exit_status')}")
            return False
    log.warning("%s: occurrence %s was taken over meanwhile; this run's result is not recorded", job,
                claim["occurrence"])
    return False
