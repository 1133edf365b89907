"""One notification per Consul outage, not one per timer tick.

A node whose agent is down fails every run of every job with exit 69 (Consul
unavailable), and each failure starts the job's on_failure handler: a job
every 10 s would page someone six times a minute about one outage. The
handler tells the first 69 of an outage and keeps quiet about the next ones
until the outage has ended, which is when a run of the job has reached Consul
again: it acquired the lock or skipped (a `consulrun: JOB: acquired` or
`... skipped:` line in the job unit's journal), or failed some other way
(which is told, and ends the outage too).

The state is the journal itself (the handler's own lines and the job's), so
nothing is written anywhere, whatever user the handler runs as, and a reboot
starts afresh only if the journal does.
"""

from __future__ import annotations

import re
import subprocess

from consulrun.errors import ExitCode
from consulrun.protocol.procinfo import own_unit

UNAVAILABLE = str(int(ExitCode.CONSUL_UNAVAILABLE))
TOLD = "running the on_failure command"  # the end of the handler's line for a failure it tells
LOOK_BACK_LINES = 5000  # how much of the two units' journal is read: an outage older than that is told again


def told_line(job: str, unit: str, result: str, status: str, occurrence: str) -> str:
    """The handler's line for a failure it tells (the line this module later reads back)."""
    return (f"{job}: {unit} ({result or 'result unknown'}, exit status {status or 'unknown'}, occurrence "
            f"{occurrence or '-'}); {TOLD}")


def quiet_line(job: str, since: str) -> str:
    from datetime import datetime, timezone

    try:
        when = datetime.fromtimestamp(float(since), timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    except ValueError:
        when = since
    return (f"{job}: Consul is still unavailable (exit status {UNAVAILABLE}), as told at {when}; not running the "
            "on_failure command again until a run reaches Consul")


def outage_told(job: str, lines: list[str]) -> str | None:
    """When this outage was told (the time of the handler's line), if the last failure told was a 69 and no run
    of the job has reached Consul since; None if a 69 now starts a new outage.

    `lines` are the job unit's and the handler unit's journal lines, oldest first, each `<time> <message>`
    (journalctl -o short-unix without the host and the tag: see `_journal`).
    """
    prefix = f"consulrun: {re.escape(job)}: "
    told = re.compile(rf"^{prefix}\S+ \(\S+, exit status (\S+), occurrence \S+\); {TOLD}$")
    reached = re.compile(rf"^{prefix}(acquired |skipped: )")
    since: str | None = None
    for line in lines:
        when, _, message = line.partition(" ")
        if match := told.match(message):
            since = when if match.group(1) == UNAVAILABLE else None
        elif since is not None and reached.match(message):
            since = None
    return since


def journal_lines(*units: str) -> list[str]:
    """The last LOOK_BACK_LINES lines of `units`' journals, oldest first, as `<unix time> <message>`."""
    args = ["journalctl", "--no-pager", "-q", "-o", "short-unix", "-n", str(LOOK_BACK_LINES)]
    for unit in units:
        args += ["-u", unit]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []  # cannot tell: the failure is told (never quiet for want of a journal)
    lines = []
    for line in out.splitlines():
        when, _, rest = line.partition(" ")  # `<time> <host> <tag>[<pid>]: <message>`
        _, _, rest = rest.partition(" ")
        _, sep, message = rest.partition(": ")
        if sep:
            lines.append(f"{when} {message}")
    return lines


def already_told(job: str, unit: str, status: str) -> str | None:
    """For a run that exited 69: when its outage was told already (then the handler keeps quiet); else None."""
    own = own_unit()
    if status != UNAVAILABLE or own is None:
        return None
    return outage_told(job, journal_lines(unit, own))
