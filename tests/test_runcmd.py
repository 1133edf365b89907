"""`run`'s lean reader (consulrun/commands/runargs.py): click's `run` read the same way, on the timer's hot path without click."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import click
from click.testing import CliRunner
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consulrun.cli import main
from consulrun.commands.run import run as run_command
from consulrun.commands.runargs import OPTIONS, read
from tests.harness.agents import Agent
from tests.harness.runs import lock_entry

REPO = Path(__file__).resolve().parents[1]
CONSUL_VARS = ("CONSUL_HTTP_ADDR", "CONSUL_HTTP_TOKEN_FILE", "CONSUL_CACERT", "CONSUL_CLIENT_CERT", "CONSUL_CLIENT_KEY",
               "CONSUL_TLS_SERVER_NAME")


def click_params(args: list[str], environ: dict[str, str]) -> dict[str, object]:
    """What click's `run` hands its function for ARGS, in ENVIRON."""
    with mock.patch.dict(os.environ, environ, clear=True):
        with run_command.make_context("run", list(args)) as ctx:
            return dict(ctx.params)


def test_the_lean_reader_knows_every_option_of_click_s_run_and_nothing_else() -> None:
    options = [p for p in run_command.params if isinstance(p, click.Option) and p.name != "help"]
    assert sorted(opt for p in options for opt in [*p.opts, *p.secondary_opts]) == sorted(OPTIONS)
    for param in options:
        name, convert, default, repeatable, envvar = OPTIONS[param.opts[0]]
        assert (name, repeatable, convert is None, envvar) == (param.name, param.multiple, param.is_flag, param.envvar)
    arguments = [p.name for p in run_command.params if isinstance(p, click.Argument)]
    assert arguments == ["job", "command"]
    # Defaults as click converts them: nothing given, the same parameters.
    assert read(["j", "--", "true"], {}) == click_params(["j", "--", "true"], {})


def unit_run_lines() -> list[list[str]]:
    """The `run` argument lists of every golden unit's ExecStart=, as systemd would split them."""
    found = []
    for path in sorted((REPO / "tests" / "golden").rglob("*.service")):
        for line in path.read_text().splitlines():
            match = re.match(r"ExecStart=\S*consulrun run (.*)", line)
            if match:
                found.append(shlex.split(match.group(1).replace("%%", "%").replace("$$", "$")))
    return found


def test_every_unit_consulrun_generates_takes_the_lean_path_with_click_s_values() -> None:
    lines = unit_run_lines()
    assert len(lines) >= 10, lines
    for args in lines:
        assert read(args, {}) is not None, args
        assert read(args, {}) == click_params(args, {}), args


OPTION_NAMES = sorted(OPTIONS)
VALUES = ["15s", "10s", "3s", "1m30s", "1h 30min", "0s", "90", "25h", "", "abc", "-1", "0", "1", "3", "05", "1000",
          "1001", "255", "256", "+5", " 7", "1_0", "skip", "retry", "Skip", "consulrun", "ops/cron", "a b", "/x", "x/",
          "daily", "*-*-* 02:00:00", "https://hc-ping.com/x", "service:web", "-", "--", "--ttl", "127.0.0.1:8500"]
TOKENS = st.one_of(
    st.sampled_from(OPTION_NAMES),
    st.builds(lambda o, v: f"{o}={v}", st.sampled_from(OPTION_NAMES), st.sampled_from(VALUES)),
    st.sampled_from(VALUES),
    st.sampled_from(["-h", "--help", "--version", "--tt", "--ttl=", "--health-check=1", "-x", "job", "nightly",
                     "true", "sh", "-c"]),
)

# Mostly well-formed: options with values, then JOB, then the command (what units and people write).
OPTION_PAIRS = st.builds(lambda o, v, joined: [f"{o}={v}"] if joined else [o, v], st.sampled_from(OPTION_NAMES),
                         st.sampled_from(VALUES), st.booleans())
WELL_FORMED = st.builds(lambda pairs, job, rest: [t for pair in pairs for t in pair] + [job] + rest,
                        st.lists(OPTION_PAIRS, max_size=5), st.sampled_from(["job", "nightly", "_watchdog", "-j", "a b"]),
                        st.lists(st.sampled_from(["--", "true", "-c", "--ttl", "echo hi"]), min_size=1, max_size=3))


@settings(max_examples=600, deadline=None)
@given(args=st.one_of(st.lists(TOKENS, max_size=10), WELL_FORMED),
       environ=st.dictionaries(st.sampled_from(CONSUL_VARS), st.sampled_from(["", "127.0.0.1:8500", "/etc/ca.pem"]),
                               max_size=3))
def test_whatever_the_lean_reader_takes_click_reads_the_same_way(args: list[str], environ: dict[str, str]) -> None:
    lean = read(args, environ)
    if lean is not None:
        assert lean == click_params(args, environ)


