"""Benchmark: Consul Raft writes per scheduled occurrence as the number of nodes grows.

For N contenders (1, 3, 10, 30) started at once for one occurrence, counts the
Raft entries the server applies (coordinate updates off, so nothing else
writes) and how many times the job ran, for:
  * consulrun run --schedule SPEC J -- true
  * consul lock P true              (as its docs show it: waits, so every node runs in turn)
  * consul lock -timeout=10ms P true (try once: the closest `consul lock` gets to "skip if taken")

Usage: python bench/occurrence_writes.py [--nodes 1,3,10,30]   (prints a Markdown table)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.agents import Agent, consul_binary, start_dev_agent  # noqa: E402

SPEC = "*-01-01 00:00:00 UTC"


def applied(agent: Agent) -> int:
    return int(agent.get("agent/self")["Stats"]["raft"]["applied_index"])


def contend(agent: Agent, cmds: list[list[str]], env: dict[str, str], runs_file: Path) -> tuple[int, int]:
    runs_file.write_text("")
    before = applied(agent)
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in cmds]
    for proc in procs:
        proc.wait(timeout=600)
    return applied(agent) - before, len(runs_file.read_text().split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,3,10,30")
    args = parser.parse_args()
    binary = consul_binary()
    tmp = Path(tempfile.mkdtemp(prefix="bench-occ-"))
    agent = start_dev_agent(binary, tmp, extra_config={"disable_coordinates": True})
    env = {**os.environ, "CONSUL_HTTP_ADDR": agent.http_addr}
    runs = tmp / "runs"
    job = f"echo x >> {runs}"
    rows = []
    try:
        for n in (int(x) for x in args.nodes.split(",")):
            ours = [[sys.executable, "-m", "consulrun", "run", "--schedule", SPEC, f"occ{n}", "--", "sh", "-c", job]] * n
            docs = [[binary, "lock", "-shell", f"lock{n}", job]] * n
            once = [[binary, "lock", "-shell", "-timeout=10ms", f"once{n}", job]] * n
            rows.append((n, contend(agent, ours, env, runs), contend(agent, docs, env, runs), contend(agent, once, env, runs)))
    finally:
        agent.stop()
    print("One dev agent, Consul v1.16.3; N processes started together for one occurrence.\n")
    print("| nodes | consulrun: writes (runs) | consul lock: writes (runs) | consul lock -timeout=10ms: writes (runs) "
          "| writes ratio consulrun / consul lock -timeout |")
    print("|---|---|---|---|---|")
    for n, (ow, orun), (dw, drun), (tw, trun) in rows:
        print(f"| {n} | {ow} ({orun}) | {dw} ({drun}) | {tw} ({trun}) | {ow / tw:.2f} |")


if __name__ == "__main__":
    main()
