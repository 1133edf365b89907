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
    """Convert `text`; a user crontab (no --system) as alice's."""
    user = [] if "--system" in args or "--user" in args else ["--user", "alice"]
    result = CliRunner().invoke(main, ["import-crontab", "-", *user, *args], input=text)
    return result.exit_code, result.stdout, result.stderr


def jobs(text: str, *args: str) -> dict:
    code, out, err = convert(text, *args)
    assert (code, err) == (0, ""), err
    parse_manifest(out, "<converted>")
    return yaml.safe_load(out)["jobs"]


def test_example_crontab_converts_to_the_example_manifest() -> None:
    result = CliRunner().invoke(main, ["import-crontab", "--user", "alice", str(EXAMPLES / "crontab")])
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
    assert converted["first"] == {"command": "/bin/first", "schedule": "*-*-* 01:00:00", "user": "alice"}
    assert converted["second"]["environment"] == {"A": "1", "B": "two words", "C": "x y"}
    assert converted["third"] == {"command": ["/bin/bash", "-c", "/bin/third | tee /tmp/t"],
                                  "schedule": "*-*-* 03:00:00 Europe/Berlin", "user": "alice",
                                  "environment": {"A": "1", "B": "two words", "C": "x y"}}


def test_mailto_becomes_an_on_failure_that_mails_the_journal_lines(tmp_path: Path) -> None:
    """cron mails a job's output to MAILTO; the converted jobs mail it their journal lines when a run fails."""
    from consulrun.manifest.crontab import mail_on_failure

    code, out, err = convert("0 1 * * * /bin/before\nMAILTO=ops@example.com, dba@example.com\n0 2 * * * /bin/true\n"
                             "MAILTO=\"\"\n0 3 * * * /bin/after\n")
    assert (code, err) == (0, "")
    converted = yaml.safe_load(out)["jobs"]
    assert "on_failure" not in converted["before"] and "on_failure" not in converted["after"]
    assert converted["true"]["on_failure"] == mail_on_failure("ops@example.com, dba@example.com")
    assert ("# line 2: MAILTO=ops@example.com, dba@example.com -- the jobs after it mail ops@example.com, "
            "dba@example.com their last journal lines when a run fails (on_failure); cron mailed any output, of a "
            "run that succeeded too, which consulrun leaves in the journal\n") in out
    assert "# line 4: MAILTO=\"\" -- cron sends no mail for the lines after it; neither do their jobs\n" in out
    # The command, as `consulrun on-failure` runs it (the journal lines on its standard input), with sendmail
    # replaced by a recorder of its arguments and input.
    job = parse_manifest(out, "<converted>").jobs[[j.name for j in parse_manifest(out, "-").jobs].index("true")]
    record = tmp_path / "mail"
    recorder = tmp_path / "sendmail"
    recorder.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" > {record}\ncat >> {record}\n')
    recorder.chmod(0o755)
    argv = [arg.replace("/usr/sbin/sendmail", str(recorder)) for arg in job.on_failure]
    env = {"PATH": os.defpath, "CONSULRUN_JOB": "true", "CONSULRUN_NODE": "n1", "CONSULRUN_RESULT": "exit-code",
           "CONSULRUN_EXIT_STATUS": "3"}
    subprocess.run(argv, input="line one\nline two\n", text=True, env=env, check=True, timeout=60)
    assert record.read_text() == ("-i -- ops@example.com, dba@example.com\nTo: ops@example.com, dba@example.com\n"
                                  "Subject: true failed on n1 (exit-code, exit status 3)\n\nline one\nline two\n")


def test_a_mailto_that_is_not_an_address_list_is_reported() -> None:
    code, out, err = convert("MAILTO=-oQ/tmp/x root\n0 2 * * * /bin/true\n")
    assert code == 2
    assert err == ("Error: <stdin>:1: MAILTO='-oQ/tmp/x root' is not a list of mail addresses; the jobs after it get "
                   "no on_failure\n")
    assert "on_failure" not in yaml.safe_load(out)["jobs"]["true"]


