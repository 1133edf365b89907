"""`consulrun run`'s refusals and documented exit statuses that need no cluster: 2, 70, 127.

Range refusals run in-process; an accepted value goes on to Consul, which is
pointed at a port nobody listens on, so "accepted" shows as 69 and "refused"
as 2 with its message. Exit 70 is a real HTTP server on loopback that answers
what Consul never would.
"""

from __future__ import annotations

import http.server
import base64
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from consulrun.cli import main
from tests.harness.agents import Agent, free_port

REPO = Path(__file__).resolve().parents[1]


def cli_run(*args: str, addr: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["run", *args], env={"CONSUL_HTTP_ADDR": addr or f"127.0.0.1:{free_port()}"})
    return result.exit_code, result.stdout, result.stderr


def consulrun(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("CONSUL_")}, **env, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "consulrun", *args], env=full, capture_output=True, text=True,
                          timeout=60)


# (option, value on the edge (accepted), value past it (refused), words of the refusal)
EDGES = [
    ("--ttl", "10s", "5s", "--ttl: 5s is out of range: must be 10s to 24h"),
    ("--ttl", "10s", "9999ms", "--ttl: 9s999ms is out of range: must be 10s to 24h"),
    ("--ttl", "24h", "24h1ms", "--ttl: 24h1ms is out of range: must be 10s to 24h"),
    ("--lock-delay", "5s", "2s", "--lock-delay: 2s is out of range: must be 5s to 1m"),
    ("--lock-delay", "5s", "0", "--lock-delay: 0s is out of range: must be 5s to 1m"),
    ("--lock-delay", "60s", "60001ms", "--lock-delay: 1m1ms is out of range: must be 5s to 1m"),
    ("--concurrency", "1", "0", "'--concurrency': 0 is not in the range 1<=x<=1000"),
    ("--concurrency", "1000", "1001", "'--concurrency': 1001 is not in the range 1<=x<=1000"),
    ("--skip-exit-code", "255", "256", "'--skip-exit-code': 256 is not in the range 0<=x<=255"),
    ("--skip-exit-code", "0", "-1", "'--skip-exit-code': -1 is not in the range 0<=x<=255"),
    ("--history", "1", "0", "'--history': 0 is not in the range 1<=x<=1000"),
    ("--history", "1000", "1001", "'--history': 1001 is not in the range 1<=x<=1000"),
    ("--wait", "0", "5 mintues", "--wait: '5 mintues' is not a duration (e.g. 500ms, 15s, 1m30s, 1h 30min)"),
    ("--on-holder-loss", "retry", "sometimes", "'sometimes' is not one of 'skip', 'retry'"),
]


@pytest.mark.parametrize(("option", "edge", "past", "words"), EDGES, ids=[f"{e[0]}={e[2]}" for e in EDGES])
def test_run_option_ranges(option: str, edge: str, past: str, words: str) -> None:
    code, out, err = cli_run(f"{option}={past}", "job", "--", "true")
    assert (code, out) == (2, ""), err
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, err  # one message (click puts a usage hint before its own)
    if words.startswith("--"):
        assert errors[0] == f"Error: {words}", err
    else:
        assert errors[0].startswith(f"Error: Invalid value for '{option}': ") and errors[0].rstrip(".").endswith(words), err
    code, _, err = cli_run(f"{option}={edge}", "job", "--", "true")
    assert code == 69 and "Consul agent not reachable" in err, err  # accepted: it went on to ask Consul


@pytest.mark.parametrize(("args", "words"), [
    (["--schedule", "hourly", "--concurrency", "2", "job", "--", "true"], "cannot be combined with --concurrency"),
    (["--schedule", "Mon *-*-* 25:00", "job", "--", "true"], "--schedule: "),
    (["bad/name", "--", "true"], "'bad/name'"),
    (["job", "--"], "no command given"),
], ids=["schedule-with-concurrency", "bad-schedule", "bad-job-name", "no-command"])
def test_run_usage_refusals(args: list[str], words: str) -> None:
    code, out, err = cli_run(*args)
    assert (code, out) == (2, ""), err
    assert err.startswith("Error: ") and words in err and err.count("\n") == 1, err


