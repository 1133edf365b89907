"""The real Consul UI, in a real headless Chromium, shows who holds a job's lock."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import require_tool
from tests.harness.agents import Agent, wait_for
from tests.test_run import consulrun, finish, lock_entry

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
        dom = chromium(url, "--dump-dom").stdout
        (artifacts / "kv-lock.html").write_text(dom)
        assert "consulrun:billing-report@dev1" in dom  # the Lock Session panel: job and node in the session name
        assert session in dom
        assert "billing-report" in dom and "dev1" in dom
        shot = artifacts / "consul-ui-lock.png"
        result = chromium(url, f"--screenshot={shot}")
        assert shot.exists() and shot.stat().st_size > 10_000, result.stderr[-2000:]
        listing = chromium(f"{consul.url}/ui/dc1/kv/consulrun/", "--dump-dom").stdout
        assert "billing-report/" in listing  # keys are grouped per job
    finally:
        holder.send_signal(signal.SIGTERM)
        finish(holder)
