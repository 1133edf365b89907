"""Benchmark: Raft writes per occurrence, and which node runs it, with every node's timer firing at once.

A real cluster: 3 servers and N client agents, each in its own network namespace (tests.harness.bigcluster),
coordinates off so the servers' Raft log counts only what the runs write. Each round is a new occurrence of one
job: `consulrun run --schedule` starts on every client in one burst (the spread of the starts is reported), and
the servers' applied index before and after gives the writes, a file the job appends to gives the runs. With
`--before DIR` (an earlier checkout, e.g. `git worktree add --detach DIR <commit>`) the same rounds run with that
tree too, interleaved, in the same run.

Then the spread: 10 jobs x 10 occurrences with 3 client nodes firing at once, and which node ran each.

Usage (root, the built Consul agent): python bench/ranked_writes.py [--nodes 3,10,30] [--rounds 10] [--before DIR]
(prints a Markdown report)
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.agents import consul_binary  # noqa: E402
from tests.harness.bigcluster import BigCluster, start_big_cluster  # noqa: E402
from tests.harness.netns import Network  # noqa: E402


def consulrun_cmd(tree: Path | None) -> list[str]:
    """What a node's unit runs: this checkout's consulrun, or an earlier tree's (-P: not the cwd first)."""
    if tree is None:
        return ["env", f"PYTHONPATH={REPO}", sys.executable, "-P", "-m", "consulrun"]
    return ["env", f"PYTHONPATH={tree}", sys.executable, "-P", "-m", "consulrun"]


def occurrence(cluster: BigCluster, nodes: list[int], cmd: list[str], spec: str, job: str,
               runs: Path) -> tuple[int, list[str], float]:
    """Start `job` on the given clients at once; (Raft writes, the nodes that ran it, spread of the starts in s)."""
    runs.write_text("")
    before = cluster.applied_index()
    procs, started = [], []
    for i in nodes:
        agent = cluster.clients[i]
        started.append(time.monotonic())
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", agent.netns, *cmd, "run", "--schedule", spec, job, "--", "sh", "-c",
             f"echo {agent.name} >> {runs}"],
            env={**os.environ, "CONSUL_HTTP_ADDR": "127.0.0.1:8500"}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
    for proc in procs:
        proc.wait(timeout=600)
    time.sleep(0.5)  # let every server apply what the leader committed
    after = cluster.applied_index()
    if before is None or after is None:
        raise SystemExit("the servers do not agree on an applied index")
    return after - before, runs.read_text().split(), started[-1] - started[0]


def settle(cluster: BigCluster, quiet_s: float = 5.0) -> None:
    """Wait until the cluster's own start-up writes (registrations, autopilot) have stopped for `quiet_s`."""
    last, since = cluster.applied_index(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.5)
        now = cluster.applied_index()
        if now != last:
            last, since = now, time.monotonic()


def cell(values: list[float]) -> str:
    return f"{min(values):g} / {statistics.median(values):g} / {max(values):g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="3,10,30")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--before", type=Path, help="an earlier checkout whose consulrun runs beside this one")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces)")
    binary = consul_binary()
    trees: dict[str, Path | None] = {"consulrun": None}
    if args.before:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(args.before / "consulrun")], check=True)
        trees["before"] = args.before
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "consulrun")], check=True)
    sizes = [int(x) for x in args.nodes.split(",")]
    writes: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    spreads: dict[int, list[float]] = collections.defaultdict(list)
    once = True
    landed: dict[str, collections.Counter[str]] = {}
    for n in sizes:
        tmp = Path(tempfile.mkdtemp(prefix=f"bench-ranked-{n}-"))
        network = Network(3 + n, subnet="10.213.90.0/24", tag="b").up()
        cluster = None
        try:
            cluster = start_big_cluster(binary, tmp, network, servers=3, clients=n)
            settle(cluster)
            for r in range(args.rounds):
                for name, tree in trees.items():  # interleaved: both trees see the same machine state
                    count, ran, spread = occurrence(cluster, list(range(n)), consulrun_cmd(tree),
                                                    "*-01-01 00:00:00 UTC", f"w{n}-{r}-{name}", tmp / "runs")
                    writes[(name, n)].append(count)
                    spreads[n].append(spread)
                    once = once and len(ran) == 1
            if n == 3:  # the spread of runs over the nodes: 10 jobs, 10 occurrences each, on these 3 clients
                for name, tree in trees.items():
                    landed[name] = collections.Counter()
                    for hour in range(10):
                        for j in range(10):
                            _, ran, _ = occurrence(cluster, [0, 1, 2], consulrun_cmd(tree),
                                                   f"*-01-01 {hour:02d}:00:00 UTC", f"s{j}-{name}", tmp / "runs")
                            once = once and len(ran) == 1
                            landed[name].update(ran)
        finally:
            if cluster:
                cluster.stop()
            network.down()
    print(f"3 Consul servers and N clients, each in its own network namespace; {args.rounds} rounds per size, "
          f"each a new occurrence; the job ran exactly once in every round: {'yes' if once else 'NO'}.\n")
    print("Raft writes per occurrence, min / median / max:\n")
    print("| client nodes | " + " | ".join(trees) + " | spread of the starts (s), min / median / max |")
    print("|---" * (len(trees) + 2) + "|")
    for n in sizes:
        print(f"| {n} | " + " | ".join(cell(writes[(name, n)]) for name in trees)
              + f" | {cell([round(s, 2) for s in spreads[n]])} |")
    if landed:
        print("\nWhere 100 occurrences (10 jobs x 10) ran, 3 client nodes firing at once (3 servers also members):\n")
        nodes = sorted({node for counter in landed.values() for node in counter})
        print("| tree | " + " | ".join(nodes) + " |")
        print("|---" * (len(nodes) + 1) + "|")
        for name, counter in landed.items():
            print(f"| {name} | " + " | ".join(str(counter[node]) for node in nodes) + " |")


if __name__ == "__main__":
    main()
