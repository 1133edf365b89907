"""The package as a user gets it: the wheel carries the templates and the CLI works."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun import __version__
from consulrun.cli import main
from tests.conftest import require_tool

REPO = Path(__file__).resolve().parents[1]
MAN_PAGES = REPO / "docs" / "man" / "man1"


def test_version_and_help() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"consulrun, version {__version__}\n"
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("generate", "run", "status"):
        assert command in result.stdout
    assert "75  lock lost" in result.stdout


def test_python_dash_m_runs_the_cli() -> None:
    result = subprocess.run([sys.executable, "-m", "consulrun", "--version"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(__version__)


@pytest.mark.slow
def test_wheel_ships_templates_and_renders_from_installed_copy(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(REPO)],
                   check=True, capture_output=True)
    wheel = next(dist.glob("consulrun-*.whl"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True, capture_output=True)
    # Run from an unrelated folder so the source tree's templates/ cannot be found.
    where = subprocess.run([str(py), "-c", "from consulrun.units.render import shipped_templates; print(shipped_templates())"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(env_dir)), where
    assert sorted(p.name for p in Path(where).iterdir()) == ["chainwatch.j2", "onfailure.j2", "service.j2", "timer.j2"]
    out = tmp_path / "units"
    result = subprocess.run([str(env_dir / "bin" / "consulrun"), "generate", str(REPO / "examples" / "jobs.yaml"),
                             "-o", str(out)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    service = (out / "consulrun-billing-report.service").read_text()
    assert f"ExecStart={env_dir}/bin/consulrun run " in service

    # The man pages the units' Documentation= names come with the wheel, where `man` finds them beside bin/ on
    # PATH, so systemd-analyze verify passes as it checks them (no --man=no). Any stderr is a failure too.
    require_tool("systemd-analyze")
    units = sorted(str(p) for p in out.iterdir() if p.suffix in (".service", ".timer"))
    path = f"{env_dir / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin"
    result = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, cwd=out,
                            env={"PATH": path, "LANG": "C.UTF-8"})
    assert (result.returncode, result.stderr) == (0, "")
    pages = env_dir / "share" / "man" / "man1"
    assert sorted(p.name for p in pages.iterdir()) == sorted(p.name for p in MAN_PAGES.iterdir())


def test_shipped_man_pages_are_up_to_date_with_the_cli(tmp_path: Path) -> None:
    """docs/man/man1 is what the wheel ships: it must be what `python -m consulrun.manpage` makes from --help now."""
    from consulrun.manpage import write_pages

    made = {p.name: p.read_text() for p in write_pages(tmp_path)}
    shipped = {p.name: p.read_text() for p in MAN_PAGES.iterdir()}
    stale = sorted(n for n in {**made, **shipped} if made.get(n) != shipped.get(n))
    assert not stale, f"run `python -m consulrun.manpage docs/man/man1`: out of date: {', '.join(stale)}"


@pytest.mark.slow
def test_readme_first_command_works_on_a_fresh_copy(tmp_path: Path) -> None:
    """The README's first command (install, render the example, show it) as a newcomer would run it."""
    readme = (REPO / "README.md").read_text()
    command = readme.split("```sh\n", 1)[1].split("\n```", 1)[0].strip()
    copy = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(REPO), str(copy)], check=True)
    for path in ("README.md", "examples", "templates", "consulrun", "pyproject.toml"):  # the working tree, not HEAD
        source = REPO / path
        if source.is_dir():
            shutil.rmtree(copy / path)
            shutil.copytree(source, copy / path, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, copy / path)
    result = subprocess.run(["bash", "-c", command], cwd=copy, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "[Timer]\nOnCalendar=*-*-* 02:00:00\n" in result.stdout
    assert sorted(p.name for p in (copy / "units").iterdir()) == [
        "consulrun-_watchdog-jobs.jobs", "consulrun-_watchdog.service", "consulrun-_watchdog.timer",
        "consulrun-billing-report.service", "consulrun-billing-report.timer",
        "consulrun-cache-warm.service", "consulrun-cache-warm.timer",
        "consulrun-onfailure@billing-report.service", "consulrun-onfailure@cache-warm.service"]
