"""scripts/test-pythons, which CI runs on the other Pythons: a version it cannot find is a failure, never a skip."""

from __future__ import annotations

import os
import subprocess

from tests.conftest import REPO


def test_a_missing_python_version_fails_loudly_and_nothing_is_run() -> None:
    env = {**os.environ, "PYENV_ROOT": "/nonexistent"}
    env.pop("CONSULRUN_PYTHON_3_99", None)
    result = subprocess.run([str(REPO / "scripts" / "test-pythons"), "3.99"], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Python 3.99 not found" in result.stderr and "FAILED on: 3.99 (missing)" in result.stderr, result.stderr
    assert not (REPO / ".venv-py3.99").exists()


def test_a_python_of_another_version_is_refused() -> None:
    env = {**os.environ, "CONSULRUN_PYTHON_3_99": "/usr/bin/python3"}
    result = subprocess.run([str(REPO / "scripts" / "test-pythons"), "3.99"], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 1 and "not 3.99" in result.stderr and "3.99 (is 3." in result.stderr, result.stderr
