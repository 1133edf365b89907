"""Every way a manifest can be wrong: the message, its FILE:LINE:COL, exit 2, nothing written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.durations import DurationError, format_duration, parse_duration
from consulrun.manifest import LockSettings, load_manifest
from tests.conftest import require_tool

OK_JOB = "    command: [/bin/true]\n    schedule: daily\n"

# (manifest text, line, column, words the message must contain)
CASES = {
    "unknown-top-key": ("jobz:\n  a:\n" + OK_JOB, 1, 1, ["unknown key 'jobz'", "did you mean 'jobs'"]),
    "unknown-job-key": ("jobs:\n  a:\n" + OK_JOB + "    scheduel: daily\n", 5, 5, ["unknown key 'scheduel'", "'schedule'"]),
    "unknown-lock-key": ("jobs:\n  a:\n" + OK_JOB + "    lock: {tll: 20s}\n", 5, 12, ["jobs.a.lock", "did you mean 'ttl'"]),
    "missing-command": ("jobs:\n  a:\n    schedule: daily\n", 3, 5, ["jobs.a", "missing required key 'command'"]),
    "missing-schedule": ("jobs:\n  a:\n    command: /bin/true\n", 3, 5, ["missing required key 'schedule'"]),
    "wrong-type": ("jobs:\n  a:\n" + OK_JOB + "    user: [root]\n", 5, 11, ["jobs.a.user", "must be a user name"]),
    "wrong-type-bool": ("jobs:\n  a:\n" + OK_JOB + "    timer: {persistent: maybe}\n", 5, 25,
                        ["jobs.a.timer.persistent", "must be boolean, not a string"]),
    "bad-duration": ("jobs:\n  a:\n" + OK_JOB + "    timeout: 5 minutes\n", 5, 14, ["jobs.a.timeout", "must be a duration"]),
    "ttl-range": ("jobs:\n  a:\n" + OK_JOB + "    lock: {ttl: 2s}\n", 5, 17, ["jobs.a.lock.ttl", "out of range"]),
    "lock-delay-zero": ("defaults:\n  lock: {lock_delay: 0}\njobs:\n  a:\n" + OK_JOB, 2, 22,
                        ["defaults.lock.lock_delay", "out of range", "partitioned holder"]),
    "bad-job-name": ("jobs:\n  bad/name:\n" + OK_JOB, 2, 3, ["'bad/name'", "unit names and KV keys"]),
    "duplicate-job": ("jobs:\n  a:\n" + OK_JOB + "  a:\n" + OK_JOB, 5, 3, ["duplicate key 'a'", "line 2"]),
    "duplicate-nested": ("jobs:\n  a:\n" + OK_JOB + "    schedule: hourly\n", 5, 5, ["duplicate key 'schedule'"]),
    "empty-file": ("", 1, 1, ["the manifest is empty"]),
    "comments-only": ("# nothing here\n", 1, 1, ["the manifest is empty"]),
    "top-level-list": ("- jobs\n", 1, 1, ["top level must be a mapping", "not a list"]),
    "no-jobs": ("jobs: {}\n", 1, 7, ["at least one job"]),
    "bad-calendar": ("jobs:\n  a:\n    command: [/bin/true]\n    schedule: Mon *-*-* 25:00\n", 4, 15,
                     ["jobs.a.schedule", "not a valid calendar expression"]),
    "bad-calendar-in-list": ("jobs:\n  a:\n    command: [/bin/true]\n    schedule: [daily, 'foo']\n", 4, 23,
                             ["jobs.a.schedule[1]", "'foo'"]),
    "yaml-syntax": ("jobs:\n  a: [unclosed\n", 3, 1, ["YAML syntax error"]),
    "unsplittable-command": ("jobs:\n  a:\n    command: 'echo \"unterminated'\n    schedule: daily\n", 3, 14,
                             ["cannot split command"]),
    "newline-in-description": ("jobs:\n  a:\n" + OK_JOB + "    description: \"two\\nlines\"\n", 5, 18,
                               ["jobs.a.description", "cannot be written to a unit file", "newline"]),
    "env-name": ("jobs:\n  a:\n" + OK_JOB + "    environment: {'1BAD': x}\n", 5, 19, ["'1BAD'", "environment variable name"]),
    "env-bool": ("jobs:\n  a:\n" + OK_JOB + "    environment: {DEBUG: yes}\n", 5, 26, ["jobs.a.environment.DEBUG", "quote"]),
    "relative-path": ("jobs:\n  a:\n" + OK_JOB + "    working_directory: srv\n", 5, 24, ["absolute path"]),
    "concurrency-zero": ("jobs:\n  a:\n" + OK_JOB + "    lock: {concurrency: 0}\n", 5, 25, ["between 1 and 1000"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_manifest(case: str, tmp_path: Path) -> None:
    text, line, col, words = CASES[case]
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(text)
    out = tmp_path / "units"
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", str(out), "--consulrun-path", "/x/consulrun"])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"Error: {manifest}:{line}:{col}: "), result.stderr
    for word in words:
        assert word in first, result.stderr
    assert not out.exists()


def test_all_errors_reported_at_once(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a:\n    command: [/bin/true]\n    schedule: foo\n    tiemout: 1h\n"
                        "  b:\n    schedule: daily\n    lock: {ttl: 1s}\n")
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-"])
    lines = result.stderr.splitlines()
    assert result.exit_code == 2
    assert [line.split(": ", 2)[1].rsplit(":", 2)[1:] for line in lines] == [["4", "15"], ["5", "5"], ["7", "5"], ["8", "17"]]
    assert all(line.startswith(f"Error: {manifest}:") for line in lines)


def test_unreadable_manifest(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["generate", str(tmp_path / "missing.yaml"), "-o", "-"])
    assert result.exit_code == 2
    assert "cannot read manifest" in result.stderr


def test_defaults_merge_key_by_key(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("defaults:\n  lock: {ttl: 30s, concurrency: 2}\njobs:\n  a:\n" + OK_JOB + "    lock: {ttl: 20s}\n")
    job = load_manifest(manifest).jobs[0]
    assert job.lock == LockSettings(ttl_ms=20_000, concurrency=2)


def test_string_command_is_split_like_a_shell(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a:\n    command: /bin/echo 'two words' \"and $NOT_EXPANDED\"\n    schedule: daily\n")
    assert load_manifest(manifest).jobs[0].command == ("/bin/echo", "two words", "and $NOT_EXPANDED")


SPECS = ["daily", "*-*-* 02:00:00", "Mon..Fri 09:00", "hourly", "weekly", "quarterly", "*:0/5",
         "*-*-* 02:00:00 Europe/Berlin", "Mon *-*-* 25:00", "2026-02-30", "*-*~1", "foo", "Sun..Mon", "1..5",
         "*-*-* 00:00:00 Mars/Base", "*-*-* 00:60", "Mon,Tue 10:00", "00:00 UTC", "semiannually", "*-2-29",
         "*:0/0", "2026-13-01", "d a i l y", "Fri *-*-13 13:00", "*-*-* *:*:*", "Sat,Sun 08..10:00"]


@pytest.mark.systemd
@pytest.mark.parametrize("spec", SPECS)
def test_schedule_validation_agrees_with_systemd(spec: str, tmp_path: Path) -> None:
    require_tool("systemd-analyze")
    systemd_ok = subprocess.run(["systemd-analyze", "calendar", spec], capture_output=True).returncode == 0
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(f"jobs:\n  a:\n    command: [/bin/true]\n    schedule: '{spec}'\n")
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
    assert (result.exit_code == 0) == systemd_ok, result.stderr


# Every range check at both edges: the value on the edge is accepted, one step past it is refused with the message.
BOUNDS = [
    ("lock", "ttl", "10s", "9999ms", "Consul accepts a session TTL from 10s to 24h"),
    ("lock", "ttl", "24h", "86400001ms", "Consul accepts a session TTL from 10s to 24h"),
    ("lock", "ttl", 10, 9, "Consul accepts a session TTL from 10s to 24h"),
    ("lock", "ttl", 86400, 86401, "Consul accepts a session TTL from 10s to 24h"),
    ("lock", "lock_delay", 60, 61, "lock_delay must be 5s to 60s; less would let another node start before a "
                                   "partitioned holder stops"),
    ("lock", "lock_delay", "5s", "4999ms", "lock_delay must be 5s to 60s; less would let another node start before a "
                                           "partitioned holder stops"),
    ("lock", "lock_delay", "60s", "60001ms", "lock_delay must be 5s to 60s; less would let another node start before "
                                             "a partitioned holder stops"),
    ("lock", "concurrency", 1, 0, "must be between 1 and 1000"),
    ("lock", "concurrency", 1000, 1001, "must be between 1 and 1000"),
    ("lock", "skip_exit_code", 0, -1, "must be between 0 and 255"),
    ("lock", "skip_exit_code", 255, 256, "must be between 0 and 255"),
    (None, "history", 1, 0, "must be between 1 and 1000"),
    (None, "history", 1000, 1001, "must be between 1 and 1000"),
]


@pytest.mark.parametrize(("block", "key", "edge", "past", "message"), BOUNDS,
                         ids=[f"{b[1]}-{b[2]}" for b in BOUNDS])
def test_range_edges(block: str | None, key: str, edge: object, past: object, message: str, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    for value, accepted in ((edge, True), (past, False)):
        setting = f"    {block}: {{{key}: {value}}}\n" if block else f"    {key}: {value}\n"
        manifest.write_text("jobs:\n  a:\n" + OK_JOB + setting)
        result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
        if accepted:
            assert result.exit_code == 0, result.stderr
            ms = value * 1000 if isinstance(value, int) else parse_duration(str(value))
            rendered = {"ttl": f"--ttl {format_duration(ms)} ", "lock_delay": f"--lock-delay {format_duration(ms)} "}
            assert rendered.get(key, "") in result.stdout  # the value reaches the unit as the manifest said
        else:
            assert result.exit_code == 2 and result.stdout == ""
            (line,) = result.stderr.splitlines()
            where = f"jobs.a.{block + '.' if block else ''}{key}"
            if message.startswith("must be between"):
                assert line.endswith(f"{where}: {message}, not {past}"), line
            else:
                assert line.endswith(f"{where}: {past!r} is out of range: {message}"), line


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ("0", "500ms", "15s", "1m30s", "2h", "1d", "1h1m1s1ms")] == \
        [0, 500, 15_000, 90_000, 7_200_000, 86_400_000, 3_661_001]
    with pytest.raises(DurationError) as caught:
        parse_duration("5 minutes")
    assert str(caught.value) == "'5 minutes' is not a duration (use e.g. 500ms, 15s, 1m30s, 2h)"


@pytest.mark.parametrize("key", ["ttl", "lock_delay"])
def test_boolean_duration_is_one_type_error_not_a_range_error(key: str, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a:\n" + OK_JOB + f"    lock: {{{key}: true}}\n")
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert f"jobs.a.lock.{key}: True must be a duration such as" in line, line


def test_a_malformed_job_does_not_hide_the_next_jobs_problems(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a: 5\n  b:\n" + OK_JOB + "    lock: {ttl: 2s}\n")
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and "jobs.a:" in lines[0] and "jobs.b.lock.ttl: '2s' is out of range" in lines[1], lines
