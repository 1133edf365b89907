"""`history` against a real Consul agent: records in the runner's shapes, and real runs."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.harness.agents import Agent, wait_for
from tests.harness.holders import hold, put
from tests.harness.runs import cli, consulrun, finish

pytestmark = pytest.mark.consul


# --- History ----------------------------------------------------------------------------------------------


def test_history_lists_every_attempt_newest_first(consul: Agent) -> None:
    lost = {"occurrence": "2026-01-02T00:00:00Z", "state": "lost", "node": "n1", "session": "a1", "attempt": 1,
            "started": "2026-01-02T00:00:01Z", "lost_at": "2026-01-02T00:00:20Z", "reason": "fenced",
            "takeover": False}
    put(consul, "consulrun/hist/history/2026-01-01T00:00:00Z", {
        "occurrence": "2026-01-01T00:00:00Z", "state": "done", "exit_status": 0, "node": "n2", "session": "b",
        "attempt": 1, "started": "2026-01-01T00:00:02Z", "ended": "2026-01-01T00:00:12Z", "takeover": False})
    put(consul, "consulrun/hist/occurrence", {
        "occurrence": "2026-01-02T00:00:00Z", "state": "done", "exit_status": 3, "node": "n2", "session": "a2",
        "attempt": 2, "takeover": True, "started": "2026-01-02T00:00:40Z", "ended": "2026-01-02T00:01:40Z",
        "earlier": [lost]})
    put(consul, "consulrun/hist/lock", {"state": "free", "last": {
        "node": "n3", "session": "m", "started": "2026-01-03T00:00:00Z", "ended": "2026-01-03T00:00:05Z",
        "exit_status": 0}})
    code, out, _ = cli("history", "hist", "--json")
    runs = json.loads(out)["runs"]
    assert code == 0
    assert [(r["occurrence"], r["attempt"], r["state"], r["manual"]) for r in runs] == [
        (None, None, "done", True), ("2026-01-02T00:00:00Z", 2, "done", False),
        ("2026-01-02T00:00:00Z", 1, "lost", False), ("2026-01-01T00:00:00Z", 1, "done", False)]
    assert runs[1]["takeover"] is True and runs[1]["exit_status"] == 3 and runs[1]["duration_s"] == 60
    assert runs[2]["reason"] == "fenced"
    code, out, _ = cli("history", "hist", "-n", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["OCCURRENCE", "ATTEMPT", "NODE"] and len(lines) == 3
    assert "takeover" in lines[2] and "exit 3" in lines[2] and "manual" in lines[1]


def test_history_of_real_runs(consul: Agent) -> None:
    assert finish(consulrun("run", "--schedule", "*-*-* 02:00:00", "real", "--", "sh", "-c", "exit 2"))[0] == 2
    code, out, _ = cli("history", "real", "--json")
    runs = json.loads(out)["runs"]
    assert code == 0 and len(runs) == 1 and runs[0]["exit_status"] == 2 and runs[0]["node"] == "dev1"


# --- Runs without --schedule that end other than cleanly (issue 25, item 6) ------------------------------------


def _problem_line(job: str) -> str:
    """`status JOB`'s line naming the job's problem (the lines after the table)."""
    code, out, _ = cli("status", job)
    assert code == 1, out
    return next(line for line in out.splitlines() if line.startswith(f"{job}: "))


def test_a_plain_run_unlocked_by_force_is_recorded_lost(consul: Agent, tmp_path: Path) -> None:
    """`unlock --force` of a live run without --schedule: its wrapper kills the job (75) and, the lock no longer
    its own, still records the run `lost` in the lock's value, which history and status read."""
    started = tmp_path / "started"
    runner = consulrun("run", "forced", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the job")
        code, _, err = cli("unlock", "forced", "--yes", "--force")
        assert code == 0, err
        code, _, err = finish(runner)
    finally:
        if runner.poll() is None:
            runner.kill()
            finish(runner)
    assert code == 75, err
    assert "the result is recorded (lost)" in err, err
    code, out, _ = cli("history", "forced", "--json")
    runs = json.loads(out)["runs"]
    assert code == 0 and len(runs) == 1, out
    assert (runs[0]["state"], runs[0]["node"], runs[0]["manual"], runs[0]["exit_status"]) == ("lost", "dev1", True, 75)
    assert "the lock was released or taken over" in runs[0]["reason"] and runs[0]["duration_s"] is not None
    line = _problem_line("forced")
    assert line.startswith(f"forced: lost: the run started {runs[0]['started']} on dev1 was lost: the lock was "), line
    assert "?" not in line, line


def test_a_plain_run_whose_wrapper_was_killed_then_reaped_is_recorded_abandoned(consul: Agent,
                                                                                tmp_path: Path) -> None:
    """SIGKILL of the wrapper (the OOM killer), then `reap` (the units' ExecStopPost=): reap destroys the dead
    wrapper's session and records the run `abandoned`, naming why, in the lock's value."""
    pidfile = tmp_path / "pid"
    runner = consulrun("run", "oomed", "--", "sh", "-c", f"echo $$ > {pidfile}; exec sleep 300")
    try:
        wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "the job")
        runner.kill()
        runner.wait(timeout=10)
        code, _, err = finish(consulrun("reap", "oomed"))
        assert code == 0 and "destroying the session" in err, err
        assert "oomed: the run is recorded abandoned" in err, err
    finally:
        if pidfile.exists() and pidfile.read_text().strip():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
    code, out, _ = cli("history", "oomed", "--json")
    runs = json.loads(out)["runs"]
    assert code == 0 and len(runs) == 1, out
    assert (runs[0]["state"], runs[0]["node"], runs[0]["manual"]) == ("abandoned", "dev1", True)
    assert f"(pid {runner.pid}) on this node has exited" in runs[0]["reason"], runs[0]
    code, out, _ = cli("history", "oomed")
    assert code == 0 and "abandoned" in out.splitlines()[1], out
    line = _problem_line("oomed")
    assert line.startswith(f"oomed: abandoned: the run started {runs[0]['started']} on dev1 was abandoned: "), line
    assert "?" not in line, line


