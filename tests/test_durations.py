"""Durations are read as systemd reads a time span; `systemd-analyze timespan` is the oracle."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.manifest.durations import PATTERN, DurationError, format_duration, parse_duration
from consulrun.manifest.schema import SCHEMA
from tests.conftest import require_tool

# text -> milliseconds (None: refused). Each one is also put to systemd-analyze below.
CASES = {
    "500ms": 500, "15s": 15_000, "1m30s": 90_000, "2h": 7_200_000, "1d": 86_400_000, "0": 0, "15": 15_000,
    "10 min": 600_000, "1h 30min": 5_400_000, "1.5h": 5_400_000, "5 minutes": 300_000, "2 hr 3 sec": 7_203_000,
    "1w": 604_800_000, "1M": 2_629_800_000, "1y": 31_557_600_000, " 5s ": 5_000, "5 s 3": 8_000, "1h30": 3_630_000,
    ".5s": 500, "3 days 2 hours": 266_400_000, "1 msec": 1, "2000us": 2, "1 week": 604_800_000,
    "5mins": None, "1,5h": None, "5S": None, "1e3s": None, "": None, "soon": None, "5 sex": None,
}


@pytest.mark.parametrize("text", sorted(CASES))
def test_parse(text: str) -> None:
    if CASES[text] is None:
        with pytest.raises(DurationError):
            parse_duration(text)
    else:
        assert parse_duration(text) == CASES[text]
    assert bool(re.fullmatch(PATTERN, text)) == (CASES[text] is not None)


@pytest.mark.systemd
@pytest.mark.parametrize("text", sorted(t for t in CASES if t))
def test_systemd_agrees(text: str) -> None:
    require_tool("systemd-analyze")
    result = subprocess.run(["systemd-analyze", "timespan", text], capture_output=True, text=True)
    match = re.search(r"μs: (\d+)", result.stdout)
    systemd_ms = int(match.group(1)) / 1000 if result.returncode == 0 and match else None
    assert systemd_ms == CASES[text]


def test_finer_than_a_millisecond_is_refused() -> None:
    with pytest.raises(DurationError, match="finer than a millisecond"):
        parse_duration("500us")


def test_schema_pattern_is_the_parser_grammar() -> None:
    assert SCHEMA["$defs"]["duration"]["pattern"] == PATTERN


@pytest.mark.parametrize("ms", [0, 1, 999, 1000, 90_000, 5_400_000, 86_400_000, 3_723_004])
def test_canonical_form_reads_back(ms: int) -> None:
    assert parse_duration(format_duration(ms)) == ms


def test_an_out_of_range_duration_written_with_M_says_M_is_months(tmp_path: Path) -> None:
    """`--ttl 5M` said only `3652h30m is out of range`: systemd's `M` is months, a typo for `m` (minutes)."""
    result = CliRunner().invoke(main, ["run", "--ttl", "5M", "j", "--", "true"])
    assert result.exit_code == 2
    assert result.stderr == ("Error: --ttl: 3652h30m is out of range: must be 10s to 24h; `M` is months, "
                             "`m` minutes\n"), result.stderr
    result = CliRunner().invoke(main, ["run", "--ttl", "48h", "j", "--", "true"])
    assert result.exit_code == 2 and "months" not in result.stderr, result.stderr
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a: {command: 'true', schedule: daily, timeout: 500M}\n")
    result = CliRunner().invoke(main, ["validate", str(manifest)])
    assert result.exit_code == 2
    assert "jobs.a.timeout: '500M' is out of range: at most 8784h; `M` is months, `m` minutes" in result.stderr


# Durations in log lines (timefmt.duration): seconds as a float -> what a line prints. Each one also reads back,
# through systemd-analyze below, as the same span to within the rounding the form allows.
LOG_CASES = {0: "0s", 0.0004: "0s", 0.94226: "942ms", 0.9996: "1s", 1: "1s", 5.34: "5.3s", 9.96: "10s", 10: "10s",
             15.4: "15s", 59.6: "1m", 90: "1m30s", 3600: "1h", 7322.5: "2h2m2s", -3: "0s"}


@pytest.mark.parametrize("seconds", sorted(LOG_CASES))
def test_log_line_durations_are_written_as_systemd_writes_them(seconds: float) -> None:
    from consulrun.timefmt import duration

    text = duration(seconds)
    assert text == LOG_CASES[seconds]
    require_tool("systemd-analyze")
    out = subprocess.run(["systemd-analyze", "timespan", text], capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    micros = int(re.search(r"μs: (\d+)", out.stdout).group(1))
    assert abs(micros / 1e6 - max(0.0, seconds)) <= max(0.0005, 0.05 * max(0.0, seconds), 0.5 if seconds >= 10 else 0)
