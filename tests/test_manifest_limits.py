"""What a hostile manifest cannot make consulrun do: expand without bound, recurse, or end a name in a newline."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.commands.runargs import read, start
from consulrun.errors import UsageError

JOB = "{command: [/bin/true], schedule: daily}"
# Seven levels of nine aliases: 1 KB of text, 9**7 (4.8 million) values once expanded; it reached 1.77 GB.
BOMB = "".join(f"{a}: &{a} [{', '.join([f'*{b}'] * 9) if b else ', '.join(['lol'] * 9)}]\n"
               for a, b in zip("abcdefg", ["", *"abcdef"])) + "jobs:\n  j: {command: [/bin/true], schedule: daily, x: *g}\n"


def _generate(tmp_path: Path, text: str) -> tuple[int, str, str]:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(text)
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", str(tmp_path / "units"),
                                       "--consulrun-path", "/x/consulrun"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr.replace(str(manifest), "M")


@pytest.mark.parametrize(("text", "where"), [
    ("jobs: &a\n  j: {command: [/bin/true], schedule: daily, x: *a}\n", "M:2:46: "),
    ("x: &a [1, *a]\njobs:\n  j: " + JOB + "\n", "M:1:4: "),
    ("x: &a {k: &b {<<: *a}}\njobs:\n  j: " + JOB + "\n", "M:1:8: "),
], ids=["mapping", "sequence", "merge-key"])
def test_a_recursive_anchor_is_a_positioned_error(tmp_path: Path, text: str, where: str) -> None:
    code, stdout, stderr = _generate(tmp_path, text)
    assert code == 2 and stdout == ""
    assert stderr == (f"Error: {where}an alias refers to a node that contains it (a recursive anchor), "
                      "an endless value\n")
    assert not (tmp_path / "units").exists()


def test_an_alias_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """Under a 1 GB address-space limit (the bomb needed 1.77 GB): a positioned error, not a MemoryError."""
    assert len(BOMB) < 1024
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(BOMB)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    result = subprocess.run([sys.executable, "-m", "consulrun", "generate", str(manifest), "-o", "-",
                             "--consulrun-path", "/x/consulrun"], capture_output=True, text=True, preexec_fn=limit,
                            timeout=600)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout == ""
    assert result.stderr == (f"Error: {manifest}:6:4: aliases expand the document past 100,000 repeated values "
                             "(an alias bomb?); write the values out or use defaults:\n")


def test_nesting_is_bounded(tmp_path: Path) -> None:
    code, _, stderr = _generate(tmp_path, "jobs: " + "[" * 70 + "]" * 70 + "\n")
    assert code == 2
    assert stderr == "Error: M:1:71: nested deeper than 64 levels\n"


def test_aliases_a_manifest_uses_still_load(tmp_path: Path) -> None:
    """An anchor shared by many jobs is not a bomb: 2,000 jobs each taking one job's 20-variable environment."""
    from consulrun.manifest.loader import load_manifest

    anchor = "{" + ", ".join(f"E{i}: v" for i in range(20)) + "}"
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(f"jobs:\n  j0: {{command: [/bin/true], schedule: daily, environment: &env {anchor}}}\n"
                        + "".join(f"  j{i}: {{command: [/bin/true], schedule: daily, environment: *env}}\n"
                                  for i in range(1, 2000)))
    loaded = load_manifest(manifest)
    assert len(loaded.jobs) == 2000 and all(len(job.environment) == 20 for job in loaded.jobs)


@pytest.mark.parametrize("args", [
    ["--prefix", "ops\n", "j", "--", "/bin/true"],
    ["--schedule", "daily\n", "j", "--", "/bin/true"],
])
def test_the_lean_run_reader_leaves_a_final_newline_to_click_or_refuses_it(args: list[str]) -> None:
    params = read(args, {})
    if params is not None:
        with pytest.raises(UsageError):
            start(**params)
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 2, result.output


def test_the_lean_run_reader_refuses_a_job_name_with_a_final_newline() -> None:
    params = read(["abc\n", "--", "/bin/true"], {})
    assert params is not None
    with pytest.raises(UsageError, match="job name 'abc\\\\n'"):
        start(**params)
