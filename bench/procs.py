"""Processes the benches start and must end: standard library only (bench/scale_node.py starts it per node)."""

from __future__ import annotations

import os


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
