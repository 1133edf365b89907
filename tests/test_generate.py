"""`consulrun generate`: golden output, systemd's own verdict, all-or-nothing writes."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.manifest.loader import load_manifest
from consulrun.units.render import render
from tests.conftest import GOLDEN_REWRITTEN, require_tool

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
CONSULRUN = "/usr/local/bin/consulrun"
CASES = {"example": REPO / "examples" / "jobs.yaml",
         **{p.name: p / "manifest.yaml" for p in sorted(GOLDEN.iterdir()) if (p / "manifest.yaml").exists()}}


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str, request: pytest.FixtureRequest) -> None:
    units = render(load_manifest(CASES[case]), CONSULRUN)
    expected_dir = GOLDEN / case / "expected"
    expected = {p.name: p.read_bytes().decode() for p in sorted(expected_dir.iterdir())} if expected_dir.is_dir() else {}
    if units != expected and request.config.getoption("--update-golden"):
        changed = sorted(n for n in {**units, **expected} if units.get(n) != expected.get(n))
        shutil.rmtree(expected_dir, ignore_errors=True)
        expected_dir.mkdir(parents=True)
        for name, text in units.items():
            (expected_dir / name).write_bytes(text.encode())
        paths = [str((expected_dir / n).relative_to(REPO)) for n in changed]
        request.config.stash.setdefault(GOLDEN_REWRITTEN, []).extend(paths)
        pytest.fail(f"--update-golden rewrote {', '.join(paths)}: not a passing test; review the diff", pytrace=False)
    assert units == expected


@pytest.mark.systemd
@pytest.mark.parametrize("case", sorted(CASES))
def test_units_pass_systemd_analyze_verify(case: str, tmp_path: Path) -> None:
    require_tool("systemd-analyze")
    code, _, err = invoke("generate", str(CASES[case]), "-o", str(tmp_path), "--consulrun-path", "/usr/bin/env")
    assert code == 0, err
    units = sorted(str(p) for p in tmp_path.iterdir() if p.suffix in (".service", ".timer"))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", *units], capture_output=True, text=True,
                            cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")


def test_watchdog_of_a_big_manifest_is_a_loadable_unit(tmp_path: Path) -> None:
    """The watchdog's job list lives in a file beside the units, not in its command line: one argument may be at
    most 128 KiB (MAX_ARG_STRLEN) and a unit-file line 1 MiB, which 2,000 jobs' schedules would pass."""
    require_tool("systemd-analyze")
    manifest = tmp_path / "big.yaml"
    manifest.write_text("health_checks: true\njobs:\n" + "".join(
        f"  job-{n:05d}: {{command: [/bin/true], schedule: '*-*-* 02:{n % 60:02d}:00 Europe/Berlin', timeout: 1h}}\n"
        for n in range(2000)))
    out = tmp_path / "units"
    code, _, err = invoke("generate", str(manifest), "-o", str(out), "--consulrun-path", "/usr/bin/env")
    assert code == 0, err
    service = out / "consulrun-_watchdog.service"
    assert max(len(line) for line in service.read_text().splitlines()) < 4096
    assert "--jobs-glob %Y/consulrun-_watchdog*.jobs" in service.read_text()
    jobs = out / "consulrun-_watchdog-big.jobs"
    assert len(jobs.read_bytes()) > 128 * 1024  # what used to be one argument
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(service)], capture_output=True, text=True,
                            cwd=out)
    assert (result.returncode, result.stderr) == (0, "")


