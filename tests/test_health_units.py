"""health_checks: true, installed on a booted systemd node: the watchdog's timer marks a missed occurrence by itself."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from tests.harness.agents import wait_for
from tests.harness.nodes import agent_node, install, manifest, show
from tests.harness.nspawn import Container

pytestmark = [pytest.mark.systemd, pytest.mark.consul]

READ_CHECKS = ("import json, urllib.request; print(json.dumps({c['Name']: [c['Status'], c['Output']] for c in "
               "json.load(urllib.request.urlopen('http://127.0.0.1:8500/v1/health/node/consulrun'))}))")


def node_checks(ctr: Container) -> dict[str, list[str]]:
    return json.loads(ctr.exec("/usr/bin/python3", "-c", READ_CHECKS).stdout)


def test_installed_watchdog_marks_a_missed_occurrence_with_no_command_run(consul_bin: str,
                                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    with agent_node(consul_bin, tmp_path_factory.mktemp("health"), "10.213.87.0/24", "h") as ctr:
        jobs = {"daily": {"command": ["sh", "-c", "exit 3"], "schedule": "*-*-* 00:00:00"},
                "hourly": {"command": ["true"], "schedule": "*-*-* *:00:00"},
                "slow": {"command": ["sleep", "600"], "schedule": "*-*-* 00:00:00", "timeout": "2s"}}
        result = install(ctr, manifest(jobs, health_checks=True), "--no-start")
        assert result.returncode == 0, result.stderr
        assert "consulrun-_watchdog.timer" in result.stdout + result.stderr
        assert show(ctr, "consulrun-_watchdog.timer", "TimersCalendar")["TimersCalendar"] == "{ OnCalendar=*-*-* *:*:00}"
        # hourly last ran three hours ago: every occurrence since was missed.
        old = (datetime.now(timezone.utc) - timedelta(hours=3)).strftime("%Y-%m-%dT%H:00:00Z")
        record = json.dumps({"occurrence": old, "state": "done", "node": "solo", "exit_status": 0,
                             "started": old, "ended": old})
        ctr.exec(consul_bin, "kv", "put", "consulrun/hourly/occurrence", record)
        # Before the watchdog ever ran, no external node: the run records its result anyway.
        assert ctr.systemctl("start", "consulrun-daily.service", check=False).returncode != 0
        journal = ctr.exec("journalctl", "-u", "consulrun-daily.service", "--no-pager", "-o", "cat").stdout
        assert "the job's Consul health check was not updated" in journal and "job exited with status 3" in journal, journal

        ctr.systemctl("start", "consulrun-_watchdog.timer")  # as `install` without --no-start would
        found = wait_for(lambda: node_checks(ctr) if len(node_checks(ctr)) == 3 else None, 90,
                         "the watchdog's timer to judge the jobs")
        assert found["hourly"][0] == "critical" and found["hourly"][1].startswith("missed: occurrence "), found
        assert found["daily"][0] == "critical" and "exit status 3" in found["daily"][1], found
        assert found["slow"] == ["passing", "never run"], found
        runs = ctr.exec("journalctl", "-u", "consulrun-_watchdog.service", "--no-pager", "-o", "cat").stdout
        assert "acquired consulrun/_watchdog/lock for occurrence" in runs and "registered the external node" in runs

        # The wrapper stops a run that outlives its timeout: the run's finish turns the check red.
        assert ctr.systemctl("start", "consulrun-slow.service", check=False).returncode != 0
        assert show(ctr, "consulrun-slow.service", "Result", "ExecMainStatus") == \
            {"Result": "exit-code", "ExecMainStatus": "143"}
        status, output = node_checks(ctr)["slow"]
        assert status == "critical" and "exit status 143" in output, output
