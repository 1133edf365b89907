"""`consulrun validate`: what `generate` checks and warns about, with nothing written."""

from __future__ import annotations

import os
from pathlib import Path

from click.testing import CliRunner

from consulrun.cli import main

DENSE = ("jobs:\n  dense:\n    command: ['true']\n    schedule: '*:*:0/30'\n    timeout: 25s\n"
         "    on_holder_loss: retry\n    lock: {ttl: 10s, lock_delay: 5s}\n")


def invoke(*args: str, cwd: Path) -> tuple[int, str, str]:
    """Run in an empty folder under `cwd`: whatever validate wrote there (or beside the manifest) is a failure."""
    before = sorted(cwd.rglob("*"))
    work = cwd / "cwd"
    work.mkdir()
    previous = Path.cwd()
    os.chdir(work)
    try:
        result = CliRunner().invoke(main, list(args))
    finally:
        os.chdir(previous)
    work.rmdir()  # fails if validate wrote anything in the working folder
    assert sorted(cwd.rglob("*")) == before
    return result.exit_code, result.stdout, result.stderr


def test_a_valid_manifest_is_said_valid_with_generates_warnings_and_nothing_written(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(DENSE)
    code, out, err = invoke("validate", str(manifest), cwd=tmp_path)
    assert code == 0, err
    assert out == f"{manifest}: valid: 1 job, 2 unit files\n"
    assert err.startswith("warning: job dense: on_holder_loss: retry cannot promise at least once")


def test_an_invalid_manifest_is_exit_2_naming_file_line_and_field(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a: {command: 'true', schedule: '*-*-* 02:00:00'}\n  b: {command: 'true', schedule: "
                        "'*-*-* 25:00:00'}\n")
    code, out, err = invoke("validate", str(manifest), cwd=tmp_path)
    assert (code, out) == (2, "")
    assert err.startswith(f"Error: {manifest}:3:") and "jobs.b.schedule" in err and err.count("\n") == 1


def test_a_template_that_cannot_render_is_caught_without_writing(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a: {command: 'true', schedule: '*-*-* 02:00:00'}\n")
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "timer.j2").write_text("[Timer]\nOnCalendar={{ no_such_variable }}\n")
    code, out, err = invoke("validate", str(manifest), "--templates", str(templates), cwd=tmp_path)
    assert code != 0 and out == "" and "no_such_variable" in err
