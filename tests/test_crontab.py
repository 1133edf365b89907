"""`consulrun import-crontab`: a crontab becomes a manifest that runs what cron ran, when cron ran it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.manifest.crontab import split_percent
from consulrun.manifest.loader import parse_manifest
from tests.conftest import require_tool

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def convert(text: str, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["import-crontab", "-", *args], input=text)
    return result.exit_code, result.stdout, result.stderr


def jobs(text: str, *args: str) -> dict:
    code, out, err = convert(text, *args)
    assert (code, err) == (0, ""), err
    parse_manifest(out, "<converted>")
    return yaml.safe_load(out)["jobs"]


def test_example_crontab_converts_to_the_example_manifest() -> None:
    result = CliRunner().invoke(main, ["import-crontab", str(EXAMPLES / "crontab")])
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == (EXAMPLES / "crontab.yaml").read_text().replace(
        "from examples/crontab.", f"from {EXAMPLES / 'crontab'}.")


@pytest.mark.systemd
def test_example_manifest_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    require_tool("systemd-analyze")
    result = CliRunner().invoke(main, ["generate", str(EXAMPLES / "crontab.yaml"), "-o", str(tmp_path),
                                       "--consulrun-path", "/usr/bin/env"])
    assert result.exit_code == 0, result.stderr
    verify = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, sorted(tmp_path.iterdir()))],
                            capture_output=True, text=True, cwd=tmp_path)
    assert (verify.returncode, verify.stderr) == (0, "")


def test_fields_macros_user_column_and_names() -> None:
    converted = jobs("0 2 * * * root /usr/sbin/backup --full\n@daily nobody /usr/bin/tidy\n"
                     "30 4 1,15 * 5 root /usr/bin/backup\n", "--system")
    assert converted == {
        "backup": {"command": "/usr/sbin/backup --full", "schedule": "*-*-* 02:00:00", "user": "root"},
        "tidy": {"command": "/usr/bin/tidy", "schedule": "*-*-* 00:00:00", "user": "nobody"},
        "backup-2": {"command": "/usr/bin/backup", "schedule": ["Fri *-*-* 04:30:00", "*-*-01,15 04:30:00"],
                     "user": "root"}}


def test_environment_lines_apply_to_the_entries_after_them() -> None:
    converted = jobs("0 1 * * * /bin/first\nA=1\n B = \"two words\" \nC='x y'\n0 2 * * * /bin/second\n"
                     "CRON_TZ=Europe/Berlin\nSHELL=/bin/bash\n0 3 * * * /bin/third | tee /tmp/t\n")
    assert converted["first"] == {"command": "/bin/first", "schedule": "*-*-* 01:00:00"}
    assert converted["second"]["environment"] == {"A": "1", "B": "two words", "C": "x y"}
    assert converted["third"] == {"command": ["/bin/bash", "-c", "/bin/third | tee /tmp/t"],
                                  "schedule": "*-*-* 03:00:00 Europe/Berlin",
                                  "environment": {"A": "1", "B": "two words", "C": "x y"}}


def test_mailto_is_kept_as_a_comment() -> None:
    code, out, err = convert("MAILTO=ops@example.com\n0 2 * * * /bin/true\n")
    assert (code, err) == (0, "")
    assert ("# line 1: MAILTO=ops@example.com -- not converted: a job's output goes to the journal, and consulrun "
            "has no on_failure alerting yet\n") in out


def test_shell_lines_get_shell_true_and_plain_lines_an_argv() -> None:
    converted = jobs("0 2 * * * /bin/echo 'a b' c\n0 3 * * * /bin/x > /dev/null 2>&1\n0 4 * * * cd /srv && make\n")
    assert converted["echo"] == {"command": "/bin/echo 'a b' c", "schedule": "*-*-* 02:00:00"}
    assert converted["x"]["shell"] is True and converted["cd"]["shell"] is True
    assert parse_manifest(yaml.safe_dump({"jobs": converted}), "-").jobs[0].command == ("/bin/sh", "-c", "cd /srv && make")


@pytest.mark.parametrize("entry, command, stdin", [
    ("cat", "cat", None),
    ("date +\\%F", "date +%F", None),
    ("mail -s hi root%line one%line two", "mail -s hi root", "line one\nline two\n"),
    ("cat%", "cat", ""),
    ("cat%a\\%b%", "cat", "a%b\n"),
    ("cat%a\\nb\\", "cat", "a\\nb\\\n"),
    ("echo \\\\%x", "echo \\\\", "x\n"),
])
def test_percent_is_read_as_cron_reads_it(entry: str, command: str, stdin: str | None) -> None:
    assert split_percent(entry) == (command, stdin)


def test_converted_percent_line_gives_the_command_its_input(tmp_path: Path) -> None:
    """Run the converted command with /bin/sh, as the unit would: cron's input arrives on standard input."""
    out = tmp_path / "out"
    converted = jobs(f"0 2 * * * cat > {out}; echo \\%done >> {out}%first line%second \\% line\n")
    job = parse_manifest(yaml.safe_dump({"jobs": converted}), "-").jobs[0]
    subprocess.run(job.command, check=True, stdin=subprocess.DEVNULL, env={"PATH": os.defpath})
    assert out.read_text() == "first line\nsecond % line\n%done\n"


