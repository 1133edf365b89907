"""Benchmark: waiting through lock-delay after an invalidation, consulrun run --wait vs consul lock -timeout.

A holder's session (lock-delay L, TTL 10s) holds the key and is destroyed, as
when its node dies; a waiter then starts and must wait out lock-delay. Counts
the Raft entries the server applies while the waiter waits and runs `true`
(coordinate updates off, so nothing else writes), and the time from the
invalidation to the waiter's job start. L = 30s and 60s exceed 2 x TTL: a
waiter that did not renew its session would lose it before lock-delay ends.

With `--schedule`, consulrun waits as a unit's run does: `--schedule` (a yearly spec, so the occurrence's own
bound is far off), no `--wait`; each round a job of its own (one occurrence each).

Usage: python bench/lockdelay_wait.py [--delays 30,60] [--rounds 3] [--schedule]   (prints a Markdown table)
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.agents import Agent, consul_binary, start_dev_agent  # noqa: E402


def applied(agent: Agent) -> int:
    return int(agent.get("agent/self")["Stats"]["raft"]["applied_index"])


CONSUL_LOCK_FLAGS = 0x2DDCCBC058A50C18  # what `consul lock` marks its keys with (it refuses others)


def invalidated_holder(agent: Agent, key: str, delay_s: int) -> float:
    session = agent.api("PUT", "session/create", json={"TTL": "10s", "LockDelay": f"{delay_s}s"}).json()["ID"]
    flags = CONSUL_LOCK_FLAGS if key.endswith("/.lock") else 0
    assert agent.api("PUT", f"kv/{key}", params={"acquire": session, "flags": flags}, data=b"holder").json() is True
    agent.api("PUT", f"session/destroy/{session}")
    return time.time()


def trial(agent: Agent, cmd: list[str], key: str, delay_s: int, started: Path, env: dict[str, str]) -> tuple[int, float, int]:
    started.unlink(missing_ok=True)
    freed_at = invalidated_holder(agent, key, delay_s)
    before = applied(agent)
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    code = done.returncode
    with (started.parent / "stderr.log").open("a") as log:
        log.write(f"--- {' '.join(cmd[:8])}: exit {code}\n{done.stderr}")
    writes = applied(agent) - before
    latency = float(started.read_text()) - freed_at if started.exists() else float("nan")
    agent.api("DELETE", f"kv/{key}")
    return writes, latency, code


def summary(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", default="30,60")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedule", action="store_true", help="consulrun run --schedule, no --wait")
    args = parser.parse_args()
    binary = consul_binary()
    tmp = Path(tempfile.mkdtemp(prefix="bench-delay-"))
    agent = start_dev_agent(binary, tmp, extra_config={"disable_coordinates": True})
    env = {**os.environ, "CONSUL_HTTP_ADDR": agent.http_addr, "PYTHONPATH": str(REPO)}
    started = tmp / "started"
    job = f"date +%s.%N > {started}"
    rows = []
    try:
        for delay in (int(x) for x in args.delays.split(",")):
            ours, theirs = [], []
            for n in range(args.rounds):
                name = f"sched{delay}-{n}" if args.schedule else "waitjob"
                how = ["--schedule", "*-01-01 00:00:00 UTC"] if args.schedule else ["--wait", "3m"]
                ours.append(trial(agent, [sys.executable, "-m", "consulrun", "run", "--ttl", "10s", "--lock-delay",
                                          f"{delay}s", *how, name, "--", "sh", "-c", job],
                                  f"consulrun/{name}/lock", delay, started, env))
                theirs.append(trial(agent, [binary, "lock", "-shell", "-timeout=3m", "waitlock", job],
                                    "waitlock/.lock", delay, started, env))
            rows.append((delay, ours, theirs))
    finally:
        agent.stop()
    print(f"(stderr of every run: {tmp / 'stderr.log'})\n")
    print(f"One dev agent, Consul v1.16.3; holder session (TTL 10s) invalidated; {args.rounds} rounds each, "
          "median (min-max).\n")
    print("| lock-delay | consulrun: Raft writes | consul lock: Raft writes | writes ratio | "
          "consulrun: start after invalidation | consul lock: start after invalidation | exits (ours / theirs) |")
    print("|---|---|---|---|---|---|---|")
    for delay, ours, theirs in rows:
        ratio = statistics.median(w for w, _, _ in ours) / max(1, statistics.median(w for w, _, _ in theirs))
        print(f"| {delay}s | {summary([w for w, _, _ in ours], '{:.0f}')} | {summary([w for w, _, _ in theirs], '{:.0f}')} "
              f"| {ratio:.2f} | {summary([l for _, l, _ in ours], '{:.1f}s')} | {summary([l for _, l, _ in theirs], '{:.1f}s')} "
              f"| {sorted({c for _, _, c in ours})} / {sorted({c for _, _, c in theirs})} |")


if __name__ == "__main__":
    main()