def test_same_manifest_same_bytes(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        assert invoke("generate", str(CASES["example"]), "-o", str(out), "--consulrun-path", CONSULRUN)[0] == 0
    assert {p.name: p.read_bytes() for p in first.iterdir()} == {p.name: p.read_bytes() for p in second.iterdir()}


def test_generate_prints_what_it_wrote_and_removes_stale_units(tmp_path: Path) -> None:
    code, out, err = invoke("generate", str(CASES["tls-and-checks"]), "-o", str(tmp_path), "--consulrun-path", CONSULRUN)
    assert code == 0 and err == ""
    assert out.splitlines() == [str(tmp_path / n) for n in
                                ("ops-rotate-logs.service", "ops-rotate-logs.timer", "ops-sync.service", "ops-sync.timer")]
    foreign = tmp_path / "hand-made.service"
    foreign.write_text("[Service]\nExecStart=/bin/true\n")
    (tmp_path / "edited").mkdir()
    manifest = tmp_path / "edited" / "manifest.yaml"  # the same manifest, one job less, given its name
    manifest.write_text("name: manifest\n" + CASES["tls-and-checks"].read_text().split("  sync:")[0])
    code, out, err = invoke("generate", str(manifest), "-o", str(tmp_path), "--consulrun-path", CONSULRUN)
    assert (code, out) == (2, "")  # the units record the file that made them: this is another file
    assert f"belongs to {CASES['tls-and-checks']}, not to {manifest}: two manifests named 'manifest'" in err
    copy = tmp_path / "edited" / "copy"
    copy.mkdir()
    shutil.copy(CASES["tls-and-checks"], copy / "manifest.yaml")
    assert invoke("generate", str(copy / "manifest.yaml"), "-o", str(copy / "units"), "--consulrun-path",
                  CONSULRUN)[0] == 0
    (copy / "manifest.yaml").write_text(manifest.read_text())  # the same file, one job less
    code, out, _ = invoke("generate", str(copy / "manifest.yaml"), "-o", str(copy / "units"), "--consulrun-path",
                          CONSULRUN)
    assert code == 0
    assert out.splitlines()[2:] == [f"removed {copy / 'units' / n}" for n in ("ops-sync.service", "ops-sync.timer")]
    assert sorted(p.name for p in (copy / "units").iterdir()) == ["ops-rotate-logs.service",
                                                                 "ops-rotate-logs.timer"]


def two_manifests(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("jobs:\n  backup: {command: 'true', schedule: daily}\n  rotate: {command: 'true', schedule: daily}\n")
    b.write_text("jobs:\n  report: {command: 'true', schedule: daily}\n")
    return a, b


def test_a_second_manifest_adds_up_and_never_removes_the_firsts_units(tmp_path: Path) -> None:
    a, b = two_manifests(tmp_path)
    out_dir = tmp_path / "units"
    assert invoke("generate", str(a), "-o", str(out_dir), "--consulrun-path", CONSULRUN)[0] == 0
    code, out, err = invoke("generate", str(b), "-o", str(out_dir), "--consulrun-path", CONSULRUN)
    assert code == 0, err
    assert "removed" not in out
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "consulrun-backup.service", "consulrun-backup.timer", "consulrun-report.service", "consulrun-report.timer",
        "consulrun-rotate.service", "consulrun-rotate.timer"]
    assert "\n# Manifest: a\n" in (out_dir / "consulrun-backup.timer").read_text()
    assert "\n# Manifest: b\n" in (out_dir / "consulrun-report.timer").read_text()
    # a.yaml loses a job: only its own unit goes
    a.write_text("jobs:\n  backup: {command: 'true', schedule: daily}\n")
    code, out, _ = invoke("generate", str(a), "-o", str(out_dir), "--consulrun-path", CONSULRUN)
    assert code == 0 and out.splitlines()[2:] == [f"removed {out_dir / 'consulrun-rotate.service'}",
                                                  f"removed {out_dir / 'consulrun-rotate.timer'}"]
    assert (out_dir / "consulrun-report.timer").exists()
    code, _, _ = invoke("generate", str(b), "-o", str(out_dir), "--check", "--consulrun-path", CONSULRUN)
    assert code == 0  # b's --check sees only b's units


def test_a_unit_of_another_manifest_in_the_way_is_refused_naming_both(tmp_path: Path) -> None:
    a, b = two_manifests(tmp_path)
    b.write_text("jobs:\n  backup: {command: 'false', schedule: daily}\n")  # the same unit name as a's job
    out_dir = tmp_path / "units"
    assert invoke("generate", str(a), "-o", str(out_dir), "--consulrun-path", CONSULRUN)[0] == 0
    before = {p.name: p.read_text() for p in out_dir.iterdir()}
    code, out, err = invoke("generate", str(b), "-o", str(out_dir), "--consulrun-path", CONSULRUN)
    assert (code, out) == (2, "")
    assert err.startswith(f"Error: {out_dir}/consulrun-backup.service belongs to manifest 'a', not to 'b'")
    assert {p.name: p.read_text() for p in out_dir.iterdir()} == before
    named = tmp_path / "named.yaml"  # a `name:` of another file's manifest does not make it that manifest
    named.write_text("name: a\n" + b.read_text())
    assert invoke("generate", str(named), "-o", str(out_dir), "--consulrun-path", CONSULRUN)[0] == 2
    a.write_text("name: a\n" + b.read_text())  # a.yaml given a name keeps the units it made
    assert invoke("generate", str(a), "-o", str(out_dir), "--consulrun-path", CONSULRUN)[0] == 0
    assert "ExecStart=/usr/local/bin/consulrun run" in (out_dir / "consulrun-backup.service").read_text()


def test_standard_input_needs_a_name(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["generate", "-", "-o", str(tmp_path)],
                                input="jobs:\n  x: {command: 'true', schedule: daily}\n")
    assert result.exit_code == 2 and "needs a top-level `name:` (or --name)" in result.stderr
    result = CliRunner().invoke(main, ["generate", "-", "-o", str(tmp_path), "--name", "piped"],
                                input="jobs:\n  x: {command: 'true', schedule: daily}\n")
    assert result.exit_code == 0, result.stderr
    assert "\n# Manifest: piped\n" in (tmp_path / "consulrun-x.timer").read_text()


def test_check_reports_diff_and_exit_status(tmp_path: Path) -> None:
    args = ("generate", str(CASES["minimal"]), "-o", str(tmp_path), "--consulrun-path", CONSULRUN)
    code, out, err = invoke(*args, "--check")
    assert code == 1
    assert "+++ b/consulrun-nightly.service" in out and "is out of date" in err
    assert list(tmp_path.iterdir()) == []
    assert invoke(*args)[0] == 0
    code, out, _ = invoke(*args, "--check")
    assert (code, out) == (0, f"{tmp_path} is up to date\n")


def test_stdout_listing() -> None:
    code, out, _ = invoke("generate", str(CASES["minimal"]), "-o", "-", "--consulrun-path", CONSULRUN)
    assert code == 0
    assert out.startswith("# --- consulrun-nightly.service\n# Generated by consulrun")
    assert "# --- consulrun-nightly.timer\n" in out


def test_refuses_to_overwrite_a_unit_it_did_not_generate(tmp_path: Path) -> None:
    foreign = tmp_path / "consulrun-nightly.timer"
    foreign.write_text("[Timer]\nOnCalendar=weekly\n")
    code, out, err = invoke("generate", str(CASES["minimal"]), "-o", str(tmp_path), "--consulrun-path", CONSULRUN)
    assert code == 74
    assert "not generated by consulrun" in err and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["consulrun-nightly.timer"]
    assert foreign.read_text() == "[Timer]\nOnCalendar=weekly\n"


def test_unwritable_output_fails_before_staging(tmp_path: Path) -> None:
    blocker = tmp_path / "file"  # a path below a regular file cannot be created, even by root
    blocker.write_text("keep\n")
    code, out, err = invoke("generate", str(CASES["minimal"]), "-o", str(blocker / "units"), "--consulrun-path", CONSULRUN)
    assert (code, out) == (74, "")
    assert f"cannot write units to {blocker / 'units'}" in err and "Not a directory" in err
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and blocker.read_text() == "keep\n"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount a tiny tmpfs (real ENOSPC from the kernel, at the point the options choose); unmounted after."""
    if os.geteuid() != 0:
        pytest.fail("mounting a small tmpfs needs root", pytrace=False)
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


# Each unit file of `minimal` takes one 4 KiB page. With one page, the second file is created but its write fails
# (stage() must remove it); with two inodes (the root and one file), creating the second file fails (write_units must
# remove the first, already staged).
@pytest.mark.parametrize("options", ["size=4k", "nr_inodes=2"])
def test_failure_after_partial_staging_leaves_no_temporary_files(small_fs: Callable[[str], Path], options: str) -> None:
    out = small_fs(options)
    code, stdout, err = invoke("generate", str(CASES["minimal"]), "-o", str(out), "--consulrun-path", CONSULRUN)
    assert (code, stdout) == (74, "")
    assert f"cannot write units to {out}" in err and "No space left on device" in err and "nothing changed" in err
    assert sorted(p.name for p in out.iterdir()) == []  # no .consulrun-*.service.XXXX left behind


def test_failed_rename_puts_back_what_was_renamed(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("a bind mount needs root", pytrace=False)
    out = tmp_path / "units"
    assert invoke("generate", str(CASES["minimal"]), "-o", str(out), "--consulrun-path", CONSULRUN)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # A mount point cannot be renamed over (EBUSY): the timer, renamed after the service, fails.
    pinned = out / "consulrun-nightly.timer"
    subprocess.run(["mount", "--bind", str(pinned), str(pinned)], check=True)
    try:
        code, _, err = invoke("generate", str(CASES["minimal"]), "-o", str(out), "--consulrun-path", "/opt/other/consulrun")
        assert code == 74, err
        assert "Device or resource busy" in err and "nothing changed" in err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the service got its old text back
    finally:
        subprocess.run(["umount", str(pinned)], check=True)


def test_template_override(tmp_path: Path) -> None:
    (tmp_path / "timer.j2").write_text("{{ header }}\n[Timer]\nOnCalendar={{ job.schedules[0] | unit_value }}\n")
    code, out, _ = invoke("generate", str(CASES["minimal"]), "-o", "-", "--templates", str(tmp_path),
                          "--consulrun-path", CONSULRUN)
    assert code == 0
    assert "[Timer]\nOnCalendar=daily\n" in out
    assert "Type=oneshot" in out  # the service template is still the shipped one


def test_template_with_undefined_variable_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "timer.j2").write_text("[Timer]\nOnCalendar={{ job.no_such_field }}\n")
    code, out, err = invoke("generate", str(CASES["minimal"]), "-o", str(tmp_path / "out"), "--templates", str(tmp_path),
                            "--consulrun-path", CONSULRUN)
    assert code == 2
    assert "template error" in err and "no_such_field" in err
    assert not (tmp_path / "out").exists()


def test_retry_job_on_a_schedule_too_dense_for_a_takeover_is_warned_about(tmp_path: Path) -> None:
    """accuracy + turns + 2 x ttl + lock_delay + timeout = 1s + 6s + 2 x 10s + 5s + 25s = 57s: every minute is fine;
    30 s apart (turns at most 3 s, a tenth of that) needs 54s, not fine."""
    from click.testing import CliRunner

    from consulrun.cli import main

    def generate(schedule: str, timer: str = "{}") -> str:
        path = tmp_path / "jobs.yaml"
        path.write_text(f"jobs:\n  dense:\n    command: ['true']\n    schedule: '{schedule}'\n    timeout: 25s\n"
                        f"    on_holder_loss: retry\n    lock: {{ttl: 10s, lock_delay: 5s}}\n    timer: {timer}\n"
                        f"  quiet:\n    command: ['true']\n    schedule: '*:0/1'\n    lock: {{ttl: 10s}}\n")
        result = CliRunner().invoke(main, ["generate", str(path), "-o", "-"])
        assert result.exit_code == 0, result.stderr
        return result.stderr

    assert generate("*:*:00") == ""
    # The timer's own randomized delay counts too: 57s + 10s.
    assert "can take 1m7s (timer accuracy + randomized delay 11s" in generate("*:*:00", "{randomized_delay: 10s}")
    warned = generate("*:*:0/30")
    assert warned.count("\n") == 1
    assert warned.startswith("warning: job dense: on_holder_loss: retry cannot promise at least once: occurrences "
                             "are 30s apart, but noticing a dead run and running it again can take 54s")


def test_units_of_an_older_consulrun_are_adopted_if_made_else_left_and_said(tmp_path: Path) -> None:
    """Units written before units named their manifest: replaced when this manifest makes them, else kept."""
    a, _ = two_manifests(tmp_path)
    out_dir = tmp_path / "units"
    assert invoke("generate", str(a), "-o", str(out_dir), "--consulrun-path", CONSULRUN)[0] == 0
    for path in out_dir.iterdir():  # as an older consulrun wrote them: no `# Manifest:` line
        path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                                if not line.startswith("# Manifest: ")))
    a.write_text("jobs:\n  backup: {command: 'true', schedule: daily}\n")
    code, out, err = invoke("generate", str(a), "-o", str(out_dir), "--consulrun-path", CONSULRUN)
    assert code == 0 and "removed" not in out
    assert err == (f"warning: left in place in {out_dir}: consulrun-rotate.service, consulrun-rotate.timer: made by "
                   "an older consulrun, they name no manifest (remove them by hand if no manifest makes them any "
                   "more)\n")
    assert "\n# Manifest: a\n" in (out_dir / "consulrun-backup.timer").read_text()
    assert (out_dir / "consulrun-rotate.timer").exists()


def test_the_example_manifest_reaches_no_one_elses_service() -> None:
    """README's first command renders examples/jobs.yaml; copied as is, it must ping nobody's real monitor (it
    carried a real service's URL with a made-up check id). Loopback or a reserved name (RFC 2606) only."""
    from urllib.parse import urlsplit

    example = load_manifest(CASES["example"])
    urls = [job.ping_url for job in example.jobs if job.ping_url] + [example.consul.address or ""]
    for url in filter(None, urls):
        host = urlsplit(url if "://" in url else f"http://{url}").hostname or ""
        assert host in ("127.0.0.1", "::1", "localhost") or host.endswith((".invalid", ".example", ".test")), url


def test_start_deadline_reaches_the_unit_s_run(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("defaults: {start_deadline: 1h}\njobs:\n  a: {command: ['true'], schedule: daily}\n"
                        "  b: {command: ['true'], schedule: daily, start_deadline: 10min}\n")
    from consulrun.manifest.loader import load_manifest
    from consulrun.units.render import render

    units = render(load_manifest(manifest), "/x/consulrun")
    assert " --start-deadline 1h " in units["consulrun-a.service"]
    assert " --start-deadline 10m " in units["consulrun-b.service"]  # as systemd writes it
