"""`consulrun forget` against a real Consul: one job's keys and check go in one transaction, never under a run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import requests

from tests.harness.agents import Agent, wait_for
from tests.harness.healthchecks import checks, register
from tests.harness.holders import hold
from tests.harness.runs import (
    consulrun,
    finish,
    gated_job,
    lock_entry,
    raft_applied as _raft_applied,
)

pytestmark = pytest.mark.consul

YEARLY = "*-01-01 00:00:00 UTC"


def keys_of(agent: Agent, job: str) -> list[str]:
    found = requests.get(f"{agent.url}/v1/kv/consulrun/{job}/", params={"recurse": "true", "keys": "true"}, timeout=10)
    return [] if found.status_code == 404 else found.json()


def test_forget_shows_asks_and_deletes_in_one_transaction(catalog: Agent) -> None:  # noqa: F811
    register(catalog)
    assert finish(consulrun("run", "--health-check", "--schedule", YEARLY, "gone", "--", "true"))[0] == 0
    assert finish(consulrun("pause", "gone"))[0] == 0 and finish(consulrun("resume", "gone"))[0] == 0
    assert finish(consulrun("run", "kept", "--", "true"))[0] == 0
    assert finish(consulrun("run", "gone-2", "--", "true"))[0] == 0  # a longer name: not under gone/
    before = keys_of(catalog, "gone")
    assert "consulrun/gone/occurrence" in before and any("/ended-pauses/" in k for k in before)
    assert "gone" in checks(catalog)

    proc = consulrun("forget", "gone", stdin=subprocess.PIPE)
    out, err = proc.communicate("n\n", timeout=60)
    assert proc.returncode == 1 and "not confirmed; nothing changed" in err
    assert f"{len(before)} key(s) under consulrun/gone/:" in err and "  consulrun/gone/occurrence" in err
    assert "health check job:gone on node consulrun" in err
    assert keys_of(catalog, "gone") == before
    proc = consulrun("forget", "gone", stdin=subprocess.DEVNULL)  # nothing can answer: a cron job, `< /dev/null`
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "Aborted" not in err, err
    assert "Error: no answer on standard input; nothing changed (--yes answers yes)" in err
    assert keys_of(catalog, "gone") == before

    applied = _raft_applied(catalog)
    code, out, err = finish(consulrun("forget", "gone", "--yes"))
    assert code == 0, err
    assert out == f"gone: forgotten ({len(before)} key(s), its health check)\n"
    assert _raft_applied(catalog) - applied <= 2  # one transaction (+ a stray write of the agent's own)
    assert keys_of(catalog, "gone") == [] and "gone" not in checks(catalog)
    assert keys_of(catalog, "kept") and keys_of(catalog, "gone-2")
    code, _, err = finish(consulrun("status", "gone"))
    assert code == 6, err
    code, _, err = finish(consulrun("forget", "goen", "--yes"))  # nothing left to forget, and a typo
    assert code == 6 and "did you mean 'gone-2'" in err


def test_forget_refuses_a_held_job(consul: Agent) -> None:
    session = hold(consul, "busy")
    before = keys_of(consul, "busy")
    code, out, err = finish(consulrun("forget", "busy", "--yes"))
    assert (code, out) == (1, "")
    assert f"busy is held by {consul.name} (session {session}): nothing forgotten" in err
    assert keys_of(consul, "busy") == before


def test_a_run_that_takes_the_lock_between_look_and_delete_makes_forget_fail(consul: Agent, tmp_path: Path) -> None:
    """The race, made deterministic: forget stops after showing what it will delete; a run takes the lock; forget
    goes on, and its check-and-set transaction is refused: the live lock is not deleted."""
    assert finish(consulrun("run", "racy", "--", "true"))[0] == 0  # released: the lock key stays, free
    hooks, started, go = tmp_path / "hooks", tmp_path / "started", tmp_path / "go"
    hooks.mkdir()
    forgetting = consulrun("forget", "racy", "--yes", env={"CONSULRUN_TEST_PAUSE": "forget-before-delete",
                                                           "CONSULRUN_TEST_HOOK_DIR": str(hooks)})
    wait_for((hooks / "forget-before-delete").exists, 30, "forget to have looked and be about to delete")
    runner = consulrun("run", "racy", "--", *gated_job(started, go))
    try:
        wait_for(started.exists, 30, "the run to take the lock and start its job")
        (hooks / "forget-before-delete.go").touch()
        code, out, err = finish(forgetting)
        assert (code, out) == (1, ""), err
        assert "changed while being forgotten (a run started?)" in err and "nothing more was deleted" in err
        assert lock_entry(consul, "consulrun/racy/lock").get("Session")  # the live lock is still there, held
    finally:
        go.touch()
    assert finish(runner)[0] == 0


def test_more_keys_than_one_transaction_holds_are_forgotten_in_guarded_batches(consul: Agent) -> None:
    """Consul refuses a transaction of more than 128 operations: the history goes first, the lock last."""
    assert finish(consulrun("run", "--schedule", YEARLY, "long-lived", "--", "true"))[0] == 0
    ops = [{"KV": {"Verb": "set", "Key": f"consulrun/long-lived/history/2000-01-01T00:{n // 60:02d}:{n % 60:02d}Z",
                   "Value": "e30="}} for n in range(100)]
    for n in range(0, 200, 100):
        batch = [{"KV": {**op["KV"], "Key": op["KV"]["Key"].replace("2000", str(2000 + n))}} for op in ops]
        assert requests.put(f"{consul.url}/v1/txn", json=batch, timeout=10).status_code == 200
    before = keys_of(consul, "long-lived")
    assert len(before) > 200
    code, out, err = finish(consulrun("forget", "long-lived", "--yes"))
    assert code == 0, err
    assert out == f"long-lived: forgotten ({len(before)} key(s))\n"
    assert keys_of(consul, "long-lived") == []


def test_a_job_with_no_state_is_named_and_no_manifest_is_suggested(consul: Agent) -> None:
    """What forget deletes is the state in Consul, so 'give its MANIFEST' (pause's hint) would send a user astray."""
    hold(consul, "backup")
    code, out, err = finish(consulrun("forget", "backpu", "--yes"))
    assert (code, out) == (6, "") and "no such job with state under consulrun/ in Consul: backpu" in err, err
    assert "did you mean 'backup'" in err and "MANIFEST" not in err, err
