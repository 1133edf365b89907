"""The job as a process group: start it, forward signals to it, and kill all of it.

`consul lock` kills only its direct child, so a shell's grandchildren outlive a
lost lock. Here the job leads its own process group, dies with the wrapper
(parent-death signal), and the wrapper is a child subreaper, so orphaned
grandchildren come back to it and can be reaped: "the group is gone" is
something the wrapper can check, not assume.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time

from consulrun.errors import JobNotStarted

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _in_child(parent: int) -> None:
    os.setpgid(0, 0)
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the wrapper died before the death signal was armed
        os._exit(128 + signal.SIGKILL)


class Job:
    """A started job: its process group id is its pid."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        parent = os.getpid()
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
        try:
            os.killpg(self.pgid, signum)
        except ProcessLookupError:
            pass

    def group_alive(self) -> bool:
        """True while any process of the job's group exists (exited ones are reaped first)."""
        self.reap()
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def kill_group(self, grace_s: float) -> None:
        """SIGTERM the whole group, SIGKILL whatever is left after `grace_s`; return when none is left."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not self.group_alive():
                return
            time.sleep(0.02)
        while self.group_alive():
            self.signal(signal.SIGKILL)
            time.sleep(0.01)
