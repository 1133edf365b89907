"""pause and resume against a real Consul: every node skips a paused job, with no Raft write, until it ends."""

from __future__ import annotations

import base64
import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import requests

from tests.harness.acl import acl as _acl, token_file as _token_file
from tests.harness.agents import Agent, wait_for
from tests.harness.runs import SKIP, consulrun, finish

pytestmark = pytest.mark.consul

YEARLY = "*-01-01 00:00:00 UTC"


def jobs_of(tmp_path: Path, *jobs: str) -> str:
    """A manifest of `jobs`: pause and resume take only a job of the manifest given, or one Consul knows."""
    path = tmp_path / "jobs.yaml"
    path.write_text("jobs:\n" + "".join(f"  {job}: {{command: ['true'], schedule: daily}}\n" for job in jobs))
    return str(path)


def indexes(agent: Agent, job: str) -> tuple[int, int]:
    """KV and session indexes: they move with any write to the job's keys or to sessions."""
    return (int(agent.api("GET", f"kv/consulrun/{job}/", params={"recurse": "true"}).headers["X-Consul-Index"]),
            int(agent.api("GET", "session/list").headers["X-Consul-Index"]))


@pytest.mark.parametrize("schedule", [True, False], ids=["scheduled", "plain"])
def test_paused_job_is_skipped_without_writes_until_resumed(consul: Agent, tmp_path: Path, schedule: bool) -> None:
    ran = tmp_path / "ran"
    args = ["run", "--skip-exit-code", str(SKIP), *(["--schedule", YEARLY] if schedule else []), "nightly", "--",
            "touch", str(ran)]
    code, out, err = finish(consulrun("pause", jobs_of(tmp_path, "nightly"), "nightly", "--reason",
                                         "database migration"))
    assert code == 0, err
    assert "nightly: paused by " in out and ": database migration" in out
    before = indexes(consul, "nightly")
    code, _, err = finish(consulrun(*args))
    assert code == SKIP, err
    assert "skipped: paused by " in err and "database migration" in err, err  # the same words with or without --schedule
    assert not ran.exists()
    assert indexes(consul, "nightly") == before
    code, out, _ = finish(consulrun("status", "--json", "nightly"))
    job = json.loads(out)["jobs"][0]
    assert job["paused"]["reason"] == "database migration"
    assert finish(consulrun("resume", jobs_of(tmp_path, "nightly"), "nightly"))[0] == 0
    code, _, err = finish(consulrun(*args))
    assert code == 0, err
    assert ran.exists()


@pytest.mark.parametrize("schedule", [False, True], ids=["plain", "scheduled"])
def test_pause_landing_between_the_look_and_the_claim_stops_the_run(consul: Agent, tmp_path: Path,
                                                                     schedule: bool) -> None:
    """The claim (or plain acquisition) carries a check of the pause key as the look read it."""
    ran, hooks = tmp_path / "ran", tmp_path / "hooks"
    hooks.mkdir()
    env = {"CONSULRUN_TEST_PAUSE": "before-claim", "CONSULRUN_TEST_HOOK_DIR": str(hooks)}
    runner = consulrun("run", "--skip-exit-code", str(SKIP), *(["--schedule", YEARLY] if schedule else []),
                       "racing", "--", "touch", str(ran), env=env)
    try:
        wait_for((hooks / "before-claim").exists, 30, "the runner to have looked (not paused) and be about to claim")
        assert finish(consulrun("pause", jobs_of(tmp_path, "racing"), "racing", "--reason", "now"))[0] == 0
    finally:
        (hooks / "before-claim.go").touch()  # a failed step above must not leave the runner waiting forever
    code, _, err = finish(runner)
    assert code == SKIP, err
    assert "paused by" in err and ": now" in err
    assert not ran.exists()
    assert finish(consulrun("resume", "racing"))[0] == 0


