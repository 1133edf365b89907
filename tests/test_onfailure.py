"""`on_failure:` through systemd's own OnFailure=, in a booted systemd container with a Consul agent."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.harness.agents import wait_for
from tests.harness.nodes import CONSULRUN, agent_node, install, manifest
from tests.harness.nspawn import Container

pytestmark = [pytest.mark.systemd, pytest.mark.consul]

# What the on_failure command saw: its CONSULRUN_* variables and its standard input, as JSON in /shared.
RECORD = ("import json, os, sys; facts = {k: v for k, v in os.environ.items() if k.startswith('CONSULRUN_')}; "
          "facts['stdin'] = sys.stdin.read(); path = '/shared/failed-' + os.environ['CONSULRUN_JOB']; "
          "json.dump(facts, open(path + '.tmp', 'w')); os.rename(path + '.tmp', path)")
SKIP = 42


@pytest.fixture(scope="module")
def node(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """One booted node with its own Consul dev agent and the jobs below installed (timers not started)."""
    with agent_node(consul_bin, tmp_path_factory.mktemp("onfailure"), "10.213.86.0/24", "f") as ctr:
        _install_jobs(ctr)
        yield ctr


def _install_jobs(ctr: Container) -> None:
    jobs = {
        "failing": {"command": ["sh", "-c", "echo boom on $CONSULRUN_OCCURRENCE; exit 3"]},
        "slow": {"command": ["sleep", "600"], "timeout": "2s"},
        "fenced": {"command": ["sh", "-c", "touch /shared/fenced-started; exec sleep 600"]},
        "skipper": {"command": ["true"], "lock": {"skip_exit_code": SKIP}},
        "fine": {"command": ["true"], "on_failure": ["sh", "-c", "touch /shared/fine-notified"]},
        "takeover": {"command": ["sh", "-c", "exit 3"], "on_holder_loss": "retry"},
        # retries: the unit fails, and OnFailure= fires, only if the last attempt fails (issue 29, item 1).
        "doomed": {"command": ["sh", "-c", "echo attempt $CONSULRUN_ATTEMPT >> /shared/doomed-runs; exit 3"],
                   "retries": {"attempts": 3, "backoff": "2s"}},
        "flaky": {"command": ["sh", "-c", "echo attempt $CONSULRUN_ATTEMPT >> /shared/flaky-runs; "
                                          "[ $CONSULRUN_ATTEMPT -ge 2 ]"], "retries": {"attempts": 3, "backoff": "1s"}},
        # issue 29, item 7: the final ping carries the run's last journal lines (the monitor: MONITOR below).
        "posted": {"command": ["sh", "-c", "for i in 1 2 3 4 5 6 7 8; do echo output line $i; done; exit 4"],
                   "ping_url": "http://127.0.0.1:8765/ping/c0ffee", "ping_output_lines": 4},
        # Every 4 s: a run that cannot reach Consul retries for at most half that (2 s) before exiting 69.
        "outage": {"command": ["true"], "schedule": "*:*:0/4",
                   "on_failure": ["sh", "-c", "echo $CONSULRUN_EXIT_STATUS >> /shared/outage-told"]},
    }
    for job in jobs.values():
        job.setdefault("schedule", "*-*-* 00:00:00")  # today's midnight is the occurrence; the timer never fires in the test
    text = manifest(jobs, defaults={"lock": {"ttl": "10s", "lock_delay": "5s"}, "timer": {"accuracy": "1s"},
                                    "on_failure": ["/usr/bin/python3", "-c", RECORD]})
    result = install(ctr, text, "--no-start")
    assert result.returncode == 0, result.stderr


# A Healthchecks.io stand-in inside the node: each request's method, path and body as JSON, one file each.
MONITOR = ("import http.server, json, itertools\n"
           "n = itertools.count()\n"
           "class H(http.server.BaseHTTPRequestHandler):\n"
           "    def do_GET(self):\n"
           "        body = self.rfile.read(int(self.headers.get('Content-Length') or 0)).decode()\n"
           "        json.dump([self.command, self.path, body], open(f'/shared/ping-{next(n)}', 'w'))\n"
           "        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers()\n"
           "        self.wfile.write(b'OK')\n"
           "    do_POST = do_GET\n"
           "http.server.HTTPServer(('127.0.0.1', 8765), H).serve_forever()\n")


def test_the_final_ping_carries_the_runs_last_journal_lines(node: Container) -> None:
    node.exec("systemd-run", "--unit", "monitor", "/usr/bin/python3", "-c", MONITOR)
    wait_for(lambda: node.exec("python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 8765))",
                               check=False).returncode == 0, 30, "the monitor listening")
    assert node.systemctl("start", "consulrun-posted.service", check=False).returncode != 0
    pings = wait_for(lambda: len(list(node.shared.glob("ping-*"))) >= 2 and
                     [json.loads(p.read_text()) for p in sorted(node.shared.glob("ping-*"))], 30, "two pings")
    (start_method, start_path, start_body), (method, path, body) = pings
    assert (start_method, start_body) == ("GET", "") and start_path.startswith("/ping/c0ffee/start?rid=")
    assert method == "POST" and path.startswith("/ping/c0ffee/4?rid=")
    # The last 4 lines of this invocation's journal, in order: the job's last output, then the wrapper's lines
    # up to the release (what journald stored when the run ended: the wrapper waits for its own mark).
    assert body.splitlines() == ["output line 7", "output line 8", "consulrun: posted: job exited with status 4",
                                 "consulrun: posted: released consulrun/posted/lock"], body


def notified(node: Container, job: str) -> dict:
    path = node.shared / f"failed-{job}"
    return wait_for(lambda: path.exists() and json.loads(path.read_text()), 60, f"the on_failure command of {job}")


def test_failed_job_runs_on_failure_with_what_happened(node: Container) -> None:
    assert node.systemctl("start", "consulrun-failing.service", check=False).returncode != 0
    facts = notified(node, "failing")
    assert facts["CONSULRUN_JOB"] == "failing"
    assert facts["CONSULRUN_UNIT"] == "consulrun-failing.service"
    assert (facts["CONSULRUN_RESULT"], facts["CONSULRUN_EXIT_STATUS"]) == ("exit-code", "3")
    # Consul's name for the node (agent_node starts its agent as `solo`), as the rest of consulrun names nodes;
    # it used to be the host name.
    assert facts["CONSULRUN_NODE"] == "solo" != node.name
    assert facts["CONSULRUN_OCCURRENCE"].endswith("T00:00:00Z")
    assert facts["CONSULRUN_INVOCATION_ID"] == node.systemctl(
        "show", "-P", "InvocationID", "consulrun-failing.service").stdout.strip()
    assert f"boom on {facts['CONSULRUN_OCCURRENCE']}" in facts["CONSULRUN_JOURNAL"]
    assert "job exited with status 3" in facts["CONSULRUN_JOURNAL"]
    assert facts["stdin"] == facts["CONSULRUN_JOURNAL"] + "\n"


def test_timed_out_job_notifies(node: Container) -> None:
    assert node.systemctl("start", "consulrun-slow.service", check=False).returncode != 0
    facts = notified(node, "slow")
    assert facts["CONSULRUN_RESULT"] == "timeout"


def test_lost_job_notifies(node: Container) -> None:
    node.systemctl("start", "--no-block", "consulrun-fenced.service")
    wait_for(lambda: (node.shared / "fenced-started").exists(), 30, "the fenced job to start")
    node.exec(CONSULRUN, "unlock", "fenced", "--yes", "--force")
    facts = notified(node, "fenced")
    assert (facts["CONSULRUN_RESULT"], facts["CONSULRUN_EXIT_STATUS"]) == ("exit-code", "75")
    assert "lock lost" in facts["CONSULRUN_JOURNAL"] and facts["CONSULRUN_NODE"] == "solo"


def test_success_and_skip_never_notify(node: Container) -> None:
    assert node.systemctl("start", "consulrun-fine.service").returncode == 0
    assert node.systemctl("start", "consulrun-skipper.service").returncode == 0  # runs today's occurrence
    assert node.systemctl("start", "consulrun-skipper.service").returncode == 0  # already done: skips with 42
    assert node.systemctl("show", "-P", "ExecMainStatus", "consulrun-skipper.service").stdout.strip() == str(SKIP)
    # OnFailure= is queued by the unit's own transition to failed; both units ended without one.
    for job in ("fine", "skipper"):
        assert node.systemctl("show", "-P", "Result", f"consulrun-{job}.service").stdout.strip() == "success"
        assert node.systemctl("show", "-P", "InvocationID", f"consulrun-onfailure@{job}.service").stdout.strip() == ""
    assert not (node.shared / "fine-notified").exists()
    assert not (node.shared / "failed-skipper").exists()


def test_a_takeover_that_fails_names_its_occurrence_exactly(node: Container, consul_bin: str) -> None:
    """The takeover's `acquired` line goes on after the occurrence (`..., taking over from a dead runner (node ...`); the
    handler is given the occurrence alone, never with the prose's comma."""
    from datetime import datetime, timezone

    from consulrun.manifest import calendar

    occurrence = calendar.occurrence_id(calendar.previous(["*-*-* 00:00:00"], datetime.now(timezone.utc)))
    lost = {"occurrence": occurrence, "state": "lost", "node": "elsewhere", "attempt": 1, "reason": "fenced"}
    node.exec(consul_bin, "kv", "put", "consulrun/takeover/occurrence", json.dumps(lost))
    assert node.systemctl("start", "consulrun-takeover.service", check=False).returncode != 0
    facts = notified(node, "takeover")
    assert "taking over from a dead runner" in facts["CONSULRUN_JOURNAL"], facts["CONSULRUN_JOURNAL"]
    assert facts["CONSULRUN_OCCURRENCE"] == occurrence, facts["CONSULRUN_OCCURRENCE"]
    assert (facts["CONSULRUN_RESULT"], facts["CONSULRUN_EXIT_STATUS"]) == ("exit-code", "3")


