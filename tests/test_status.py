"""`status`, `unlock` and `acl-policy` against a real Consul agent."""

from __future__ import annotations

import json
import os
import select
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from tests.harness.agents import Agent, wait_for
from tests.test_run import consulrun, finish, lock_entry

pytestmark = pytest.mark.consul
REPO = Path(__file__).resolve().parents[1]


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_status_table_json_and_verdicts(consul: Agent, tmp_path: Path) -> None:
    manifest = REPO / "examples" / "jobs.yaml"
    code, out, _ = cli("status", str(manifest))
    assert code == 0
    assert out.splitlines()[0].split()[:3] == ["JOB", "STATE", "HOLDER"]
    assert all("never run" in line for line in out.splitlines()[1:])

    assert finish(consulrun("run", "--schedule", "*-*-* 02:00:00", "billing-report", "--", "true"))[0] == 0
    assert finish(consulrun("run", "stray", "--", "sh", "-c", "exit 4"))[0] == 4
    started = tmp_path / "started"
    holder = consulrun("run", "cache-warm", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the cache-warm job")
        code, out, _ = cli("status", str(manifest), "--json")
        data = json.loads(out)
        jobs = {j["job"]: j for j in data["jobs"]}
        assert code == 1 and data["verdict"] == "last_run_failed"  # stray's last run exited 4
        assert jobs["billing-report"]["state"] == "free" and jobs["billing-report"]["last"]["exit_status"] == 0
        assert jobs["billing-report"]["last"]["state"] == "done" and jobs["billing-report"]["next"].endswith(":00Z")
        assert jobs["cache-warm"]["state"] == "held"
        held = jobs["cache-warm"]["holders"][0]
        assert held["node"] == "dev1" and held["healthy"] is True and held["health"] == "passing"
        assert jobs["stray"]["state"] == "orphaned" and jobs["stray"]["last"]["exit_status"] == 4

        code, _, err = cli("unlock", "cache-warm", "--yes")
        assert code == 1 and "healthy" in err and "--force" in err
        assert lock_entry(consul, "consulrun/cache-warm/lock").get("Session") == held["session"]
        code, _, err = cli("unlock", "cache-warm", "--yes", "--force")
        assert code == 0 and "unlocked: destroyed session" in err
        assert finish(holder)[0] == 75
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGTERM)
            finish(holder)
    code, out, _ = cli("unlock", "cache-warm", "--yes")
    assert (code, out) == (0, "cache-warm is not locked\n")


def test_status_exit_5_when_holder_session_is_unhealthy(consul: Agent, tmp_path: Path) -> None:
    consul.api("PUT", "agent/check/register", json={"ID": "disk-ok", "Name": "disk", "TTL": "600s"})
    consul.api("PUT", "agent/check/pass/disk-ok")
    started = tmp_path / "started"
    holder = consulrun("run", "--check", "disk-ok", "checked", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the checked job")
        assert cli("status")[0] == 0
        consul.api("PUT", "agent/check/warn/disk-ok")  # not passing, yet not critical: the session stays
        code, out, _ = cli("status")
        assert code == 5
        assert "check(s) not passing on dev1: disk-ok" in out
        consul.api("PUT", "agent/check/fail/disk-ok")  # critical invalidates the session: the holder fences itself
        assert finish(holder, timeout=60)[0] == 75
    finally:
        consul.api("PUT", "agent/check/deregister/disk-ok")


def test_status_consul_down() -> None:
    result = CliRunner().invoke(main, ["status", "--http-addr", "127.0.0.1:9"])
    assert result.exit_code == 69 and "not reachable" in result.stderr


def test_acl_policy_is_least_privilege() -> None:
    code, out, _ = cli("acl-policy", str(REPO / "examples" / "jobs.yaml"))
    assert code == 0
    assert 'key_prefix "consulrun/" {\n  policy = "write"\n}' in out
    assert 'session_prefix "" {\n  policy = "write"\n}' in out
    assert 'node_prefix "" {\n  policy = "read"\n}' in out
    assert "service_prefix" not in out and out.count('policy = "write"') == 2
    code, out, _ = cli("acl-policy", str(REPO / "tests" / "golden" / "tls-and-checks" / "manifest.yaml"))
    assert 'key_prefix "ops/cron/"' in out and 'service_prefix "" {\n  policy = "read"\n}' in out


def test_watch_redraws_when_state_changes(consul: Agent) -> None:
    watcher = consulrun("status", "--watch")
    seen = ""

    def read_available() -> str:  # raw reads: a buffered readline would hide lines from select()
        nonlocal seen
        fd = watcher.stdout.fileno()
        while select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk.decode()
        return seen

    try:
        wait_for(lambda: "JOB" in read_available(), 20, "the first table")
        assert "watched" not in seen
        assert finish(consulrun("run", "watched", "--", "true"))[0] == 0
        wait_for(lambda: "watched" in read_available(), 20, "a redraw showing the new job")
        assert watcher.poll() is None  # still watching
    finally:
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(timeout=10)
