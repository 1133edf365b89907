"""Hostile values in Consul (issue 28): what a holder of KV write under the prefix can and cannot make us do.

Every value here is written with a plain KV PUT, as anyone holding a node's
token can: a rewritten lock value, records in the future, values that are not
what consulrun writes, text with control characters. Each test talks to the
real dev agent.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import requests

from consulrun.manifest import calendar
from consulrun.protocol import keys as kvkeys, procinfo
from tests.harness.agents import Agent, free_port, wait_for
from tests.harness.runs import consulrun, finish, kv_json, lock_entry
from tests.harness.sshd import MANIFEST, Sshd, install_here as _install

pytestmark = pytest.mark.consul
SKIP = 42


def put(agent: Agent, key: str, value: Any, **params: str) -> bool:
    data = value if isinstance(value, (str, bytes)) else json.dumps(value)
    return agent.api("PUT", f"kv/{key}", data=data, params=params).json()


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return finish(consulrun(*args, env=env))


def one_error_line(err: str, *words: str) -> None:
    """stderr is one `Error: ...` line holding `words`, and no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert all(word in lines[0] for word in words), lines


def iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- 1. A rewritten lock value ----------------------------------------------------------------------------


@pytest.fixture
def other_node(consul: Agent) -> Iterator[str]:
    """A second node in the catalog (`sr2`) with a passing serfHealth, so a session can live there."""
    consul.api("PUT", "catalog/register", json={
        "Node": "sr2", "Address": "127.0.0.2",
        "Check": {"CheckID": "serfHealth", "Name": "Serf Health Status", "Status": "passing"}})
    yield "sr2"
    consul.api("PUT", "catalog/deregister", json={"Node": "sr2"})


def test_a_rewritten_lock_value_never_makes_this_node_destroy_another_nodes_live_session(
        consul: Agent, other_node: str) -> None:
    sid = consul.api("PUT", "session/create", json={"Node": other_node, "Name": "consulrun:j5@sr2", "TTL": "600s",
                                                     "LockDelay": "1ms", "NodeChecks": ["serfHealth"]}).json()["ID"]
    holder = {"job": "j5", "node": other_node, "pid": 4242, "pid_start": 7, "boot_id": "sr2-boot", "session": sid,
              "started": iso(datetime.now(timezone.utc))}
    assert put(consul, "consulrun/j5/lock", holder, acquire=sid)
    # A plain PUT (no acquire): Consul keeps the key's session, the value now names this node and a dead pid.
    forged = {"node": consul.name, "pid": 4999999, "pid_start": 1, "boot_id": procinfo.boot_id(), "session": sid,
              "started": holder["started"]}
    assert put(consul, "consulrun/j5/lock", forged)
    assert lock_entry(consul, "consulrun/j5/lock")["Session"] == sid

    code, _, err = run("reap", "j5")
    assert code == 0 and "destroying the session" not in err, err
    assert consul.get(f"session/info/{sid}"), "reap destroyed a live holder's session on another node"
    code, _, err = run("run", "--skip-exit-code", str(SKIP), "j5", "--", "true")
    assert code == SKIP and "held by" in err, err
    assert consul.get(f"session/info/{sid}"), "a run destroyed a live holder's session on another node"

    code, out, _ = run("status", "--json", "j5")
    held = json.loads(out)["jobs"][0]["holders"][0]
    assert (code, held["healthy"], held["node"]) == (0, True, other_node), out  # the session's node, not the value's
    code, _, err = run("unlock", "j5", "--yes")
    assert code == 1 and "healthy" in err and consul.get(f"session/info/{sid}"), err


