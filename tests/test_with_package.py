"""`install --host --with-package`: what is refused before anything crosses to a node (the package reaching a
bare node over a real sshd is tests/test_deb.py's test_install_with_package_takes_a_bare_node_...)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def test_with_package_refuses_what_is_not_a_deb_and_sends_nothing(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({"jobs": {"tick": {"command": ["true"], "schedule": "daily"}}}))
    not_deb = tmp_path / "consulrun.deb"
    not_deb.write_text("#!/bin/sh\n")
    missing = str(tmp_path / "none.deb")
    here = str(Path(sys.prefix) / "bin" / "consulrun")
    host = ["--host", "nowhere.invalid"]
    for extra, message in (([*host, "--with-package", str(not_deb)], "not a .deb package"),
                           (["--with-package", missing], "needs --host"),
                           ([*host, "--with-package", missing], "no such file"),
                           ([*host, "--with-package", missing, "--dry-run"], "--dry-run must not"),
                           ([*host, "--with-package", missing, "--root", str(tmp_path)], "not into --root")):
        result = subprocess.run([here, "install", str(jobs), *extra], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr and "--with-package" in result.stderr, \
            (extra, result.stderr)
        assert "nowhere.invalid" not in result.stderr  # refused before any ssh
