"""Is a lock holder's wrapper process provably dead? Only its own node can tell.

The holder value names the wrapper's pid, its start time (field 22 of
/proc/<pid>/stat, clock ticks since boot) and the machine's boot id. A pid is
reused, a (boot id, pid, start time) triple is not: on the same boot of the
same node, a missing /proc/<pid> or another start time means the wrapper is
gone, whatever its session still says. A holder value may also name the
wrapper's pid namespace (`pid_ns`, as /proc/self/ns/pid reads); if it does
and it is not ours, its pid cannot be looked up here.

All of that is what the lock's value says, and anyone with KV write can
rewrite it under a live holder. So it is believed only where Consul's own
record of the session agrees (its `Node` is this node), and a pid it names
dead counts only if no process here still holds the session's mark.
"""

from __future__ import annotations

import os
import socket
import time

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any, Callable

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def pid_namespace() -> str | None:
    """This process's pid namespace (`pid:[4026531836]`): a pid means something only inside its namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def time_namespace() -> str | None:
    """This process's time namespace: start times in /proc are counted on its boot clock."""
    try:
        return os.readlink("/proc/self/ns/time")
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of `pid`, or None if /proc does not show it to us."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: count fields after the last ')'; state is field 3.
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return fields[0], int(fields[22 - 3])
    except (IndexError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if there is no such live process (zombies are dead)."""
    stat = _stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return None
    return stat[1]


INIT_NAMES = ("systemd", "init")  # /proc/1/comm of a system that boots (systemd, also as /sbin/init; sysvinit)


def system_age() -> float | None:
    """Seconds since this system's init (PID 1 of our PID namespace) started: since the boot of the machine, or of
    the container we run in; None if that cannot be read (a /proc mounted with hidepid), or if PID 1 is no init
    (a fresh PID namespace whose first process is a command, `unshare -p` or a one-off container, boots nothing)."""
    try:
        with open("/proc/1/comm", encoding="utf-8", errors="replace") as handle:
            if handle.read().strip() not in INIT_NAMES:
                return None
    except OSError:
        return None
    start = process_start(1)
    if start is None:
        return None
    try:
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start / os.sysconf("SC_CLK_TCK"))


def provably_dead(holder: dict[str, Any], local_node: str | None, session: dict[str, Any] | None) -> str | None:
    """Why the holder's wrapper is certainly dead, or None if that cannot be proven from here.

    `holder` is the lock's value, which anyone with KV write can rewrite while
    Consul keeps the key's session; `session` is Consul's own record of that
    session (/v1/session/info), whose `Node` only Consul can say. The value is
    believed only where it agrees with it: the session's node is this node,
    and the value names this node and that session. Otherwise a forged value
    naming this node and a dead pid would make this node destroy the session
    of a live holder elsewhere.

    Absence is proven by the kernel (kill(pid, 0) answering "no such process"),
    never by /proc alone, which hides other users' processes under hidepid=2.
    """
    pid, started, booted = holder.get("pid"), holder.get("pid_start"), holder.get("boot_id")
    if local_node is None or holder.get("node") != local_node or not isinstance(pid, int) or pid <= 0:
        return None
    if not session or session.get("Node") != local_node or holder.get("session") != session.get("ID"):
        return None
    if not isinstance(started, int) or not booted or booted != boot_id():
        return None
    for key, ours in (("pid_ns", pid_namespace), ("time_ns", time_namespace)):
        if holder.get(key) and holder[key] != ours():  # another namespace's pid or boot clock
            return None
    why = _pid_gone(pid, started)
    if why and marker_held(str(session.get("ID"))):  # the value's pid is forged: the session's wrapper lives here
        return None
    return why


def _pid_gone(pid: int, started: int) -> str | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its wrapper process (pid {pid}) on this node has exited"
    except PermissionError:
        pass  # it exists; whose it is, /proc may say
    stat = _stat(pid)
    if stat is None:
        return None  # it exists, and we may not look: cannot tell
    if stat[0] in ("Z", "X"):
        return f"its wrapper process (pid {pid}) on this node has exited"
    if stat[1] != started:
        return f"its wrapper process (pid {pid}) on this node has exited; the pid now belongs to another process"
    return None


# A holder's mark on this machine that no KV writer can forge: an abstract unix socket named after its session,
# bound by the wrapper once it holds the lock and gone with it (the kernel closes it when the process dies; a
# job does not inherit it). A value naming this node and a dead pid, while the session's mark is still bound,
# was rewritten under a live holder.
_MARK = "\0consulrun-holder/"


def hold_marker(session: str) -> socket.socket | None:
    """Bind the session's mark; keep the socket for as long as the process may hold the lock. None if it could
    not be bound (a probe holds it for a moment: tried again a few times; then a forged value goes undetected)."""
    for _ in range(20):
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:  # unix sockets denied (RestrictAddressFamilies=): no mark, and reap cannot tell either
            return None
        try:
            sock.bind(_MARK + session)
            return sock
        except OSError:
            sock.close()
            time.sleep(0.005)
    return None


def marker_held(session: str) -> bool:
    """Whether a live process here (in this network namespace) holds the mark of `session`."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:  # unix sockets denied here: the mark cannot be looked at, so nothing is provably dead
        return True
    try:
        sock.bind(_MARK + session)
    except OSError:  # in use (a live holder), or any other refusal: either way not provably dead
        return True
    finally:
        sock.close()
    return False


def own_unit(read: Callable[[], str] | None = None) -> str | None:
    """The systemd unit this process runs in (from /proc/self/cgroup), or None outside a service."""
    try:
        text = read() if read else open("/proc/self/cgroup", encoding="utf-8").read()  # noqa: SIM115
    except OSError:
        return None
    lines = text.splitlines()
    # systemd's own hierarchy (v2's `0::`, or v1's `name=systemd`) places the process; a controller may lag.
    for line in [x for x in lines if x.startswith("0::") or ":name=systemd:" in x] or lines:
        for part in reversed(line.rsplit(":", 1)[-1].split("/")):
            if part.endswith(".service"):
                return part
    return None
