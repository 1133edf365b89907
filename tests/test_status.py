"""`status`, `unlock` and `acl-policy` against a real Consul agent.

Lost, abandoned, missed and overdue states are made by writing records into
KV in the shapes the runner writes (see the occurrence module), with real
sessions holding real locks where a holder is needed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.protocol import procinfo
from consulrun.cli import main
from tests.harness.acl import acl as _acl, token_file as _token_file
from tests.harness.agents import Agent, start_dev_agent, wait_for
from tests.harness.holders import hold, iso, put, session
from tests.harness.runs import cli, consulrun, finish, lock_entry, write_manifest

pytestmark = pytest.mark.consul
REPO = Path(__file__).resolve().parents[1]


# --- The table, JSON, relative times, real runs -----------------------------------------------------------


def test_status_table_json_and_verdicts(consul: Agent, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path, """
  billing-report: {command: "true", schedule: "*-*-* 02:00:00"}
  cache-warm: {command: "true", schedule: "*:0/5"}
""")
    assert finish(consulrun("run", "--schedule", "*-*-* 02:00:00", "billing-report", "--", "true"))[0] == 0
    code, out, _ = cli("status", str(manifest))
    assert code == 0, out
    assert out.splitlines()[0].split()[:3] == ["JOB", "STATE", "HOLDER"]
    assert "never run" in out and "exit 0" in out and " ago)" in out and "(in " in out  # relative times

    assert finish(consulrun("run", "stray", "--", "sh", "-c", "exit 4"))[0] == 4
    started = tmp_path / "started"
    holder = consulrun("run", "cache-warm", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the cache-warm job")
        code, out, _ = cli("status", str(manifest), "--json")
        data = json.loads(out)
        jobs = {j["job"]: j for j in data["jobs"]}
        assert code == 1 and data["verdict"] == "last_run_failed"  # stray's last run exited 4
        assert jobs["billing-report"]["state"] == "free" and jobs["billing-report"]["last"]["exit_status"] == 0
        assert jobs["billing-report"]["last"]["state"] == "done" and jobs["billing-report"]["next"].endswith(":00Z")
        assert jobs["billing-report"]["verdict"] == "ok" and jobs["billing-report"]["problems"] == []
        assert jobs["cache-warm"]["state"] == "held"
        held = jobs["cache-warm"]["holders"][0]
        assert held["node"] == "dev1" and held["healthy"] is True and held["health"] == "passing"
        assert jobs["stray"]["state"] == "orphaned" and jobs["stray"]["last"]["exit_status"] == 4
        assert jobs["stray"]["problems"][0]["kind"] == "failed"

        code, out, _ = cli("status", "cache-warm", "billing-report")  # JOB... limits the rows
        assert code == 0 and [line.split()[0] for line in out.splitlines()] == ["JOB", "cache-warm", "billing-report"]

        code, _, err = cli("unlock", str(manifest), "cache-warm", "--yes")
        assert code == 1 and "healthy" in err and "--force" in err
        assert lock_entry(consul, "consulrun/cache-warm/lock").get("Session") == held["session"]
        code, _, err = cli("unlock", "cache-warm", "--yes", "--force")
        assert code == 0 and "will destroy session" in err and "unlocked: destroyed session" in err
        will = next(line for line in err.splitlines() if "will destroy" in line)
        assert will.count(held["session"]) == 1, will  # it used to name the session twice
        assert will.startswith(f"cache-warm: will destroy session {held['session']} of dev1 (pid "), will
        assert finish(holder)[0] == 75
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGTERM)
            finish(holder)
    code, out, _ = cli("unlock", "cache-warm", "--yes")
    assert (code, out) == (0, "cache-warm is not locked\n")


# --- Never green when blind -------------------------------------------------------------------------------


def test_empty_prefix_and_unknown_job_are_said_plainly(consul: Agent, tmp_path: Path) -> None:
    code, out, err = cli("status", "--prefix", "nothing-here")
    assert code == 6 and out == "" and "no job has any state under nothing-here/" in err
    code, out, _ = cli("status", "--prefix", "nothing-here", "--json")
    assert code == 6 and json.loads(out)["verdict"] == "no_state" and json.loads(out)["jobs"] is None
    hold(consul, "real")
    code, _, err = cli("status", "real", "typo")
    assert code == 6 and "no such job under consulrun/: typo" in err
    code, _, err = cli("unlock", "typo", "--yes", "--force")
    assert code == 6 and "job 'typo' has no state under consulrun/" in err
    code, _, err = cli("history", "typo")
    assert code == 6 and "job 'typo' has no state" in err
    code, _, err = cli("status", "bad/name")
    assert code == 2


def test_status_json_gives_an_error_object_when_consul_is_down() -> None:
    code, out, err = cli("status", "--json", "--http-addr", "127.0.0.1:9")
    data = json.loads(out)
    assert code == 69 and data["verdict"] == "consul_unavailable" and data["exit_status"] == 69
    assert data["jobs"] is None and "not reachable" in data["error"]
    assert err.count("\n") == 1 and "not reachable" in err


def test_status_uses_the_manifest_consul_settings(consul: Agent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hold(consul, "viaman")
    jobs = '  viaman: {command: "true", schedule: "daily"}\n'
    monkeypatch.delenv("CONSUL_HTTP_ADDR")
    good = write_manifest(tmp_path, jobs, f"consul: {{address: 'http://{consul.http_addr}'}}\n")
    code, out, err = cli("status", str(good))
    assert code == 0 and "viaman" in out and "held" in out, err
    bad = write_manifest(tmp_path, jobs, "consul: {address: 'http://127.0.0.1:9'}\n")
    code, _, err = cli("status", str(bad))
    assert code == 69 and "127.0.0.1:9" in err
    code, _, err = cli("unlock", str(bad), "viaman", "--yes")
    assert code == 69
    code, _, _ = cli("status", str(bad), env={"CONSUL_HTTP_ADDR": consul.http_addr})  # the environment overrides
    assert code == 0
    code, _, _ = cli("status", str(bad), "--http-addr", consul.http_addr)  # so does an option
    assert code == 0
    missing = write_manifest(tmp_path, jobs, f"consul: {{address: '{consul.http_addr}', token_file: /nonexistent/t}}\n")
    code, _, err = cli("status", str(missing), "--trust-manifest-consul")  # a token to the manifest's address
    assert code == 2 and "Consul token file /nonexistent/t: no such file" in err
    code, out, _ = cli("status", str(missing), "--json", "--trust-manifest-consul")
    assert code == 2 and json.loads(out)["verdict"] == "usage_error" and json.loads(out)["jobs"] is None


def test_acl_hidden_state_is_never_green(acl_agent: tuple[Agent, str], tmp_path: Path) -> None:  # noqa: F811
    agent, management = acl_agent
    hold(agent, "heldjob", token=management)
    put(agent, "consulrun/other/occurrence", {"occurrence": "2026-01-01T00:00:00Z", "state": "done"}, management)
    env = {"CONSUL_HTTP_ADDR": agent.http_addr}

    def token(rules: str) -> str:
        name = f"p{abs(hash(rules))}"
        _acl(agent, management, "PUT", "acl/policy", {"Name": name, "Rules": rules})
        secret = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": name}]})["SecretID"]
        return str(_token_file(tmp_path, name, secret))

    # No token at all: every read is filtered or denied.
    for args in (["status"], ["status", "heldjob"], ["unlock", "heldjob", "--yes", "--force"], ["history", "heldjob"]):
        code, out, err = cli(*args, env=env)
        assert code == 77 and "ACL" in err and err.count("\n") == 1, (args, out, err)
    code, out, _ = cli("status", "--json", env=env)
    assert code == 77 and json.loads(out)["verdict"] == "permission_denied" and json.loads(out)["jobs"] is None
    assert lock_entry(agent, "consulrun/heldjob/lock?token=" + management)["Session"]  # unlock did nothing

    # A token that can read one job's keys only: the listing is filtered, so status is blind to the rest.
    partial = {**env, "CONSUL_HTTP_TOKEN_FILE": token('key_prefix "consulrun/other/" { policy = "read" }')}
    code, _, err = cli("status", env=partial)
    assert code == 77 and "cannot read all of it" in err
    # A token that reads the keys but not sessions or nodes cannot judge the holder.
    kv_only = {**env, "CONSUL_HTTP_TOKEN_FILE": token('key_prefix "consulrun/" { policy = "read" }')}
    code, _, err = cli("status", env=kv_only)
    assert code == 77, err
    code, _, err = cli("unlock", "heldjob", "--yes", "--force", env=kv_only)
    assert code == 77, err

    # With acl-policy's rules, all is visible; a manifest's token_file is used as the units use it.
    rules = CliRunner().invoke(main, ["acl-policy"]).stdout
    full = token(rules)
    manifest = write_manifest(tmp_path, '  heldjob: {command: "true", schedule: "daily"}\n',
                              f"consul: {{address: '{agent.http_addr}', token_file: {full}}}\n")
    code, out, err = cli("status", str(manifest), "--trust-manifest-consul", env={})
    assert code == 0 and "heldjob" in out and "held" in out, err
    code, _, err = cli("unlock", str(manifest), "heldjob", "--yes", "--trust-manifest-consul", env={})
    assert code == 1 and "healthy" in err


# --- Health as Consul judges it; dead holders on this node ---------------------------------------------------


def test_warning_check_leaves_the_holder_healthy_critical_does_not(consul: Agent) -> None:
    consul.api("PUT", "agent/check/register", json={"ID": "disk-ok", "Name": "disk", "TTL": "600s"})
    try:
        consul.api("PUT", "agent/check/pass/disk-ok")
        sid = hold(consul, "checked", checks=("serfHealth", "disk-ok"))
        consul.api("PUT", "agent/check/warn/disk-ok")  # not passing, yet not critical: Consul keeps the session
        code, out, _ = wait_for(lambda: (lambda r: r if "warning" in r[1] else None)(cli("status")), 20,
                                "the warning to reach the catalog")
        assert code == 0 and "warning (Consul keeps the session): disk-ok" in out
        code, _, err = cli("unlock", "checked", "--yes")
        assert code == 1 and "healthy" in err
        assert consul.get(f"session/info/{sid}")
        consul.api("PUT", "agent/check/fail/disk-ok")  # critical: Consul invalidates the session, frees the lock
        wait_for(lambda: not consul.get(f"session/info/{sid}"), 20, "Consul to invalidate the session")
        code, out, _ = cli("status", "--json")
        job = json.loads(out)["jobs"][0]
        # Free now; and the run it held ended with no result (a real runner would have been fenced): not green.
        assert (code, job["state"], job["last"]["state"]) == (1, "free", "abandoned")
    finally:
        consul.api("PUT", "agent/check/deregister/disk-ok")


def _dead_pid() -> tuple[int, int]:
    proc = subprocess.Popen(["sleep", "60"])
    start = procinfo.process_start(proc.pid)
    proc.kill()
    proc.wait()
    return proc.pid, start


def test_dead_holder_on_this_node_is_unhealthy_and_unlock_breaks_it(consul: Agent) -> None:
    boot = procinfo.boot_id()
    pid, start = _dead_pid()
    sid = hold(consul, "deadpid", pid=pid, pid_start=start, boot_id=boot)
    code, out, _ = cli("status", "--json")
    holder = json.loads(out)["jobs"][0]["holders"][0]
    assert code == 5 and holder["healthy"] is False and f"(pid {pid}) on this node has exited" in holder["health"]
    code, _, err = cli("unlock", "deadpid", "--yes")  # no --force needed
    assert code == 0 and "unlocked: destroyed session" in err
    assert not consul.get(f"session/info/{sid}")

    live = subprocess.Popen(["sleep", "60"])
    try:
        live_start = procinfo.process_start(live.pid)
        hold(consul, "alive", pid=live.pid, pid_start=live_start, boot_id=boot)
        hold(consul, "reused", pid=live.pid, pid_start=live_start + 1, boot_id=boot)  # the pid is someone else's now
        hold(consul, "elsewhere", node="another-node", pid=pid, pid_start=start, boot_id=boot)  # not provable here
        hold(consul, "otherns", pid=pid, pid_start=start, boot_id=boot, pid_ns="pid:[1]")  # nor is another namespace
        code, out, _ = cli("status", "alive", "reused", "elsewhere", "otherns", "--json")
        health = {j["job"]: j["holders"][0]["healthy"] for j in json.loads(out)["jobs"]}
        assert code == 5 and health == {"alive": True, "reused": False, "elsewhere": True, "otherns": True}
        assert cli("unlock", "alive", "--yes")[0] == 1
        assert cli("unlock", "reused", "--yes")[0] == 0
    finally:
        live.kill()
        live.wait()


# --- Lost, abandoned, missed, overdue ----------------------------------------------------------------------


def test_lost_and_abandoned_runs_are_visible(consul: Agent) -> None:
    put(consul, "consulrun/fenced/occurrence", {
        "occurrence": "2026-01-01T00:00:00Z", "state": "lost", "node": "n1", "session": "s1", "attempt": 1,
        "started": "2026-01-01T00:00:01Z", "lost_at": "2026-01-01T00:00:30Z",
        "reason": "lock not confirmed for 9.1s", "takeover": False})
    put(consul, "consulrun/killed/occurrence", {
        "occurrence": "2026-01-01T00:00:00Z", "state": "abandoned", "node": "n2", "session": "s2",
        "reason": "runner's session died with the occurrence running", "takeover": False})
    # Recorded running, but its session holds no lock: the runner died and nobody has noticed yet.
    put(consul, "consulrun/silent/occurrence", {
        "occurrence": "2026-01-01T00:00:00Z", "state": "running", "node": "n3", "session": "gone", "takeover": False})
    code, out, _ = cli("status", "--json")
    jobs = {j["job"]: j for j in json.loads(out)["jobs"]}
    assert code == 1 and json.loads(out)["verdict"] == "last_run_failed"
    assert jobs["fenced"]["problems"][0]["kind"] == "lost" and "lock not confirmed" in jobs["fenced"]["problems"][0]["detail"]
    assert jobs["killed"]["last"]["state"] == "abandoned" and jobs["killed"]["verdict"] == "last_run_failed"
    assert jobs["silent"]["last"]["state"] == "abandoned" and "no result was recorded" in jobs["silent"]["last"]["reason"]
    code, out, _ = cli("status")
    states = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:4]}
    assert states == {"fenced": "lost", "killed": "abandoned", "silent": "abandoned"}
    assert "fenced: lost: occurrence 2026-01-01T00:00:00Z on n1 was lost: lock not confirmed for 9.1s" in out


def test_a_killed_unscheduled_run_is_abandoned_not_free(consul: Agent, tmp_path: Path) -> None:
    """A run without --schedule (units with concurrency > 1) keeps no record but the slot's value: once its dead
    wrapper's session is gone, that holder value with no result is an abandoned run, not a free never-run job."""
    started = tmp_path / "started"
    runner = consulrun("run", "--concurrency", "2", "fanout", "--", "sh", "-c", f"touch {started}; exec sleep 300")
    wait_for(started.exists, 20, "the job")
    runner.kill()  # a crash: no release, no result
    runner.wait(timeout=10)
    slot = next(e for e in consul.get("kv/consulrun/fanout/slots/?recurse") if e.get("Session"))
    consul.api("PUT", f"session/destroy/{slot['Session']}")  # what the TTL would do a little later
    code, out, _ = cli("status", "--json", "fanout")
    job = json.loads(out)["jobs"][0]
    assert code == 1, out
    assert (job["state"], job["last"]["state"], job["verdict"]) == ("free", "abandoned", "last_run_failed")
    assert job["problems"][0]["kind"] == "abandoned"