def _journal(node: Container, unit: str) -> str:
    return node.exec("journalctl", "--no-pager", "-q", "-o", "cat", "-u", unit, check=False).stdout


def test_on_failure_fires_once_after_the_last_attempt_and_not_for_a_retried_one(node: Container) -> None:
    """`doomed` fails all three attempts: nothing is told during the backoff after the first, one notification
    after the third, with its status. `flaky` fails once and succeeds on the retry: the unit succeeds, no
    notification."""
    node.systemctl("start", "--no-block", "consulrun-doomed.service")
    wait_for(lambda: "attempt 1 of 3 failed (exit status 3); retrying in 2s" in _journal(
        node, "consulrun-doomed.service"), 60, "the first attempt to fail")
    assert not (node.shared / "failed-doomed").exists()  # a retried attempt is no failure of the unit
    assert node.systemctl("is-active", "consulrun-doomed.service", check=False).stdout.strip() == "activating"
    facts = notified(node, "doomed")
    assert (node.shared / "doomed-runs").read_text().split("\n")[:3] == ["attempt 1", "attempt 2", "attempt 3"]
    assert (facts["CONSULRUN_RESULT"], facts["CONSULRUN_EXIT_STATUS"]) == ("exit-code", "3")
    last = "attempt 3 of 3 failed (exit status 3); no retry: it was the last of 3 attempts"
    assert last in facts["CONSULRUN_JOURNAL"], facts["CONSULRUN_JOURNAL"]
    wait_for(lambda: node.ended("consulrun-onfailure@doomed.service"), 60, "the handler to end")
    assert _journal(node, "consulrun-onfailure@doomed.service").count("running the on_failure command") == 1

    assert node.systemctl("start", "consulrun-flaky.service").returncode == 0
    assert (node.shared / "flaky-runs").read_text().split() == ["attempt", "1", "attempt", "2"]
    assert node.systemctl("show", "-P", "Result", "consulrun-flaky.service").stdout.strip() == "success"
    assert node.systemctl("show", "-P", "InvocationID", "consulrun-onfailure@flaky.service").stdout.strip() == ""
    assert not (node.shared / "failed-flaky").exists()


