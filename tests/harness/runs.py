"""Running consulrun as the units do, and reading what it left in Consul: the helpers tests share.

`consulrun(...)` starts `python -m consulrun` as a separate process (a wrapper is a process of its own: it
takes signals, forks its job and can be SIGKILLed); `cli(...)` runs a command in-process through click's
runner, for what only reads or prints.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.protocol import keys as kvkeys
from tests.harness.agents import Agent

REPO = Path(__file__).resolve().parents[2]


def consulrun(*args: str, env: dict[str, str] | None = None, netns: str | None = None,
              **kwargs: Any) -> subprocess.Popen[str]:
    """`consulrun ARGS` as its own process (in network namespace `netns`, if given)."""
    cmd = [sys.executable, "-m", "consulrun", *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = str(REPO)
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}  # a test may send a stream elsewhere
    return subprocess.Popen(cmd, env=full_env, text=True, **kwargs)


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    """Wait for `proc`: (exit status, stdout, stderr)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`consulrun ARGS` in this process: (exit status, stdout, stderr)."""
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def kv_entry(agent: Agent, key: str) -> dict[str, Any] | None:
    """The KV entry of `key` as Consul returns it, or None."""
    response = requests.get(f"{agent.url}/v1/kv/{key}", timeout=10)
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return response.json()[0]


def kv_json(agent: Agent, key: str) -> Any:
    """The JSON value of `key`, or None."""
    entry = kv_entry(agent, key)
    return json.loads(base64.b64decode(entry["Value"])) if entry and entry.get("Value") else None


def kv_keys(agent: Agent, prefix: str) -> list[str]:
    """The keys under `prefix` (none: an empty list)."""
    response = requests.get(f"{agent.url}/v1/kv/{prefix}", params={"keys": "true"}, timeout=10)
    if response.status_code == 404:
        return []
    response.raise_for_status()
    return response.json()


SKIP = 42  # a skip code no test job uses, so "skipped" is never confused with "ran"
# The latest occurrence of a yearly schedule is the same all year: stable for a test, yet a real schedule.
YEARLY = "*-01-01 00:00:00 UTC"


# The lock's KV entry (its Session, its Value): `kv_entry`, under the name the lock tests give it.
lock_entry = kv_entry


def gated_job(started: Path, go: Path) -> list[str]:
    """A job that says it started (`started`) and runs until the test lets it end (`go`)."""
    return ["sh", "-c", f"touch {started}; while [ ! -e {go} ]; do sleep 0.1; done"]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def raft_applied(agent: Agent) -> int:
    return int(agent.get("agent/self")["Stats"]["raft"]["applied_index"])


def sessions(agent: Agent) -> list[dict]:
    return agent.get("session/list")


def write_manifest(tmp_path: Path, jobs: str, consul: str = "") -> Path:
    path = tmp_path / "jobs.yaml"
    path.write_text(f"{consul}jobs:\n{jobs}")
    return path


def history(agent: Agent, job: str) -> dict[str, dict]:
    entries = agent.get(f"kv/consulrun/{job}/history/", params={"recurse": "true"})
    return {kvkeys.history_order(e["Key"])[0] + (kvkeys.MANUAL if kvkeys.is_manual(e["Key"]) else ""):
            json.loads(base64.b64decode(e["Value"])) for e in entries}


def skip_writes(agent: Agent, args: list[str], env: dict[str, str] | None = None) -> tuple[list[int], list[str]]:
    """Raft writes of three skipping runs (the agent's own writes may land in one window, not in all)."""
    deltas, errs = [], []
    for _ in range(3):
        before = raft_applied(agent)
        code, _, err = finish(consulrun(*args, env=env))
        deltas.append(raft_applied(agent) - before)
        assert code == SKIP, err
        errs.append(err)
    return deltas, errs


def fake_root(tmp_path: Path) -> tuple[Path, str]:
    """An image root with an executable consulrun inside, where the units would call it."""
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    inside = root / "usr" / "bin" / "consulrun"
    inside.write_text("#!/bin/sh\n")
    inside.chmod(0o755)
    return root, "/usr/bin/consulrun"
