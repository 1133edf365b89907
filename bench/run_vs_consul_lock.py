"""Benchmark: `consulrun run J -- true` against `consul lock P true`, same agent, same built binary.

Measures, interleaved round by round so machine noise hits both alike:
  * wall time of a winning run (lock free: acquire, run `true`, release);
  * Raft writes per winning run and per losing attempt (lock held elsewhere),
    read from the server's applied Raft index, with coordinate updates off so
    nothing else writes.

Usage: python bench/run_vs_consul_lock.py [--rounds N]   (prints a Markdown report)
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.agents import Agent, consul_binary, start_dev_agent, wait_for  # noqa: E402


def applied(agent: Agent) -> int:
    return int(agent.get("agent/self")["Stats"]["raft"]["applied_index"])


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True)
    return time.perf_counter() - start, result.returncode


def writes(agent: Agent, cmd: list[str], env: dict[str, str]) -> int:
    before = applied(agent)
    subprocess.run(cmd, env=env, capture_output=True)
    return applied(agent) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    binary = consul_binary()
    agent = start_dev_agent(binary, Path(tempfile.mkdtemp(prefix="bench-")), extra_config={"disable_coordinates": True})
    env = {**os.environ, "CONSUL_HTTP_ADDR": agent.http_addr}
    consulrun = [sys.executable, "-m", "consulrun", "run"]
    ours = [*consulrun, "bench", "--", "true"]
    theirs = [binary, "lock", "bench-lock", "true"]
    try:
        for cmd in (ours, theirs):  # warm caches once
            subprocess.run(cmd, env=env, capture_output=True, check=True)
        times: dict[str, list[float]] = {"consulrun": [], "consul lock": []}
        win_writes: dict[str, list[int]] = {"consulrun": [], "consul lock": []}
        for round_no in range(args.rounds):
            order = [("consulrun", ours), ("consul lock", theirs)]
            if round_no % 2:
                order.reverse()
            for name, cmd in order:
                elapsed, code = timed(cmd, env)
                assert code == 0, (name, code)
                times[name].append(elapsed)
                win_writes[name].append(writes(agent, cmd, env))
        lose_writes = {"consulrun": [], "consul lock": []}
        holders = {
            "consulrun": ([*consulrun, "bench", "--", "sleep", "600"], [*consulrun, "bench", "--", "true"], "consulrun/bench/lock"),
            "consul lock": ([binary, "lock", "bench-lock", "sleep 600"], [binary, "lock", "-timeout=10ms", "bench-lock", "true"],
                            "bench-lock/.lock"),
        }
        for name, (hold, lose, key) in holders.items():
            holder = subprocess.Popen(hold, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_for(lambda k=key: (agent.api("GET", f"kv/{k}").json()[0].get("Session")), 20, f"{name} holder")
            for _ in range(min(args.rounds, 10)):
                lose_writes[name].append(writes(agent, lose, env))
            holder.send_signal(signal.SIGTERM)
            holder.wait(timeout=30)
    finally:
        agent.stop()

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"Rounds: {args.rounds} (interleaved, alternating order), one dev agent, Consul v1.16.3 built by scripts/consul-binary\n")
    print("| | consulrun run | consul lock | ratio consulrun/consul lock |")
    print("|---|---|---|---|")
    print(f"| winner wall time, median | {med['consulrun'] * 1000:.0f} ms | {med['consul lock'] * 1000:.0f} ms | "
          f"{med['consulrun'] / med['consul lock']:.2f} |")
    for label, key in (("winner wall time, min", min), ("winner wall time, max", max)):
        a, b = key(times["consulrun"]), key(times["consul lock"])
        print(f"| {label} | {a * 1000:.0f} ms | {b * 1000:.0f} ms | {a / b:.2f} |")
    for label, data in (("Raft writes per winning run", win_writes), ("Raft writes per losing attempt", lose_writes)):
        a, b = statistics.mean(data["consulrun"]), statistics.mean(data["consul lock"])
        ratio = f"{a / b:.2f}" if b else "n/a"
        print(f"| {label} (mean; min-max) | {a:.1f} ({min(data['consulrun'])}-{max(data['consulrun'])}) | "
              f"{b:.1f} ({min(data['consul lock'])}-{max(data['consul lock'])}) | {ratio} |")


if __name__ == "__main__":
    main()