@pytest.mark.parametrize("args", [
    ["--ttl", "3s", "j", "--", "true"],  # out of range: click's message
    ["--ttl=abc", "j", "--", "true"],
    ["--concurrency", "0", "j", "--", "true"],
    ["--on-holder-loss", "Skip", "j", "--", "true"],
    ["--prefix", "a b", "j", "--", "true"],
    ["--help"], ["-h"], ["--tt", "10s", "j", "--", "true"], ["--ttl"], [],
    ["--health-check=yes", "j", "--", "true"],
    ["--ttl", "10s", "--ttl", "20s", "j", "--", "true"],  # click takes the last; the lean reader does not guess
    ["--", "j", "true"],
])
def test_what_the_lean_reader_leaves_to_click(args: list[str]) -> None:
    assert read(args, {}) is None


@pytest.mark.parametrize("args", [["--", "echo", "hi"], ["--ttl", "15s", "--", "echo", "hi"],
                                  ["--health-check", "--wait=1s", "--", "echo"]])
def test_a_forgotten_job_is_said_missing_not_taken_from_the_command(args: list[str]) -> None:
    """`run -- echo hi` used to say `cannot start hi`: click took `echo` for JOB. The lean reader leaves it to
    click, which says JOB is missing."""
    assert read(args, {}) is None
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 2, result.output
    assert "Error: Missing argument 'JOB': it goes before `--`" in result.stderr and "cannot start" not in result.stderr


@pytest.mark.consul
def test_a_run_started_as_units_start_it_does_not_import_click_and_runs_as_click_s_run_does(
        consul: Agent, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(REPO)}
    lean = subprocess.run([sys.executable, "-X", "importtime", "-m", "consulrun", "run", "--ttl", "10s", "lean", "--",
                           "sh", "-c", "echo $CONSULRUN_JOB"], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)
    imported = {line.split("|")[-1].strip() for line in lean.stderr.splitlines() if line.startswith("import time:")}
    assert {"consulrun.protocol.lock", "consulrun.protocol.runner"} <= imported, sorted(imported)  # it did run the job's path
    assert not {m for m in imported if m == "click" or m.startswith("click.")}, sorted(imported)
    # The same arguments through click's command: the same outcome, the same lines.
    via_click = subprocess.run([sys.executable, "-c", "from consulrun.cli import main; main()", "run", "--ttl", "10s",
                                "viaclick", "--", "sh", "-c", "echo $CONSULRUN_JOB"], env={**os.environ, **env},
                               capture_output=True, text=True, timeout=60)
    code, out, err = via_click.returncode, via_click.stdout, via_click.stderr
    assert (lean.returncode, lean.stdout, code, out) == (0, "lean\n", 0, "viaclick\n"), (lean.stderr[-2000:], err)
    said = [line for line in lean.stderr.splitlines() if line.startswith("consulrun: ")]
    shape = [re.sub(r"session \S+|token \d+|lean", "X", line) for line in said]
    assert shape == [re.sub(r"session \S+|token \d+|viaclick", "X", line) for line in err.splitlines()], (said, err)
    assert lock_entry(consul, "consulrun/lean/lock") is not None and lock_entry(consul, "consulrun/viaclick/lock")


# What a skipping run must not load: each was once on its path and cost every timer tick of every node
# (bench/RESULTS.md has the figures): the command-line library, http.client with the email package, ssl without
# TLS, typing, dataclasses with inspect, hashlib (OpenSSL) without turns to rank, subprocess without a job, the
# cron converter for an OnCalendar= spec.
NOT_ON_THE_SKIP_PATH = {"click", "http.client", "email", "ssl", "typing", "dataclasses", "inspect", "hashlib",
                        "subprocess", "consulrun.manifest.cronfields", "urllib.parse"}


@pytest.mark.consul
def test_a_skipping_run_loads_none_of_what_it_does_not_use(consul: Agent, tmp_path: Path) -> None:
    from tests.harness.agents import wait_for
    from tests.harness.runs import consulrun, finish

    started = tmp_path / "started"
    holder = consulrun("run", "heldjob", "--", "sh", "-c", f"touch {started}; exec sleep 60")
    try:
        wait_for(started.exists, 30, "the holder's job")
        assert finish(consulrun("run", "--schedule", "*-01-01 00:00:00 UTC", "donejob", "--", "true"))[0] == 0
        for args, said in ((["heldjob"], "skipped: held by"),
                           (["--schedule", "*-01-01 00:00:00 UTC", "donejob"], "already ran")):
            skip = subprocess.run([sys.executable, "-X", "importtime", "-m", "consulrun", "run", *args, "--", "true"],
                                  env={**os.environ, "CONSUL_HTTP_ADDR": consul.http_addr}, capture_output=True,
                                  text=True, timeout=60)
            assert skip.returncode == 0 and said in skip.stderr, skip.stderr[-2000:]
            imported = {line.split("|")[-1].strip() for line in skip.stderr.splitlines()
                        if line.startswith("import time:")}
            assert {"consulrun.protocol.lock", "consulrun.protocol.runner"} <= imported, sorted(imported)
            assert not {m for m in imported if m.split(".")[0] in NOT_ON_THE_SKIP_PATH or m in NOT_ON_THE_SKIP_PATH}, \
                sorted(imported)
    finally:
        holder.terminate()
        finish(holder)
