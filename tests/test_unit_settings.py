"""Per-job `service:`/`timer:` settings and `shell:`: what is refused, where, and what systemd itself says."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.manifest import unitsettings
from consulrun.cli import main
from consulrun.manifest.loader import load_manifest, parse_manifest
from consulrun.units.render import render
from tests.conftest import require_tool
from tests.harness.agents import wait_for

GOLDEN = Path(__file__).parent / "golden"


def errors(text: str) -> list[str]:
    result = CliRunner().invoke(main, ["generate", "-", "-o", "-"], input=text)
    assert result.exit_code == 2, result.stdout
    assert result.stdout == ""
    return [line.removeprefix("Error: ") for line in result.stderr.splitlines()]


def job(extra: str, command: str = "[/bin/true]") -> str:
    return f"jobs:\n  a:\n    command: {command}\n    schedule: daily\n{extra}"


@pytest.mark.parametrize("extra, message", [
    ("    service: {ExecStart: /bin/false}\n",
     "<stdin>:5:15: jobs.a.service.ExecStart: ExecStart= is consulrun's: consulrun writes it (consulrun run ... -- COMMAND); "
     "set the job's command"),
    ("    service:\n      KillMode: process\n",
     "<stdin>:6:7: jobs.a.service.KillMode: KillMode= is consulrun's: consulrun sets it so that systemd kills the whole job "
     "before another node can take the lock (see Fencing)"),
    ("    service: {Type: simple}\n", "<stdin>:5:15: jobs.a.service.Type: Type= is consulrun's: consulrun's units are "
                                     "Type=oneshot, which its timers and exit statuses rely on"),
    ("    service: {TimeoutStopSec: 1h}\n", "<stdin>:5:15: jobs.a.service.TimeoutStopSec: TimeoutStopSec= is consulrun's"),
    ("    service: {Environment: A=1}\n", "<stdin>:5:15: jobs.a.service.Environment: Environment= is consulrun's: set the "
                                         "job's environment"),
    ("    service: {ExecStartPre: /bin/true}\n", "<stdin>:5:15: jobs.a.service.ExecStartPre: ExecStartPre= is consulrun's: it "
                                                "would run on every node, outside the lock"),
    ("    timer: {Unit: other.service}\n", "<stdin>:5:13: jobs.a.timer.Unit: Unit= is consulrun's"),
    ("    timer: {OnCalendar: hourly}\n", "<stdin>:5:13: jobs.a.timer.OnCalendar: OnCalendar= is consulrun's: set the job's "
                                         "schedule"),
    ("    timer: {OnBootSec: 5min}\n", "<stdin>:5:13: jobs.a.timer.OnBootSec: OnBootSec= is consulrun's: a monotonic trigger"),
    ("    timer: {AccuracySec: 1min}\n", "<stdin>:5:13: jobs.a.timer.AccuracySec: AccuracySec= is consulrun's: set "
                                        "timer.accuracy"),
    ("    service: {Nicee: 5}\n", "<stdin>:5:15: jobs.a.service.Nicee: 'Nicee' is not a [Service] setting systemd documents "
                                 "(did you mean 'Nice'?)"),
    ("    service: {nice: 5}\n", "(did you mean 'Nice'?)"),
    ("    service: {'Nice=': 5}\n", "<stdin>:5:15: jobs.a.service['Nice=']: write the setting name without '=': Nice"),
    ("    service: {WakeSystem: true}\n", "WakeSystem= is a [Timer] setting, not a [Service] one; put it under timer:"),
    ("    timer: {Nice: 3}\n", "Nice= is a [Service] setting, not a [Timer] one; put it under service:"),
    ("    service: {OnFailure: alert.service}\n", "OnFailure= is a [Unit] or [Install] setting, not a [Service] one; consulrun "
                                                 "writes only [Service] and [Timer] settings"),
    ("    service: {SyslogIdentifier: 'a%b'}\n", "<stdin>:5:33: jobs.a.service.SyslogIdentifier: has a '%', which "
                                                "SyslogIdentifier= may or may not read as a specifier"),
    ("    service: {LoadCredential: 'consul-token:/x'}\n", "the credential id 'consul-token' is consulrun's"),
    ("    service: {Nice: 1.5}\n", "<stdin>:5:21: jobs.a.service.Nice: expected a string, integer, boolean or a list of "
                                  "them (quote values like 1.5), got a number"),
    ("    service: {ReadWritePaths: []}\n", "jobs.a.service.ReadWritePaths: must not be empty"),
    ("    service: {ReadWritePaths: [/a, {b: 1}]}\n", "jobs.a.service.ReadWritePaths[1]: expected a string, integer or "
                                                     "boolean (quote values like 1.5), got a mapping"),
    ("    service: {LogExtraFields: \"A=1\\nB=2\"}\n", "jobs.a.service.LogExtraFields: cannot be written to a unit file: "
                                                      "contains a newline"),
    ("    timer: {acuracy: 1s}\n", "<stdin>:5:13: jobs.a.timer.acuracy: unknown key 'acuracy' (did you mean 'accuracy'?)"),
])
def test_refused_settings_name_file_line_and_column(extra: str, message: str) -> None:
    lines = errors(job(extra))
    assert len(lines) == 1, lines
    assert message in lines[0]


def test_defaults_are_checked_and_merged_key_by_key() -> None:
    assert errors("defaults:\n  service: {KillMode: none}\n" + job("")) == [
        "<stdin>:2:13: defaults.service.KillMode: KillMode= is consulrun's: consulrun sets it so that systemd kills the "
        "whole job before another node can take the lock (see Fencing)"]
    manifest = parse_manifest("defaults:\n  service: {Nice: 5, PrivateTmp: true}\n  timer: {WakeSystem: true}\n"
                              + job("    service: {Nice: 7}\n    timer: {accuracy: 2s}\n"), "-")
    assert manifest.jobs[0].service_settings == (("Nice", "7"), ("PrivateTmp", "true"))
    assert manifest.jobs[0].timer_settings == (("WakeSystem", "true"),)
    assert manifest.jobs[0].timer.accuracy_ms == 2000


def test_every_setting_the_templates_write_is_refused() -> None:
    """Whatever the shipped templates set, a job cannot set again (LoadCredential: only the token's id;
    SyslogIdentifier: a job's own tag is written after consulrun's and wins, for all the unit's lines)."""
    manifest = load_manifest(GOLDEN / "tls-and-checks" / "manifest.yaml")
    units = render(manifest, "/usr/bin/consulrun")
    written: dict[str, set[str]] = {"service": set(), "timer": set()}
    for name, text in units.items():
        section = None
        for line in text.splitlines():
            if line.startswith("["):
                section = line.strip("[]").lower()
            elif section in written and "=" in line:
                written[section].add(line.split("=", 1)[0])
    assert written["service"] >= {"ExecStart", "Type", "KillMode", "TimeoutStopSec", "User", "Environment"}
    for section, names in written.items():
        for name in sorted(names - {"LoadCredential", "SyslogIdentifier"}):
            assert (unitsettings.name_problem(section, name) or "").startswith(f"{name}= is consulrun's"), name
    assert unitsettings.value_problem("LoadCredential", "consul-token:/etc/t") is not None
    assert unitsettings.name_problem("service", "SyslogIdentifier") is None


def test_owned_and_percent_settings_are_names_systemd_documents() -> None:
    for section, owned in unitsettings.OWNED.items():
        assert set(owned) <= set(unitsettings.known(section))
    assert unitsettings.PERCENT_SETTINGS <= set(unitsettings.known("service"))


@pytest.mark.systemd
def test_systemd_knows_every_listed_setting(tmp_path: Path) -> None:
    """The committed list, checked against systemd itself: no name in it is an unknown key."""
    require_tool("systemd-analyze")
    service = tmp_path / "all.service"
    service.write_text("[Service]\nExecStart=/bin/true\n" + "".join(f"{n}=\n" for n in unitsettings.known("service")))
    timer = tmp_path / "all.timer"
    timer.write_text("[Timer]\n" + "".join(f"{n}=\n" for n in unitsettings.known("timer")) + "OnCalendar=daily\n")
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(service), str(timer)], capture_output=True,
                            text=True, cwd=tmp_path)
    assert "Unknown key" not in result.stderr and "Unknown section" not in result.stderr, result.stderr
    assert re.search(r"Unknown key 'NoSuchSetting'", subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(_unit(tmp_path, "NoSuchSetting=1"))], capture_output=True,
        text=True, cwd=tmp_path).stderr)


