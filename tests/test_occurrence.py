"""Exactly once per scheduled occurrence, against a real Consul, with real skewed clocks (libfaketime)."""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.conftest import require_tool
from tests.harness.agents import Agent, Cluster, wait_for
from tests.test_run import SKIP, consulrun, finish, lock_entry

pytestmark = pytest.mark.consul

# The latest occurrence of a yearly schedule is the same all year: stable for a test, yet a real schedule.
YEARLY = "*-01-01 00:00:00 UTC"


def skewed(offset_s: float) -> dict[str, str]:
    """Environment that runs a process with its wall clock `offset_s` off (monotonic time stays real)."""
    require_tool("faketime")
    return {"FAKETIME": f"{offset_s:+.3f}", "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"}


def kv_json(agent: Agent, key: str) -> dict | None:
    entry = lock_entry(agent, key)
    return json.loads(base64.b64decode(entry["Value"])) if entry and entry.get("Value") else None


def history(agent: Agent, job: str) -> dict[str, dict]:
    entries = agent.get(f"kv/consulrun/{job}/history/", params={"recurse": "true"})
    return {e["Key"].rsplit("/", 1)[1]: json.loads(base64.b64decode(e["Value"])) for e in entries}


def staggered(args_for: list[list[str]], gap_s: float, envs: list[dict[str, str]] | None = None) -> list[tuple[int, str, str]]:
    procs = []
    for i, args in enumerate(args_for):
        procs.append(consulrun(*args, env=(envs or [{}] * len(args_for))[i]))
        time.sleep(gap_s)
    return [finish(p, timeout=60) for p in procs]


def test_plain_mutex_runs_a_skewed_occurrence_many_times(consul: Agent, tmp_path: Path) -> None:
    """The failure the occurrence record exists for: a free lock is taken again by late nodes."""
    runs = tmp_path / "runs"
    job = ["sh", "-c", f"echo x >> {runs}; sleep 0.5"]
    results = staggered([["run", "--skip-exit-code", str(SKIP), "mutex", "--", *job] for _ in range(5)], 0.7)
    assert len(runs.read_text().split()) > 1, results


