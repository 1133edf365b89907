"""Emulated systemd timers: on every client node, for every job, `consulrun run --schedule` per occurrence.

Each (node, job) timer fires at every scheduled time of the job's spec plus a
random delay (RandomizedDelaySec=), read on the node's own clock (which the
nemesis may skew), and starts the wrapper inside the node's network namespace
against the node's agent. As systemd does for a oneshot service still
running, a timer that fires while its previous wrapper lives starts nothing.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from consulrun.manifest import calendar
from consulrun.protocol.child import live_processes

from bench.chaos.logs import AppendLog
from bench.procs import descendants
from tests.harness.agents import Agent

JOB_SCRIPT = Path(__file__).resolve().with_name("job.py")
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


RETRY_BACKOFF_S = 1.0  # a retries job's backoff (`--retry-backoff`)
FAIL_RATE = 0.5  # how often a retries job's run exits 3


@dataclass(frozen=True)
class JobSpec:
    name: str
    policy: str  # skip | retry | eachN (mode: each-node, lock.concurrency N, on_holder_loss skip)
    schedule: str  # OnCalendar= spec ("" for a job that only runs after another)
    seconds: float  # how long the job runs
    after: str = ""  # the job this one runs after (on: success), started by an emulated chain-watch
    attempts: int = 1  # retries.attempts (`POLICY+aN`): the job then fails half its runs, so retries happen

    @property
    def each_node(self) -> int:
        """N of an `eachN` job (every node once, N at a time); 0 for a once-per-cluster job."""
        return int(self.policy[4:]) if self.policy.startswith("each") else 0

    def interval_s(self) -> float:
        if not self.schedule:
            return 0.0
        first = calendar.following([self.schedule], datetime(2030, 1, 1, tzinfo=timezone.utc))
        second = calendar.following([self.schedule], first)
        return (second - first).total_seconds()


@dataclass(frozen=True)
class LockSettings:
    ttl_s: int = 10
    lock_delay_s: int = 5
    prefix: str = "chaos"
    max_delay_s: float = 2.0  # RandomizedDelaySec=


@dataclass
class Wrapper:
    node: str
    job: str
    sched: str
    process: subprocess.Popen[bytes]
    started: float
    stderr: Path


def _in_session(sid: int) -> list[int]:
    """Live processes of session `sid` (a wrapper started with start_new_session leads its own)."""
    return [pid for pid, fields in live_processes() if int(fields[3]) == sid]


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def status_of(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Fleet:
    """Every wrapper the timers started: which run now, on which node, and their end."""

    def __init__(self, clients: list[Agent], jobs: list[JobSpec], lock: LockSettings, history: AppendLog,
                 out: Path, seed: int) -> None:
        self.clients = clients
        self.jobs = jobs
        self.lock = lock
        self.history = history
        self.stderr_dir = out / "wrappers"
        self.stderr_dir.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(seed)
        self.skews: dict[str, float] = {}
        self.running: dict[tuple[str, str], Wrapper] = {}
        self.every: list[subprocess.Popen[bytes]] = []
        self.guard = threading.Lock()
        self.stop_event = threading.Event()
        self.fire_until = 0.0
        self.threads: list[threading.Thread] = []

    # --- what the nemesis reads and sets

    def skew(self, node: str) -> float:
        return self.skews.get(node, 0.0)

    def set_skew(self, node: str, seconds: float) -> None:
        self.skews[node] = seconds

    def holders(self, job: str | None = None) -> list[Wrapper]:
        """Wrappers whose job is running now (they have a child)."""
        with self.guard:
            live = [w for w in self.running.values() if w.process.poll() is None and job in (None, w.job)]
        return [w for w in live if descendants(w.process.pid)]

    def fresh_holder(self, job: str, timeout: float, stop: threading.Event) -> Wrapper | None:
        """The first wrapper of `job` whose job starts within `timeout` (seen within 0.1 s of its start)."""
        before = {w.process.pid for w in self.holders(job)}
        deadline = time.time() + timeout
        while time.time() < deadline and not stop.is_set():
            fresh = [w for w in self.holders(job) if w.process.pid not in before]
            if fresh:
                return fresh[0]
            before |= {w.process.pid for w in self.holders(job)}
            stop.wait(0.1)
        return None

    # --- timers

    def start(self, fire_until: float) -> None:
        self.fire_until = fire_until
        for agent in self.clients:
            for job in self.jobs:
                target, extra = (self._watcher, ()) if job.after else (self._timer, (self.rng.random(),))
                self.threads.append(threading.Thread(target=target, args=(agent, job, *extra),
                                                     name=f"timer-{agent.name}-{job.name}", daemon=True))
        self.threads.append(threading.Thread(target=self._reaper, name="reaper", daemon=True))
        for thread in self.threads:
            thread.start()

    def _timer(self, agent: Agent, job: JobSpec, seed: float) -> None:
        rng = random.Random(seed)
        when = calendar.following([job.schedule], datetime.fromtimestamp(time.time() + 1, timezone.utc))
        while when is not None and when.timestamp() <= self.fire_until and not self.stop_event.is_set():
            delay = rng.uniform(0, self.lock.max_delay_s)
            while not self.stop_event.is_set():
                remaining = when.timestamp() + delay - (time.time() + self.skew(agent.name))
                if remaining <= 0:
                    break
                self.stop_event.wait(min(remaining, 0.05))
            if self.stop_event.is_set():
                return
            self._fire(agent, job, calendar.occurrence_id(when), delay)
            when = calendar.following([job.schedule], when)

    def _watcher(self, agent: Agent, job: JobSpec) -> None:
        """What `consulrun chain-watch` does on the node (chainwatch.py), its `systemctl start` a fire of the
        job's wrapper, waited for; it goes on through the drain, so the last parents' children run too."""
        from consulrun.consul.client import Client, ConsulConfig
        from consulrun.errors import ConsulrunError
        from consulrun.protocol.chainwatch import watch

        def start_unit(unit: str) -> subprocess.CompletedProcess[str]:
            self._fire(agent, job, "after", 0.0)
            with self.guard:
                wrapper = self.running.get((agent.name, job.name))
            code = wrapper.process.wait() if wrapper else 0
            return subprocess.CompletedProcess([unit], code, "", "")

        while not self.stop_event.is_set():
            try:
                watch(Client(ConsulConfig.from_env({}, address=agent.http_addr)), f"{self.lock.prefix}/{job.name}",
                      f"consulrun-{job.name}.service", start_unit, stop=self.stop_event.is_set)
            except (ConsulrunError, OSError):  # as systemd's Restart= would: watch again
                self.stop_event.wait(1.0)

    def _command(self, agent: Agent, job: JobSpec) -> list[str]:
        when = ["--after", job.after] if job.after else ["--schedule", job.schedule]
        then = [arg for child in self.jobs if child.after == job.name for arg in ("--then", f"{child.name}:success")]
        return ["ip", "netns", "exec", str(agent.netns), sys.executable, "-m", "consulrun", "run",
                "--prefix", self.lock.prefix, *when, *then,
                *(["--each-node", "--concurrency", str(job.each_node), "--on-holder-loss", "skip"] if job.each_node
                  else ["--on-holder-loss", job.policy]),
                *(["--attempts", str(job.attempts), "--retry-backoff", f"{RETRY_BACKOFF_S:g}s"] if job.attempts > 1
                  else []),
                "--ttl", f"{self.lock.ttl_s}s", "--lock-delay", f"{self.lock.lock_delay_s}s", job.name, "--",
                "/usr/bin/env", "-u", "LD_PRELOAD", "-u", "FAKETIME",
                sys.executable, "-S", str(JOB_SCRIPT), str(self.history.path), job.name, agent.name, str(job.seconds),
                *([str(FAIL_RATE)] if job.attempts > 1 else [])]

    def _environment(self, skew: float) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CONSUL_HTTP_ADDR": "127.0.0.1:8500",
               "PYTHONDONTWRITEBYTECODE": "1"}
        if skew:
            # Only the wrapper's clocks are offset, never the job's (the oracle's). The monotonic clock moves by
            # the same constant, which changes no interval; DONT_FAKE_MONOTONIC=1 would keep it, but with
            # libfaketime 0.9.10 it makes every nanosleep fail with EINVAL (time.sleep raises OSError).
            env.update({"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"{skew:+.3f}"})
        return env

    def _fire(self, agent: Agent, job: JobSpec, sched: str, delay: float) -> None:
        key = (agent.name, job.name)
        with self.guard:
            previous = self.running.get(key)
            if previous and previous.process.poll() is None:
                self.history.emit("busy", node=agent.name, job=job.name, sched=sched, wrapper=previous.process.pid)
                return
            skew = self.skew(agent.name)
            stderr = self.stderr_dir / f"{job.name}-{agent.name}-{sched.replace(':', '')}.log"
            with stderr.open("ab") as err:
                process = subprocess.Popen(self._command(agent, job), env=self._environment(skew),
                                           stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True)
            self.every.append(process)
            self.running[key] = Wrapper(agent.name, job.name, sched, process, time.time(), stderr)
            self.history.emit("fire", node=agent.name, job=job.name, sched=sched, delay=round(delay, 3),
                              skew=round(skew, 3), wrapper=process.pid)

    def _reaper(self) -> None:
        while not self.stop_event.is_set():
            self.reap()
            self.stop_event.wait(0.05)

    def reap(self) -> None:
        with self.guard:
            done = [(k, w) for k, w in self.running.items() if w.process.poll() is not None]
            for key, _ in done:
                del self.running[key]
        for _, wrapper in done:
            try:
                lines = [ln for ln in wrapper.stderr.read_text(errors="replace").splitlines() if ln.strip()]
            except OSError:
                lines = []
            self.history.emit("exit", node=wrapper.node, job=wrapper.job, sched=wrapper.sched,
                              wrapper=wrapper.process.pid, status=status_of(wrapper.process.returncode),
                              ran=round(time.time() - wrapper.started, 3), last=(lines[-1][:300] if lines else ""))
            if status_of(wrapper.process.returncode) != 0:
                thread = threading.Thread(target=self._stop_unit, args=(wrapper,), daemon=True)
                thread.start()
                self.threads.append(thread)

    def _stop_unit(self, wrapper: Wrapper) -> None:
        """What systemd does when a unit's run ends other than cleanly, as the generated units ask it to.

        KillMode=control-group: every process left in the unit (here: the wrapper's session) gets SIGTERM,
        then SIGKILL after TimeoutStopSec= (lock-delay - 1 s); then ExecStopPost= runs `consulrun reap`, which
        destroys a dead wrapper's session at once instead of leaving it to its TTL.
        """
        left = _in_session(wrapper.process.pid)
        signal_all(left, signal.SIGTERM)
        deadline = time.monotonic() + self.lock.lock_delay_s - 1
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = _in_session(wrapper.process.pid)
        signal_all(left, signal.SIGKILL)
        agent = next(a for a in self.clients if a.name == wrapper.node)
        cmd = ["ip", "netns", "exec", str(agent.netns), sys.executable, "-m", "consulrun", "reap", "--prefix",
               self.lock.prefix, wrapper.job]
        with wrapper.stderr.open("ab") as err:
            done = subprocess.run(cmd, env=self._environment(0.0), stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                  timeout=60, check=False)
        self.history.emit("stop-post", node=wrapper.node, job=wrapper.job, sched=wrapper.sched,
                          wrapper=wrapper.process.pid, status=done.returncode)

    def drain(self, timeout: float) -> bool:
        """Wait for every wrapper to end by itself; True if they all did within `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.reap()
            with self.guard:
                if not self.running:
                    return True
            time.sleep(0.1)
        return False

    def kill_all(self) -> None:
        """SIGKILL every wrapper and job still alive (woken first if stopped), and stop the timers."""
        self.stop_event.set()
        for process in self.every:
            if process.poll() is None:
                pids = [process.pid, *descendants(process.pid)]
                signal_all(pids, signal.SIGKILL)
                signal_all(pids, signal.SIGCONT)
        for process in self.every:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for thread in self.threads:
            thread.join(timeout=5)
        self.reap()