def _unit(tmp_path: Path, line: str) -> Path:
    path = tmp_path / "one.service"
    path.write_text(f"[Service]\nExecStart=/bin/true\n{line}\n")
    return path


@pytest.mark.systemd
@pytest.mark.parametrize("name", sorted(unitsettings.PERCENT_SETTINGS))
def test_percent_settings_resolve_no_specifiers(name: str, tmp_path: Path) -> None:
    """50% is valid as written, and 50%% is not: systemd reads these values without specifiers."""
    require_tool("systemd-analyze")

    def verify(value: str) -> str:
        return subprocess.run(["systemd-analyze", "verify", "--man=no", str(_unit(tmp_path, f"{name}={value}"))],
                              capture_output=True, text=True, cwd=tmp_path).stderr

    assert verify("50%") == ""
    assert "50%%" in verify("50%%")


# --- shell ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command, what", [
    ("/usr/bin/report | gzip > /tmp/r.gz", "the operator '|' at character 17"),
    ("a && b", "the operator '&&' at character 3"),
    ("a; b", "the operator ';' at character 2"),
    ("echo $HOME", "the expansion '$HOME' at character 6"),
    ("echo \"${HOME}/x\"", "the expansion '${HOME}' at character 7"),
    ("echo $(date)", "the expansion '$(' at character 6"),
    ("rm /tmp/*.log", "the wildcard '*' at character 9"),
    ("FOO=1 /bin/x", "the variable assignment 'FOO=' at character 1"),
    ("/bin/x # note", "a '#' comment at character 8"),
    ("if true; then x; fi", "the shell keyword 'if' at character 1"),
    ("echo \"\\$HOME\"", "a backslash escape of '$' or '`' inside double quotes at character 7"),
])
def test_shell_syntax_without_shell_is_an_error_that_suggests_it(command: str, what: str) -> None:
    assert errors(job("", command=json.dumps(command))) == [
        f"<stdin>:3:14: jobs.a.command: has shell syntax ({what}) that would be passed on literally, not interpreted; "
        "add 'shell: true' to run it with /bin/sh -c, or quote it"]


