"""Exit statuses and the one exception hierarchy every failure maps onto.

The numbers are part of the interface: units list the skip code in
`SuccessExitStatus=`, and monitoring reads the others.  They follow sysexits(3)
where a meaning matches, so they stay clear of the small codes jobs use.
"""

from __future__ import annotations

import enum
import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import IO


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1  # a job-independent failure that has no more specific code
    USAGE = 2  # bad command line or manifest (click uses 2 for usage errors too)
    MALFORMED = 65  # EX_DATAERR: a value in Consul is malformed (or impossible, e.g. a record in the future)
    CONSUL_UNAVAILABLE = 69  # EX_UNAVAILABLE: agent or servers not reachable; job not started
    SOFTWARE = 70  # EX_SOFTWARE: Consul answered something we cannot make sense of
    IO = 74  # EX_IOERR: writing output failed
    LOCK_LOST = 75  # EX_TEMPFAIL: the lock was lost while the job ran; job killed
    PERMISSION = 77  # EX_NOPERM: ACL token lacks a permission; job not started
    JOB_NOT_STARTED = 127  # as a shell says: the job's command could not be executed


class ConsulrunError(Exception):
    """Base of every error consulrun reports: `Error: <message>` on stderr, then exit with `exit_code`.

    Not a click exception: `run` reports these without importing click (see
    consulrun/commands/runargs.py), and the command group reports them the same way.
    """

    exit_code = ExitCode.FAILURE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def format_message(self) -> str:
        return self.message

    def show(self, file: IO[str] | None = None) -> None:
        print(f"Error: {self.format_message()}", file=file or sys.stderr, flush=True)


class UsageError(ConsulrunError):
    exit_code = ExitCode.USAGE


class ManifestError(UsageError):
    """One or more problems in a manifest; every problem is reported at once."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))

    def format_message(self) -> str:
        return "\n".join(self.problems)

    def show(self, file: IO[str] | None = None) -> None:
        for line in self.problems:
            print(f"Error: {line}", file=file or sys.stderr, flush=True)


class ConsulUnavailable(ConsulrunError):
    """Consul could not serve a request. `transient`: the servers answered that they cannot yet
    (no leader, an RPC error, a 5xx, a node not yet registered), or the agent did not answer a read in time (it
    holds a request while the servers elect a leader), which a leader election or an agent that has just started
    causes, and which is worth retrying. `not_listening`: nothing listens at the agent's address
    (refused, no socket): an agent still starting if the system has just booted, else an agent that is down."""

    exit_code = ExitCode.CONSUL_UNAVAILABLE

    def __init__(self, message: str, transient: bool = False, not_listening: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
        self.not_listening = not_listening


class ConsulProtocolError(ConsulrunError):
    exit_code = ExitCode.SOFTWARE


class MalformedValue(ConsulrunError):
    """A value read from Consul is not what consulrun writes there (anyone with KV write may have written it)."""

    exit_code = ExitCode.MALFORMED

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key


class PermissionDenied(ConsulrunError):
    """Consul's ACLs refused a request. The line an operator reads says which policy to give:
    the one printed with the manifest, since `acl-policy` without it leaves out what the
    manifest's features (health_checks, bound checks) need."""

    exit_code = ExitCode.PERMISSION
    HINT = ("; give the token the policy `consulrun acl-policy MANIFEST --node NODE` prints (with "
            "the manifest, for its features' rules; --operator instead of --node for status, "
            "history and the other operator commands)")

    def show(self, file: IO[str] | None = None) -> None:
        print(f"Error: {self.format_message()}{self.HINT}", file=file or sys.stderr, flush=True)


class OutputError(ConsulrunError):
    exit_code = ExitCode.IO

    def show(self, file: IO[str] | None = None) -> None:
        try:
            super().show(file)
        except OSError:  # stderr is gone too (`2>&1 | head`): the exit status still says it
            pass


class JobNotStarted(ConsulrunError):
    exit_code = ExitCode.JOB_NOT_STARTED


_REASONS = {errno.ENOENT: "no such file", errno.EISDIR: "is a directory", errno.ENOTDIR: "not a directory",
            errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.ENOSPC: "no space left on device",
            errno.EROFS: "read-only file system", errno.EPIPE: "broken pipe", errno.EIO: "input/output error"}


def os_reason(exc: OSError) -> str:
    """A short, lower-case reason for an OS error (`no such file`), without Python's `[Errno 2] ...: 'x'`."""
    return _REASONS.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()


class BrokenPipe(OutputError):
    """Standard output's reader went away (`| head -1`): exit 74 without a word, as there is no one to read it."""

    def __init__(self) -> None:
        super().__init__("broken pipe")

    def show(self, file: IO[str] | None = None) -> None:
        pass


# Errors writing standard output: a full disk (`> /dev/full`), a closed pipe (`| head -1`), a dead terminal.
_OUTPUT_ERRNOS = {errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG}


@contextmanager
def output_guard() -> Iterator[None]:
    """Turn a failed write to stdout into exit 74 with one line (none for a closed pipe), never a traceback."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _OUTPUT_ERRNOS:
            raise
        try:  # what is still buffered would fail again when Python flushes at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
        if exc.errno == errno.EPIPE:
            raise BrokenPipe() from None
        raise OutputError(f"writing output failed: {os_reason(exc)}") from None
