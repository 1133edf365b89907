"""Every way a manifest can be wrong: the message, its FILE:LINE:COL, exit 2, nothing written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.manifest.durations import DurationError, format_duration, parse_duration
from consulrun.manifest.loader import LockSettings, load_manifest
from tests.conftest import require_tool

OK_JOB = "    command: [/bin/true]\n    schedule: daily\n"

# (manifest text, line, column, words the message must contain)
CASES = {
    "unknown-top-key": ("jobz:\n  a:\n" + OK_JOB, 1, 1, ["unknown key 'jobz'", "did you mean 'jobs'"]),
    "unknown-job-key": ("jobs:\n  a:\n" + OK_JOB + "    scheduel: daily\n", 5, 5, ["unknown key 'scheduel'", "'schedule'"]),
    "unknown-lock-key": ("jobs:\n  a:\n" + OK_JOB + "    lock: {tll: 20s}\n", 5, 12, ["jobs.a.lock", "did you mean 'ttl'"]),
    "missing-command": ("jobs:\n  a:\n    schedule: daily\n", 3, 5, ["jobs.a", "missing required key 'command'"]),
    "missing-schedule": ("jobs:\n  a:\n    command: /bin/true\n", 3, 5, ["missing required key 'schedule'"]),
    "wrong-type": ("jobs:\n  a:\n" + OK_JOB + "    user: [root]\n", 5, 11, ["jobs.a.user: expected a user name, got a list"]),
    "wrong-type-bool": ("jobs:\n  a:\n" + OK_JOB + "    timer: {persistent: maybe}\n", 5, 25,
                        ["jobs.a.timer.persistent", "expected a boolean, got a string"]),
    "integral-float": ("jobs:\n  a:\n" + OK_JOB + "    lock: {concurrency: 1.0}\n", 5, 25,
                       ["jobs.a.lock.concurrency: 1.0 is a number with a decimal point; write an integer"]),
    "integral-float-duration": ("jobs:\n  a:\n" + OK_JOB + "    timer: {accuracy: 0.0}\n", 5, 23,
                                ["jobs.a.timer.accuracy: 0.0 is a number with a decimal point"]),
    "bad-duration": ("jobs:\n  a:\n" + OK_JOB + "    timeout: 5 minutez\n", 5, 14, ["jobs.a.timeout", "is not a duration"]),
    "duration-boolean": ("jobs:\n  a:\n" + OK_JOB + "    timeout: yes\n", 5, 14,
                         ["jobs.a.timeout: expected a duration", "got a boolean"]),
    "duration-too-long": ("jobs:\n  a:\n" + OK_JOB + "    timeout: 400 days\n", 5, 14, ["out of range", "at most 8784h"]),
    "ttl-malformed": ("jobs:\n  a:\n" + OK_JOB + "    lock: {ttl: 2x}\n", 5, 17, ["jobs.a.lock.ttl", "is not a duration"]),
    "lock-delay-malformed": ("jobs:\n  a:\n" + OK_JOB + "    lock: {lock_delay: 2x}\n", 5, 24,
                             ["jobs.a.lock.lock_delay", "is not a duration"]),
    "defaults-ttl-malformed": ("defaults:\n  lock: {ttl: 2x}\njobs:\n  a:\n" + OK_JOB, 2, 15,
                               ["defaults.lock.ttl", "is not a duration"]),
    "defaults-lock-delay-malformed": ("defaults:\n  lock: {lock_delay: '5 sex'}\njobs:\n  a:\n" + OK_JOB, 2, 22,
                                      ["defaults.lock.lock_delay", "is not a duration"]),
    "sub-millisecond": ("jobs:\n  a:\n" + OK_JOB + "    timer: {accuracy: 500us}\n", 5, 23, ["finer than a millisecond"]),
    "schedule-empty-list": ("jobs:\n  a:\n    command: [/bin/true]\n    schedule: []\n", 4, 15,
                            ["jobs.a.schedule: needs at least one calendar spec"]),
    "command-empty-list": ("jobs:\n  a:\n    command: []\n    schedule: daily\n", 3, 14, ["needs at least one argument"]),
    "unknown-time-zone": ("jobs:\n  a:\n    command: [/bin/true]\n    schedule: '*-*-* 02:00 Mars/Olympus'\n", 4, 15,
                          ["unknown time zone 'Mars/Olympus'"]),
    "unit-prefix": ("unit_prefix: 'a b'\njobs:\n  a:\n" + OK_JOB, 1, 14, ["unit_prefix", "unit names)"]),
    "address-port-range": ("consul: {address: '127.0.0.1:99999'}\njobs:\n  a:\n" + OK_JOB, 1, 19,
                           ["consul.address", "port must be a number from 1 to 65535"]),
    "address-port-zero": ("consul: {address: 'http://127.0.0.1:0'}\njobs:\n  a:\n" + OK_JOB, 1, 19, ["port must be"]),
    "address-ipv6-unbracketed": ("consul: {address: '::1'}\njobs:\n  a:\n" + OK_JOB, 1, 19, ["in brackets"]),
    "description-too-long": ("jobs:\n  a:\n" + OK_JOB + "    description: " + "x" * 2_000_000 + "\n", 5, 18,
                             ["jobs.a.description: is too long: at most 512 characters, got 2000000"]),
    "too-many-args": ("jobs:\n  a:\n    schedule: daily\n    command: [" + ", ".join(["x"] * 300) + "]\n", 4, 14,
                      ["jobs.a.command: has too many entries: at most 256"]),
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
    # PyYAML says "found character that cannot start any token" and "mapping values are not allowed here".
    "yaml-tab": ("jobs:\n  a:\n\tcommand: [/bin/true]\n", 3, 1,
                 ["YAML syntax error: a tab character: YAML indents with spaces only"]),
    "yaml-unquoted-colon": ("jobs:\n  a:\n    command: cat x | cut -d: -f1\n    schedule: daily\n", 3, 28,
                            ["a value holding ': ' must be quoted (command: 'cat x | cut -d: -f1')"]),
    "schedule-time-span": ("jobs:\n  a:\n    command: [/bin/true]\n    schedule: 5m\n", 4, 15,
                           ["'5m' is not a valid calendar expression: it looks like a time span",
                            "every 5m is '*:0/5'"]),
    "unsplittable-command": ("jobs:\n  a:\n    command: 'echo \"unterminated'\n    schedule: daily\n", 3, 14,
                             ["cannot split command"]),
    "unsplittable-default-on-failure": ("defaults:\n  on_failure: 'echo \"x'\njobs:\n  a:\n" + OK_JOB, 2, 15,
                                        ["defaults.on_failure: cannot split command"]),
    "unsplittable-on-failure": ("jobs:\n  a:\n" + OK_JOB + "    on_failure: 'echo \"x'\n", 5, 17,
                                ["jobs.a.on_failure: cannot split command"]),
    "lock-wait-too-long": ("jobs:\n  a:\n" + OK_JOB + "    lock: {wait: 400d}\n", 5, 18,
                           ["jobs.a.lock.wait: '400d' is out of range: at most 8784h"]),
    "default-accuracy-too-long": ("defaults:\n  timer: {accuracy: 400d}\njobs:\n  a:\n" + OK_JOB, 2, 21,
                                  ["defaults.timer.accuracy: '400d' is out of range: at most 8784h"]),
    "newline-in-description": ("jobs:\n  a:\n" + OK_JOB + "    description: \"two\\nlines\"\n", 5, 18,
                               ["jobs.a.description", "cannot be written to a unit file", "newline"]),
    "env-name": ("jobs:\n  a:\n" + OK_JOB + "    environment: {'1BAD': x}\n", 5, 19, ["'1BAD'", "environment variable name"]),
    "env-bool": ("jobs:\n  a:\n" + OK_JOB + "    environment: {DEBUG: yes}\n", 5, 26, ["jobs.a.environment.DEBUG", "quote"]),
    "relative-path": ("jobs:\n  a:\n" + OK_JOB + "    working_directory: srv\n", 5, 24, ["absolute path"]),
    "concurrency-zero": ("jobs:\n  a:\n" + OK_JOB + "    lock: {concurrency: 0}\n", 5, 25, ["between 1 and 1000"]),
    "each-node-after": ("jobs:\n  a:\n" + OK_JOB + "  b:\n    command: [/bin/true]\n    mode: each-node\n"
                        "    after: [a]\n", 8, 13, ["jobs.b.after[0]", "it is mode: each-node"]),
    "after-each-node": ("jobs:\n  c:\n    command: [/bin/true]\n    mode: each-node\n    schedule: daily\n"
                        "  d:\n    command: [/bin/true]\n    after: [c]\n", 8, 13,
                        ["jobs.d.after[0]", "its parent 'c' is mode: each-node"]),
    "output-without-ping": ("jobs:\n  a:\n" + OK_JOB + "    ping_output_lines: 20\n", 5, 24,
                            ["jobs.a.ping_output_lines", "it needs ping_url"]),
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


def test_each_missing_required_key_is_reported_once(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a:\n    timeout: 5m\n")
    result = CliRunner().invoke(main, ["validate", str(manifest)])
    assert result.exit_code == 2
    assert result.stderr == (f"Error: {manifest}:3:5: jobs.a: missing required key 'command'\n"
                             f"Error: {manifest}:3:5: jobs.a: missing required key 'schedule'\n"), result.stderr


@pytest.mark.parametrize("command", [["generate", "-o", "-"], ["install", "--dry-run"], ["acl-policy"]])
def test_unreadable_manifest_is_one_line(command: list[str], tmp_path: Path) -> None:
    """A missing file and a directory read the same: one line, no errno text, no usage block."""
    for path, reason in ((tmp_path / "missing.yaml", "no such file"), (tmp_path, "is a directory")):
        result = CliRunner().invoke(main, [command[0], str(path), *command[1:]])
        assert result.exit_code == 2, result.output
        assert result.stderr == f"Error: {path}: {reason}\n"


def test_systemd_duration_forms_are_accepted(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a:\n" + OK_JOB + "    timeout: 1h 30min\n    lock: {ttl: 10 min, wait: 2 sec}\n"
                        "    timer: {randomized_delay: 1.5min, accuracy: 15}\n")
    job = load_manifest(manifest).jobs[0]
    assert (job.timeout_ms, job.lock.ttl_ms, job.lock.wait_ms) == (5_400_000, 600_000, 2_000)
    assert (job.timer.randomized_delay_ms, job.timer.accuracy_ms) == (90_000, 15_000)


@pytest.mark.parametrize("address", ["http://[::1]:8500", "unix:///run/consul/http.sock", "https://consul.internal",
                                     "10.0.0.1:8501"])
def test_good_addresses(address: str, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(f"consul: {{address: '{address}'}}\njobs:\n  a:\n" + OK_JOB)
    assert load_manifest(manifest).consul.address == address


def test_defaults_merge_key_by_key(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("defaults:\n  lock: {ttl: 30s, concurrency: 2}\njobs:\n  a:\n" + OK_JOB + "    lock: {ttl: 20s}\n")
    job = load_manifest(manifest).jobs[0]
    assert job.lock == LockSettings(ttl_ms=20_000, concurrency=2)


def test_string_command_is_split_like_a_shell(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a:\n    command: /bin/echo 'two words' 'and $NOT_EXPANDED' a\\$b\n"
                        "    schedule: daily\n")
    assert load_manifest(manifest).jobs[0].command == ("/bin/echo", "two words", "and $NOT_EXPANDED", "a$b")


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


# --- property: any one field replaced by a wrong value is a positioned error, never a traceback -------------

FULL = {
    "unit_prefix": "ops", "kv_prefix": "ops/cron",
    "consul": {"address": "https://consul.internal:8501", "token_file": "/etc/t", "ca_file": "/etc/ca.pem",
               "cert_file": "/etc/c.pem", "key_file": "/etc/k.pem", "tls_server_name": "server.dc1.consul",
               "agent_unit": "consul.service"},
    "defaults": {"lock": {"ttl": "20s", "lock_delay": "10s", "wait": "0s", "concurrency": 1, "skip_exit_code": 0,
                          "checks": ["mem-ok"]},
                 "timer": {"accuracy": "5s", "randomized_delay": "1s", "persistent": True},
                 "on_holder_loss": "skip", "history": 20, "on_failure": "/usr/bin/logger failed",
                 "ping_url": "https://hc-ping.com/x",
                 "retries": {"attempts": 1, "backoff": "10s", "max_backoff": "5min"}},
    "jobs": {"a": {"command": ["/bin/true", "x"], "schedule": ["daily"], "description": "A job", "user": "root",
                   "group": "adm", "working_directory": "/srv", "environment": {"K": "v"},
                   "environment_file": "-/etc/env", "timeout": "1h", "on_holder_loss": "retry", "history": 5,
                   "lock": {"ttl": "30s", "lock_delay": "15s", "wait": "1m", "concurrency": 2, "skip_exit_code": 3,
                            "checks": ["serfHealth"]},
                   "timer": {"accuracy": "1s", "randomized_delay": "2m", "persistent": False},
                   "on_failure": ["/bin/sh", "-c", "echo $CONSULRUN_JOB"], "ping_url": "http://[::1]:8000/ping/a",
                   "pass_consul_token": True}},
}
DURATIONS = {"ttl", "lock_delay", "wait", "accuracy", "randomized_delay", "timeout", "backoff", "max_backoff"}
OUT_OF_RANGE = {"ttl": ["9s", 86401, "2x"], "lock_delay": ["4s", "61s", 0, "1 sex"], "wait": [-1, "367d", "2y"],
                "accuracy": ["2x", 10**30], "randomized_delay": ["-1s", "500us"], "timeout": ["soon", "400d"],
                "concurrency": [0, 1001], "skip_exit_code": [-1, 256], "history": [0, 1001],
                "unit_prefix": ["", "a/b", "x" * 65], "kv_prefix": ["", "/lead", "a//b"],
                "address": ["h:0", "h:99999", ":abc", "::1", "ftp://h"], "user": ["1root", "a b"],
                "on_holder_loss": ["maybe"], "command": ["", [], "'unclosed"], "schedule": [[], "", "Mars 25:00"],
                "description": ["x" * 600, "two\nlines"], "working_directory": ["srv", "/a\x01"],
                "tls_server_name": ["a b"],
                "agent_unit": ["consul", "consul@.service", "a b.service", "consul.service\nExecStart=/x", "%i.service"],
                "checks": [[""], ["a b"]],
                "on_failure": ["", [], "'unclosed", ["a\x00"]], "ping_url": ["ftp://x/y", "https://x/y?z=1", "a b", ""],
                "attempts": [0, 101], "backoff": ["2x", "400d", "6min"], "max_backoff": ["1 sex", "367d", "1s"]}
WRONG_TYPES = [True, None, 1.5, {"k": "v"}, [{}], "text", 7, ["text"]]


def _accepts(path: tuple, value: object) -> bool:
    """Whether the schema takes a value of this type at `path` (so it is not a wrong-type case)."""
    name, parent = path[-1], path[-2] if len(path) > 1 else None
    original = _get(FULL, path)
    kinds = {type(original)}
    if name in DURATIONS:
        kinds = {str, int}
    elif name in ("command", "schedule", "on_failure"):
        kinds = {str, list}
    elif parent == "environment":
        kinds = {str, int}
    if isinstance(value, bool) or isinstance(original, bool):
        return isinstance(value, bool) and isinstance(original, bool)
    return type(value) in kinds and not (type(value) is list and value and not isinstance(value[0], str))


def _get(data: object, path: tuple) -> object:
    for part in path:
        data = data[part]  # type: ignore[index]
    return data


def _paths(data: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for key, value in data.items():
            out += _paths(value, prefix + (key,))
    return out


def _replaced(path: tuple, value: object) -> dict:
    import copy

    data = copy.deepcopy(FULL)
    _get(data, path[:-1])[path[-1]] = value  # type: ignore[index]
    return data


def test_every_field_replaced_by_a_wrong_value_is_a_positioned_error(tmp_path: Path) -> None:
    import re

    import yaml

    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(yaml.safe_dump(FULL))
    ok = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
    assert ok.exit_code == 0, ok.stderr
    positioned = re.compile(rf"Error: {re.escape(str(manifest))}:\d+:\d+: \S")
    cases = [(path, value) for path in _paths(FULL) for value in WRONG_TYPES if not _accepts(path, value)]
    cases += [(path, value) for path in _paths(FULL) for value in OUT_OF_RANGE.get(path[-1], [])]
    assert len(cases) > 300
    for path, value in cases:
        manifest.write_text(yaml.safe_dump(_replaced(path, value), width=10**7))
        result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
        where = f"{'.'.join(map(str, path))} = {value!r:.40}"
        assert result.exception is None or isinstance(result.exception, SystemExit), (where, result.exception)
        assert result.exit_code == 2, (where, result.output)
        lines = result.stderr.splitlines()
        assert lines and all(positioned.match(line) for line in lines), (where, result.stderr)
        assert all(len(line) < 400 for line in lines), where


# Free text, where a final newline is data the unit escapes: argv words and environment values.
FREE_TEXT = {("jobs", "a", "command"), ("jobs", "a", "on_failure"), ("defaults", "on_failure"),
             ("jobs", "a", "environment", "K")}


def _newline_cases() -> list[tuple[str, dict]]:
    import copy

    cases = []
    for path in _paths(FULL):
        value = _get(FULL, path)
        if isinstance(value, str):
            items = [(path, value)]
        else:
            items = [(path + (i,), item) for i, item in enumerate(value) if isinstance(item, str)] \
                if isinstance(value, list) else []
        for where, item in items:
            if where[:len(path)] in FREE_TEXT or path in FREE_TEXT:
                continue
            data = copy.deepcopy(FULL)
            _get(data, where[:-1])[where[-1]] = item + "\n"  # type: ignore[index]
            cases.append((".".join(map(str, where)), data))
    renamed = copy.deepcopy(FULL)
    renamed["jobs"]["abc\n"] = renamed["jobs"].pop("a")
    env_name = copy.deepcopy(FULL)
    env_name["jobs"]["a"]["environment"] = {"FOO\n": "bar"}
    return cases + [("job name", renamed), ("environment name", env_name)]


def test_a_trailing_newline_is_refused_in_every_string_field(tmp_path: Path) -> None:
    """`$` alone matches before a final newline (Python's re, as jsonschema uses it): `unit_prefix: "ops\\n"` wrote
    unit files whose names held a newline. Every field with a pattern or a parser refuses it, positioned."""
    import re

    import yaml

    manifest = tmp_path / "jobs.yaml"
    positioned = re.compile(rf"Error: {re.escape(str(manifest))}:\d+:\d+: \S")
    cases = _newline_cases()
    assert len(cases) > 30
    for where, data in cases:
        manifest.write_text(yaml.safe_dump(data, width=10**7))
        result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
        assert result.exception is None or isinstance(result.exception, SystemExit), (where, result.exception)
        assert result.exit_code == 2, (where, result.output)
        lines = result.stderr.splitlines()
        assert lines and all(positioned.match(line) for line in lines), (where, result.stderr)


def _yaml_values():  # noqa: ANN202 - a hypothesis strategy
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**40, max_value=10**40),
                        st.floats(allow_nan=False), st.text(max_size=40),
                        st.sampled_from(["15s", "2x", "10 min", "daily", "/abs", "a b", "-1", "1y", "unix:///s"]))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                        max_leaves=6)


def test_any_value_anywhere_is_accepted_or_a_positioned_error(tmp_path: Path) -> None:
    """Fuzzing on top of the table above: whatever replaces a field, the answer is exit 0 or exit 2, never a crash."""
    import re

    import yaml
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    manifest = tmp_path / "jobs.yaml"
    positioned = re.compile(rf"Error: {re.escape(str(manifest))}:\d+:\d+: \S")

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.sampled_from(_paths(FULL)), _yaml_values())
    def check(path: tuple, value: object) -> None:
        manifest.write_text(yaml.safe_dump(_replaced(path, value), width=10**7))
        result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
        assert result.exception is None or isinstance(result.exception, SystemExit), (path, value, result.exception)
        assert result.exit_code in (0, 2), (path, value, result.output)
        if result.exit_code == 2:
            assert all(positioned.match(line) for line in result.stderr.splitlines()), (path, value, result.stderr)

    check()


# Every range check at both edges: the value on the edge is accepted, one step past it is refused with the message.
BOUNDS = [
    ("lock", "ttl", "10s", "9999ms", "Consul accepts a session TTL from 10s to 24h"),
    ("lock", "ttl", "24h", "86400001ms", "Consul accepts a session TTL from 10s to 24h"),
    ("lock", "ttl", 10, 9, "Consul accepts a session TTL from 10s to 24h"),
    ("lock", "ttl", 86400, 86401, "Consul accepts a session TTL from 10s to 24h"),
    ("lock", "lock_delay", 60, 61, "lock_delay must be 5s to 1m; less would let another node start before a "
                                   "partitioned holder stops"),
    ("lock", "lock_delay", "5s", "4999ms", "lock_delay must be 5s to 1m; less would let another node start before a "
                                           "partitioned holder stops"),
    ("lock", "lock_delay", "60s", "60001ms", "lock_delay must be 5s to 1m; less would let another node start before "
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
    assert parse_duration("5 minutes") == 300_000  # systemd's spelling too
    with pytest.raises(DurationError) as caught:
        parse_duration("5 mintues")
    assert str(caught.value) == "'5 mintues' is not a duration (e.g. 500ms, 15s, 1m30s, 1h 30min)"


@pytest.mark.parametrize("key", ["ttl", "lock_delay"])
def test_boolean_duration_is_one_type_error_not_a_range_error(key: str, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a:\n" + OK_JOB + f"    lock: {{{key}: true}}\n")
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert line.endswith(f"jobs.a.lock.{key}: expected a duration (e.g. 500ms, 15s, 1m30s, 1h 30min; a bare number "
                         "means seconds), got a boolean"), line


def test_a_malformed_job_does_not_hide_the_next_jobs_problems(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a: 5\n  b:\n" + OK_JOB + "    lock: {ttl: 2s}\n")
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and "jobs.a:" in lines[0] and "jobs.b.lock.ttl: '2s' is out of range" in lines[1], lines


def test_parsing_pauses_the_cyclic_collector_and_gives_it_back_as_it_was() -> None:
    """The collector is paused while a manifest is parsed (a third of the time on 10,000 jobs), never left off:
    a process that parses manifests again and again (a test run, a long-lived caller) keeps collecting."""
    import gc

    from consulrun.manifest import loader as manifest
    from consulrun.errors import ManifestError
    from consulrun.manifest.loader import parse_manifest

    seen: list[bool] = []
    real_load = manifest.load

    def watched(text: str):  # noqa: ANN202 - the loader's own type
        seen.append(gc.isenabled())
        return real_load(text)

    assert gc.isenabled()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest, "load", watched)
        parse_manifest("jobs: {a: {command: 'true', schedule: daily}}\n", "m.yaml")
        with pytest.raises(ManifestError):
            parse_manifest("jobs: {a: {command: 'true', schedule: nonsense}}\n", "m.yaml")
        with pytest.raises(ManifestError):
            parse_manifest("jobs: [\n", "m.yaml")
        assert gc.isenabled()
        gc.disable()
        try:
            parse_manifest("jobs: {a: {command: 'true', schedule: daily}}\n", "m.yaml")
            assert not gc.isenabled()  # off before, off after
        finally:
            gc.enable()
    assert seen == [False, False, False, False]


def test_default_output_lines_are_for_the_jobs_that_ping(tmp_path: Path) -> None:
    """defaults.ping_output_lines neither forces a ping_url on every job nor sends anything for one without it."""
    from consulrun.manifest.loader import load_manifest

    path = tmp_path / "jobs.yaml"
    path.write_text("defaults:\n  ping_output_lines: 20\njobs:\n  quiet:\n" + OK_JOB + "  pinged:\n" + OK_JOB +
                    "    ping_url: https://hc-ping.com/x\n")
    jobs = {j.name: j for j in load_manifest(path).jobs}
    assert (jobs["quiet"].ping_output_lines, jobs["pinged"].ping_output_lines) == (0, 20)
