"""The job and every process it makes: start it, signal it, and kill all of it.

`consul lock` kills only its direct child, so a shell's grandchildren outlive a
lost lock. Here the job leads its own process group and dies with the wrapper
(parent-death signal), and the wrapper is a child subreaper: a descendant that
leaves the group (`setsid`, a daemonising double fork) is re-parented to the
wrapper, not to init. So "every descendant of the wrapper" is exactly the
job's processes, found by walking the parent links in /proc, and "all of it is
gone" is something the wrapper checks, not assumes.

Nothing here needs `pidfd_open` (Linux 5.3): the wrapper learns of exits from
SIGCHLD through the signal wake-up pipe (see runner.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

from consulrun.errors import JobNotStarted
from consulrun.timefmt import duration

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init; without it nothing starts."""
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed: a daemonising job process "
                                          "could escape the wrapper")


def _in_child(parent: int) -> None:
    # The wrapper blocks termination signals across the fork (so none is lost between its last look and the
    # job's existence); the job starts with them unblocked.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
    os.setpgid(0, 0)
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the wrapper died before the death signal was armed
        os._exit(128 + signal.SIGKILL)


def live_processes() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, the fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ...) of every live,
    not zombie, process this process may see."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        if fields[0] != b"Z":
            yield int(name), fields


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process, read from /proc/*/stat."""
    return {pid: int(fields[1]) for pid, fields in live_processes()}


def _has_children() -> bool:
    """Whether this process has any child, living or exited, whatever /proc shows."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def descendants(root: int | None = None, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Live descendants of `root` (default: this process), children before grandchildren.

    Children of `root` in `exclude` are left out with their whole subtrees.
    """
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    queue = [pid for pid in children.get(root, []) if pid not in exclude]
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


KILL_TIMEOUT_S = 10.0


class JobUnkillable(Exception):
    """Some process of the job outlives SIGKILL: the lock must not be released."""


class Job:
    """A started job: its process group id is its pid; every other descendant of the wrapper is its too."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        parent = os.getpid()
        # Children the wrapper had before the job (none when it runs as `consulrun run`; a host process
        # embedding it may have some) are not the job's.
        self._foreign = frozenset(descendants())
        try:
            self.process = subprocess.Popen(argv, env=env, preexec_fn=lambda: _in_child(parent),  # noqa: PLW1509
                                            close_fds=True)
        except OSError as exc:
            raise JobNotStarted(f"cannot start {argv[0]}: {exc.strerror}") from None
        self.pgid = self.process.pid
        self.status: int | None = None

    def reap(self) -> None:
        """Collect every exited child (the job and adopted orphans), keeping the job's own status."""
        while True:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            if pid == self.pgid:
                self.status = os.waitstatus_to_exitcode(raw)
                self.process.returncode = self.status

    def poll(self) -> int | None:
        """The job's exit status in shell convention (128+N for a signal), or None while it runs."""
        self.reap()
        if self.status is None:
            return None
        return 128 - self.status if self.status < 0 else self.status

    def signal(self, signum: int) -> None:
        """Send `signum` once to every process of the job: its group, and each descendant that left the group."""
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.processes():
            try:
                if os.getpgid(pid) != self.pgid:
                    os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def processes(self) -> list[int]:
        """Every live process of the job: the wrapper's descendants, less those that predate the job."""
        return descendants(exclude=self._foreign)

    def alive(self) -> bool:
        """True while any process of the job exists (exited ones are reaped first).

        /proc may hide some (hidepid=2 hides a non-dumpable process even from its own user), so when it shows
        none the kernel is asked whether this subreaper still has a child at all.
        """
        self.reap()
        return bool(self.processes()) or (not self._foreign and _has_children())

    def kill_all(self, grace_s: float, now: Callable[[], float] = time.monotonic) -> None:
        """SIGTERM every process of the job, SIGKILL whatever is left after `grace_s` (at once if <= 0).

        Returns only when none is left: the caller releases the lock after this.
        """
        if grace_s > 0:
            self.signal(signal.SIGTERM)
            deadline = now() + grace_s
            while now() < deadline:
                if not self.alive():
                    return
                time.sleep(0.02)
        unkillable_by = now() + KILL_TIMEOUT_S
        while self.alive():
            if now() > unkillable_by:  # a process in uninterruptible sleep, or one we may not signal
                seen = ", ".join(map(str, self.processes())) or "that /proc does not show (hidepid?)"
                raise JobUnkillable(f"process(es) {seen} of the job survive SIGKILL after {duration(KILL_TIMEOUT_S)}")
            self.signal(signal.SIGKILL)
            time.sleep(0.01)
