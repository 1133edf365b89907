"""A process with its wall clock off (libfaketime; monotonic time stays real): skewed nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require_tool


FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def skewed(offset_s: float) -> dict[str, str]:
    """Environment that runs a process with its wall clock `offset_s` off (monotonic time stays real)."""
    require_tool("faketime")
    if not FAKETIME_LIB.exists():  # LD_PRELOAD of a missing library is silently ignored: no skew at all
        pytest.fail(f"{FAKETIME_LIB} is missing (Debian package libfaketime)", pytrace=False)
    return {"FAKETIME": f"{offset_s:+.3f}", "FAKETIME_DONT_FAKE_MONOTONIC": "1", "LD_PRELOAD": str(FAKETIME_LIB)}
