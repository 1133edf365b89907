"""Two manifests with health checks installed on one booted systemd node: one watchdog unit
judges both manifests' jobs, stays while either is installed, and goes with the last."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from tests.harness.agents import wait_for
from tests.harness.nodes import agent_node
from tests.harness.nspawn import Container

pytestmark = [pytest.mark.systemd, pytest.mark.consul]

CONSULRUN = str(Path(sys.prefix) / "bin" / "consulrun")
READ_CHECKS = ("import json, urllib.request; print(json.dumps({c['Name']: [c['Status'], c['Output']] "
               "for c in json.load(urllib.request.urlopen("
               "'http://127.0.0.1:8500/v1/health/node/consulrun'))}))")


@pytest.fixture(scope="module")
def node(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    with agent_node(consul_bin, tmp_path_factory.mktemp("watchdogs"), "10.213.98.0/24",
                    "w") as ctr:
        yield ctr


def manifest(job: str) -> str:
    """One hourly job, with health checks."""
    jobs = {job: {"command": ["true"], "schedule": "*-*-* *:00:00"}}
    return yaml.safe_dump({"health_checks": True, "jobs": jobs})


def missed_long_ago(ctr: Container, consul_bin: str, job: str) -> None:
    old = (datetime.now(timezone.utc) - timedelta(hours=3)).strftime("%Y-%m-%dT%H:00:00Z")
    record = json.dumps({"occurrence": old, "state": "done", "node": "solo", "exit_status": 0,
                         "started": old, "ended": old})
    ctr.exec(consul_bin, "kv", "put", f"consulrun/{job}/occurrence", record)


def checks(ctr: Container) -> dict[str, list[str]]:
    return json.loads(ctr.exec("/usr/bin/python3", "-c", READ_CHECKS).stdout)


def test_one_watchdog_covers_every_installed_manifest(node: Container, consul_bin: str) -> None:
    for name, job in (("teama", "alpha"), ("teamb", "beta")):
        (node.shared / f"{name}.yaml").write_text(manifest(job))
        result = node.exec(CONSULRUN, "install", f"/shared/{name}.yaml", "--no-start",
                           check=False)
        assert result.returncode == 0, result.stderr  # teamb: exit 2 before, the watchdog's
        missed_long_ago(node, consul_bin, job)
    node.systemctl("start", "consulrun-_watchdog.service")
    found = wait_for(lambda: checks(node) if len(checks(node)) == 2 else None, 90,
                     "the watchdog to judge both manifests' jobs")
    for job in ("alpha", "beta"):
        assert found[job][0] == "critical" and found[job][1].startswith("missed: "), found

    result = node.exec(CONSULRUN, "uninstall", "/shared/teama.yaml", check=False)
    assert result.returncode == 0, result.stderr
    assert node.systemctl("is-enabled", "consulrun-_watchdog.timer").stdout.strip() == "enabled"
    assert not (node.unit_dir / "consulrun-_watchdog-teama.jobs").exists()
    result = node.exec(CONSULRUN, "uninstall", "/shared/teamb.yaml", check=False)
    assert result.returncode == 0, result.stderr
    assert "consulrun-_watchdog.service, consulrun-_watchdog.timer" in result.stdout
    assert sorted(p.name for p in node.unit_dir.glob("consulrun-*")) == []
    assert node.systemctl("cat", "consulrun-_watchdog.timer", check=False).returncode != 0
