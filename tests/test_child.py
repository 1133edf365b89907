"""The job's process tree as the wrapper reads it from /proc and from the kernel: real processes, no agent."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from consulrun.protocol import child


def state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()[0]


def test_a_process_that_exits_while_proc_is_read_is_passed_over_and_the_rest_still_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gone = 2 ** 22 + 1  # above any pid Linux gives (PID_MAX_LIMIT): no /proc entry, as for one that just exited
    assert not os.path.exists(f"/proc/{gone}")
    listed = [str(gone), "self", str(os.getpid())]
    monkeypatch.setattr(child.os, "listdir", lambda path: listed if path == "/proc" else os.listdir(path))
    assert [pid for pid, _ in child.live_processes()] == [os.getpid()]


def test_a_zombie_is_not_a_live_process_but_is_still_a_child_and_stays_unreaped() -> None:
    proc = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 30
        while state(proc.pid) != b"Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert proc.pid not in dict(child.live_processes())
        assert proc.pid not in child.descendants()
        assert os.getpid() in dict(child.live_processes())
        assert child._has_children() is True  # what the kernel says when /proc shows none (hidepid)
        # Asking did not reap it: the job's own exit status is still there for the wrapper to collect.
        assert state(proc.pid) == b"Z"
        assert os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    finally:
        proc.wait()
    assert proc.returncode == 0


def test_a_process_without_children_has_none() -> None:
    # In a fresh interpreter: the test process itself may have children (the suite's agents).
    code = "from consulrun.protocol.child import _has_children; print(_has_children())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert (result.returncode, result.stdout, result.stderr) == (0, "False\n", "")


def test_a_job_that_proc_does_not_show_is_alive_while_the_kernel_still_has_it_as_a_child() -> None:
    """hidepid=2 hides a non-dumpable process even from its own user: when /proc shows none of the job,
    `alive` asks the kernel whether the wrapper still has a child, and says yes until the last one is gone.
    In a fresh interpreter, so the job is the wrapper's only child (as under `consulrun run`)."""
    probe = "\n".join([
        "import os, signal, sys, time",
        "from consulrun.protocol import child",
        "job = child.Job(['sleep', '60'], dict(os.environ))",
        "child.descendants = lambda exclude=frozenset(): []  # what /proc shows under hidepid=2: nothing",
        "assert job.processes() == []",
        "print('alive while hidden:', job.alive())",
        "os.kill(job.pgid, signal.SIGKILL)",
        "deadline = time.monotonic() + 30",
        "while job.alive() and time.monotonic() < deadline:",
        "    time.sleep(0.01)",
        "print('alive once gone:', job.alive(), job.poll())",
    ])
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == ["alive while hidden: True", "alive once gone: False 137"], done.stderr