def test_a_rewritten_pid_never_makes_the_holders_own_node_destroy_its_live_session(
        consul: Agent, tmp_path: Path) -> None:
    started, go = tmp_path / "started", tmp_path / "go"
    holder = consulrun("run", "j6", "--", "sh", "-c", f"touch {started}; while [ ! -e {go} ]; do sleep 0.1; done")
    try:
        wait_for(started.exists, 30, "the holder's job")
        entry = lock_entry(consul, "consulrun/j6/lock")
        value = kv_json(consul, "consulrun/j6/lock")
        assert put(consul, "consulrun/j6/lock", {**value, "pid": 4999999, "pid_start": 1})  # same node, a dead pid
        assert lock_entry(consul, "consulrun/j6/lock")["Session"] == entry["Session"]
        code, _, err = run("reap", "j6")
        assert code == 0 and "destroying the session" not in err, err
        code, out, _ = run("status", "--json", "j6")
        assert code == 0 and json.loads(out)["jobs"][0]["holders"][0]["healthy"] is True, out
        assert consul.get(f"session/info/{entry['Session']}") and holder.poll() is None
    finally:
        go.touch()
    code, _, err = finish(holder)
    assert code == 0 and "lock lost" not in err, err


def test_a_value_forged_before_the_acquisition_is_confirmed_meets_the_holders_mark(
        consul: Agent, tmp_path: Path) -> None:
    """Between the acquisition's commit and its confirmation (a read that an election can stretch to a TTL), the
    value is already in Consul: the holder's mark must be bound by then, or a forged pid gets its session reaped."""
    from tests.harness.hooks import at, go, hooks

    holder = consulrun("run", "jw", "--", "true", env=hooks(tmp_path, "committed"))
    try:
        at(tmp_path, "committed")
        entry = lock_entry(consul, "consulrun/jw/lock")
        value = kv_json(consul, "consulrun/jw/lock")
        assert put(consul, "consulrun/jw/lock", {**value, "pid": 4999999, "pid_start": 1})
        code, _, err = run("reap", "jw")
        assert code == 0 and "destroying the session" not in err, err
        assert consul.get(f"session/info/{entry['Session']}")
    finally:
        go(tmp_path, "committed")
    code, _, err = finish(holder)
    assert code == 0 and "acquired consulrun/jw/lock" in err, err