@pytest.mark.parametrize("command", ["/bin/echo 'a | b' \"c > d\" '$HOME'", "/bin/x --budget 50% a#b", "/bin/x a\\|b"])
def test_quoted_or_escaped_syntax_is_not_shell_syntax(command: str) -> None:
    assert parse_manifest(job("", command=json.dumps(command)), "-").jobs[0].command[0].startswith("/bin/")


def test_shell_true_runs_bin_sh_c_and_escapes_for_exec_start() -> None:
    manifest = parse_manifest(job("    shell: true\n", command="'tar c /srv | gzip > /b/$(date +%F).tgz'"), "-")
    assert manifest.jobs[0].command == ("/bin/sh", "-c", "tar c /srv | gzip > /b/$(date +%F).tgz")
    service = render(manifest, "/usr/bin/consulrun")["consulrun-a.service"]
    assert 'a -- /bin/sh -c "tar c /srv | gzip > /b/$$(date +%%F).tgz"\n' in service


def test_shell_true_with_a_list_command_is_an_error() -> None:
    assert errors(job("    shell: true\n", command="[/bin/true]")) == [
        "<stdin>:5:12: jobs.a.shell: shell: true runs one command string with /bin/sh -c; write the command as a string, "
        "or drop shell: and keep the list"]


# --- settings that would weaken the stop sequence fencing relies on (systemd.kill(5), systemd.service(5)) --------

@pytest.mark.parametrize("extra, message", [
    ("    service: {TimeoutStopFailureMode: abort}\n",
     "<stdin>:5:39: jobs.a.service.TimeoutStopFailureMode: TimeoutStopFailureMode=abort is refused (terminate or kill "
     "are accepted): an abort sends WatchdogSignal= instead of the final kill and then waits TimeoutAbortSec="),
    ("    service: {TimeoutStartFailureMode: Abort}\n", "TimeoutStartFailureMode=Abort is refused"),
    ("    service: {WatchdogSignal: SIGCONT}\n",
     "<stdin>:5:15: jobs.a.service.WatchdogSignal: WatchdogSignal= is refused: it replaces the final SIGKILL"),
    ("    service: {TimeoutAbortSec: infinity}\n",
     "<stdin>:5:15: jobs.a.service.TimeoutAbortSec: TimeoutAbortSec= is refused: it is the wait between an abort's "
     "WatchdogSignal= and the final SIGKILL (infinity: for ever)"),
    ("    service: {RestartKillSignal: SIGKILL}\n",
     "<stdin>:5:15: jobs.a.service.RestartKillSignal: RestartKillSignal= is refused: on `systemctl restart` the wrapper "
     "must get SIGTERM"),
    ("    service: {SendSIGKILL: false}\n", "<stdin>:5:15: jobs.a.service.SendSIGKILL: SendSIGKILL= is consulrun's"),
    ("    service: {FinalKillSignal: SIGCONT}\n", "FinalKillSignal= is consulrun's: consulrun sets it so that systemd "
                                                 "kills the whole job"),
    ("    service: {KillSignal: SIGCONT}\n", "KillSignal= is consulrun's"),
    ("    service: {KillMode: mixed}\n", "KillMode= is consulrun's"),
])
def test_settings_that_weaken_the_kill_sequence_are_refused_with_the_reason(extra: str, message: str) -> None:
    problems = errors(job(extra))
    assert len(problems) == 1, problems
    assert problems[0].startswith(message) if message.startswith("<") else message in problems[0], problems


