"""`consulrun trigger`: one manual run, through the job's own unit, never beside another run."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest

from tests.harness.agents import Agent, wait_for
from tests.test_faults import stop_agent_in
from tests.test_run import consulrun, finish

pytestmark = pytest.mark.consul


def test_trigger_while_the_job_runs_says_so_and_starts_nothing(consul: Agent, tmp_path: Path) -> None:
    from consulrun.consulapi import Client, ConsulConfig
    from consulrun.trigger import NotTriggered, trigger

    started = tmp_path / "started"
    holder = consulrun("run", "busy", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the running job")
        calls: list[str] = []
        client = Client(ConsulConfig.from_env({}, address=consul.http_addr))
        with pytest.raises(NotTriggered, match="the job is running: dev1"):
            trigger(client, "consulrun/busy", "consulrun-busy.service", wait_s=0,
                    start_unit=lambda unit: calls.append(unit))  # type: ignore[arg-type,return-value]
        assert calls == []
        assert requests_get(consul, "kv/consulrun/busy/trigger") == 404
    finally:
        holder.terminate()
        finish(holder)


def requests_get(agent: Agent, path: str) -> int:
    import requests

    return requests.get(f"{agent.url}/v1/{path}", timeout=10).status_code


@pytest.mark.systemd
def test_trigger_runs_once_through_the_unit_beside_its_timer(systemd_container, consul_bin: str,
                                                              tmp_path: Path) -> None:
    """A timer fires every 3 s; a trigger makes one more run, recorded as manual; no two runs overlap."""
    from tests.test_install import CONSULRUN, manifest, start_agent

    ctr = systemd_container
    agent = start_agent(ctr, consul_bin, "trignode", ["-dev", "-client", "127.0.0.1", "-bind", "127.0.0.1"],
                        tmp_path / "consul.log")
    log = ctr.shared / "trig-log"
    try:
        job = {"command": ["sh", "-c", "echo start $(date +%s.%N) ${CONSULRUN_MANUAL:-timer} >> /shared/trig-log; "
                                       "sleep 1; echo end $(date +%s.%N) >> /shared/trig-log"],
               "schedule": "*:*:0/3"}
        (ctr.shared / "trig.yaml").write_text(manifest({"trigjob": job}))
        ctr.exec(CONSULRUN, "install", "/shared/trig.yaml")
        wait_for(lambda: log.exists() and "end" in log.read_text(), 30, "a timer run")
        result = ctr.exec(CONSULRUN, "trigger", "--wait", "30s", "/shared/trig.yaml", "trigjob", check=False,
                          timeout=120)
        assert result.returncode == 0, result.stderr
        assert "trigjob: manual run on trignode" in result.stdout and "exit status 0" in result.stdout
        wait_for(lambda: log.read_text().count("start") >= 3, 30, "more timer runs after the manual one")
        ctr.systemctl("stop", "consulrun-trigjob.timer")
        wait_for(lambda: ctr.systemctl("is-active", "consulrun-trigjob.service", check=False).stdout.strip()
                 != "active", 30, "the last run to end")
        lines = [line.split() for line in log.read_text().splitlines()]
        manual = [line for line in lines if line[0] == "start" and line[2] != "timer"]
        assert len(manual) == 1 and manual[0][2].startswith("root@")
        spans, opened = [], None
        for line in lines:
            if line[0] == "start":
                assert opened is None, "two runs overlapped"
                opened = float(line[1])
            else:
                spans.append((opened, float(line[1])))
                opened = None
        exported = json.loads(ctr.exec(consul_bin, "kv", "export", "consulrun/trigjob/history/").stdout)
        entries = [json.loads(base64.b64decode(e["value"])) for e in exported if e["key"].endswith("~manual")]
        assert len(entries) == 1 and entries[0]["manual"] is True and entries[0]["state"] == "done"
        assert entries[0]["requested_by"].startswith("root@")
    finally:
        ctr.systemctl("stop", "consulrun-trigjob.timer", "consulrun-trigjob.service", check=False)
        stop_agent_in(ctr, consul_bin, agent)
