"""`mode: each-node`: every node runs each occurrence once, never more than lock.concurrency at a time; a node
done skips on reads alone; a node that dies mid-run is fenced, its slot goes to the next, and status names it.

Real agents: a server and three clients, each in its own network namespace (the runs share this machine's
files, so one log holds every run's start and end by the real clock); and one dev agent for what one node
shows (the escaping of node names into keys, a wait for a slot that ends at the next occurrence).
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from consulrun.protocol.keys import stamp
from consulrun.errors import ManifestError
from consulrun.manifest.loader import load_manifest
from consulrun.protocol.eachnode import SLOTS_FULL_MISSED, node_key, node_of_key
from consulrun.units.render import run_argv
from tests.harness.agents import Agent, Cluster, cluster_up, wait_for
from tests.harness.clock import skewed
from tests.harness.runs import consulrun, finish

SKIP = 42
DAILY = "*-*-* 00:00:00"  # today's midnight: one occurrence for the whole test, the next one a day away
KV_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789,_./-?&=")


@pytest.fixture(scope="module")
def cluster(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """node1 (server) and node2, node3, node4 (clients), each in its own network namespace."""
    if os.geteuid() != 0:
        pytest.fail("the cluster needs root for network namespaces", pytrace=False)
    with cluster_up(consul_bin, tmp_path_factory.mktemp("eachnode"), "10.213.140.0/24", "e", clients=3) as started:
        yield started


def _run(agent: Agent, job: str, log: Path, *args: str, seconds: float = 1.0, extra: list[str] | None = None):
    """Start `run --each-node` of `job` on `agent`'s node; its job logs `start|end NODE TIME` lines to `log`."""
    script = (f'echo "start $NODE $(date +%s.%N)" >> {log}; sleep {seconds}; echo "end $NODE $(date +%s.%N)" >> {log}')
    return consulrun("run", "--each-node", "--schedule", DAILY, "--skip-exit-code", str(SKIP), "--lock-delay", "5s",
                     "--ttl", "10s", *args, job, "--", *(extra or ["sh", "-c", script]), netns=agent.netns,
                     env={"CONSUL_HTTP_ADDR": agent.http_addr, "NODE": agent.name})


def _intervals(log: Path) -> dict[str, list[tuple[float, float]]]:
    """node -> its runs' (start, end) by the real clock."""
    starts: dict[str, list[float]] = {}
    runs: dict[str, list[tuple[float, float]]] = {}
    for line in log.read_text().splitlines():
        what, node, when = line.split()
        if what == "start":
            starts.setdefault(node, []).append(float(when))
        else:
            runs.setdefault(node, []).append((starts[node].pop(0), float(when)))
    return runs


def _most_at_once(runs: dict[str, list[tuple[float, float]]]) -> int:
    events = sorted([(s, 1) for r in runs.values() for s, _ in r] + [(e, -1) for r in runs.values() for _, e in r])
    now = most = 0
    for _, step in events:  # an end at the same instant as a start is counted first (-1 sorts before 1)
        now += step
        most = max(most, now)
    return most


def _kv(agent: Agent, prefix: str) -> dict[str, dict]:
    found = requests.get(f"{agent.url}/v1/kv/{prefix}", params={"recurse": "true"}, timeout=10)
    return {} if found.status_code == 404 else {e["Key"]: json.loads(base64.b64decode(e["Value"]))
                                                for e in found.json() if e.get("Value")}


def _raft_applied(agent: Agent) -> int:
    return int(agent.get("agent/self")["Stats"]["raft"]["applied_index"])


