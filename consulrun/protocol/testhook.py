"""Deterministic hooks for tests: pause points (`CONSULRUN_TEST_PAUSE=point[,point...]`,
`CONSULRUN_TEST_HOOK_DIR`) and injected failures (`CONSULRUN_TEST_FAIL=point`).

At a named point the wrapper creates `<dir>/<point>` (holding its pid) and
waits until the test creates `<dir>/<point>.go` or a termination signal has
arrived, so a test can land a signal, a crash or a competing run exactly
between two steps of the protocol instead of relying on timing. Both need
CONSULRUN_TEST_HOOK_DIR naming an existing folder, so a stray variable in a
unit's environment does nothing; without them this is a dictionary lookup.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def _armed(variable: str, point: str) -> str | None:
    """The hook folder when `point` is listed in `variable` and the folder exists; else None (hooks are off)."""
    folder = os.environ.get("CONSULRUN_TEST_HOOK_DIR", "")
    if point not in os.environ.get(variable, "").split(",") or not folder or not os.path.isdir(folder):
        return None
    return folder


def fail(point: str) -> None:
    """`CONSULRUN_TEST_FAIL=point`: raise here, as an unexpected failure (a bug, a resource limit) would."""
    if _armed("CONSULRUN_TEST_FAIL", point):
        raise RuntimeError(f"failure injected at {point}")


def pause(point: str, interrupted: Callable[[], bool] = lambda: False) -> None:
    folder = _armed("CONSULRUN_TEST_PAUSE", point)
    if folder is None:
        return
    where = os.path.join(folder, point)
    with open(where + ".tmp", "w", encoding="ascii") as handle:
        handle.write(str(os.getpid()))
    os.rename(where + ".tmp", where)
    while not os.path.exists(where + ".go") and not interrupted():
        time.sleep(0.02)