def test_pause_for_a_while_ends_by_itself(consul: Agent, tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    assert finish(consulrun("pause", jobs_of(tmp_path, "brief"), "brief", "--for", "3s"))[0] == 0
    code, _, err = finish(consulrun("run", "--skip-exit-code", str(SKIP), "brief", "--", "touch", str(ran)))
    assert code == SKIP and "until" in err, err

    def runs() -> bool:
        return finish(consulrun("run", "--skip-exit-code", str(SKIP), "brief", "--", "touch", str(ran)))[0] == 0

    wait_for(runs, 20, "the pause to end by itself")
    assert ran.exists()


def test_pause_all_of_a_manifest_is_one_write_and_status_shows_it(consul: Agent, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a: {command: ['true'], schedule: daily}\n  b: {command: ['true'], schedule: daily}\n")
    before = int(consul.get("agent/self")["Stats"]["raft"]["applied_index"])
    code, out, err = finish(consulrun("pause", str(manifest), "--all", "--for", "1h"))
    assert code == 0, err
    assert int(consul.get("agent/self")["Stats"]["raft"]["applied_index"]) - before <= 1 + 1  # one txn (+ a stray)
    assert out.count("paused by") == 2
    code, out, err = finish(consulrun("status", str(manifest)))
    assert "paused" in out and out.count("paused by") == 2, out
    assert code == 0, out  # a paused job that runs nothing is not "missed"
    assert finish(consulrun("resume", str(manifest), "--all"))[0] == 0
    left = requests.get(f"{consul.url}/v1/kv/consulrun/", params={"recurse": "true", "keys": "true"}, timeout=10)
    # resume deleted the pause keys, filing each as an ended episode in the same transaction
    assert [key.split("/", 2)[2].split("/")[0] for key in left.json()] == ["ended-pauses", "ended-pauses"]
    assert [key.split("/")[1] for key in left.json()] == ["a", "b"]
    # A pause and its ended episode are an operator's, not a run: jobs that never ran still say so.
    code, out, err = finish(consulrun("status", str(manifest), "--json"))
    assert [job["state"] for job in json.loads(out)["jobs"]] == ["never run", "never run"], out


def test_pause_needs_jobs_or_all(consul: Agent) -> None:
    code, _, err = finish(consulrun("pause"))
    assert code == 2 and "name the JOBs, or give --all" in err


def test_pause_without_write_on_the_prefix_is_refused(acl_agent, tmp_path: Path) -> None:  # noqa: F811
    agent, management = acl_agent
    rules = 'key_prefix "consulrun/" { policy = "read" }\n'
    _acl(agent, management, "PUT", "acl/policy", {"Name": "readonly", "Rules": rules})
    secret = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": "readonly"}]})["SecretID"]
    env = {"CONSUL_HTTP_ADDR": agent.http_addr, "CONSUL_HTTP_TOKEN_FILE": str(_token_file(tmp_path, "ro", secret))}
    code, out, err = finish(consulrun("pause", jobs_of(tmp_path, "guarded"), "guarded", env=env))
    assert code == 77, err
    assert out == "" and err.count("\n") == 1 and "Consul ACL denied it" in err
    assert requests.get(f"{agent.url}/v1/kv/consulrun/guarded/pause", headers={"X-Consul-Token": management},
                        timeout=10).status_code == 404


# --- occurrences skipped while paused: derived from the pause episodes and the schedule ----------------------

DENSE = "*:*:0/2"  # every even second


def kv_value(agent: Agent, key: str) -> dict | None:
    response = requests.get(f"{agent.url}/v1/kv/{key}", params={"raw": "true"}, timeout=10)
    return None if response.status_code == 404 else json.loads(response.text)


def episodes_of(agent: Agent, job: str) -> list[dict]:
    entries = requests.get(f"{agent.url}/v1/kv/consulrun/{job}/ended-pauses/", params={"recurse": "true"},
                           timeout=10)
    return [] if entries.status_code == 404 else [json.loads(base64.b64decode(e["Value"])) for e in entries.json()]


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def grid(start: str, end: str, ran: set[str]) -> list[str]:
    """The DENSE schedule's occurrences from `start` (its second included) to `end` (excluded) not in `ran`,
    newest first: what history must list as skipped for a pause from `start` to `end`."""
    first = at(start) + timedelta(seconds=at(start).second % 2)
    occurrences = []
    while first < at(end):
        occurrences.append(first.strftime("%Y-%m-%dT%H:%M:%SZ"))
        first += timedelta(seconds=2)
    return [occ for occ in reversed(occurrences) if occ not in ran]


def history_json(job: str) -> list[dict]:
    code, out, err = finish(consulrun("history", job, "--json", "-n", "100"))
    assert code == 0, err
    return json.loads(out)["runs"]


def test_history_lists_the_occurrences_skipped_while_paused(consul: Agent, tmp_path: Path) -> None:
    """Runs before and after a pause are listed as runs; the occurrences between, which every node skipped with
    no write, as `skipped (paused by ...: reason)`; status names them until the next run."""
    args = ["run", "--skip-exit-code", str(SKIP), "--schedule", DENSE, "dense", "--", "true"]
    assert finish(consulrun(*args))[0] == 0
    assert finish(consulrun("pause", "dense", "--reason", "database migration"))[0] == 0
    paused = kv_value(consul, "consulrun/dense/pause")
    before = indexes(consul, "dense")
    assert finish(consulrun(*args))[0] == SKIP
    assert indexes(consul, "dense") == before  # the skip path still writes nothing
    # Let two occurrences pass inside the pause (polled, not slept: the condition is the clock).
    wait_for(lambda: datetime.now(timezone.utc) >= at(paused["at"]) + timedelta(seconds=7), 20,
             "two occurrences to fall inside the pause")
    code, out, _ = finish(consulrun("status", "dense"))
    assert code == 0 and "dense: skipped while paused by " in out and ": database migration (from " in out, out
    assert finish(consulrun("resume", "dense"))[0] == 0
    assert kv_value(consul, "consulrun/dense/pause") is None
    [episode] = episodes_of(consul, "dense")
    assert {k: episode[k] for k in ("by", "at", "reason")} == paused and episode["ended_by"] == paused["by"]
    code, out, _ = finish(consulrun("status", "--json", "dense"))
    job = json.loads(out)["jobs"][0]
    assert job["paused"] is None and job["skipped"] and all(s["paused"]["reason"] == "database migration"
                                                           for s in job["skipped"])
    assert finish(consulrun(*args))[0] == 0

    runs = history_json("dense")
    done = [r for r in runs if r["state"] == "done"]
    assert len(done) == 2
    expected = grid(episode["at"], episode["ended"], {r["occurrence"] for r in done})
    assert len(expected) >= 2
    skipped = [r for r in runs if r["state"] == "skipped"]
    assert [r["occurrence"] for r in skipped] == expected
    assert all(r["reason"] == f"paused by {paused['by']}: database migration"
               and {k: v for k, v in r["paused"].items() if v is not None} == episode
               and r["node"] is None and r["started"] is None for r in skipped)
    assert runs == [done[0], *skipped, done[1]]  # newest first: the run after, the skipped ones, the run before
    code, out, _ = finish(consulrun("history", "dense", "-n", "100"))
    lines = out.splitlines()
    assert len(lines) == 1 + len(runs)
    assert all(f"skipped (paused by {paused['by']}: database migration)" in line for line in lines[2:-1])
    assert "exit 0" in lines[1] and "exit 0" in lines[-1]
    code, out, _ = finish(consulrun("status", "--json", "dense"))
    assert json.loads(out)["jobs"][0]["skipped"] == []  # a run since: nothing skipped after the last one


def test_pause_that_ran_out_lists_its_skips_and_is_filed_by_the_next_pause(consul: Agent) -> None:
    args = ["run", "--skip-exit-code", str(SKIP), "--schedule", DENSE, "short", "--", "true"]
    assert finish(consulrun(*args))[0] == 0
    assert finish(consulrun("pause", "short", "--for", "7s", "--reason", "quick fix"))[0] == 0
    paused = kv_value(consul, "consulrun/short/pause")
    wait_for(lambda: finish(consulrun(*args))[0] == 0, 30, "the pause to end by itself and a run after it")
    assert kv_value(consul, "consulrun/short/pause") == paused and episodes_of(consul, "short") == []

    def skipped() -> list[dict]:
        return [r for r in history_json("short") if r["state"] == "skipped"]

    ran = {r["occurrence"] for r in history_json("short") if r["state"] == "done"}
    expected = grid(paused["at"], paused["until"], ran)
    assert len(expected) >= 2
    first = skipped()
    assert [r["occurrence"] for r in first] == expected
    assert all(r["reason"] == f"paused by {paused['by']}: quick fix" and r["paused"]["ended"] == paused["until"]
               and r["paused"]["ended_by"] is None for r in first)
    # The next pause files the one that ran out, as it ended: at its `until`, by nobody.
    assert finish(consulrun("pause", "short", "--reason", "second"))[0] == 0
    assert episodes_of(consul, "short") == [{**paused, "ended": paused["until"]}]
    assert finish(consulrun("resume", "short"))[0] == 0
    assert len(episodes_of(consul, "short")) == 2
    assert [r for r in skipped() if r["paused"]["reason"] == "quick fix"] == first


def test_pause_episodes_kept_are_bounded(consul: Agent) -> None:
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.protocol.pause import KEPT_EPISODES, pause, resume

    client = Client(ConsulConfig.from_env({}, address=consul.http_addr))
    for n in range(KEPT_EPISODES + 3):
        pause(client, "consulrun", ["bounded", "other"], for_ms=None, reason=f"round {n}")
        resume(client, "consulrun", ["bounded", "other"])
    for job in ("bounded", "other"):
        kept = sorted(int(e["reason"].split()[1]) for e in episodes_of(consul, job))
        assert kept == list(range(3, KEPT_EPISODES + 3))  # the newest, however many seconds they share


def test_occurrences_skipped_while_paused_are_derived_exactly_and_are_not_missed() -> None:
    """No Consul: the derivation on a fixed clock. A filed pause and one that ran out by itself, runs on both
    sides; an occurrence inside a pause that a node ran anyway (a timer that fired before the pause) is a run."""
    from consulrun.report import history, status

    def entry(value: dict) -> dict:
        return {"Value": json.dumps(value)}

    def run(occurrence: str) -> dict:
        return entry({"occurrence": occurrence, "state": "done", "exit_status": 0, "node": "n1", "attempt": 1,
                      "started": occurrence, "ended": occurrence, "schedule": ["*:*:0/10"]})

    keys = {f"history/{occ}": run(occ) for occ in ("2026-01-01T00:00:00Z", "2026-01-01T00:00:10Z",
                                                   "2026-01-01T00:00:40Z")}
    keys["ended-pauses/2026-01-01T00:00:05Z~7"] = entry({"by": "a@h", "at": "2026-01-01T00:00:05Z", "reason": "mig",
                                                         "ended": "2026-01-01T00:00:35Z", "ended_by": "b@h"})
    keys["pause"] = entry({"by": "c@h", "at": "2026-01-01T00:01:00Z", "until": "2026-01-01T00:01:20Z"})
    now = datetime(2026, 1, 1, 0, 2, tzinfo=timezone.utc)
    ran = history.rows_of(keys)
    rows = history.newest_first(ran + history.skipped_rows(keys, ran, history.stored_schedule(keys), now, 100))
    assert [(r["occurrence"], r["state"], r["reason"]) for r in rows] == [
        ("2026-01-01T00:01:10Z", "skipped", "paused by c@h"), ("2026-01-01T00:01:00Z", "skipped", "paused by c@h"),
        ("2026-01-01T00:00:40Z", "done", None),
        ("2026-01-01T00:00:30Z", "skipped", "paused by a@h: mig"), ("2026-01-01T00:00:20Z", "skipped", "paused by a@h: mig"),
        ("2026-01-01T00:00:10Z", "done", None), ("2026-01-01T00:00:00Z", "done", None)]
    assert [r["occurrence"] for r in history.skipped_rows(keys, ran, ("*:*:0/10",), now, 3)] == [
        "2026-01-01T00:01:10Z", "2026-01-01T00:01:00Z", "2026-01-01T00:00:30Z"]  # the newest, looked for backwards

    # status: the latest due occurrence (now - 60 s lag) fell in a pause that ended since: skipped, not missed.
    judge = status.HolderJudge(client=None)  # type: ignore[arg-type] - no holder: nothing to ask Consul
    later = {k: v for k, v in keys.items() if k != "history/2026-01-01T00:00:40Z"}
    later["occurrence"] = run("2026-01-01T00:00:10Z")
    judged = status.judge_job("j", later, None, judge, datetime(2026, 1, 1, 0, 1, 25, tzinfo=timezone.utc), 0)
    assert judged.problems == [] and [s["occurrence"] for s in judged.skipped] == [
        "2026-01-01T00:01:10Z", "2026-01-01T00:01:00Z", "2026-01-01T00:00:30Z", "2026-01-01T00:00:20Z"]
    del later["ended-pauses/2026-01-01T00:00:05Z~7"]
    judged = status.judge_job("j", later, None, judge, datetime(2026, 1, 1, 0, 1, 25, tzinfo=timezone.utc), 0)
    assert [p["kind"] for p in judged.problems] == ["missed"]  # without the pause, 00:00:20 was missed


def test_pause_and_resume_of_more_jobs_than_one_transaction_holds(consul: Agent) -> None:
    """Consul refuses a transaction of more than 128 operations: many jobs go in batches, each job's keys together."""
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.protocol.pause import pause, resume

    client = Client(ConsulConfig.from_env({}, address=consul.http_addr))
    jobs = [f"job{n:03d}" for n in range(150)]
    pause(client, "consulrun", jobs, for_ms=None, reason="first")
    pause(client, "consulrun", jobs, for_ms=None, reason="second")  # three operations a job: files the first
    resume(client, "consulrun", jobs)
    keys = requests.get(f"{consul.url}/v1/kv/consulrun/", params={"recurse": "true", "keys": "true"}, timeout=10).json()
    assert len(keys) == 2 * len(jobs) and all("/ended-pauses/" in key for key in keys)


def test_a_resume_within_an_occurrences_second_still_covers_it(consul: Agent) -> None:
    """`ended` is rounded up: nodes skipped the 12:12:00 occurrence at .138, the resume came at .618."""
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.protocol.pause import pause, resume

    client = Client(ConsulConfig.from_env({}, address=consul.http_addr))
    pause(client, "consulrun", ["roundup"], for_ms=None, reason="r",
          now=datetime(2026, 11, 30, 12, 11, 30, 250_000, tzinfo=timezone.utc))
    resume(client, "consulrun", ["roundup"], now=datetime(2026, 11, 30, 12, 12, 0, 618_000, tzinfo=timezone.utc))
    (episode,) = episodes_of(consul, "roundup")
    assert (episode["at"], episode["ended"]) == ("2026-11-30T12:11:30Z", "2026-11-30T12:12:01Z")


def test_a_job_named_twice_is_paused_and_resumed_once(consul: Agent, tmp_path: Path) -> None:
    for verb in ("pause", "resume"):
        code, _, err = finish(consulrun(verb, jobs_of(tmp_path, "twice"), "twice", "twice"))
        assert code == 0, err
    assert len(episodes_of(consul, "twice")) == 1


# --- job names: a typo pauses, resumes or triggers nothing, and leaves no phantom -------------------------


def keys_under(agent: Agent, prefix: str) -> list[str]:
    found = requests.get(f"{agent.url}/v1/kv/{prefix}", params={"recurse": "true", "keys": "true"}, timeout=10)
    return [] if found.status_code == 404 else found.json()


def test_a_typo_is_refused_with_a_suggestion_and_writes_nothing(consul: Agent, tmp_path: Path) -> None:
    manifest = jobs_of(tmp_path, "db-backup", "cache-warm")
    for verb in ("pause", "resume", "trigger"):
        code, out, err = finish(consulrun(verb, manifest, "db-bakup"))
        assert (code, out) == (6, ""), err
        assert err == f"Error: no such job in {manifest}: db-bakup (did you mean 'db-backup'?)\n"
    assert keys_under(consul, "consulrun/") == []

    assert finish(consulrun("run", "db-backup", "--", "true"))[0] == 0  # now Consul knows it
    for verb in ("pause", "resume", "trigger"):
        code, out, err = finish(consulrun(verb, "db-bakup"))
        assert (code, out) == (6, ""), err
        assert "no such job with state under consulrun/ in Consul: db-bakup (did you mean 'db-backup'?)" in err
    code, _, err = finish(consulrun("pause", "db-bakup", "cache-wram"))
    assert code == 6 and "db-bakup, cache-wram (did you mean 'db-backup' for 'db-bakup'?)" in err
    for verb in ("status", "unlock", "history"):  # these refused typos already; now they suggest too
        code, _, err = finish(consulrun(verb, "db-bakup", *(["--yes"] if verb == "unlock" else [])))
        assert code == 6 and "(did you mean 'db-backup'?)" in err, (verb, err)
    assert not [key for key in keys_under(consul, "consulrun/") if "bakup" in key]
    code, out, _ = finish(consulrun("pause", "--all"))
    assert code == 0 and out.startswith("db-backup: paused by ") and out.count("\n") == 1  # no phantom to pause


def test_resume_of_a_job_that_is_not_paused_says_so(consul: Agent, tmp_path: Path) -> None:
    manifest = jobs_of(tmp_path, "steady", "held-up")
    assert finish(consulrun("pause", manifest, "held-up", "--reason", "disk full"))[0] == 0
    code, out, err = finish(consulrun("resume", manifest, "steady", "held-up"))
    assert code == 0, err
    assert out.splitlines()[0] == "steady: not paused; nothing to resume"
    assert out.splitlines()[1].startswith("held-up: resumed (paused by ") and out.endswith(": disk full)\n")
    code, out, _ = finish(consulrun("resume", manifest, "held-up"))
    assert (code, out) == (0, "held-up: not paused; nothing to resume\n")