def test_unconvertible_lines_are_reported_with_line_numbers_and_the_rest_printed() -> None:
    code, out, err = convert("0 2 * * * /bin/ok\n@reboot root /bin/warm\n0 0 L * * root /bin/x\n1 2 3\n"
                             "0 0 31 2 * root /bin/never\nMY-VAR=1\n0 0 * * * 7 /bin/y\n0 1 * * * root /bin/fine\n",
                             "--system")
    assert code == 2
    assert err.splitlines() == [
        "Error: <stdin>:1: cannot convert '0 2 * * * /bin/ok': expected 5 time fields, a user and a command, got only "
        "6 word(s)",
        "Error: <stdin>:2: cannot convert '@reboot root /bin/warm': @reboot runs at boot, not on a calendar; a systemd "
        "unit WantedBy=multi-user.target does that",
        "Error: <stdin>:3: cannot convert '0 0 L * * root /bin/x': day of month: 'L' is not a number",
        "Error: <stdin>:4: cannot convert '1 2 3': expected 5 time fields, a user and a command, got only 3 word(s)",
        "Error: <stdin>:5: cannot convert '0 0 31 2 * root /bin/never': '0 0 31 2 *' never fires (no such date)",
        "Error: <stdin>:6: 'MY-VAR' is not an environment variable name a unit can set",
        "Error: <stdin>:7: cannot convert '0 0 * * * 7 /bin/y': '7' is not a user name (is this a user crontab? "
        "leave out --system)",
    ]
    assert yaml.safe_load(out)["jobs"] == {"fine": {"command": "/bin/fine", "schedule": "*-*-* 01:00:00",
                                                    "user": "root"}}
    assert "# not converted: <stdin>:2: cannot convert '@reboot root /bin/warm'" in out


def test_a_value_no_unit_file_can_hold_is_reported_for_its_line() -> None:
    code, out, err = convert("0 2 * * * /bin/echo a\x00b\n0 3 * * * /bin/ok\n")
    assert code == 2
    assert err == ("Error: <stdin>:1: cannot convert '0 2 * * * /bin/echo a\\x00b': cannot be written to a unit "
                   "file: contains a NUL character\n")
    assert list(yaml.safe_load(out)["jobs"]) == ["ok"]


def test_nothing_convertible_prints_no_manifest() -> None:
    code, out, err = convert("@reboot /bin/warm\n")
    assert (code, out) == (2, "")
    assert err.startswith("Error: <stdin>:1: cannot convert")


def test_missing_file_is_a_one_line_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["import-crontab", str(tmp_path / "nope")])
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"Error: {tmp_path / 'nope'}: no such file\n")


def test_full_disk_exits_74_with_one_line(tmp_path: Path) -> None:
    import sys

    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "consulrun", "import-crontab", "-"], stdout=full,
                                stderr=subprocess.PIPE, input="0 2 * * * /bin/true\n", text=True, timeout=60,
                                env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)})
    assert (result.returncode, result.stderr) == (74, "Error: writing output failed: no space left on device\n")


def test_any_crontab_text_converts_or_reports_never_a_traceback() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    field = st.sampled_from(["*", "*/5", "0", "1-5", "mon", "jan-mar", "L", "99", "5/0", "@daily", "@reboot", "x=1"])
    words = st.text(alphabet=st.sampled_from(list("ab $%\\'\"|;&<>()`*#~={}!\t")), max_size=20)
    line = st.one_of(st.builds(lambda f, w: " ".join(f) + " " + w, st.lists(field, min_size=1, max_size=7), words),
                     st.text(max_size=40))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(line, max_size=6), st.booleans())
    def check(lines: list[str], system: bool) -> None:
        result = CliRunner().invoke(main, ["import-crontab", "-", *(["--system"] if system else [])],
                                    input="\n".join(lines) + "\n")
        assert result.exit_code in (0, 2), (lines, result.exception)
        assert result.exception is None or isinstance(result.exception, SystemExit), (lines, result.exception)
        if result.stdout:
            parse_manifest(result.stdout, "<converted>")
        assert all(line.startswith("Error: ") for line in result.stderr.splitlines())

    check()
