"""Each command's one-line summary is a whole sentence (man's NAME line, `man -k`, `consulrun
--help`), and shell completion offers the job names of the manifest given.

The NAME lines were click's cut of the docstring (`consulrun-run - Run COMMAND for JOB on this
node only if...`), and `pause jobs.yaml <TAB>` offered nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from tests.conftest import require_tool

REPO = Path(__file__).resolve().parents[1]
MAN = REPO / "docs" / "man" / "man1"
MANIFEST = ("jobs:\n  report: {command: [/bin/true], schedule: daily}\n"
            "  rotate: {command: [/bin/true], schedule: daily}\n"
            "  backup: {command: [/bin/true], schedule: daily}\n")


@pytest.mark.parametrize("name", sorted(main.commands))
def test_a_command_s_short_help_is_a_whole_sentence(name: str) -> None:
    summary = main.commands[name].get_short_help_str(limit=45)
    assert summary.endswith(".") and "..." not in summary and len(summary) <= 65, summary
    assert summary[0].isupper(), summary


def test_the_command_list_and_the_man_pages_names_are_whole() -> None:
    listing = CliRunner().invoke(main, ["--help"]).stdout.split("Commands:")[1].split("Exit")[0]
    assert "..." not in listing
    lexgrog = require_tool("lexgrog")  # what mandb reads for `man -k`
    pages = sorted(MAN.glob("*.1"))
    assert len(pages) == len(main.commands) + 1
    for page in pages:
        whatis = subprocess.run([lexgrog, str(page)], capture_output=True, text=True, timeout=60,
                                check=True).stdout
        assert whatis.rstrip().endswith('."') and "..." not in whatis, whatis


def complete(cwd: Path, line: str) -> list[str]:
    """What bash completion offers for `line` (its last word being completed), as bash asks."""
    words = line.split(" ")
    env = {**os.environ, "COMP_WORDS": line, "COMP_CWORD": str(len(words) - 1),
           "_CONSULRUN_COMPLETE": "bash_complete", "PYTHONPATH": str(REPO)}
    entry = "from consulrun.cli import main; main(prog_name='consulrun')"  # as the installed script
    done = subprocess.run([sys.executable, "-c", entry], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [item for item in done.stdout.splitlines() if item]


def test_completion_offers_the_manifest_s_job_names(tmp_path: Path) -> None:
    (tmp_path / "jobs.yaml").write_text(MANIFEST)
    assert sorted(complete(tmp_path, "consulrun pause jobs.yaml ")) == [
        "plain,backup", "plain,report", "plain,rotate"]
    assert complete(tmp_path, "consulrun pause jobs.yaml report r") == ["plain,rotate"]
    assert complete(tmp_path, "consulrun trigger ./jobs.yaml b") == ["plain,backup"]
    assert complete(tmp_path, "consulrun trigger jobs.yaml backup ") == []  # one job only
    assert complete(tmp_path, "consulrun pause j") == ["file,j"]  # the manifest: a file
    assert complete(tmp_path, "consulrun pause missing.yaml ") == []