# --- 127: the job's command cannot be started ------------------------------------------------------------


@pytest.mark.consul
def test_missing_command_is_127_before_any_consul_write(consul: Agent) -> None:
    def kv_index() -> str:  # the KV table's index moves with every KV write, and only then
        return requests.get(f"{consul.url}/v1/kv/consulrun/?recurse", timeout=10).headers["X-Consul-Index"]

    before = kv_index()
    result = consulrun("run", "nojob", "--", "/no/such/program", "arg", env={"CONSUL_HTTP_ADDR": consul.http_addr})
    assert result.returncode == 127
    assert result.stderr == "Error: cannot start /no/such/program: not found or not executable\n"
    assert kv_index() == before
    assert consul.get("session/list") == []


@pytest.mark.consul
def test_command_that_fails_to_exec_is_127_and_leaves_the_lock_free(consul: Agent, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.write_text("#!/no/such/interpreter\n")
    broken.chmod(0o755)  # executable, so it passes the PATH check; exec(2) itself fails after the lock is taken
    result = consulrun("run", "brokenjob", "--", str(broken), env={"CONSUL_HTTP_ADDR": consul.http_addr})
    assert result.returncode == 127, result.stderr
    assert f"cannot start {broken}: No such file or directory" in result.stderr
    entry = consul.get("kv/consulrun/brokenjob/lock")[0]
    assert "Session" not in entry  # released
    last = json.loads(base64.b64decode(entry["Value"]))["last"]
    assert last["lost"] == f"cannot start {broken}: No such file or directory" and "exit_status" not in last, last
    assert consul.get("session/list") == []  # and its session destroyed


# --- 70: Consul answering garbage -------------------------------------------------------------------------

GOOD = {  # just enough of the agent to reach the step under test: a free lock, a node name, no checks
    ("GET", "/v1/kv/"): (404, b"", True),
    ("GET", "/v1/agent/self"): (200, json.dumps({"Config": {"NodeName": "garbage"}}).encode(), True),
    ("GET", "/v1/agent/checks"): (200, b"{}", True),
}
GARBAGE = {
    "kv-not-json": {("GET", "/v1/kv/"): (200, b"<html>hello</html>", True)},
    "kv-object-not-list": {("GET", "/v1/kv/"): (200, b'{"unexpected": true}', True)},
    "kv-entry-without-key": {("GET", "/v1/kv/"): (200, b'[{"Nope": 1}]', True)},
    "kv-no-index-header": {("GET", "/v1/kv/"): (200, b"[]", False)},
    "session-create-list": {("PUT", "/v1/session/create"): (200, b'["not", "an", "id"]', True)},
    "session-create-no-id": {("PUT", "/v1/session/create"): (200, b'{"Nope": "x"}', True)},
}


@pytest.fixture
def garbage_consul() -> Iterator[Callable[[dict], str]]:
    """A real HTTP server on loopback that answers like Consul except where told; returns its address."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def serve(routes: dict) -> str:
        table = {**GOOD, **routes}

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?", 1)[0]
                match = max((k for k in table if k[0] == self.command and path.startswith(k[1])),
                            key=lambda k: len(k[1]), default=None)
                status, body, index = table[match] if match else (404, b"", True)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if index:
                    self.send_header("X-Consul-Index", "7")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_DELETE = answer

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"127.0.0.1:{server.server_port}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_from_consul_is_70_and_nothing_runs(garbage_consul: Callable[[dict], str], case: str,
                                                     tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = consulrun("run", "job", "--", "touch", str(marker), env={"CONSUL_HTTP_ADDR": garbage_consul(GARBAGE[case])})
    assert result.returncode == 70, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("Error: ") and "unexpected answer from Consul" in result.stderr
    assert not marker.exists()
