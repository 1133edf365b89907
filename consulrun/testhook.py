"""Deterministic hooks for tests: pause points (`CONSULRUN_TEST_PAUSE=point[,point...]`,
`CONSULRUN_TEST_HOOK_DIR`) and injected failures (`CONSULRUN_TEST_FAIL=point`).

At a named point the wrapper creates `<dir>/<point>` (holding its pid) and
waits until the test creates `<dir>/<point>.go` or a termination signal has
arrived, so a test can land a signal, a crash or a competing run exactly
between two steps of the protocol instead of relying on timing. Without the
variables this is one dictionary lookup.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def fail(point: str) -> None:
    """`CONSULRUN_TEST_FAIL=point`: raise here, as an unexpected failure (a bug, a resource limit) would."""
    if point in os.environ.get("CONSULRUN_TEST_FAIL", "").split(","):
        raise RuntimeError(f"failure injected at {point}")


def pause(point: str, interrupted: Callable[[], bool] = lambda: False) -> None:
    if point not in os.environ.get("CONSULRUN_TEST_PAUSE", "").split(","):
        return
    where = os.path.join(os.environ["CONSULRUN_TEST_HOOK_DIR"], point)
    with open(where + ".tmp", "w", encoding="ascii") as handle:
        handle.write(str(os.getpid()))
    os.rename(where + ".tmp", where)
    while not os.path.exists(where + ".go") and not interrupted():
        time.sleep(0.02)
