"""What a `consul snapshot restore` does to sessions, locks, lock-delay and blocking queries, on the real agent.

docs/guarantees.md's text about a restore and the chaos run's `snapshot-restore` fault
(bench/chaos/consul_faults.py) rest on these facts of Consul v1.16.3; a Consul upgrade that changes one of
them fails here. A dedicated dev agent: a restore replaces the whole state, the shared agent's too.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from tests.harness.agents import Agent, start_dev_agent, wait_for
from tests.harness.runs import SKIP, consulrun, finish

TTL_S = 10
YEARLY = "*-01-01 00:00:00 UTC"


@pytest.fixture
def agent(consul_bin: str, tmp_path: Path) -> Iterator[Agent]:
    started = start_dev_agent(consul_bin, tmp_path, name="restore1", extra_config={"disable_coordinates": True})
    yield started
    started.stop()


def _session(agent: Agent, name: str, lock_delay: str = "15s") -> str:
    return agent.api("PUT", "session/create", json={"Name": name, "TTL": f"{TTL_S}s", "LockDelay": lock_delay,
                                                      "Behavior": "release"}).json()["ID"]


def _acquire(agent: Agent, key: str, session: str) -> bool:
    return agent.api("PUT", f"kv/{key}", params={"acquire": session}, data=session).json() is True


def _read(agent: Agent, key: str, **params: Any) -> tuple[int, dict[str, Any]]:
    response = requests.get(f"{agent.url}/v1/kv/{key}", params=params, timeout=90)
    response.raise_for_status()
    return int(response.headers["X-Consul-Index"]), response.json()[0]


def _snapshot(consul_bin: str, agent: Agent, verb: str, path: Path) -> None:
    subprocess.run([consul_bin, "snapshot", verb, "-http-addr", agent.http_addr, str(path)], check=True,
                   capture_output=True, timeout=60)


def _sessions(agent: Agent) -> set[str]:
    return {s["Name"] for s in agent.get("session/list")}


@pytest.mark.consul
def test_a_restore_brings_sessions_locks_and_records_back_and_forgets_lock_delay(
        consul_bin: str, agent: Agent, tmp_path: Path) -> None:
    snapshot = tmp_path / "state.snap"
    finished = _session(agent, "finished-run")  # holds the lock when the snapshot is taken, destroyed after
    assert _acquire(agent, "job/lock", finished)
    agent.api("PUT", "kv/job/occurrence", data="X running")
    agent.api("PUT", "kv/other/lock", data="free")
    _, saved_record = _read(agent, "job/occurrence")
    _snapshot(consul_bin, agent, "save", snapshot)

    agent.api("PUT", f"session/destroy/{finished}")  # the run finished: its lock is free after lock-delay
    current = _session(agent, "current-run", lock_delay="1s")
    wait_for(lambda: _acquire(agent, "job/lock", current), 30, "the lock after the finished run's lock-delay")
    agent.api("PUT", "kv/job/occurrence", data="Y running")
    broken = _session(agent, "broken")  # its lock-delay (15 s) still runs at the restore
    assert _acquire(agent, "other/lock", broken)
    agent.api("PUT", f"session/destroy/{broken}")
    assert not _acquire(agent, "other/lock", current), "lock-delay should refuse the lock before the restore"
    before_index, before_record = _read(agent, "job/occurrence")

    woken: dict[str, Any] = {}

    def block() -> None:
        woken["answer"] = _read(agent, "job/occurrence", index=before_index, wait="60s")

    waiter = threading.Thread(target=block, daemon=True)
    waiter.start()
    wait_for(lambda: not waiter.is_alive() or agent.get("agent/self"), 5, "the blocking read to be sent")
    _snapshot(consul_bin, agent, "restore", snapshot)

    # A blocked query wakes at the restore with its pre-restore answer, not the restored one.
    wait_for(lambda: not waiter.is_alive(), 30, "the blocked read to wake at the restore (it waits up to 60 s)")
    assert woken["answer"][0] == before_index and woken["answer"][1]["Value"] == before_record["Value"]
    # Then the store answers from the snapshot: the record and its index went back in time...
    index, record = _read(agent, "job/occurrence")
    assert record["Value"] == saved_record["Value"] and record["ModifyIndex"] == saved_record["ModifyIndex"]
    assert index < before_index
    # ...and a blocking read with the pre-restore index gets it only when its wait is over, with a lower index.
    index, record = _read(agent, "job/occurrence", index=before_index, wait="2s")
    assert index < before_index and record["Value"] == saved_record["Value"]

    # Sessions are the snapshot's: the current holder's is gone (its renewal is a 404), the finished run's is
    # back and holds the lock again.
    assert _sessions(agent) == {"finished-run"}
    assert requests.put(f"{agent.url}/v1/session/renew/{current}", timeout=10).status_code == 404
    assert agent.api("PUT", f"session/renew/{finished}").json()[0]["ID"] == finished
    _, lock = _read(agent, "job/lock")
    assert lock.get("Session") == finished

    # Lock-delay is not in the snapshot: a key that lock-delay refused before the restore is free at once.
    fresh = _session(agent, "after-restore")
    assert _acquire(agent, "other/lock", fresh), "the restore should have forgotten the running lock-delay"
    # Indexes go on from where the log was: a write after the restore is above every index before it, so a
    # fencing token (the lock's ModifyIndex at acquisition) stays monotonic across the restore.
    _, other = _read(agent, "other/lock")
    assert other["ModifyIndex"] > before_index

    # Nobody renews the restored session: Consul destroys it after up to 2 x TTL, and frees the lock.
    wait_for(lambda: "finished-run" not in _sessions(agent), 2 * TTL_S + 15, "the restored session to expire")
    _, lock = _read(agent, "job/lock")
    assert not lock.get("Session")


@pytest.mark.consul
def test_after_a_restore_an_occurrence_that_ran_runs_again_and_a_later_pause_is_undone(
        consul_bin: str, agent: Agent, tmp_path: Path) -> None:
    """The limit docs/guarantees.md states (*Consul snapshot restore*): the restored record says the occurrence
    is unclaimed, so the next run of it runs the job again, and a pause set after the snapshot was saved is gone.
    A protocol change that keeps a restore from repeating a run makes this test fail: update the text with it."""
    env = {"CONSUL_HTTP_ADDR": agent.http_addr}
    ran = tmp_path / "ran"
    args = ["run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "report", "--", "sh", "-c",
            f"echo x >> {ran}"]
    snapshot = tmp_path / "before.snap"
    _snapshot(consul_bin, agent, "save", snapshot)
    code, _, err = finish(consulrun(*args, env=env))
    assert code == 0, err
    code, _, err = finish(consulrun(*args, env=env))
    assert code == SKIP and "already ran" in err, err
    code, _, err = finish(consulrun("pause", "report", "--reason", "restoring Consul", env=env))
    assert code == 0, err
    assert finish(consulrun(*args, env=env))[0] == SKIP

    _snapshot(consul_bin, agent, "restore", snapshot)
    code, _, err = finish(consulrun(*args, env=env))
    assert code == 0, f"the restore should have taken the claim and the pause back:\n{err}"
    assert ran.read_text().count("x") == 2, "the occurrence ran twice: once before the restore, once after"
