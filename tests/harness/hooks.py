"""Pausing a wrapper at a named point of the protocol (consulrun/protocol/testhook.py), then
letting it go on.
"""

from __future__ import annotations

from pathlib import Path

from tests.harness.agents import wait_for


def hooks(tmp_path: Path, *points: str) -> dict[str, str]:
    (tmp_path / "hooks").mkdir(exist_ok=True)
    return {"CONSULRUN_TEST_PAUSE": ",".join(points), "CONSULRUN_TEST_HOOK_DIR": str(tmp_path / "hooks")}


def at(tmp_path: Path, point: str, timeout: float = 30) -> None:
    wait_for((tmp_path / "hooks" / point).exists, timeout, f"the wrapper to reach {point}")


def go(tmp_path: Path, point: str) -> None:
    (tmp_path / "hooks" / f"{point}.go").touch()
