"""Which manifest owns a unit: two manifests of one file name (/srv/a/jobs.yaml,
/srv/b/jobs.yaml) are two manifests, for `generate -o` and `install`; a clash is refused
with nothing changed, and units an older consulrun wrote (no manifest file recorded) still
go with the manifest that wrote them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from click.testing import CliRunner

from consulrun.cli import main
from tests.harness.runs import fake_root

CONSULRUN = "/usr/local/bin/consulrun"


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def generate(manifest: Path, units: Path, *args: str) -> tuple[int, str, str]:
    return invoke("generate", str(manifest), "-o", str(units), "--consulrun-path", CONSULRUN,
                  *args)


def teams(tmp_path: Path) -> tuple[Path, Path]:
    """Two teams' manifests, both called jobs.yaml, with jobs of their own."""
    a = tmp_path / "srv" / "teamA" / "jobs.yaml"
    b = tmp_path / "srv" / "teamB" / "jobs.yaml"
    a.parent.mkdir(parents=True)
    b.parent.mkdir(parents=True)
    a.write_text("jobs:\n  nightly-backup: {command: 'true', schedule: daily}\n"
                 "  rotate: {command: 'true', schedule: daily}\n")
    b.write_text("jobs:\n  report: {command: 'true', schedule: daily}\n")
    return a, b


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_second_jobs_yaml_is_refused_not_taken_for_the_first(tmp_path: Path) -> None:
    a, b = teams(tmp_path)
    units = tmp_path / "units"
    assert generate(a, units)[0] == 0
    before = snapshot(units)
    code, out, err = generate(b, units)
    assert (code, out) == (2, "")
    assert err == (f"Error: {units}/consulrun-nightly-backup.service belongs to {a}, not to "
                   f"{b}: two manifests named 'jobs' (give one a top-level `name:` of its own; "
                   "if the manifest moved, `consulrun uninstall --name jobs` first); nothing "
                   "changed\n")
    assert snapshot(units) == before  # nothing half-written, nothing removed
    # The fix the line gives: a name of its own. They add up; each prunes only its own units.
    b.write_text("name: team-b\n" + b.read_text())
    code, out, err = generate(b, units)
    assert code == 0 and "removed" not in out, err
    a.write_text("jobs:\n  nightly-backup: {command: 'true', schedule: daily}\n")
    code, out, _ = generate(a, units)
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("removed")] == [
        f"removed {units / 'consulrun-rotate.service'}",
        f"removed {units / 'consulrun-rotate.timer'}"]
    assert sorted(snapshot(units)) == [
        "consulrun-nightly-backup.service", "consulrun-nightly-backup.timer",
        "consulrun-report.service", "consulrun-report.timer"]
    assert "\n# Manifest: jobs\n# Manifest file: ../srv/teamA/jobs.yaml\n[Unit]" in \
        (units / "consulrun-nightly-backup.timer").read_text()
    assert "\n# Manifest: team-b\n# Manifest file: none (named by its name: or --name)\n[Unit]" \
        in (units / "consulrun-report.timer").read_text()


def tree(root: Path) -> dict[str, bytes | str]:
    """Every file and symlink under `root` (an enabled timer is a symlink)."""
    return {str(p.relative_to(root)): os.readlink(p) if p.is_symlink() else p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file() or p.is_symlink()}


def test_install_refuses_the_clash_before_touching_anything(tmp_path: Path) -> None:
    a, b = teams(tmp_path)
    root, inside = fake_root(tmp_path)
    code, out, err = invoke("install", str(a), "--root", str(root), "--consulrun-path", inside)
    assert code == 0, err
    unit_dir = root / "etc" / "systemd" / "system"
    before = tree(root)
    code, out, err = invoke("install", str(b), "--root", str(root), "--consulrun-path", inside)
    assert (code, out) == (2, "")
    assert err.startswith(f"Error: {unit_dir}/consulrun-nightly-backup.service belongs to {a}, "
                          f"not to {b}: ")
    assert err.count("\n") == 1
    assert tree(root) == before  # no unit written or removed, no timer enabled or disabled
    code, out, err = invoke("uninstall", str(b), "--root", str(root))  # nor taken away by b
    assert code == 2 and "belongs to" in err
    assert tree(root) == before


