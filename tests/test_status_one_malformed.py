"""One job's malformed value blinds `status` to that job only (issue 37, weak point 8), against
the real dev agent: the job is `malformed_value` with its one line why, the others are judged as
they are, and the exit status stays 65 (never green when blind)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from tests.harness.agents import Agent
from tests.harness.holders import iso
from tests.harness.runs import cli

pytestmark = pytest.mark.consul


def put(agent: Agent, key: str, value: object) -> None:
    data = value if isinstance(value, str) else json.dumps(value)
    assert agent.api("PUT", f"kv/{key}", data=data).json() is True


@pytest.fixture
def two_jobs(consul: Agent) -> Agent:
    """`good` whose last run failed (exit 1: judged), `bad` whose record no consulrun writes."""
    now = datetime.now(timezone.utc)
    put(consul, "consulrun/good/occurrence", {
        "occurrence": iso(now - timedelta(minutes=1)), "state": "done", "exit_status": 1,
        "node": "n1", "started": iso(now), "ended": iso(now)})
    put(consul, "consulrun/bad/occurrence", {"occurrence": 5, "state": "done"})
    return consul


def test_json_names_the_malformed_job_and_judges_the_others(two_jobs: Agent) -> None:
    code, out, err = cli("status", "--json")
    assert code == 65, (out, err)
    data = json.loads(out)
    assert data["verdict"] == "malformed_value", out
    jobs = {j["job"]: j for j in data["jobs"]}
    assert jobs["good"]["verdict"] == "last_run_failed", out
    assert jobs["good"]["last"]["exit_status"] == 1, out
    bad = jobs["bad"]
    assert (bad["state"], bad["verdict"]) == ("malformed_value", "malformed_value"), out
    [problem] = bad["problems"]
    assert problem["kind"] == "malformed_value", problem
    assert problem["key"] == "consulrun/bad/occurrence", problem
    assert problem["detail"].startswith("consulrun/bad/occurrence: "), problem
    assert "'occurrence'" in problem["detail"], problem
    # The one line every reader gives for such a value, on stderr.
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert errors == [f"Error: {problem['detail']}"], err


def test_the_table_shows_every_job_and_exits_65(two_jobs: Agent) -> None:
    code, out, err = cli("status")
    assert code == 65, (out, err)
    rows = [line.split() for line in out.splitlines()[1:] if line]
    states = {row[0]: row[1] for row in rows if not row[0].endswith(":")}
    assert states == {"bad": "malformed_value", "good": "failed"}, out
    assert "bad: malformed_value: consulrun/bad/occurrence: " in out
    assert "good: failed: " in out
    # Asked about the good job alone, status is not blind: its own verdict.
    assert cli("status", "good")[0] == 1
