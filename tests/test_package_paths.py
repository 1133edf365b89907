"""README says where the package's venv is, as `dpkg-deb -c` and the postinst have it.

README said the venv was "under /opt/consulrun"; the package holds it under
/usr/lib/consulrun/releases/<version>-<release>/, which its postinst links into /opt.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, require_tool

pytestmark = pytest.mark.slow


def install_section() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0].replace("\n", " ")


@pytest.fixture(scope="module")
def listing(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, set[str]]:
    """(the release, the paths `dpkg-deb -c` lists) of the package scripts/package builds."""
    require_tool("dpkg-deb")
    built = subprocess.run([str(REPO / "scripts" / "package")], capture_output=True, text=True,
                           timeout=1200, env={**os.environ, "CONSULRUN_PACKAGE_RELEASE": "1"})
    assert built.returncode == 0, built.stderr
    deb = Path(built.stdout.strip().splitlines()[-1])
    release = deb.name.split("_")[1]
    out = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True,
                         check=True).stdout
    return release, {line.split()[5].removeprefix(".") for line in out.splitlines()}


def test_readme_names_the_venv_s_path_in_the_package(listing: tuple[str, set[str]]) -> None:
    release, paths = listing
    section = install_section()
    venv = section[section.index("in a venv"):]
    first = re.search(r"`(/[^`]*)`", venv)
    assert first, "README's Install section names no path for the venv"
    unpacked = first.group(1).replace("<version>-<release>", release)
    assert unpacked in paths and f"{unpacked}bin/consulrun" in paths, unpacked
    assert not [p for p in paths if p.startswith("/opt/")]  # /opt is the postinst's, as README says


def test_readme_s_opt_paths_are_the_postinst_s() -> None:
    postinst = (REPO / "scripts" / "packaging" / "postinst").read_text()
    assert "live=/opt/consulrun" in postinst and 'ln -sfn "$release" "$live/.current.new"' in postinst
    section = install_section()
    assert "hard-links to `/opt/consulrun/<version>-<release>/`" in section
    assert "`/opt/consulrun/current`" in section
