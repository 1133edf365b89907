"""Processes the benches start and must end: standard library only (bench/scale_node.py starts it per node)."""

from __future__ import annotations

import os
import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """A bench run told to stop (Ctrl-C, SIGTERM, SIGHUP): raised where it runs, so its cleanup runs."""


def stop_on_signal(signum: int, _frame: FrameType | None) -> None:
    """The signal handler of a bench run: ignore further stops (a second Ctrl-C must not cut the cleanup short)
    and raise Stopped."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children of all its threads, recursively)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            tids = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{current}/task/{tid}/children", encoding="ascii") as handle:
                    children = [int(c) for c in handle.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found