@pytest.mark.parametrize("concurrency", [1, 2])
def test_every_node_runs_the_occurrence_once_never_more_than_n_at_once_and_then_skips_without_a_write(
        cluster: Cluster, tmp_path: Path, concurrency: int) -> None:
    job, log = f"rolling{concurrency}", tmp_path / "runs"
    procs = {a.name: _run(a, job, log, "--concurrency", str(concurrency)) for a in cluster.agents}
    results = {name: finish(proc, timeout=120) for name, proc in procs.items()}
    assert all(code == 0 for code, _, _ in results.values()), results
    runs = _intervals(log)
    assert sorted(runs) == sorted(a.name for a in cluster.agents) and all(len(r) == 1 for r in runs.values()), runs
    assert _most_at_once(runs) <= concurrency, runs
    records = _kv(cluster.server, f"consulrun/{job}/nodes/")
    for agent in cluster.agents:
        record = records[f"consulrun/{job}/nodes/{agent.name}/occurrence"]
        assert record["state"] == "done" and record["node"] == agent.name and record["exit_status"] == 0, record
        assert f"consulrun/{job}/nodes/{agent.name}/history/{stamp(record['occurrence'])}" in records
    # Done everywhere: a node's second start skips on one read-only transaction (the agent's own writes may land in
    # one window, not in all three).
    for agent in cluster.agents[1:2] + cluster.agents[3:]:
        deltas = []
        for _ in range(3):
            before = _raft_applied(cluster.server)
            code, _, err = finish(_run(agent, job, log, "--concurrency", str(concurrency)))
            deltas.append(_raft_applied(cluster.server) - before)
            assert code == SKIP and f"already ran on this node ({agent.name}, exit status 0)" in err, err
        assert min(deltas) == 0, deltas
    assert len(log.read_text().splitlines()) == 2 * len(cluster.agents)  # nothing ran again
    code, out, err = finish(consulrun("history", "--json", job, env={"CONSUL_HTTP_ADDR": cluster.server.http_addr}))
    assert code == 0 and sorted(r["node"] for r in json.loads(out)["runs"]) == sorted(a.name for a in cluster.agents), out + err
    status = finish(consulrun("status", "--json", env={"CONSUL_HTTP_ADDR": cluster.server.http_addr}))
    assert status[0] == 0, status
    rows = next(j for j in json.loads(status[1])["jobs"] if j["job"] == job)["nodes"]
    assert [(r["node"], r["state"], r["healthy"]) for r in rows] == \
        [(a.name, "done", True) for a in sorted(cluster.agents, key=lambda a: a.name)], rows


def test_a_node_killed_mid_run_is_fenced_the_others_still_run_one_at_a_time_and_it_is_reported(
        cluster: Cluster, tmp_path: Path) -> None:
    job, log, beats = "rollkill", tmp_path / "runs", tmp_path / "beats"
    victim, others = cluster.by_name("node2"), [cluster.by_name("node3"), cluster.by_name("node4")]
    holder = _run(victim, job, log, extra=["sh", "-c", f"while :; do date +%s.%N >> {beats}; sleep 0.1; done"])
    try:
        wait_for(lambda: beats.exists() and beats.read_text().count("\n") >= 3, 30, "node2's job to be running")
        waiting = [_run(agent, job, log) for agent in others]
        time.sleep(2)  # both are waiting for the one slot: node2 holds it
        assert not log.exists() and all(p.poll() is None for p in waiting)
        victim.kill()  # node2's agent dies: its session is invalidated, its wrapper can confirm nothing
        code, _, err = finish(holder, timeout=60)
        assert code == 75, err  # fenced: its job killed, the lock lost
        results = [finish(p, timeout=120) for p in waiting]
        assert all(c == 0 for c, _, _ in results), results
        last_beat = max(float(t) for t in beats.read_text().split())
        runs = _intervals(log)
        assert sorted(runs) == ["node3", "node4"] and all(len(r) == 1 for r in runs.values()), runs
        assert min(s for r in runs.values() for s, _ in r) > last_beat, (runs, last_beat)  # never beside the dead one
        assert _most_at_once(runs) == 1, runs
        wait_for(lambda: "node2" in {c["Node"] for c in cluster.server.get("health/state/critical")
                                     if c["CheckID"] == "serfHealth"}, 30, "node2 failing in the catalog")
        code, out, err = finish(consulrun("status", job, env={"CONSUL_HTTP_ADDR": cluster.server.http_addr}))
        assert code == 3, out + err  # node-down counts as a miss: node2 runs nothing of this occurrence
        assert "rollkill: node-down: node2 is failing in Consul" in out, out
        assert any(line.startswith("rollkill@node2") and " down " in line for line in out.splitlines()), out
        assert any(line.startswith("rollkill@node3") and " done " in line for line in out.splitlines()), out
        code, metrics, err = finish(consulrun("exporter", "--textfile", "-",
                                              env={"CONSUL_HTTP_ADDR": cluster.server.http_addr}))
        assert 'consulrun_job_node_up{job_name="rollkill",node="node2"} 0.0' in metrics, metrics + err
        assert 'consulrun_job_node_up{job_name="rollkill",node="node3"} 1.0' in metrics, metrics
        assert 'consulrun_job_state{job_name="rollkill",state="node-down"} 1.0' in metrics, metrics
    finally:
        if holder.poll() is None:
            holder.kill()
        if not victim.alive():
            victim.restart()
            wait_for(lambda: sum(m["Status"] == 1 for m in cluster.server.get("agent/members")) == 4, 60,
                     "node2 back in the cluster")