def test_shell_lines_get_shell_true_and_plain_lines_an_argv() -> None:
    converted = jobs("0 2 * * * /bin/echo 'a b' c\n0 3 * * * /bin/x > /dev/null 2>&1\n0 4 * * * cd /srv && make\n")
    assert converted["echo"] == {"command": "/bin/echo 'a b' c", "schedule": "*-*-* 02:00:00",
                                 "user": "alice"}
    assert converted["x"]["shell"] is True and converted["make"]["shell"] is True
    assert parse_manifest(yaml.safe_dump({"jobs": {"make": converted["make"]}}), "-").jobs[0].command == (
        "/bin/sh", "-c", "cd /srv && make")


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
        result = subprocess.run([sys.executable, "-m", "consulrun", "import-crontab", "--user", "alice", "-"],
                                stdout=full,
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
        result = CliRunner().invoke(main, ["import-crontab", "-",
                                           *(["--system"] if system else ["--user", "alice"])],
                                    input="\n".join(lines) + "\n")
        assert result.exit_code in (0, 2), (lines, result.exception)
        assert result.exception is None or isinstance(result.exception, SystemExit), (lines, result.exception)
        if result.stdout:
            parse_manifest(result.stdout, "<converted>")
        assert all(line.startswith("Error: ") for line in result.stderr.splitlines())

    check()


# --- names: after what a line runs, past guards; after the file for a system file; unique across files ----------

@pytest.mark.parametrize("command, name", [
    ("test -x /usr/lib/sysstat/debian-sa1 && /usr/lib/sysstat/debian-sa1 1 1", "debian-sa1"),
    ("[ -x /usr/sbin/anacron ] || exit 0; /usr/sbin/anacron -s", "anacron"),
    ("if [ -x /usr/share/mdadm/checkarray ] && [ $(date +\\%d) -le 7 ]; then /usr/share/mdadm/checkarray --cron; fi",
     "checkarray"),
    ("command -v munin-run >/dev/null && munin-run --quiet", "munin-run"),
    ("[[ -d /srv ]] && cd /srv && nice -n 10 ionice -c3 /usr/bin/backup.sh --full", "backup.sh"),
    ("test -e /run/systemd/system || SERVICE_MODE=1 /usr/lib/e2fsprogs/e2scrub_all_cron", "e2scrub_all_cron"),
    ("date +\\%F >> /var/log/dates", "date"),
    ("test -x /nothing", "test"),
])
def test_a_job_is_named_after_what_it_runs_past_guards(command: str, name: str) -> None:
    assert list(jobs(f"0 2 * * * {command}\n")) == [name]


def test_several_system_files_name_jobs_after_the_file_unique_across_files(tmp_path: Path) -> None:
    """Two cron.d files whose lines both start with `test`: before, both jobs were `test`, and their units collided."""
    first, second, third = tmp_path / "sysstat", tmp_path / "munin-node", tmp_path / "crontab"
    first.write_text("5-55/10 * * * * root test -x /usr/lib/sysstat/debian-sa1 && debian-sa1 1 1\n"
                     "59 23 * * * root test -x /usr/lib/sysstat/debian-sa1 && debian-sa1 60 2\n")
    second.write_text("*/5 * * * * munin test -x /usr/sbin/munin-run && /usr/sbin/munin-run --quiet\n")
    third.write_text("0 3 * * * root test -x /usr/bin/munin-node && munin-node\n"
                     "0 4 * * * root test -x /usr/bin/munin-node && munin-node --again\n")
    result = CliRunner().invoke(main, ["import-crontab", "--system", str(first), str(second), str(third)])
    assert (result.exit_code, result.stderr) == (0, ""), result.stderr
    converted = yaml.safe_load(result.stdout)["jobs"]
    assert list(converted) == ["sysstat-debian-sa1", "sysstat-debian-sa1-2", "munin-node", "munin-node-2",
                               "munin-node-3"]
    assert converted["munin-node"]["user"] == "munin"
    assert f"  # {second} line 1: */5 * * * * munin test -x" in result.stdout
    parse_manifest(result.stdout, "<converted>")


def test_several_files_report_each_file_s_lines() -> None:
    result = CliRunner().invoke(main, ["import-crontab", "--user", "alice", "-", "-"],
                                input="@reboot /bin/x\n0 1 * * * /bin/y\n")
    assert result.exit_code == 2  # standard input read once, then empty
    assert result.stderr.startswith("Error: <stdin>:1: cannot convert '@reboot /bin/x'")


# --- what import-crontab writes loads back as exactly the jobs it converted ------------------------------------

REVIEWER_LINE = ("30 2 * * * alice /usr/bin/backup\u2028  zz-evil: {command: [/bin/sh, -c, 'id > /tmp/pwned'], "
                 "schedule: daily}\n")
# Every character YAML ends a line at (besides "\n"), control and format characters, and YAML's own punctuation.
HOSTILE = ["\r", "\x85", "\u2028", "\u2029", "\x00", "\x0b", "\x0c", "\x1b", "\x7f", "\x9b", "\ufeff", "\u202e",
           "\u200b", "\ud800", "\ue000", "\uffff", "\t", " ", "#", ":", "{", "}", "[", "]", "'", '"', "%", "\\", "&",
           "|", ">", "-", "*", "!", "a", "é", "/"]


def _unsafe_in_output(text: str) -> list[str]:
    import unicodedata

    return [ch for ch in text if ch != "\n" and unicodedata.category(ch) in {"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"}]


def test_a_line_break_in_a_cron_d_line_cannot_add_a_job() -> None:
    """The reviewer's line: a terminal shows one comment, YAML read a second job `zz-evil` with no user (root)."""
    code, out, err = convert(REVIEWER_LINE, "--system")
    assert (code, err) == (0, "")
    converted = yaml.safe_load(out)["jobs"]
    assert list(converted) == ["backup"] and converted["backup"]["user"] == "alice"
    assert _unsafe_in_output(out) == []
    assert len(parse_manifest(out, "<converted>").jobs) == 1


def test_whatever_a_crontab_holds_the_output_loads_as_exactly_its_jobs() -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from consulrun.manifest import crontab

    text = st.text(alphabet=st.sampled_from(HOSTILE), max_size=16)
    entry = st.builds(lambda user, command: f"0 2 * * * {user}/bin/{command}", st.sampled_from(["", "root "]), text)
    env = st.builds(lambda name, value: f"{name}={value}", st.sampled_from(["A", "MAILTO", "B_2", "SHELL"]), text)
    comment = st.builds(lambda body: "#" + body, text)

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.lists(st.one_of(entry, env, comment), min_size=1, max_size=6), st.booleans(),
           st.sampled_from(["<stdin>", "/etc/cron.d/x\u2028y: 1", "f"]))
    def check(lines: list[str], system: bool, source: str) -> None:
        source_text = "\n".join(lines) + "\n"
        user = None if system else "alice"
        part = crontab._read(source_text, source, system, user)  # what was converted, before any rendering
        try:
            out = crontab.convert_all([(source_text, source, system)], user=user)
        except crontab.CrontabError as exc:
            out = exc.manifest
        assert _unsafe_in_output(out) == [], (lines, out)
        loaded = yaml.safe_load(out) if out else {"jobs": {}}
        assert [data for data in loaded["jobs"].values()] == [job.data for job in part.jobs], (lines, out)
        assert len(loaded["jobs"]) == sum(line.startswith("  # line ") for line in out.splitlines())
        entries = sum(1 for line in lines if line.startswith("0 2 "))
        assert len(part.jobs) + sum(": cannot convert " in p for p in part.problems) == entries, (lines, part)
        if out:
            assert len(parse_manifest(out, "<converted>").jobs) == len(part.jobs)

    check()