NO_UNIX_SOCKETS = """
import os, socket, sys, seccomp
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
f.add_rule(seccomp.ERRNO(97), "socket", seccomp.Arg(0, seccomp.EQ, socket.AF_UNIX))  # EAFNOSUPPORT
f.load()
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_unix_sockets_denied_runs_the_job_and_reap_waits_for_the_ttl(consul: Agent, tmp_path: Path) -> None:
    """RestrictAddressFamilies=AF_INET AF_INET6 leaves no unix sockets: the holder runs without its mark, and a
    reap that cannot look at marks proves nothing dead (the session's TTL frees the lock)."""
    launcher = tmp_path / "nounix.py"
    launcher.write_text(NO_UNIX_SOCKETS)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    denied = ["/usr/bin/python3", str(launcher), sys.executable, "-m", "consulrun"]
    probe = subprocess.run(denied[:3] + ["-c", "import socket; socket.socket(socket.AF_UNIX)"], capture_output=True,
                           text=True)
    assert "Address family not supported" in probe.stderr, probe.stderr  # the filter really denies it
    done = subprocess.run([*denied, "run", "--schedule", "*:0/5", "ju", "--", "sh", "-c", "echo RAN-U"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "RAN-U" in done.stdout and "Traceback" not in done.stderr, done.stderr
    assert kv_json(consul, "consulrun/ju/occurrence")["state"] == "done"
    reaped = subprocess.run([*denied, "reap", "ju"], env=env, capture_output=True, text=True, timeout=60)
    assert reaped.returncode == 0 and "Traceback" not in reaped.stderr, reaped.stderr


# --- 3. Values consulrun never writes ----------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000
NOW = iso(datetime.now(timezone.utc))


@pytest.mark.parametrize("key, value, field", [
    ("occurrence", DEEP, "nests deeper"),
    ("occurrence", {"occurrence": 5}, "'occurrence'"),
    ("occurrence", {"occurrence": "2026-01-01T00:00:00Z", "state": "running", "session": [1]}, "'session'"),
    ("occurrence", "[1, 2]", "not an object"),
    ("occurrence", {"occurrence": "0001-01-01T00:00:00+01:00", "state": "done"}, "'occurrence'"),
    ("occurrence", {"state": "running"}, "'occurrence' is missing"),
    # It once reached the zone comparison, which blamed this node's zone (exit 2) for a value nobody wrote.
    ("occurrence", {"occurrence": "2026-01-01T00:00:00Z", "state": "done", "zone_offsets": "\u0663,0,0"},
     "'zone_offsets'"),
    ("occurrence", "{not json", "not JSON"),
    ("occurrence", {"occurrence": "2026-01-01T00:00:00Z", "state": "running", "retry_at": "soon"}, "'retry_at'"),
    ("occurrence", {"occurrence": "2026-01-01T00:00:00Z", "state": "done", "earlier": [{"retry_after_s": "10"}]},
     "'earlier[0].retry_after_s'"),
    ("lock", DEEP, "nests deeper"),
    ("history/2026-01-01T00:00:00Z", {"occurrence": "2026-01-01T00:00:00Z", "started": 5, "state": "done"},
     "'started'"),
    ("history/2026-01-01T00:00:00Z", {"occurrence": "2026-01-01T00:00:00Z", "started": "9999-12-31T23:30:00-01:00",
                                      "state": "done"}, "'started'"),
    ("history/2026-01-01T00:00:00Z", {"occurrence": "2026-01-01T00:00:00Z", "earlier": [{"attempt": "one"}]},
     "'earlier[0].attempt'"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "deep" if v is DEEP else None)
def test_a_value_consulrun_never_writes_is_one_line_and_exit_65_in_every_reader(
        consul: Agent, key: str, value: Any, field: str) -> None:
    put(consul, f"consulrun/j1/{key}", value)
    readers = [["history", "j1"], ["exporter", "--textfile", "-"]]
    if not key.startswith("history/"):  # status (and the watchdog) judge the record and the lock, not the history
        jobs = json.dumps({"j1": {"schedules": ["*-*-* *:*:00"], "accuracy_ms": 1000, "randomized_delay_ms": 0,
                                  "timeout_ms": None}})
        readers += [["status"], ["status", "j1"], ["status", "--json"], ["watchdog", "--jobs", jobs]]
    if key == "occurrence":  # the run path reads the record (and a lock's value only while a session holds it)
        readers.append(["run", "--schedule", "*-*-* *:*:00", "j1", "--", "true"])
    for args in readers:
        code, out, err = run(*args)
        assert code == 65, (args, code, out, err[-2000:])
        one_error_line(err, f"consulrun/j1/{key}", field)
        if "--json" in args:  # the job is malformed_value (issue 37: the others would be judged)
            data = json.loads(out)
            assert data["verdict"] == "malformed_value", out
            assert [(j["job"], j["verdict"], j["problems"][0]["key"]) for j in data["jobs"]] == \
                [("j1", "malformed_value", f"consulrun/j1/{key}")], out


def test_a_trigger_without_a_zone_is_ignored_and_the_scheduled_skip_still_skips(consul: Agent) -> None:
    spec = "*-*-* *:*:00"
    occurrence = calendar.occurrence_id(calendar.previous([spec], datetime.now(timezone.utc)))
    put(consul, "consulrun/j1/occurrence", {"occurrence": occurrence, "state": "done", "exit_status": 0,
                                            "node": "elsewhere"})
    naive = datetime.now(timezone.utc).replace(tzinfo=None).isoformat(timespec="seconds")
    trigger = {"id": "0b7f1f3e-5a2c-4a43-9d2a-1f5c1c9b8e11", "by": "mallory@x", "at": naive, "node": consul.name}
    put(consul, "consulrun/j1/trigger", trigger)
    code, _, err = run("run", "--skip-exit-code", str(SKIP), "--schedule", spec, "j1", "--", "true")
    assert code == SKIP and "already ran" in err and "Traceback" not in err, err
    assert "ignoring the trigger request" in err and "zone" in err, err
    assert kv_json(consul, "consulrun/j1/trigger") == trigger  # not consumed


# --- 2. A record in the future ------------------------------------------------------------------------------


def test_a_record_in_the_future_is_a_problem_everywhere_and_runs_do_not_obey_it(consul: Agent, tmp_path: Path) -> None:
    spec = "*-*-* *:*:00"
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(f"health_checks: true\njobs:\n  j1: {{command: 'true', schedule: '{spec}'}}\n")
    put(consul, "consulrun/j1/occurrence", {"occurrence": "9999-12-31T23:59:00Z", "state": "done", "exit_status": 0,
                                            "node": "sr1", "schedule": [spec]})
    ran = tmp_path / "ran"
    code, _, err = run("run", "--schedule", spec, "j1", "--", "touch", str(ran))
    assert code == 65 and not ran.exists(), err
    one_error_line(err, "consulrun/j1/occurrence", "9999-12-31T23:59:00Z", "not obeyed")
    assert "is already claimed" not in err

    for args in (["status", "--grace", "0s", "--json"], ["status", "--grace", "0s", "--json", str(manifest)]):
        code, out, _ = run(*args)
        job = json.loads(out)["jobs"][0]
        assert code == 3 and job["verdict"] == "missed" and [p["kind"] for p in job["problems"]] == ["future"], out
    code, out, _ = run("status", str(manifest))
    assert code == 3 and "j1: future: " in out, out

    code, out, err = run("exporter", "--textfile", "-", str(manifest))
    assert code == 0, err
    assert 'consulrun_job_state{job_name="j1",state="future"} 1.0' in out and \
        'consulrun_job_health{job_name="j1"} 3.0' in out, out

    code, _, err = run("watchdog", str(manifest))
    assert code == 0, err
    check = next(c for c in consul.get("health/node/consulrun") if c["CheckID"] == "job:j1")
    assert check["Status"] == "critical" and "future" in check["Output"], check


# --- 14. The exporter under idle connections ----------------------------------------------------------------


@pytest.fixture
def listening_exporter(consul: Agent) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    address = f"127.0.0.1:{free_port()}"
    proc = consulrun("exporter", "--listen", address)
    try:
        wait_for(lambda: requests.get(f"http://{address}/metrics", timeout=2).ok, 30, "the exporter to serve")
        yield address, proc
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_idle_half_sent_connections_are_bounded_and_timed_out_and_metrics_keeps_answering(
        listening_exporter: tuple[str, subprocess.Popen[str]]) -> None:
    address, proc = listening_exporter
    host, port = address.rsplit(":", 1)
    idle = []
    try:
        for _ in range(300):
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the request
            idle.append(sock)
        for _ in range(5):
            answer = requests.get(f"http://{address}/metrics", timeout=5)
            assert answer.ok and "consulrun_exporter_consul_up 1.0" in answer.text
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
        assert threads <= 8, f"{threads} threads for 300 idle connections"

        def closed_by_the_exporter() -> int:
            count = 0
            for sock in idle:
                sock.setblocking(False)
                try:
                    count += sock.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:  # reset: closed too
                    count += 1
            return count
        # The newest are kept up to the bound, the rest closed at once; then every one when its deadline passes.
        wait_for(lambda: closed_by_the_exporter() >= 300 - 64, 10, "the exporter to close connections over its bound")
        wait_for(lambda: closed_by_the_exporter() == 300, 40, "the exporter to time out idle connections")
    finally:
        for sock in idle:
            sock.close()


def test_a_malformed_value_does_not_stop_the_exporter_which_says_so(
        consul: Agent, listening_exporter: tuple[str, subprocess.Popen[str]]) -> None:
    address, proc = listening_exporter
    put(consul, "consulrun/j1/occurrence", DEEP)

    def reported() -> bool:
        text = requests.get(f"http://{address}/metrics", timeout=5).text
        return "consulrun_exporter_malformed_value 1.0" in text and "consulrun_exporter_consul_up 0.0" in text
    wait_for(reported, 30, "the exporter to report the malformed value")
    consul.api("DELETE", "kv/consulrun/j1/occurrence")
    put(consul, "consulrun/j1/occurrence", {"occurrence": "2026-01-01T00:00:00Z", "state": "done", "exit_status": 0})
    wait_for(lambda: "consulrun_exporter_malformed_value 0.0" in requests.get(f"http://{address}/metrics",
                                                                              timeout=5).text,
             60, "the exporter to recover")
    assert proc.poll() is None


# --- 4. Text from Consul or a remote host reaches no terminal raw -------------------------------------------

CONTROL = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)]


def test_control_characters_in_records_are_escaped_in_status_and_history(consul: Agent) -> None:
    put(consul, "consulrun/j1/occurrence", {
        "occurrence": "2026-01-01T00:00:00Z", "state": "lost", "node": "\x1b[2J\x1b[Hsr1",
        "reason": "boom\nj1: ok: all is well\r\x1b]0;pwned\x07", "started": "2026-01-01T00:00:01Z",
        "ended": "2026-01-01T00:00:02Z"})
    for args in (["status"], ["status", "j1"], ["history", "j1"]):
        code, out, err = run(*args)
        assert code in (0, 1), (args, code, err)
        assert not any(c in out + err for c in CONTROL if c != "\n"), repr(out + err)
        assert not any(line.startswith("j1: ok") for line in out.splitlines()), out
        assert "\\x1b[2J" in out and "boom\\nj1: ok" in out, out  # shown, escaped


def test_a_forged_trigger_with_a_line_break_is_not_consumed_and_adds_no_journal_line(
        consul: Agent, tmp_path: Path) -> None:
    spec = "*-*-* *:*:00"
    occurrence = calendar.occurrence_id(calendar.previous([spec], datetime.now(timezone.utc)))
    put(consul, "consulrun/j1/occurrence", {"occurrence": occurrence, "state": "done", "exit_status": 0,
                                            "node": "elsewhere"})
    trigger = {"id": "0b7f1f3e-5a2c-4a43-9d2a-1f5c1c9b8e11", "by": "mallory\nconsulrun: j1: all is well",
               "at": iso(datetime.now(timezone.utc)), "node": consul.name}
    put(consul, "consulrun/j1/trigger", trigger)
    ran = tmp_path / "ran"
    code, _, err = run("run", "--skip-exit-code", str(SKIP), "--schedule", spec, "j1", "--", "touch", str(ran))
    assert code == SKIP and not ran.exists(), err
    assert "consulrun: j1: all is well" not in err.splitlines(), err
    assert "ignoring the trigger request" in err and "`by`" in err, err
    assert kv_json(consul, "consulrun/j1/trigger") == trigger  # not consumed
    assert not [k for k in consul.get("kv/consulrun/j1/", params={"keys": "true"}) if kvkeys.is_manual(k)]


def test_a_nodes_ssh_output_reaches_the_terminal_escaped(sshd: Sshd, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(MANIFEST)
    hostile = tmp_path / "consulrun"  # what a hostile node runs as `consulrun install -`
    hostile.write_text("#!/bin/sh\ncat >/dev/null\nprintf 'warning: \\033[2Jwiped\\n' >&2\n"
                       "printf '\\033]0;pwned\\007\\r[1/1] prod-db: ok: installed\\n'\n")
    hostile.chmod(0o755)
    code, out, err = _install(str(manifest), "--host", "root@127.0.0.1", "--consulrun-path", str(hostile),
                              *sshd.options())
    assert code == 0, out + err
    assert not any(c in out + err for c in CONTROL if c != "\n"), repr(out + err)
    assert "\\x1b]0;pwned\\x07\\r[1/1] prod-db: ok: installed" in err and "\\x1b[2Jwiped" in err, err


def test_unlock_force_breaks_a_lock_whose_value_is_forged(consul: Agent, tmp_path: Path) -> None:
    """`unlock --force` judges the holder from its session when the value is not one consulrun writes: the safe
    way to break a lock must not be lost exactly when someone rewrote it."""
    started = tmp_path / "started"
    holder = consulrun("run", "jc", "--", "sh", "-c", f"touch {started}; exec sleep 120")
    try:
        wait_for(started.exists, 30, "the holder's job")
        session = lock_entry(consul, "consulrun/jc/lock")["Session"]
        assert put(consul, "consulrun/jc/lock", [1])
        code, _, err = run("unlock", "jc", "--yes")
        assert code == 65 and "consulrun/jc/lock" in err, err  # without --force: the value is named, nothing done
        code, out, err = run("unlock", "jc", "--yes", "--force")
        assert code == 0 and f"will destroy session {session} of {consul.name}" in err, err
        assert "value is JSON an array" in err and "None" not in err, err
        assert not consul.get(f"session/info/{session}")
    finally:
        code, _, err = finish(holder)
    assert code == 75, err