def test_a_plain_runs_holder_value_that_no_session_holds_is_an_abandoned_run(consul: Agent) -> None:
    """Nobody recorded the end (the session's TTL ran out, no reap): history still lists the run, abandoned."""
    sid = hold(consul, "expired")
    # While its session holds the lock, the run is under way (history listed nothing, even for a dead wrapper's
    # run that `status` reports): one row, running.
    code, out, _ = cli("history", "expired", "--json")
    assert [(r["state"], r["node"], r["manual"]) for r in json.loads(out)["runs"]] == [("running", "dev1", True)], out
    consul.api("PUT", f"session/destroy/{sid}")  # what the TTL does
    code, out, _ = cli("history", "expired", "--json")
    runs = json.loads(out)["runs"]
    assert code == 0 and [(r["state"], r["node"], r["manual"]) for r in runs] == [("abandoned", "dev1", True)], out
    assert "no result was recorded" in runs[0]["reason"]


def test_a_run_recorded_without_its_node_prints_no_placeholder(consul: Agent) -> None:
    """A value missing fields (written by hand, or by an older consulrun): the tables and lines leave the unknown
    out (or print the tables' `-`), never a `?`."""
    put(consul, "consulrun/nonode/lock", {"state": "free", "last": {
        "session": "m", "started": "2026-01-03T00:00:00Z", "ended": "2026-01-03T00:00:05Z", "lost": "fenced"}})
    code, out, _ = cli("history", "nonode")
    assert code == 0 and "?" not in out and out.splitlines()[1].split()[1:3] == ["-", "-"], out
    code, out, _ = cli("status", "nonode")
    assert code == 1 and "?" not in out, out
    assert "nonode: lost: the run started 2026-01-03T00:00:00Z was lost: fenced" in out, out


def test_a_job_of_the_manifest_that_never_ran_has_an_empty_history(consul: Agent, tmp_path: Path) -> None:
    """It blamed the job's name (exit 6, 'wrong job name or --prefix?') for a job the manifest has."""
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  fresh: {command: ['true'], schedule: daily}\n")
    code, out, err = cli("history", str(manifest), "fresh")
    assert (code, out) == (0, "") and err == f"fresh: no runs yet (a job of {manifest} that has never run)\n", err
    code, out, _ = cli("history", str(manifest), "fresh", "--json")
    assert code == 0 and json.loads(out)["runs"] == []
    code, _, err = cli("history", str(manifest), "fresch")  # a typo is still one
    assert code == 6 and "did you mean 'fresh'" in err, err
