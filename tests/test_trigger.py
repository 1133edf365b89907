"""`consulrun trigger`: one manual run, through the job's own unit, never beside another run."""

from __future__ import annotations

import base64
import json
import subprocess
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from consulrun.protocol import keys as kvkeys
from tests.harness.agents import Agent, wait_for
from tests.harness.nodes import stop_agent_in
from tests.harness.runs import consulrun, finish, gated_job, kv_json

pytestmark = pytest.mark.consul


def test_trigger_while_the_job_runs_says_so_and_starts_nothing(consul: Agent, tmp_path: Path) -> None:
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.protocol.trigger import NotTriggered, trigger

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


def test_a_trigger_beside_a_done_occurrence_is_run_once_as_manual_by_the_run_it_starts(consul: Agent,
                                                                                       tmp_path: Path) -> None:
    """The run side of a trigger on the dev agent (the unit started by calling what its ExecStart= runs): the
    request is taken by that one run although the occurrence is done, consumed, and recorded as manual; the next
    run is the scheduled one again, already done."""
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.protocol.pause import who
    from consulrun.protocol.trigger import trigger

    ran = tmp_path / "ran"
    run = ["run", "--schedule", "*-01-01 00:00:00 UTC", "manualjob", "--", "sh", "-c", f"echo x >> {ran}"]
    assert finish(consulrun(*run))[0] == 0  # the occurrence, done

    def start_unit(unit: str) -> subprocess.CompletedProcess[str]:
        code, out, err = finish(consulrun(*run))
        return subprocess.CompletedProcess([unit], code, out, err)

    client = Client(ConsulConfig.from_env({}, address=consul.http_addr))
    outcome = trigger(client, "consulrun/manualjob", "consulrun-manualjob.service", wait_s=0, start_unit=start_unit)
    assert outcome.unit_status == 0, outcome.unit_output
    assert outcome.record and outcome.record["manual"] and outcome.record["state"] == "done", outcome
    entry = outcome.record  # the manual run's history entry: who asked, when, and the run that took it
    assert entry["requested_by"] == who() and entry["requested_at"].endswith("Z"), entry
    datetime.fromisoformat(entry["requested_at"].replace("Z", "+00:00"))
    assert entry["node"] == "dev1" and len(entry["session"]) == 36 and entry["started"].endswith("Z"), entry
    keys = consul.get("kv/consulrun/manualjob/history/?keys")
    assert kvkeys.history_key("consulrun/manualjob", entry["started"], manual=True) in keys, keys
    assert ran.read_text() == "x\nx\n"
    assert requests_get(consul, "kv/consulrun/manualjob/trigger") == 404  # consumed
    code, _, err = finish(consulrun(*run))
    year = datetime.now(timezone.utc).year
    assert code == 0 and f"occurrence {year}-01-01T00:00:00Z already ran on dev1 (exit status 0)" in err, err
    assert ran.read_text() == "x\nx\n"


def test_a_trigger_meeting_the_job_running_leaves_it_alone_and_names_the_holder(consul: Agent, tmp_path: Path) -> None:
    """A request that reaches a run while the job is running (the lock was free when it was made): that run starts
    nothing, says who holds the job, and leaves the request for the trigger to withdraw."""
    started, go, second = tmp_path / "started", tmp_path / "go", tmp_path / "second"
    schedule = ["run", "--schedule", "*-01-01 00:00:00 UTC", "--skip-exit-code", "75", "busyjob", "--"]
    runner = consulrun(*schedule, *gated_job(started, go))
    wait_for(started.exists, 20, "the scheduled run to start")
    request = _ask(consul, "busyjob")
    try:
        code, _, err = finish(consulrun(*schedule, "touch", str(second)))
        holder = kv_json(consul, "consulrun/busyjob/lock")
    finally:
        go.touch()
    assert code == 75 and not second.exists(), err
    assert (f"a manual run was asked for, but the job is running: dev1 (pid {holder['pid']}, since "
            f"{holder['started']}, session ") in err, err
    assert kv_json(consul, "consulrun/busyjob/trigger") == request
    assert finish(runner)[0] == 0


def test_a_trigger_beside_a_later_occurrence_is_run_as_manual(consul: Agent, tmp_path: Path) -> None:
    """A node whose clock is behind finds a later occurrence recorded: it skips its own, but a trigger asked of it
    is still run (a manual run is outside the schedule), and consumed."""
    later = {"occurrence": f"{datetime.now(timezone.utc).year + 1}-01-01T00:00:00Z", "state": "done", "node": "ahead",
             "session": "s", "attempt": 1, "earlier": [], "exit_status": 0}
    consul.api("PUT", "kv/consulrun/laterjob/occurrence", data=json.dumps(later))
    _ask(consul, "laterjob")
    ran = tmp_path / "ran"
    code, _, err = finish(consulrun("run", "--schedule", "*-01-01 00:00:00 UTC", "laterjob", "--", "touch", str(ran)))
    assert code == 0 and ran.exists(), err
    assert "for a manual run asked for by tester" in err, err
    assert requests_get(consul, "kv/consulrun/laterjob/trigger") == 404  # consumed
    assert kv_json(consul, "consulrun/laterjob/occurrence") == later