def test_the_kill_sequence_settings_are_names_systemd_documents() -> None:
    assert set(unitsettings.KILL_SEQUENCE) | set(unitsettings.KILL_SEQUENCE_MODES) <= set(unitsettings.known("service"))


@pytest.mark.systemd
@pytest.mark.parametrize("extra", ["    service: {TimeoutStopFailureMode: kill, TimeoutStartFailureMode: terminate}\n",
                                   "    service: {SendSIGHUP: true}\n"])
def test_modes_that_keep_the_final_kill_render_and_pass_verify(extra: str, tmp_path: Path) -> None:
    require_tool("systemd-analyze")
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(job(extra))
    out = tmp_path / "units"
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", str(out), "--consulrun-path", "/usr/bin/env"])
    assert result.exit_code == 0, result.stderr
    verify = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, sorted(out.glob("*.service")))],
                            capture_output=True, text=True, cwd=out)
    assert (verify.returncode, verify.stderr) == (0, ""), verify.stderr


def _show(ctr, unit: str) -> dict[str, str]:  # noqa: ANN001 - tests.harness.nspawn.Container
    out = ctr.systemctl("show", "-p", "ActiveState,SubState,MainPID,TimeoutAbortUSec", unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_a_booted_systemd_takes_the_abort_path_with_no_final_kill(systemd_container) -> None:  # noqa: ANN001
    """Why TimeoutStopFailureMode=abort is refused, asked of systemd as PID 1: a job that ignores SIGTERM is, after
    TimeoutStopSec=, sent WatchdogSignal= (SIGCONT) and waits TimeoutAbortSec=infinity alive in `stop-watchdog`;
    with the default mode the same job gets the final SIGKILL."""
    ctr = systemd_container
    body = ("[Service]\nType=oneshot\nExecStart=/bin/sh -c 'trap \"\" TERM; while :; do sleep 1; done'\n"
            "TimeoutStopSec=1s\n")
    units = {"crabort.service": body + "TimeoutStopFailureMode=abort\nWatchdogSignal=SIGCONT\n"
                                       "TimeoutAbortSec=infinity\n",
             "crterminate.service": body}
    for name, text in units.items():
        (ctr.unit_dir / name).write_text(text)
    ctr.systemctl("daemon-reload")
    try:
        for name in units:
            ctr.systemctl("start", "--no-block", name)
            wait_for(lambda name=name: _show(ctr, name)["MainPID"] != "0", 30, f"{name} to run")
            ctr.systemctl("stop", "--no-block", name)
        def in_abort() -> dict[str, str] | None:
            state = _show(ctr, "crabort.service")
            return state if state["SubState"] == "stop-watchdog" else None

        aborted = wait_for(in_abort, 60, "the abort path")
        assert aborted["TimeoutAbortUSec"] == "infinity" and aborted["MainPID"] != "0", aborted
        wait_for(lambda: _show(ctr, "crterminate.service")["ActiveState"] in ("inactive", "failed"), 60,
                 "the final SIGKILL of the default mode")
        state = _show(ctr, "crabort.service")
        assert (state["SubState"], state["MainPID"] != "0") == ("stop-watchdog", True), state
    finally:
        for name in units:
            ctr.systemctl("kill", "--signal=SIGKILL", name, check=False)
            (ctr.unit_dir / name).unlink()
        ctr.systemctl("daemon-reload", check=False)
