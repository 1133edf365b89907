"""`hardening: strict` relaxed for what a unit must see is said at generate, and the docs' list is
what is rendered.

Units generated from a checkout under /tmp got `ProtectHome=read-only` and no `PrivateTmp=` with
no word, and the preset list in docs/manifest.md said `ProtectHome=yes`, `PrivateTmp=`.
"""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from consulrun.cli import main

DOCS = Path(__file__).resolve().parents[1] / "docs" / "manifest.md"
INSTALLED = "/usr/bin/env"  # a consulrun path in no home and no /tmp, and no script


def manifest(command: str, extra: str = "") -> str:
    return (f"jobs:\n  a:\n    command: [{command}]\n    schedule: daily\n"
            f"    hardening: strict\n{extra}  b:\n    command: [/bin/true]\n    schedule: daily\n")


def generate(text: str, consulrun_path: str = INSTALLED) -> tuple[str, list[str]]:
    args = ["generate", "-", "-o", "-", "--consulrun-path", consulrun_path]
    result = CliRunner().invoke(main, args, input=text)
    assert result.exit_code == 0, result.stderr
    return result.stdout, result.stderr.splitlines()


def preset(units: str, job: str = "a") -> list[str]:
    """The lines under the `# hardening: strict` comment of the job's service."""
    service = units.split(f"# --- consulrun-{job}.service\n", 1)[1].split("# --- ", 1)[0]
    return service.split("# hardening: strict", 1)[1].split("\n")[1:-1]


def test_a_command_under_tmp_is_said_to_lose_private_tmp(tmp_path: Path) -> None:
    units, err = generate(manifest(f"{tmp_path}/job.sh"))
    assert err == [f"warning: hardening: strict is relaxed for a: PrivateTmp= left out, as "
                   f"{tmp_path}/job.sh is under /tmp or /var/tmp, which PrivateTmp=yes would hide "
                   "from the unit"]
    assert "ProtectHome=yes" in preset(units) and not any(
        line.startswith("PrivateTmp=") for line in preset(units))


def test_a_consulrun_in_a_checkout_under_tmp_and_a_home_is_said_once_per_setting() -> None:
    _, err = generate(manifest("/home/ops/bin/job") + "    hardening: strict\n",
                      consulrun_path="/tmp/co/.venv/bin/consulrun")
    assert err == [
        "warning: hardening: strict is relaxed for a: ProtectHome=read-only (not yes), as "
        "/home/ops/bin/job is under /home, /root or /run/user, which ProtectHome=yes would hide "
        "from the unit",
        "warning: hardening: strict is relaxed for a, b: PrivateTmp= left out, as "
        "/tmp/co/.venv/bin/consulrun is under /tmp or /var/tmp, which PrivateTmp=yes would hide "
        "from the unit",
    ]


def test_the_whole_preset_says_nothing_nor_a_job_s_own_choice(tmp_path: Path) -> None:
    assert generate(manifest("/bin/true"))[1] == []
    own = "    service: {PrivateTmp: false}\n"
    assert generate(manifest(f"{tmp_path}/job.sh", own))[1] == []


def test_the_docs_preset_list_is_what_is_rendered() -> None:
    text = DOCS.read_text()
    start = text.index("written under a `# hardening: strict` line before the job's own `service:`")
    listed = text[start:text.index("(`SystemCallErrorNumber=EPERM`).", start)]
    documented = re.findall(r"`([A-Za-z]+)=([^`]*)`", listed)
    paragraph = text[start:text.index("\n\n", start)].replace("\n", " ")
    # ...and what it is relaxed to, and that generate says so
    assert "`ProtectHome=read-only` instead of `yes`" in paragraph
    assert "no `PrivateTmp=` when" in paragraph and "`generate` says so" in paragraph
    units, _ = generate(manifest("/bin/true"))
    rendered = [tuple(line.split("=", 1)) for line in preset(units)]
    names = {name for name, _ in rendered}
    assert {name for name, _ in documented} | {"SystemCallFilter", "SystemCallErrorNumber"} == names
    for name, value in documented:
        if value:  # a bare `PrivateDevices=` stands for yes
            assert (name, value) in rendered, (name, value)
        else:
            values = {v for n, v in rendered if n == name}
            assert {"yes", ""} & values or name == "IPAddressAllow", name
