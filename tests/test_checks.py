"""`--check`: extra node and service checks bound to the session, on a real agent; unknown ones refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.harness.agents import Agent, wait_for

pytestmark = pytest.mark.consul
REPO = Path(__file__).resolve().parents[1]


def consulrun(agent: Agent, *args: str) -> subprocess.Popen[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CONSUL_")},
           "CONSUL_HTTP_ADDR": agent.http_addr, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "consulrun", "run", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.fixture
def checks(consul: Agent) -> Agent:
    """A service `web` with a TTL check `service:web`, and a node TTL check `mem-ok`, both passing."""
    consul.api("PUT", "agent/service/register", json={"Name": "web", "ID": "web", "Check": {"TTL": "300s"}})
    consul.api("PUT", "agent/check/register", json={"Name": "mem-ok", "ID": "mem-ok", "TTL": "300s"})
    consul.api("PUT", "agent/check/pass/service:web")
    consul.api("PUT", "agent/check/pass/mem-ok")
    yield consul
    consul.api("PUT", "agent/service/deregister/web")
    consul.api("PUT", "agent/check/deregister/mem-ok")


def test_service_and_node_checks_are_bound_and_a_failing_one_stops_the_job(checks: Agent, tmp_path: Path) -> None:
    started = tmp_path / "started"
    proc = consulrun(checks, "--check", "service:web", "--check", "mem-ok", "checked", "--",
                     "sh", "-c", f"touch {started}; exec sleep 300")
    try:
        wait_for(started.exists, 20, "the job to start")
        (session,) = checks.get("session/list")
        assert [c["ID"] for c in session["ServiceChecks"]] == ["service:web"]
        assert sorted(session["NodeChecks"]) == ["mem-ok", "serfHealth"]
        assert session["Name"] == "consulrun:checked@dev1"
        checks.api("PUT", "agent/check/fail/service:web")  # the bound service check goes critical
        code, _, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    assert code == 75, err
    assert "lock lost" in err
    assert "Session" not in checks.get("kv/consulrun/checked/lock")[0]
    assert checks.get("session/list") == []


def test_unknown_check_is_refused_before_any_write(checks: Agent, tmp_path: Path) -> None:
    def kv_index() -> str:
        return requests.get(f"{checks.url}/v1/kv/consulrun/?recurse", timeout=10).headers["X-Consul-Index"]

    before = kv_index()
    marker = tmp_path / "ran"
    code, out, err = finish(consulrun(checks, "--check", "service:web", "--check", "no-such-check", "checked", "--",
                                      "touch", str(marker)))
    assert (code, out) == (2, "")
    assert err == "Error: check(s) not registered on node dev1: no-such-check\n"
    assert not marker.exists()
    assert checks.get("session/list") == [] and kv_index() == before


def test_check_critical_at_start_means_the_job_does_not_run(checks: Agent, tmp_path: Path) -> None:
    checks.api("PUT", "agent/check/fail/mem-ok")
    marker = tmp_path / "ran"
    code, out, err = finish(consulrun(checks, "--check", "mem-ok", "checked", "--", "touch", str(marker)))
    assert code == 69, err
    assert err.count("\n") == 1 and "mem-ok" in err and "critical" in err, err
    assert not marker.exists()
    assert checks.get("session/list") == []