def _agent_down(node: Container, down: bool) -> None:
    """The outage job's agent address: a port nothing listens on (its agent down), or the agent again."""
    dropin = node.unit_dir / "consulrun-outage.service.d"
    if down:
        dropin.mkdir(exist_ok=True)
        (dropin / "agent-down.conf").write_text("[Service]\nEnvironment=CONSUL_HTTP_ADDR=127.0.0.1:1\n")
    else:
        (dropin / "agent-down.conf").unlink()
    node.systemctl("daemon-reload")


def _handled(node: Container, count: int) -> None:
    """Wait until the outage job's OnFailure= handler has ended `count` times (told or kept quiet)."""
    def ends() -> int:
        out = node.exec("journalctl", "--no-pager", "-q", "-o", "cat", "-u", "consulrun-onfailure@outage.service",
                        check=False).stdout
        return sum(1 for line in out.splitlines() if "running the on_failure command" in line
                   or "not running the on_failure command again" in line)

    wait_for(lambda: ends() >= count and node.ended("consulrun-onfailure@outage.service"), 60,
             f"{count} ends of the outage handler")


def test_an_outage_is_told_once_not_once_per_run(node: Container) -> None:
    """Three runs while the agent is down: one notification. A run that reaches Consul ends the outage; the next
    69 starts another, told again."""
    told = node.shared / "outage-told"
    told.unlink(missing_ok=True)
    _agent_down(node, True)
    try:
        for count in (1, 2, 3):
            assert node.systemctl("start", "consulrun-outage.service", check=False).returncode != 0
            assert node.systemctl("show", "-P", "ExecMainStatus", "consulrun-outage.service").stdout.strip() == "69"
            _handled(node, count)
        assert told.read_text().split() == ["69"], told.read_text()
        quiet = node.exec("journalctl", "--no-pager", "-q", "-o", "cat", "-u", "consulrun-onfailure@outage.service",
                          check=False).stdout
        assert quiet.count("outage: Consul is still unavailable (exit status 69), as told at ") == 2, quiet
        _agent_down(node, False)
        assert node.systemctl("start", "consulrun-outage.service").returncode == 0  # reaches Consul: outage over
        _agent_down(node, True)
        assert node.systemctl("start", "consulrun-outage.service", check=False).returncode != 0
        _handled(node, 4)
        assert told.read_text().split() == ["69", "69"], told.read_text()
    finally:
        if (node.unit_dir / "consulrun-outage.service.d" / "agent-down.conf").exists():
            _agent_down(node, False)
