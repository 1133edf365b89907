"""Unit-file escaping: table tests, then the proof that a real systemd reads values back exactly."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from consulrun.manifest import unitescape
from consulrun.manifest.loader import validate
from consulrun.units.render import render, run_argv
from consulrun.manifest.unitescape import Context, UnrepresentableError, escape
from consulrun.manifest.yamlsource import Located

TABLE = [
    ("plain", Context.EXEC_ARG, "plain"),
    ("/usr/bin/x", Context.EXEC_ARG, "/usr/bin/x"),
    ("two words", Context.EXEC_ARG, '"two words"'),
    ("", Context.EXEC_ARG, '""'),
    ("$HOME", Context.EXEC_ARG, '"$$HOME"'),
    ("100%", Context.EXEC_ARG, '"100%%"'),
    ('say "hi"', Context.EXEC_ARG, '"say \\"hi\\""'),
    ("back\\slash", Context.EXEC_ARG, '"back\\\\slash"'),
    ("a\nb", Context.EXEC_ARG, '"a\\nb"'),
    ("\x01", Context.EXEC_ARG, '"\\x01"'),
    (";", Context.EXEC_ARG, '";"'),
    ("K=$v 5%", Context.ENV_ASSIGNMENT, '"K=$v 5%%"'),
    ("K=v", Context.ENV_ASSIGNMENT, "K=v"),
    ("50% of $x", Context.PLAIN, "50%% of $x"),
]


@pytest.mark.parametrize(("value", "context", "expected"), TABLE)
def test_escape_table(value: str, context: Context, expected: str) -> None:
    assert escape(value, context) == expected


@pytest.mark.parametrize(("value", "context"), [("a\nb", Context.PLAIN), (" lead", Context.PLAIN), ("dir\\", Context.PLAIN),
                                                ("nul\x00", Context.EXEC_ARG), ("\ud800", Context.EXEC_ARG)])
def test_unrepresentable_values_are_refused(value: str, context: Context) -> None:
    with pytest.raises(UnrepresentableError):
        escape(value, context)


def test_exec_line_joins_escaped_words() -> None:
    assert unitescape.exec_line(["/bin/echo", "a b", "$x"]) == '/bin/echo "a b" "$$x"'


# --- the proof against a real systemd -------------------------------------------------------------

ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
DESCRIPTION = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=40).filter(
    lambda s: s == s.strip() and s.strip() and not s.endswith("\\"))
ENV_NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True).filter(lambda n: not n.startswith("CONSUL"))

DUMP = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, open("/shared/dump.json", "w"))
    """)


@pytest.mark.systemd
@example(args=["$HOME", "${X}", "%h", "%%", '"', "'", "\\", "a\nb", "", ";", "\t", " ", "\x7f", "\u2028"],
         env={"A": "$x %% \"q\" \\n", "B": "", "C": " lead", "D": "a\nb", "E": "\x85\u2028 trail "}, description='100% "$x" \\ {}')
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(ANY_TEXT, min_size=1, max_size=6), env=st.dictionaries(ENV_NAME, ANY_TEXT, max_size=4),
       description=DESCRIPTION)
def test_systemd_reads_back_exactly_what_the_manifest_said(systemd_container, args: list[str], env: dict[str, str],
                                                           description: str) -> None:
    ctr = systemd_container
    dump = ctr.shared / "dump"
    dump.write_text(DUMP.format(python=os.path.realpath(sys.executable)))  # /tmp is private in there
    dump.chmod(0o755)
    result_file = ctr.shared / "dump.json"
    result_file.unlink(missing_ok=True)
    # Validated as data: a YAML round trip of its own would fold characters such as U+0085.
    manifest = validate(Located(data={"jobs": {"probe": {
        "command": ["/bin/job", *args], "schedule": "daily", "description": description, "environment": env}}}),
        "probe.yaml")
    units = render(manifest, "/shared/dump")
    unit_dir = ctr.merged / "etc" / "systemd" / "system"
    for name, text in units.items():
        (unit_dir / name).write_text(text)
    ctr.systemctl("daemon-reload")
    started = ctr.systemctl("start", "consulrun-probe.service", check=False)
    assert started.returncode == 0, started.stderr + ctr.exec("journalctl", "-u", "consulrun-probe", "-n", "5").stdout
    seen = json.loads(result_file.read_text())
    assert seen["argv"] == run_argv(manifest, manifest.jobs[0], "/shared/dump")[1:]
    for name, value in env.items():
        assert seen["env"].get(name) == value, name
    shown = ctr.systemctl("show", "-p", "Description", "--value", "consulrun-probe.service").stdout
    assert shown == description + "\n"