def test_units_generated_into_a_checkout_are_the_same_bytes_wherever_it_lies(
        tmp_path: Path) -> None:
    """The file is recorded relative to the unit folder: a checkout's units/ stays up to date in
    every clone."""
    first, second = tmp_path / "one" / "repo", tmp_path / "two" / "elsewhere" / "repo"
    for checkout in (first, second):
        checkout.mkdir(parents=True)
        (checkout / "jobs.yaml").write_text(
            "health_checks: true\njobs:\n  x: {command: 'true', schedule: daily}\n")
        assert generate(checkout / "jobs.yaml", checkout / "units")[0] == 0
    assert snapshot(first / "units") == snapshot(second / "units")
    shutil.rmtree(second / "units")
    shutil.copytree(first / "units", second / "units")  # committed in one clone, checked in another
    code, out, _ = generate(second / "jobs.yaml", second / "units", "--check")
    assert (code, out) == (0, f"{second / 'units'} is up to date\n")


def as_older_consulrun_wrote(units: Path) -> None:
    """Take out what this version adds to a header: the manifest's file (the name stays)."""
    for path in units.iterdir():
        path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                                if not line.startswith("# Manifest file: ")))


def test_units_of_the_previous_version_go_with_the_manifest_that_wrote_them(
        tmp_path: Path) -> None:
    a, b = teams(tmp_path)
    units = tmp_path / "units"
    assert generate(a, units)[0] == 0
    as_older_consulrun_wrote(units)
    before = snapshot(units)
    # Another jobs.yaml makes none of them: they are not its own, whatever their name says.
    code, out, err = generate(b, units)
    assert (code, out) == (2, "")
    assert "written by an older consulrun, which recorded no manifest file, and " in err
    assert str(b) in err
    assert snapshot(units) == before
    # The manifest that wrote them, a job less: its stale unit goes, the others record its file.
    a.write_text("jobs:\n  nightly-backup: {command: 'true', schedule: daily}\n")
    code, out, err = generate(a, units)
    assert code == 0, err
    assert sorted(snapshot(units)) == ["consulrun-nightly-backup.service",
                                       "consulrun-nightly-backup.timer"]
    assert "# Manifest file: ../srv/teamA/jobs.yaml\n" in \
        (units / "consulrun-nightly-backup.service").read_text()


def test_uninstall_by_name_takes_a_moved_manifests_units(tmp_path: Path) -> None:
    a, _ = teams(tmp_path)
    root, inside = fake_root(tmp_path)
    assert invoke("install", str(a), "--root", str(root), "--consulrun-path", inside)[0] == 0
    moved = tmp_path / "moved" / "jobs.yaml"
    moved.parent.mkdir()
    a.rename(moved)
    code, _, err = invoke("install", str(moved), "--root", str(root), "--consulrun-path", inside)
    assert code == 2 and "if the manifest moved, `consulrun uninstall --name jobs` first" in err
    code, out, err = invoke("uninstall", "--name", "jobs", "--root", str(root))
    assert code == 0, err
    assert "uninstalled: 0 added, 0 changed, 4 removed" in out
    assert invoke("install", str(moved), "--root", str(root), "--consulrun-path", inside)[0] == 0


def test_a_manifest_from_standard_input_never_takes_a_files_units(tmp_path: Path) -> None:
    a, _ = teams(tmp_path)
    units = tmp_path / "units"
    assert generate(a, units)[0] == 0
    result = CliRunner().invoke(main, ["generate", "-", "-o", str(units), "--name", "jobs",
                                       "--consulrun-path", CONSULRUN], input=a.read_text())
    assert result.exit_code == 2
    assert f"belongs to {a}, not to standard input: two manifests named 'jobs'" in result.stderr


def test_a_path_the_header_cannot_hold_is_refused(tmp_path: Path) -> None:
    """A newline in a folder name would end the header's comment line and start a unit setting."""
    folder = tmp_path / "team\nExecStartPre=true"
    folder.mkdir()
    manifest = folder / "jobs.yaml"
    manifest.write_text("jobs:\n  x: {command: 'true', schedule: daily}\n")
    units = tmp_path / "units"
    code, out, err = generate(manifest, units)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "the manifest's path has a control character" in err
    assert not units.exists()
    manifest.write_text("name: team\n" + manifest.read_text())  # named: no file is recorded
    assert generate(manifest, units)[0] == 0
    assert "ExecStartPre" not in (units / "consulrun-x.service").read_text()
