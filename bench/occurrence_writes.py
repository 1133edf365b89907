"""Benchmark: Consul Raft writes per scheduled occurrence as the number of nodes grows.

For N contenders (1, 3, 10, 30) started at once for one occurrence, counts the
Raft entries the server applies (coordinate updates off, so nothing else
writes) and how many times the job ran, for:
  * consulrun run --schedule SPEC J -- true
  * consulrun run --health-check --schedule SPEC J -- true  (the job's Consul health check set by the finish;
    the external node registered once beforehand, as the watchdog does)
  * consul lock P true              (as its docs show it: waits, so every node runs in turn)
  * consul lock -timeout=10ms P true (try once: the closest `consul lock` gets to "skip if taken")

Usage: python bench/occurrence_writes.py [--nodes 1,3,10,30] [--rounds R]   (prints a Markdown table)
With --rounds above 1, each cell is the median of R occurrences (min-max) and the most runs any round gave.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from consulrun.report import watchdog as health  # noqa: E402
from consulrun.consul.client import Client, ConsulConfig  # noqa: E402
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
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    binary = consul_binary()
    tmp = Path(tempfile.mkdtemp(prefix="bench-occ-"))
    agent = start_dev_agent(binary, tmp, extra_config={"disable_coordinates": True})
    env = {**os.environ, "CONSUL_HTTP_ADDR": agent.http_addr}
    runs = tmp / "runs"
    job = f"echo x >> {runs}"
    rows = []
    try:
        health.ensure_registered(Client(ConsulConfig(address=agent.http_addr)), "consulrun")  # the watchdog's write
        for n in (int(x) for x in args.nodes.split(",")):
            cells: list[list[tuple[int, int]]] = [[], [], [], []]
            for r in range(args.rounds):  # a fresh job name per round: each round is a new occurrence
                ours = [[sys.executable, "-m", "consulrun", "run", "--schedule", SPEC, f"occ{n}-{r}", "--", "sh", "-c",
                         job]] * n
                checked = [[sys.executable, "-m", "consulrun", "run", "--health-check", "--schedule", SPEC,
                            f"hc{n}-{r}", "--", "sh", "-c", job]] * n
                docs = [[binary, "lock", "-shell", f"lock{n}-{r}", job]] * n
                once = [[binary, "lock", "-shell", "-timeout=10ms", f"once{n}-{r}", job]] * n
                for samples, cmds in zip(cells, (ours, checked, docs, once)):
                    samples.append(contend(agent, cmds, env, runs))
                status = agent.get("health/checks/consulrun")
                if not any(c["Name"] == f"hc{n}-{r}" and c["Status"] == "passing" for c in status):
                    raise SystemExit(f"hc{n}-{r}: the health check was not set by the run")
            rows.append((n, *cells))
    finally:
        agent.stop()
    print("One dev agent, Consul v1.16.3; N processes started together for one occurrence.\n")
    print("| nodes | consulrun: writes (runs) | consulrun --health-check: writes (runs) | consul lock: writes (runs) "
          "| consul lock -timeout=10ms: writes (runs) | writes ratio consulrun / consul lock -timeout |")
    print("|---|---|---|---|---|---|")
    for n, ours, checked, docs, once in rows:
        print(f"| {n} | {cell(ours)} | {cell(checked)} | {cell(docs)} | {cell(once)} | "
              f"{statistics.median(w for w, _ in ours) / statistics.median(w for w, _ in once):.2f} |")


def cell(samples: list[tuple[int, int]]) -> str:
    """`writes (runs)`; over several rounds the median writes (min-max) and the most runs of any round."""
    writes = [w for w, _ in samples]
    spread = f" ({min(writes)}-{max(writes)})" if len(samples) > 1 else ""
    return f"{statistics.median(writes):g}{spread} ({max(r for _, r in samples)} runs)"


if __name__ == "__main__":
    main()