def test_forced_unlock_of_a_real_scheduled_run_is_not_green(consul: Agent, tmp_path: Path) -> None:
    started = tmp_path / "started"
    runner = consulrun("run", "--schedule", "*-*-* 02:00:00", "broken", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the scheduled job")
        assert cli("status", "broken")[0] == 0
        code, _, err = cli("unlock", "broken", "--yes", "--force")
        assert code == 0, err
        assert finish(runner)[0] == 75
    finally:
        if runner.poll() is None:
            runner.send_signal(signal.SIGTERM)
            finish(runner)
    code, out, _ = cli("status", "broken", "--json")
    job = json.loads(out)["jobs"][0]
    assert code == 1 and job["last"]["state"] in ("lost", "abandoned") and job["problems"][0]["kind"] in ("lost", "abandoned")


def test_runner_killed_9_shows_abandoned_once_its_session_is_gone(consul: Agent, tmp_path: Path) -> None:
    started = tmp_path / "started"
    runner = consulrun("run", "--ttl", "10s", "--schedule", "*-*-* 02:00:00", "killed", "--", "sh", "-c",
                       f"touch {started}; exec sleep 60")
    wait_for(started.exists, 20, "the scheduled job")
    runner.kill()  # as the OOM killer does: nothing is recorded
    runner.wait()
    # Until Consul ends the session (TTL) the lock may look held; never may the run look fine once it is gone.
    code, out, _ = wait_for(lambda: (lambda r: r if r[0] == 1 else None)(cli("status", "killed", "--json")), 60,
                            "status to call the killed run abandoned")
    job = json.loads(out)["jobs"][0]
    assert job["state"] == "free" and job["last"]["state"] == "abandoned" and job["problems"][0]["kind"] == "abandoned"


def test_missed_occurrence_from_manifest_or_stored_schedule(consul: Agent, tmp_path: Path) -> None:
    yearly = "*-01-01 00:00:00 UTC"
    now = datetime.now(timezone.utc)
    due = f"{now.year if now > datetime(now.year, 1, 1, 0, 2, tzinfo=timezone.utc) else now.year - 1}-01-01T00:00:00Z"
    put(consul, "consulrun/yearly/occurrence", {"occurrence": "2020-01-01T00:00:00Z", "state": "done", "exit_status": 0,
                                                "node": "n1", "session": "s", "schedule": [yearly]})
    manifest = write_manifest(tmp_path, f'  yearly: {{command: "true", schedule: "{yearly}"}}\n')
    for args in (["status", str(manifest), "--json"], ["status", "--json"]):  # manifest, or the schedule in Consul
        code, out, _ = cli(*args)
        job = json.loads(out)["jobs"][0]
        assert code == 3 and json.loads(out)["verdict"] == "missed", out
        assert job["problems"] == [{"kind": "missed", "occurrence": due, "detail": job["problems"][0]["detail"]}]
    code, out, _ = cli("status", str(manifest))
    assert out.splitlines()[1].split()[1] == "missed" and f"yearly: missed: occurrence {due} was claimed by no node" in out
    # Claimed in time: not missed.
    put(consul, "consulrun/yearly/occurrence", {"occurrence": due, "state": "done", "exit_status": 0, "node": "n1",
                                                "session": "s", "schedule": [yearly]})
    assert cli("status", str(manifest))[0] == 0


def test_jobs_without_occurrence_records_are_judged_by_start_times(consul: Agent, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path, """
  slotted: {command: "true", schedule: "*-01-01 00:00:00 UTC", lock: {concurrency: 3}}
  longheld: {command: "true", schedule: "*-*-* *:*:00", timeout: 1m, lock: {concurrency: 2}}
""")
    put(consul, "consulrun/slotted/slots/0", {"state": "free", "last": {
        "node": "n1", "session": "s", "started": "2020-01-01T00:00:05Z", "ended": "2020-01-01T00:00:09Z",
        "exit_status": 0}})
    sid = session(consul)
    an_hour_ago = iso(datetime.now(timezone.utc) - timedelta(hours=1))
    assert put(consul, "consulrun/longheld/slots/1", {"job": "longheld", "node": "dev1", "pid": 1, "session": sid,
                                                      "started": an_hour_ago}, acquire=sid)
    code, out, _ = cli("status", str(manifest), "--json")
    problems = {j["job"]: [p["kind"] for p in j["problems"]] for j in json.loads(out)["jobs"]}
    assert code == 3 and problems == {"slotted": ["missed"], "longheld": ["overdue"]}
    assert cli("status", str(manifest), "longheld")[0] == 4


def test_overdue_run_of_a_real_job_past_its_timeout(consul: Agent, tmp_path: Path) -> None:
    spec = "*-*-* *:*:00"
    manifest = write_manifest(tmp_path, f'  slow: {{command: "true", schedule: "{spec}", timeout: 1s}}\n')
    started = tmp_path / "started"
    runner = consulrun("run", "--schedule", spec, "slow", "--", "sh", "-c", f"touch {started}; sleep 60")
    try:
        wait_for(started.exists, 20, "the slow job")
        code, out, _ = wait_for(lambda: (lambda r: r if r[0] == 4 else None)(cli("status", str(manifest))), 20,
                                "status to call the run overdue")
        assert "slow: overdue: occurrence" in out and "longer than its timeout (1s)" in out
    finally:
        runner.send_signal(signal.SIGTERM)
        finish(runner)


# --- acl-policy, --watch ----------------------------------------------------------------------------------


def test_acl_policy_is_least_privilege() -> None:
    code, out, _ = cli("acl-policy", str(REPO / "examples" / "jobs.yaml"))
    assert code == 0
    assert 'key_prefix "consulrun/" {\n  policy = "write"\n}' in out
    assert 'session_prefix "" {\n  policy = "write"\n}' in out
    assert 'node_prefix "" {\n  policy = "read"\n}' in out
    # Writes: the job keys, sessions, and (health_checks) the external node and its service, each by exact name.
    assert "service_prefix" not in out and out.count('policy = "write"') == 4
    assert 'node "consulrun" {\n  policy = "write"\n}' in out and 'service "consulrun" {\n  policy = "write"\n}' in out
    code, out, _ = cli("acl-policy", str(REPO / "tests" / "golden" / "tls-and-checks" / "manifest.yaml"))
    assert 'key_prefix "ops/cron/"' in out and 'service_prefix "" {\n  policy = "read"\n}' in out


class Output:
    """Everything a process has written to a pipe so far (raw reads: a buffered readline would hide lines)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.fd = proc.stdout.fileno()  # type: ignore[union-attr]
        self.seen = ""

    def read(self) -> str:
        while select.select([self.fd], [], [], 0.2)[0]:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                break
            self.seen += chunk.decode()
        return self.seen


def test_watch_redraws_on_change_and_ends_quietly_on_ctrl_c(consul: Agent) -> None:
    watcher = consulrun("status", "--watch")
    out = Output(watcher)
    try:
        wait_for(lambda: "no job has any state under consulrun/" in out.read(), 20, "the empty-prefix message")
        assert finish(consulrun("run", "watched", "--", "true"))[0] == 0
        wait_for(lambda: "watched" in out.read(), 20, "a redraw showing the new job")
        assert "-- refreshed " in out.read() and watcher.poll() is None  # still watching
    finally:
        watcher.send_signal(signal.SIGINT)
        code, _, err = finish(watcher, timeout=30)
    assert code == 130 and "Aborted" not in err and "Traceback" not in err


def test_watch_survives_an_agent_restart(consul_bin: str, tmp_path: Path) -> None:
    agent = start_dev_agent(consul_bin, tmp_path, name="watch1")
    ports = agent.extra["ports"]
    put(agent, "consulrun/before/lock", {"state": "free"})
    watcher = consulrun("status", "--watch", "--json", env={"CONSUL_HTTP_ADDR": agent.http_addr})
    out = Output(watcher)
    try:
        wait_for(lambda: '"before"' in out.read(), 20, "the first JSON line")
        agent.stop()
        wait_for(lambda: "reconnecting_in_s" in out.read(), 20, "a reconnecting line")
        agent = start_dev_agent(consul_bin, tmp_path, name="watch1", extra_config={"ports": ports})
        put(agent, "consulrun/after/lock", {"state": "free"})
        wait_for(lambda: '"after"' in out.read(), 60, "a line from the restarted agent")
        lines = [json.loads(line) for line in out.read().splitlines()]  # one compact object per line
        assert lines[0]["verdict"] == "ok" and lines[-1]["jobs"][0]["job"] == "after"
        assert any(line["verdict"] == "consul_unavailable" for line in lines)
    finally:
        try:
            watcher.send_signal(signal.SIGINT)
            finish(watcher, timeout=30)
        finally:
            agent.stop()  # whatever the watcher did: an agent this test started never outlives it


def test_process_start_survives_odd_process_names() -> None:
    import sys

    child = subprocess.Popen([sys.executable, "-c", "open('/proc/self/comm', 'w').write('a) b (c'); import time; "
                              "print(flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # type: ignore[union-attr]
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "a) b (c"
        fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert procinfo.process_start(child.pid) == int(fields[19]) > 0
    finally:
        child.kill()
        child.wait()
    assert procinfo.process_start(child.pid) is None


def test_a_paused_job_whose_last_run_failed_shows_both(consul: Agent) -> None:
    assert finish(consulrun("run", "flaky", "--", "sh", "-c", "exit 3"))[0] == 3
    assert finish(consulrun("pause", "flaky", "--reason", "looking into it"))[0] == 0
    code, out, _ = cli("status", "flaky")
    assert code == 1, out
    assert out.splitlines()[1].split()[:3] == ["flaky", "failed,", "paused"]
    assert "flaky: paused by " in out and ": looking into it" in out
    code, out, _ = cli("status", "--json", "flaky")
    job = json.loads(out)["jobs"][0]
    assert code == 1 and job["verdict"] == "last_run_failed" and job["problems"][0]["kind"] == "failed"
    assert job["state"] == "free" and job["paused"]["reason"] == "looking into it"
    assert finish(consulrun("resume", "flaky"))[0] == 0
    code, out, _ = cli("status", "flaky")
    assert out.splitlines()[1].split()[:2] == ["flaky", "failed"] and "paused" not in out