def test_five_skewed_contenders_one_run(consul: Agent, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    job = ["sh", "-c", f"echo $CONSULRUN_OCCURRENCE >> {runs}; sleep 0.5"]
    args = ["run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "skewed", "--", *job]
    results = staggered([args] * 5, 0.7)
    codes = sorted(code for code, _, _ in results)
    assert codes == [0] + [SKIP] * 4, [e for _, _, e in results]
    year = datetime.now(timezone.utc).year
    assert runs.read_text().split() == [f"{year}-01-01T00:00:00Z"]
    assert all("already ran on dev1" in e for c, _, e in results if c == SKIP)
    record = kv_json(consul, "consulrun/skewed/occurrence")
    assert record["state"] == "done" and record["exit_status"] == 0
    assert list(history(consul, "skewed")) == [f"{year}-01-01T00:00:00Z"]


def test_simultaneous_catch_up_runs_once(consul: Agent, tmp_path: Path) -> None:
    """What Persistent=true does at boot on every node at once."""
    runs = tmp_path / "runs"
    procs = [consulrun("run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "catchup", "--", "sh", "-c",
                       f"echo x >> {runs}; sleep 0.5") for _ in range(10)]
    codes = sorted(finish(p)[0] for p in procs)
    assert codes == [0] + [SKIP] * 9
    assert len(runs.read_text().split()) == 1


def test_randomised_clock_skew_over_many_occurrences(consul: Agent, tmp_path: Path) -> None:
    """Five nodes with clocks up to 3 s apart fire up to 2 s late for each 10-second occurrence."""
    runs = tmp_path / "runs"
    rng = random.Random(20261129)
    offsets = [rng.uniform(-3, 3) for _ in range(5)]
    start = (int(time.time()) // 10 + 1) * 10 + 10  # the occurrence after next, leaving time to launch
    occurrences = [start + 10 * k for k in range(4)]
    results: list[tuple[int, str, str]] = []
    lock = threading.Lock()

    def node(offset: float) -> None:
        for scheduled in occurrences:
            fire_at = scheduled + rng.uniform(0, 2) - offset  # real time at which this node's clock says scheduled+delay
            time.sleep(max(0.0, fire_at - time.time()))
            proc = consulrun("run", "--schedule", "*:*:0/10", "--skip-exit-code", str(SKIP), "skew", "--", "sh", "-c",
                             f"echo $CONSULRUN_OCCURRENCE >> {runs}; sleep 0.5", env=skewed(offset))
            with lock:
                results.append(finish(proc))

    threads = [threading.Thread(target=node, args=(o,)) for o in offsets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 20, results
    assert all(code in (0, SKIP) for code, _, _ in results), [e for c, _, e in results if c not in (0, SKIP)]
    ran = runs.read_text().split()
    expected = [datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") for t in occurrences]
    assert sorted(ran) == expected  # every occurrence exactly once


def test_late_contender_from_previous_occurrence_does_not_run(consul: Agent, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    while time.time() % 600 > 590:  # not across a 10-minute boundary between the two runs
        time.sleep(1)
    assert finish(consulrun("run", "--schedule", "*:0/10", "late", "--", "true"))[0] == 0
    code, _, err = finish(consulrun("run", "--schedule", "*:0/10", "--skip-exit-code", str(SKIP), "late", "--",
                                    "touch", str(marker), env=skewed(-600)))
    assert code == SKIP, err
    assert "is already claimed" in err and "is past" in err
    assert not marker.exists()


def test_loser_reads_only_once_the_occurrence_is_recorded(consul: Agent) -> None:
    assert finish(consulrun("run", "--schedule", YEARLY, "cheap-occ", "--", "true"))[0] == 0
    before = int(consul.get("agent/self")["Stats"]["raft"]["applied_index"])
    code, _, _ = finish(consulrun("run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "cheap-occ", "--", "true"))
    assert code == SKIP
    assert int(consul.get("agent/self")["Stats"]["raft"]["applied_index"]) == before


@pytest.mark.cluster
@pytest.mark.parametrize("policy", ["retry", "skip"])
def test_takeover_when_runners_agent_dies(cluster: Cluster, tmp_path: Path, policy: str) -> None:
    node2, node3 = cluster.clients
    env = {"CONSUL_HTTP_ADDR": "127.0.0.1:8500"}
    started, second = tmp_path / "started", tmp_path / "second"
    common = ["run", "--schedule", YEARLY, "--on-holder-loss", policy, "--skip-exit-code", str(SKIP), "billing"]
    runner = consulrun(*common, "--", "sh", "-c", f"touch {started}; sleep 300", env=env, netns=node2.netns)
    wait_for(started.exists, 20, "the job on node2")
    standby = consulrun(*common, "--", "sh", "-c", f"echo $CONSULRUN_OCCURRENCE > {second}", env=env, netns=node3.netns)
    time.sleep(1)  # let the standby read the record and start waiting (or skip)
    node2.kill()
    assert finish(runner, timeout=60)[0] == 75
    code, _, err = finish(standby, timeout=120)
    year = datetime.now(timezone.utc).year
    if policy == "retry":
        assert code == 0, err
        assert "taking over" in err
        assert second.read_text().strip() == f"{year}-01-01T00:00:00Z"
        entry = history(cluster.server, "billing")[f"{year}-01-01T00:00:00Z"]
        assert entry["takeover"] is True and entry["node"] == "node3" and entry["state"] == "done"
    else:
        assert code == SKIP, err
        assert "claimed by node2" in err
        assert not second.exists()
        assert kv_json(cluster.server, "consulrun/billing/occurrence")["state"] == "running"