def _ask(consul: Agent, job: str) -> dict[str, str]:
    """A fresh trigger request for the dev agent's node, written as `consulrun trigger` writes it; the request."""
    now = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    request = {"id": str(uuid.uuid4()), "by": "tester", "at": now, "node": "dev1"}
    consul.api("PUT", f"kv/consulrun/{job}/trigger", data=json.dumps(request))
    return request


def requests_get(agent: Agent, path: str) -> int:
    import requests

    return requests.get(f"{agent.url}/v1/{path}", timeout=10).status_code


@pytest.mark.systemd
def test_trigger_runs_once_through_the_unit_beside_its_timer(systemd_container, consul_bin: str,
                                                              tmp_path: Path) -> None:
    """A timer fires every 3 s; a trigger makes one more run, recorded as manual; no two runs overlap."""
    from tests.harness.nodes import CONSULRUN, manifest, start_agent

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
        wait_for(lambda: ctr.ended("consulrun-trigjob.service"), 30, "the last run to end")
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
        entries = [json.loads(base64.b64decode(e["value"])) for e in exported if kvkeys.is_manual(e["key"])]
        assert len(entries) == 1 and entries[0]["manual"] is True and entries[0]["state"] == "done"
        assert entries[0]["requested_by"].startswith("root@")
    finally:
        ctr.systemctl("stop", "consulrun-trigjob.timer", "consulrun-trigjob.service", check=False)
        stop_agent_in(ctr, consul_bin, agent)