def test_node_names_become_kv_safe_keys_and_come_back() -> None:
    for name in ["node1", "web-01.dc", "Ünïcode", "a b/c", "..", ".hidden", "x=41", "%", ""]:
        key = node_key(name)
        assert set(key) <= KV_SAFE and "/" not in key and key not in (".", ".."), (name, key)
        assert node_of_key(key) == name, (name, key)
    assert len({node_key(n) for n in ["a=41", "aA", "a.", "a=2E"]}) == 4  # never two names in one key


def test_a_node_finding_every_slot_held_waits_until_its_next_occurrence_then_records_it_missed(
        consul: Agent, tmp_path: Path) -> None:
    # Another node's run holds the only slot (a session of our own making, as the holder's wrapper would).
    session = consul.api("PUT", "session/create", json={"Name": "other", "TTL": "60s", "LockDelay": "0s"}).json()["ID"]
    value = json.dumps({"node": "other", "session": session, "started": "2026-01-01T00:00:00Z"})
    assert consul.api("PUT", "kv/consulrun/full/lock", params={"acquire": session}, data=value).json() is True
    # This node's clock says the next minute is 4 s away: it waits that long (reads only), then records the miss.
    to_next = 60 - time.time() % 60
    code, _, err = finish(consulrun("run", "--each-node", "--schedule", "*:*:00", "--skip-exit-code", str(SKIP), "full",
                                    "--", "touch", str(tmp_path / "ran"), env=skewed(to_next - 4)), timeout=60)
    assert code == SKIP, err
    assert "every slot is held" in err and "recorded it missed" in err, err
    assert not (tmp_path / "ran").exists()
    node = consul.get("agent/self")["Config"]["NodeName"]
    record = _kv(consul, f"consulrun/full/nodes/{node_key(node)}/occurrence")
    assert [r["state"] for r in record.values()] == ["missed"] and SLOTS_FULL_MISSED in str(record), record
    code, out, _ = finish(consulrun("status", "full"))
    assert code == 3 and "missed" in out, out
    consul.api("PUT", f"session/destroy/{session}")


def test_a_failed_run_is_reported_for_its_node(consul: Agent) -> None:
    code, _, err = finish(consulrun("run", "--each-node", "--schedule", DAILY, "failing", "--", "sh", "-c", "exit 3"))
    assert code == 3, err
    code, out, _ = finish(consulrun("status", "--json", "failing"))
    job = json.loads(out)["jobs"][0]
    assert code == 1 and [p["kind"] for p in job["problems"]] == ["failed"], out
    assert job["nodes"][0]["state"] == "done" and job["nodes"][0]["exit_status"] == 3, out


def _manifest(tmp_path: Path, job: str) -> Path:
    path = tmp_path / "jobs.yaml"
    path.write_text(f"jobs:\n  roll:\n    command: [\"true\"]\n    schedule: \"{DAILY}\"\n{job}")
    return path


