"""`service:` values systemd would ignore are refused at load; systemd is the oracle.

systemd logs `Invalid memory limit 'lots', ignoring` and runs the job without the limit; the
manifest said `valid: 1 job`. tests/unit_values.txt holds values with systemd's verdict beside
each: systemd must still give it, and the loader must agree with it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.errors import ManifestError
from consulrun.manifest import unitsettings
from consulrun.manifest.loader import parse_manifest
from tests.conftest import require_tool

TABLE = Path(__file__).parent / "unit_values.txt"


def cases() -> list[tuple[str, str, str]]:
    """(verdict, setting, value) for each line of the table."""
    out = []
    for line in TABLE.read_text().splitlines():
        if line and not line.startswith("#"):
            verdict, setting = line.split(None, 1)
            name, value = setting.split("=", 1)
            out.append((verdict, name, value))
    return out


def test_the_table_covers_every_setting_checked_both_ways() -> None:
    from consulrun.manifest.unitvalues import CHECKS

    verdicts = {(name, verdict) for verdict, name, _ in cases()}
    tested = {name for name, _ in verdicts}
    # the same check as a setting in the table (a boolean, a count, a size) covers these
    alike = {"IOAccounting", "IPAccounting", "TasksAccounting", "PrivateIPC", "PrivateMounts",
             "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectClock",
             "RestrictRealtime", "RestrictSUIDSGID", "MemoryDenyWriteExecute", "RemoveIPC",
             "DynamicUser", "MountAPIVFS", "CPUAccounting", "LimitAS", "LimitDATA", "LimitSTACK",
             "LimitRSS", "LimitLOCKS", "LimitSIGPENDING", "LimitMSGQUEUE", "LimitMEMLOCK"}
    assert set(CHECKS) - tested <= alike
    assert len(cases()) > 150


@pytest.mark.systemd
def test_systemd_analyze_verify_still_gives_the_table_s_verdicts(tmp_path: Path) -> None:
    """One unit holding every case on a line of its own: systemd names the lines it ignores."""
    require_tool("systemd-analyze")
    unit = tmp_path / "values.service"
    head = ["[Service]", "Type=oneshot", "ExecStart=/bin/true"]
    table = cases()
    body = [f"{name}={unitsettings.escape(name, value)}" for _, name, value in table]
    unit.write_text("\n".join(head + body) + "\n")
    verify = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    ignored = {int(line.split(":")[1]) for line in verify.stderr.splitlines()
               if line.startswith(f"{unit}:")}
    systemd = [("invalid" if len(head) + 1 + index in ignored else "valid", name, value)
               for index, (_, name, value) in enumerate(table)]
    assert [case for case, said in zip(table, systemd) if case != said] == []


@pytest.mark.parametrize("verdict, name, value", cases())
def test_the_loader_agrees_with_systemd(verdict: str, name: str, value: str) -> None:
    text = (f"jobs:\n  a:\n    command: [/bin/true]\n    schedule: daily\n    service:\n"
            f"      {name}: '{value}'\n")
    try:
        parse_manifest(text, "jobs.yaml")
        ours = "valid"
    except ManifestError as exc:
        assert exc.problems[0].startswith(f"jobs.yaml:6:"), exc.problems
        ours = "invalid"
    assert ours == verdict


def test_the_issue_s_values_are_refused_each_with_file_line_and_why() -> None:
    manifest = "jobs:\n  a:\n    command: [/bin/true]\n    schedule: daily\n    service:\n" \
               "      MemoryMax: lots\n      CPUQuota: abc\n      Nice: 99\n"
    result = CliRunner().invoke(main, ["validate", "-"], input=manifest)
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        "Error: <stdin>:6:18: jobs.a.service.MemoryMax: MemoryMax=lots is ignored by systemd: "
        "'lots' is not a size (512M, 2G), infinity or a percentage up to 100%",
        "Error: <stdin>:7:17: jobs.a.service.CPUQuota: CPUQuota=abc is ignored by systemd: "
        "'abc' is not a percentage above 0% (100% is one CPU)",
        "Error: <stdin>:8:13: jobs.a.service.Nice: Nice=99 is ignored by systemd: '99' is not "
        "a whole number from -20 to 19",
    ]