@pytest.mark.systemd
def test_trigger_right_after_install_runs_a_manual_run(systemd_container, consul_bin: str, tmp_path: Path) -> None:
    """A daily job just installed: its latest occurrence came before the install and was never run. The unit
    `trigger` starts (no timer started it) runs the manual run asked for, not that occurrence; trigger exits 0."""
    from tests.harness.nodes import CONSULRUN, manifest, start_agent

    ctr = systemd_container
    agent = start_agent(ctr, consul_bin, "freshnode", ["-dev", "-client", "127.0.0.1", "-bind", "127.0.0.1"],
                        tmp_path / "consul.log")
    log = ctr.shared / "fresh-log"
    try:
        job = {"command": ["sh", "-c", "echo ${CONSULRUN_MANUAL:-occurrence-$CONSULRUN_OCCURRENCE} >> /shared/fresh-log"],
               "schedule": "*-*-* 00:00:00 UTC"}
        (ctr.shared / "fresh.yaml").write_text(manifest({"freshjob": job}))
        ctr.exec(CONSULRUN, "install", "/shared/fresh.yaml")
        result = ctr.exec(CONSULRUN, "trigger", "/shared/fresh.yaml", "freshjob", check=False, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "freshjob: manual run on freshnode" in result.stdout and "exit status 0" in result.stdout
        runs = log.read_text().split()
        assert len(runs) == 1 and runs[0].startswith("root@"), runs  # one run, the manual one (CONSULRUN_MANUAL)
        exported = json.loads(ctr.exec(consul_bin, "kv", "export", "consulrun/freshjob/").stdout)
        keys = {e["key"] for e in exported}
        assert "consulrun/freshjob/occurrence" not in keys, keys  # the never-run occurrence is left alone
        assert [k for k in keys if kvkeys.is_manual(k)], keys
    finally:
        ctr.systemctl("stop", "consulrun-freshjob.timer", "consulrun-freshjob.service", check=False)
        stop_agent_in(ctr, consul_bin, agent)


# --- three booted nodes: timers on all three, one trigger -------------------------------------------------


@pytest.fixture(scope="module")
def three_timers(consul_bin: str, tmp_path_factory: pytest.TempPathFactory):
    """Three booted nodes, one Consul cluster, sshd on each (for `trigger --host`)."""
    from tests.harness.nodes import ssh_cluster

    with ssh_cluster(consul_bin, tmp_path_factory.mktemp("trig3"), "10.213.82.0/24", "g") as cluster:
        yield cluster


def run_log(job: str) -> list[str]:
    """What the job logs: a start and an end line per run, each with its time, what it ran and where."""
    mark = f"$(date +%s.%N) ${{CONSULRUN_OCCURRENCE:-manual}} $(hostname) >> /shared/{job}.log"
    return ["sh", "-c", f"echo start {mark}; sleep 1; echo end {mark}"]


@pytest.mark.systemd
@pytest.mark.parametrize("remote", [False, True], ids=["here", "host"])
def test_trigger_among_three_nodes_runs_once_as_manual(three_timers, consul_bin: str, remote: bool,
                                                       request: pytest.FixtureRequest) -> None:
    """Timers fire every 5 s on three nodes; one trigger (here, or `--host` another node) is one manual run there,
    recorded as manual with who asked, beside no other run; every scheduled occurrence still runs exactly once."""
    from tests.conftest import artifact_dir
    from tests.harness.nodes import CONSULRUN, manifest

    nodes, network, _ = three_timers
    job = "tri-host" if remote else "tri-here"
    # lock.wait: an occurrence due while the manual run holds the lock waits for it instead of being skipped.
    text = manifest({job: {"command": run_log(job), "schedule": "*:*:0/5", "history": 100, "lock": {"wait": "10s"}}})
    asker, target = (nodes[0], 2) if remote else (nodes[1], 1)

    def lines() -> list[list[str]]:
        return sorted((line.split() for ctr in nodes if (ctr.shared / f"{job}.log").exists()
                       for line in (ctr.shared / f"{job}.log").read_text().splitlines()), key=lambda x: float(x[1]))

    def ended(kind: str | None = None) -> list[list[str]]:
        return [x for x in lines() if x[0] == "end" and (kind is None or (x[2] == "manual") == (kind == "manual"))]

    try:
        for ctr in nodes:
            (ctr.shared / f"{job}.yaml").write_text(text)
            ctr.exec(CONSULRUN, "install", f"/shared/{job}.yaml")
        wait_for(lambda: len(ended("scheduled")) >= 2, 60, "scheduled runs on the cluster")
        where = ["--host", f"root@{network.address(target)}"] if remote else []
        result = asker.exec(CONSULRUN, "trigger", "--wait", "30s", *where, f"/shared/{job}.yaml", job, check=False,
                            timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{job}: manual run on node{target + 1} " in result.stdout and "exit status 0" in result.stdout
        manual_end = float(wait_for(lambda: ended("manual"), 30, "the manual run's end line")[0][1])
        wait_for(lambda: len([x for x in ended("scheduled") if float(x[1]) > manual_end]) >= 2, 60,
                 "scheduled runs after the manual one")
    finally:
        for ctr in nodes:
            ctr.systemctl("stop", f"consulrun-{job}.timer", check=False)
        for ctr in nodes:
            wait_for(lambda: ctr.ended(f"consulrun-{job}.service"), 60, "the last run to end")
        artifact_dir(request.node).mkdir(parents=True, exist_ok=True)
        (artifact_dir(request.node) / "runs.txt").write_text("\n".join(" ".join(x) for x in lines()))

    log = lines()
    opened = None
    for event, _, kind, host in log:  # one timeline for the whole cluster (the nodes share the host's clock)
        assert (event == "start") == (opened is None), f"two runs overlapped at {kind} on {host}: {log}"
        opened = kind if event == "start" else None
    manual = [x for x in log if x[0] == "start" and x[2] == "manual"]
    assert len(manual) == 1 and manual[0][3] == nodes[target].name, log

    exported = json.loads(nodes[0].exec(consul_bin, "kv", "export", f"consulrun/{job}/history/").stdout)
    history = {kvkeys.history_order(e["key"])[0] + (kvkeys.MANUAL if kvkeys.is_manual(e["key"]) else ""):
               json.loads(base64.b64decode(e["value"])) for e in exported}  # by the time each names
    manual_records = [r for k, r in history.items() if kvkeys.is_manual(k)]
    assert len(manual_records) == 1, manual_records
    record = manual_records[0]
    assert record["manual"] is True and record["state"] == "done" and record["exit_status"] == 0
    assert record["node"] == f"node{target + 1}"
    assert record["requested_by"] == f"root@{nodes[target].name}"  # with `--host`, trigger runs on the target

    # Every occurrence from the first run to the last is run once, recorded done; none ran twice.
    started = [x[2] for x in log if x[0] == "start" and x[2] != "manual"]
    assert len(started) == len(set(started)), started
    first, last = (datetime.fromisoformat(started[i].replace("Z", "+00:00")) for i in (0, -1))
    due = [(first + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ")
           for s in range(0, int((last - first).total_seconds()) + 1, 5)]
    assert started == due, f"scheduled runs {started}, due {due}"
    assert all(history[occ]["state"] == "done" and not history[occ].get("manual") for occ in due)
