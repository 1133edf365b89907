"""pause and resume against a real Consul: every node skips a paused job, with no Raft write, until it ends."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from tests.harness.agents import Agent, wait_for
from tests.test_acl_tls import _acl, _token_file, acl_agent  # noqa: F401 - the fixture
from tests.test_run import SKIP, consulrun, finish

pytestmark = pytest.mark.consul

YEARLY = "*-01-01 00:00:00 UTC"


def indexes(agent: Agent, job: str) -> tuple[int, int]:
    """KV and session indexes: they move with any write to the job's keys or to sessions."""
    return (int(agent.api("GET", f"kv/consulrun/{job}/", params={"recurse": "true"}).headers["X-Consul-Index"]),
            int(agent.api("GET", "session/list").headers["X-Consul-Index"]))


@pytest.mark.parametrize("schedule", [True, False], ids=["scheduled", "plain"])
def test_paused_job_is_skipped_without_writes_until_resumed(consul: Agent, tmp_path: Path, schedule: bool) -> None:
    ran = tmp_path / "ran"
    args = ["run", "--skip-exit-code", str(SKIP), *(["--schedule", YEARLY] if schedule else []), "nightly", "--",
            "touch", str(ran)]
    code, out, err = finish(consulrun("pause", "nightly", "--reason", "database migration"))
    assert code == 0, err
    assert "nightly: paused by " in out and ": database migration" in out
    before = indexes(consul, "nightly")
    code, _, err = finish(consulrun(*args))
    assert code == SKIP, err
    assert "skipped: " in err and "paused by" in err and "database migration" in err
    assert not ran.exists()
    assert indexes(consul, "nightly") == before
    code, out, _ = finish(consulrun("status", "--json", "nightly"))
    job = json.loads(out)["jobs"][0]
    assert job["paused"]["reason"] == "database migration"
    assert finish(consulrun("resume", "nightly"))[0] == 0
    code, _, err = finish(consulrun(*args))
    assert code == 0, err
    assert ran.exists()


def test_pause_for_a_while_ends_by_itself(consul: Agent, tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    assert finish(consulrun("pause", "brief", "--for", "3s"))[0] == 0
    code, _, err = finish(consulrun("run", "--skip-exit-code", str(SKIP), "brief", "--", "touch", str(ran)))
    assert code == SKIP and "until" in err, err

    def runs() -> bool:
        return finish(consulrun("run", "--skip-exit-code", str(SKIP), "brief", "--", "touch", str(ran)))[0] == 0

    wait_for(runs, 20, "the pause to end by itself")
    assert ran.exists()


def test_pause_all_of_a_manifest_is_one_write_and_status_shows_it(consul: Agent, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a: {command: ['true'], schedule: daily}\n  b: {command: ['true'], schedule: daily}\n")
    before = int(consul.get("agent/self")["Stats"]["raft"]["applied_index"])
    code, out, err = finish(consulrun("pause", str(manifest), "--all", "--for", "1h"))
    assert code == 0, err
    assert int(consul.get("agent/self")["Stats"]["raft"]["applied_index"]) - before <= 1 + 1  # one txn (+ a stray)
    assert out.count("paused by") == 2
    code, out, err = finish(consulrun("status", str(manifest)))
    assert "paused" in out and out.count("paused by") == 2, out
    assert code == 0, out  # a paused job that runs nothing is not "missed"
    assert finish(consulrun("resume", str(manifest), "--all"))[0] == 0
    left = requests.get(f"{consul.url}/v1/kv/consulrun/", params={"recurse": "true", "keys": "true"}, timeout=10)
    assert left.status_code == 404  # the pause keys were the only state, and resume deleted them


def test_pause_needs_jobs_or_all(consul: Agent) -> None:
    code, _, err = finish(consulrun("pause"))
    assert code == 2 and "name the JOBs, or give --all" in err


def test_pause_without_write_on_the_prefix_is_refused(acl_agent, tmp_path: Path) -> None:  # noqa: F811
    agent, management = acl_agent
    rules = 'key_prefix "consulrun/" { policy = "read" }\n'
    _acl(agent, management, "PUT", "acl/policy", {"Name": "readonly", "Rules": rules})
    secret = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": "readonly"}]})["SecretID"]
    env = {"CONSUL_HTTP_ADDR": agent.http_addr, "CONSUL_HTTP_TOKEN_FILE": str(_token_file(tmp_path, "ro", secret))}
    code, out, err = finish(consulrun("pause", "guarded", env=env))
    assert code == 77, err
    assert out == "" and err.count("\n") == 1 and "Consul ACL denied it" in err
    assert requests.get(f"{agent.url}/v1/kv/consulrun/guarded/pause", headers={"X-Consul-Token": management},
                        timeout=10).status_code == 404
