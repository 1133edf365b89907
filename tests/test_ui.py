"""The real Consul UI, in a real headless Chromium, shows who holds a job's lock."""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import require_tool
from tests.harness.agents import Agent, start_dev_agent, wait_for
from tests.harness.runs import consulrun, finish, lock_entry

pytestmark = pytest.mark.consul

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=20000", "--window-size=1400,1250"]


def chromium(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium on `url`; a browser that failed is a failed test, whatever it printed."""
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run([require_tool("chromium"), *FLAGS, f"--user-data-dir={profile}", *args, url],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"chromium exited {result.returncode}: {result.stderr[-2000:]}"
    return result


def rendered(url: str, marker: str, timeout: float = 90) -> str:
    """The DOM of `url` once the UI has rendered `marker`: a page dumped while the UI still loads (its
    `ember-loading` shell, seen on a busy machine) is asked for again, within `timeout`."""
    dom = ""

    def shows() -> bool:
        nonlocal dom
        dom = chromium(url, "--dump-dom").stdout
        return marker in dom

    try:
        wait_for(shows, timeout, f"the UI to render {marker!r} at {url}", interval=1)
    except TimeoutError:  # the assertion that follows says what was shown instead
        pass
    return dom


def test_ui_shows_job_key_holder_node_and_session(consul: Agent, tmp_path: Path, artifacts: Path) -> None:
    started = tmp_path / "started"
    holder = consulrun("run", "billing-report", "--", "sh", "-c", f"touch {started}; sleep 120")
    try:
        wait_for(started.exists, 20, "the job to hold its lock")
        entry = lock_entry(consul, "consulrun/billing-report/lock")
        session = entry["Session"]
        value = base64.b64decode(entry["Value"]).decode()
        assert json.loads(value)["node"] == "dev1" and value.startswith("{\n  ")  # indented: readable in the editor
        url = f"{consul.url}/ui/dc1/kv/consulrun/billing-report/lock/edit"
        dom = rendered(url, "consulrun:billing-report@dev1")
        (artifacts / "kv-lock.html").write_text(dom)
        assert "consulrun:billing-report@dev1" in dom  # the Lock Session panel: job and node in the session name
        assert session in dom
        assert "billing-report" in dom and "dev1" in dom
        shot = artifacts / "consul-ui-lock.png"
        result = chromium(url, f"--screenshot={shot}")
        assert shot.exists() and shot.stat().st_size > 10_000, result.stderr[-2000:]
        listing = rendered(f"{consul.url}/ui/dc1/kv/consulrun/", "billing-report/")
        assert "billing-report/" in listing  # keys are grouped per job
    finally:
        holder.send_signal(signal.SIGTERM)
        finish(holder)


def test_ui_shows_a_failing_jobs_check_red_and_a_passing_ones_green(consul_bin: str, tmp_path: Path,
                                                                      artifacts: Path) -> None:
    """The checks runs set (health_checks), on the Nodes and Services pages, as the UI's own DOM classes say."""
    # The UI follows with blocking queries; headless Chromium's virtual time stands still while one is open,
    # so this agent answers them within a second.
    agent = start_dev_agent(consul_bin, tmp_path, name="ui1", extra_config={
        "disable_coordinates": True, "default_query_time": "1s", "max_query_time": "2s"})
    try:
        env = {"CONSUL_HTTP_ADDR": agent.http_addr}
        manifest = tmp_path / "jobs.yaml"
        manifest.write_text("health_checks: true\njobs:\n"
                            '  billing-report: {command: "true", schedule: "*-*-* 02:00:00"}\n'
                            '  cache-warm: {command: "true", schedule: "*:0/5"}\n')
        code, _, err = finish(consulrun("watchdog", str(manifest), env=env))
        assert code == 0 and "registered the external node consulrun" in err, err
        for job, command in (("billing-report", "true"), ("cache-warm", "exit 3")):
            code, _, err = finish(consulrun("run", "--health-check", "--schedule", "*-*-* 02:00:00", job, "--",
                                            "sh", "-c", command, env=env))
            assert code == (0 if command == "true" else 3), err
        url = f"{agent.url}/ui/dc1/nodes/consulrun/health-checks"
        dom = rendered(url, "health-check-output")
        (artifacts / "node-health-checks.html").write_text(dom)
        shown = dict((name, status) for status, name in
                     re.findall(r'<li class="health-check-output (\w+)">\s*<div>\s*<header>\s*<h2>([^<]+)</h2>', dom))
        assert shown == {"billing-report": "passing", "cache-warm": "critical"}, shown
        assert "exit status 3" in dom and "ran on ui1" in dom  # the output names node and exit status
        services = rendered(f"{agent.url}/ui/dc1/services", 'href="/ui/dc1/services/consulrun"')
        (artifacts / "services.html").write_text(services)
        assert re.search(r'<dl class="critical">\s*<dt>\s*Health\s*</dt>.*?<a href="/ui/dc1/services/consulrun">',
                         services, re.S), "the consulrun service is not shown critical"
        shot = artifacts / "health-checks.png"
        result = chromium(url, f"--screenshot={shot}")
        assert shot.exists() and shot.stat().st_size > 10_000, result.stderr[-2000:]
    finally:
        agent.stop()