@pytest.mark.parametrize(("text", "where", "message"), [
    ("    mode: each-node\n    on_holder_loss: retry\n", ":6:21: jobs.roll.on_holder_loss: ",
     "it needs on_holder_loss: skip"),
    ("    mode: each-node\n    lock: {wait: 5m}\n", ":6:18: jobs.roll.lock.wait: ", "lock.wait has no meaning"),
    ("    mode: rolling\n", ":5:11: jobs.roll.mode: ", "must be once or each-node"),
])
def test_nonsense_combinations_are_refused_at_load_with_file_and_line(tmp_path: Path, text: str, where: str,
                                                                       message: str) -> None:
    path = _manifest(tmp_path, text)
    with pytest.raises(ManifestError) as caught:
        load_manifest(path)
    said = str(caught.value)
    assert f"{path}{where}" in said and message in said, said


def test_the_unit_runs_each_node_with_its_schedule_slots_retries_and_start_deadline(tmp_path: Path) -> None:
    path = _manifest(tmp_path, "    mode: each-node\n    lock: {concurrency: 2}\n    retries: {attempts: 2}\n"
                               "    start_deadline: 10m\n")
    manifest = load_manifest(path)
    argv = run_argv(manifest, manifest.jobs[0], "/usr/bin/consulrun")
    assert "--each-node" in argv and argv[argv.index("--concurrency") + 1] == "2"
    assert argv[argv.index("--schedule") + 1] == DAILY and "--attempts" in argv and "--start-deadline" in argv
    assert "--each-node" not in run_argv(manifest, replace(manifest.jobs[0], mode="once"), "/usr/bin/consulrun")


def test_a_node_waiting_for_its_slot_is_not_cut_off_by_its_units_start_timeout(tmp_path: Path) -> None:
    """A node waits for a slot up to its next occurrence, then runs its whole timeout: a TimeoutStartSec= summed
    for one run (13m6s for a 10m timeout) stopped the second node of two whose runs take 7 minutes in the middle
    of its own run, and the third while it still waited (its share then neither ran nor was recorded missed).
    The wrapper bounds the wait and the run itself: the unit gets no TimeoutStartSec= backstop."""
    from consulrun.units.render import render

    path = _manifest(tmp_path, "    mode: each-node\n    timeout: 10m\n")
    manifest = load_manifest(path)
    units = render(manifest, "/usr/bin/consulrun")
    service = next(text for name, text in units.items() if name.endswith("roll.service"))
    assert "--timeout 10m" in service, service
    assert "TimeoutStartSec=" not in service, service
    once = load_manifest(_manifest(tmp_path, "    timeout: 10m\n"))  # a once-per-cluster job keeps its backstop
    assert "TimeoutStartSec=13m6s" in next(t for n, t in render(once, "/usr/bin/consulrun").items()
                                           if n.endswith("roll.service"))


def test_run_refuses_each_node_without_a_schedule_or_with_retry() -> None:
    code, _, err = finish(consulrun("run", "--each-node", "roll", "--", "true"))
    assert code == 2 and "--each-node" in err and "needs --schedule" in err, err
    code, _, err = finish(consulrun("run", "--each-node", "--schedule", DAILY, "--on-holder-loss", "retry", "roll",
                                    "--", "true"))
    assert code == 2 and "--on-holder-loss skip" in err, err


def test_trigger_refuses_an_each_node_job(tmp_path: Path) -> None:
    path = _manifest(tmp_path, "    mode: each-node\n")
    code, _, err = finish(consulrun("trigger", str(path), "roll"))
    assert code == 2 and "each-node job" in err and "no manual runs" in err, err


def test_the_watchdog_turns_a_nodes_problem_into_a_critical_check() -> None:
    from consulrun.report.status import JobStatus
    from consulrun.report.watchdog import verdict

    last = {"occurrence": "2030-01-01T00:00:00Z", "state": "done", "node": "node3", "exit_status": 0,
            "started": "2030-01-01T00:00:01Z", "ended": "2030-01-01T00:00:02Z"}
    job = JobStatus(job="roll", state="free", in_manifest=True, last=last, nodes=[])
    assert verdict(job)[0] == "passing"
    job.problem("node-down", "node2 is failing in Consul (serfHealth critical)", node="node2")
    state, output = verdict(job)
    assert state == "critical" and "node-down: node2 is failing" in output, output
