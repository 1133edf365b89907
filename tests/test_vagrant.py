"""vagrant/ is a valid Vagrant configuration (no VM can boot here; `validate` checks every setting)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import require_tool

VAGRANT_DIR = Path(__file__).resolve().parents[1] / "vagrant"


def validate(folder: Path) -> subprocess.CompletedProcess[str]:
    """`vagrant validate` with a throw-away VAGRANT_HOME, and its .vagrant/ state dir kept out of the checkout."""
    with tempfile.TemporaryDirectory() as home:
        work = Path(home) / "work"
        shutil.copytree(folder, work, ignore=shutil.ignore_patterns(".vagrant"))
        return subprocess.run([require_tool("vagrant"), "validate", "--ignore-provider"], cwd=work, capture_output=True,
                              text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": home,
                                                           "VAGRANT_CHECKPOINT_DISABLE": "1"})


def test_vagrantfile_validates() -> None:
    result = validate(VAGRANT_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    for script in (VAGRANT_DIR / "provision").glob("*.sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


def test_validate_would_catch_a_bad_setting(tmp_path: Path) -> None:
    copy = tmp_path / "vagrant"
    shutil.copytree(VAGRANT_DIR, copy)
    text = (copy / "Vagrantfile").read_text().replace('node.vm.hostname = name', 'node.vm.hostname = name\n      node.vm.no_such_setting = 1')
    (copy / "Vagrantfile").write_text(text)
    result = validate(copy)
    assert result.returncode == 1
    assert "no_such_setting" in result.stdout + result.stderr


@pytest.mark.parametrize("script", ["consul.sh", "consulrun.sh"])
def test_provision_scripts_exist_and_are_executable(script: str) -> None:
    path = VAGRANT_DIR / "provision" / script
    assert path.stat().st_mode & 0o111
