"""Benchmark: consulrun at scale: 3 servers and N clients, every job on every client, jobs spread over the minute.

Each client is a Consul agent in its own network namespace
(tests.harness.bigcluster, Consul's default gossip timing); its "systemd" is
bench/scale_node.py in the same namespace, firing each job's wrapper at every
occurrence plus a random delay of at most --spread (RandomizedDelaySec=), so
every occurrence has N contenders. One runs the job (bash printing its start
time), the others skip. A phase is one tool at one load for --duration of
firings; with --peer consul-lock the same load is then driven through
`consul lock -timeout=10ms` (try once, the closest it has to "skip if taken";
bench/hot_path.py's peer) on the same cluster, in alternating order per load.

Measured per phase: Raft writes (the servers' applied index, before and after
the drain), the lag from occurrence time to the job's start on the winner
(p50/p99/max), each wrapper's CPU (wait4(2) on the node), the leader's and
every agent's CPU (/proc/PID/stat), and the machine's (/proc/stat). Loads go
up the --jobs-per-minute list until the lag's p99 passes 1 s (the knee; all
of them with --all-levels). A phase is stopped early when occurrences stay
unstarted past --abort-lag or memory runs short, and says so; a node
starts no wrapper while --max-live-per-node of its own live (thirty nodes
share this machine's memory), and a phase where that happened is past the
knee.

Everything it starts is stopped by PID, and the namespaces, veths and the
bridge are removed on the way out, also on Ctrl-C, SIGTERM or SIGHUP.

Usage (root): python bench/scale.py --out DIR [--clients 10,30] [--jobs-per-minute 25,50,100,250,500,1000]
              [--duration 60s] [--peer consul-lock|none] [--spread 100ms] [--all-levels] [--always 1000]
(writes DIR/report.md, DIR/phases.jsonl and each phase's raw records; prints the report)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.procs import Stopped as _Stop, stop_on_signal as _on_signal  # noqa: E402
from bench.scale_report import markdown, parse_runs, past_knee, phase_figures  # noqa: E402
from consulrun.manifest.durations import DurationError, parse_duration  # noqa: E402
from tests.harness.agents import consul_binary  # noqa: E402
from tests.harness.bigcluster import BigCluster, start_big_cluster  # noqa: E402
from tests.harness.netns import Network  # noqa: E402

NODE_SCRIPT = REPO / "bench" / "scale_node.py"
SUBNET = "10.213.92.0/24"  # moved by CONSULRUN_TEST_NET_PREFIX like the test harness's subnets
JOB_SCRIPT = 'printf "%s %s %s %s %s %s\\n" "$EPOCHREALTIME" "$2" "$3" "$4" "$5" "${CONSULRUN_OCCURRENCE:--}" >> "$1"'
TICK = os.sysconf("SC_CLK_TCK")


def say(text: str) -> None:
    print(f"scale {time.strftime('%H:%M:%S')}: {text}", file=sys.stderr, flush=True)


def process_cpu_s(pid: int) -> float:
    """User + system CPU of a live process so far (0 if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    return total - idle, total


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def settle(cluster: BigCluster, quiet_s: float = 3.0, at_most_s: float = 90.0) -> None:
    """Wait until no session is left and no Raft write has landed for `quiet_s`: the last phase's tail must not be
    counted in the next (a wrapper killed when a phase was stopped leaves its session to expire by TTL: a write)."""
    last, since, start = cluster.applied_index(), time.monotonic(), time.monotonic()
    while time.monotonic() - start < at_most_s:
        time.sleep(0.5)
        now = cluster.applied_index()
        if now != last:
            last, since = now, time.monotonic()
        if time.monotonic() - since >= quiet_s and not cluster.servers[0].get("session/list"):
            return
    say(f"the cluster did not settle within {at_most_s:g} s (sessions left, or writes still landing)")


def occurrence_id(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))  # consulrun.manifest.calendar.occurrence_id


def plan_jobs(jobs_per_minute: int, tag: str) -> list[tuple[str, int]]:
    """(job name, second of the minute): `jobs_per_minute` jobs spread evenly over the minute's 60 seconds."""
    return [(f"{tag}{jobs_per_minute}-{i:04d}", i * 60 // jobs_per_minute) for i in range(jobs_per_minute)]


def plan_occurrences(jobs: list[tuple[str, int]], t0: int, window_s: float) -> dict[tuple[str, str], float]:
    """Every (job, occurrence id) -> occurrence time in [t0, t0 + window_s)."""
    found = {}
    for job, second in jobs:
        when = t0 + (second - t0) % 60
        while when < t0 + window_s:
            found[(job, occurrence_id(when))] = float(when)
            when += 60
    return found


class Bench:
    """One run: the settings, the tools' command lines, and the phases measured so far."""

    def __init__(self, args: argparse.Namespace, binary: str, script: str) -> None:
        self.args, self.binary, self.script = args, binary, script
        self.rng = random.Random(args.seed)
        self.launchers: list[subprocess.Popen[bytes]] = []
        self.phases: list[dict[str, Any]] = []
        self.idle_rate: dict[str, float] = {}  # each agent's CPU-s per s on the idle cluster

    def argv(self, tool: str, job: str, second: int, occ: str, node: str, runs: Path) -> list[str]:
        tail = ["/bin/bash", "-c", JOB_SCRIPT, "job", str(runs), tool.replace(" ", "-"), job, occ, node]
        if tool == "consulrun":
            return [self.script, "run", "--prefix", "scale", "--schedule", f"*-*-* *:*:{second:02d} UTC", job, "--",
                    *tail]
        return [self.binary, "lock", "-shell=false", "-timeout=10ms", f"scale-lock/{job}", *tail]

    def phase(self, cluster: BigCluster, tool: str, jobs_per_minute: int) -> dict[str, Any]:
        """Fire one tool at one load on every client for the window, drain, and measure."""
        args, clients = self.args, len(cluster.clients)
        folder = args.out / f"{clients}c-{jobs_per_minute}-{tool.replace(' ', '-')}"
        folder.mkdir(parents=True, exist_ok=True)
        runs = folder / "runs.log"
        runs.write_text("")
        jobs = plan_jobs(jobs_per_minute, "r" if tool == "consulrun" else "l")
        seconds = dict(jobs)
        t0 = math.ceil(time.time() + 3 + 0.1 * clients)  # the node timers' own start-up first
        occurrences = plan_occurrences(jobs, t0, args.window_s)
        env = {"PATH": "/usr/bin:/bin", "CONSUL_HTTP_ADDR": "127.0.0.1:8500"}
        for agent in cluster.clients:
            firings = sorted([when + self.rng.uniform(0, args.spread_s), job, occ,
                              self.argv(tool, job, seconds[job], occ, agent.name, runs)]
                             for (job, occ), when in occurrences.items())
            plan = {"node": agent.name, "env": env, "stderr": str(folder / f"{agent.name}.stderr"),
                    "drain_s": args.drain_s, "max_live": args.max_live_per_node, "firings": firings}
            (folder / f"{agent.name}.plan.json").write_text(json.dumps(plan))
        leader = cluster.leader()
        if leader is None:
            raise RuntimeError("no Raft leader before the phase")
        agents = {a.name: a.process.pid for a in cluster.agents}
        load_start = os.getloadavg()[0]
        with (folder / "timers.log").open("ab") as timers_log:
            self.launchers = [subprocess.Popen(
                ["ip", "netns", "exec", str(agent.netns), sys.executable, str(NODE_SCRIPT),
                 str(folder / f"{agent.name}.plan.json"), str(folder / f"{agent.name}.jsonl")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=timers_log,
                start_new_session=True) for agent in cluster.clients]
        say(f"{clients} clients, {jobs_per_minute} jobs/min, {tool}: {len(occurrences)} occurrences from "
            f"{time.strftime('%H:%M:%S', time.localtime(t0))}")
        time.sleep(max(0.0, t0 - 0.1 - time.time()))  # the counters start with the first occurrence
        before = {"t": time.time(), "applied": cluster.applied_index(), "machine": machine_ticks(),
                  "cpu": {name: process_cpu_s(pid) for name, pid in agents.items()}, "load": load_start,
                  "self": self_cpu_s()}
        aborted, timers_cpu = self.watch(occurrences, runs)
        time.sleep(1.0)  # let every server apply what the leader committed
        after = {"t": time.time(), "applied": cluster.applied_index(), "machine": machine_ticks(),
                 "cpu": {name: process_cpu_s(pid) for name, pid in agents.items()}, "load": os.getloadavg()[0],
                 "self": self_cpu_s()}
        wrappers = []
        for agent in cluster.clients:
            path = folder / f"{agent.name}.jsonl"
            if path.exists():
                wrappers += [json.loads(line) for line in path.read_text().splitlines() if line]
        figures = phase_figures(occurrences, wrappers, parse_runs(runs.read_text()))
        cpu = {name: after["cpu"][name] - before["cpu"][name] for name in agents}
        servers = [a.name for a in cluster.servers]
        phase_s = after["t"] - before["t"]
        per_s = 100 / phase_s
        busy = after["machine"][0] - before["machine"][0]
        ours = sum(cpu.values()) + timers_cpu + after["self"] - before["self"]  # this process watched too
        figures.update(
            clients=clients, jobs_per_minute=jobs_per_minute, tool=tool,
            aborted=aborted or ("" if (cluster.leader() or leader).name == leader.name else "the leader changed"),
            writes=after["applied"] - before["applied"],
            writes_per_s=(after["applied"] - before["applied"]) / min(args.window_s, phase_s),  # a stopped one: less
            writes_per_occurrence=(after["applied"] - before["applied"]) / max(1, len(occurrences)),
            leader=leader.name, leader_after=(cluster.leader() or leader).name,
            load_start=before["load"], load_end=after["load"], phase_s=phase_s,
            cpu_pct={"leader": cpu[leader.name] * per_s,
                     "other_servers": sum(cpu[s] for s in servers if s != leader.name) * per_s,
                     "clients": sum(cpu[c.name] for c in cluster.clients) * per_s,
                     "wrappers": figures["wrappers_cpu_s"] * per_s,
                     "timers": max(0.0, timers_cpu - figures["wrappers_cpu_s"]) * per_s,
                     "machine": busy / TICK * per_s, "not_ours": max(0.0, busy / TICK - ours) * per_s})
        figures["skip_cpu_per_node_pct"] = figures["skip_cpu_s"] * per_s / clients
        # What the occurrences cost the leader: its CPU over the phase less what it spends idle (heartbeats, gossip).
        busy_leader = cpu[leader.name] - self.idle_rate.get(leader.name, 0.0) * phase_s
        figures["leader_cpu_ms_per_occurrence"] = 1000 * max(0.0, busy_leader) / max(1, len(occurrences))
        figures["wrappers_cpu_per_node_pct"] = figures["wrappers_cpu_s"] * per_s / clients
        (folder / "figures.json").write_text(json.dumps(figures, indent=1))
        return figures

    def watch(self, occurrences: dict[tuple[str, str], float], runs: Path) -> tuple[str, float]:
        """Until every node's timers have ended: (why the phase was stopped early, or ""; the timers' CPU, their
        wrappers' included)."""
        args = self.args
        due = sorted((when, key) for key, when in occurrences.items())
        seen: set[tuple[str, str]] = set()
        position, aborted, stopped_at, cpu = 0, "", 0.0, 0.0
        alive = {p.pid: p for p in self.launchers}
        tail = ""
        with runs.open() as log:
            while alive:
                time.sleep(0.2)
                now = time.time()
                tail += log.read()
                *lines, tail = tail.split("\n")  # a line still being written waits for the next look
                for line in lines:
                    parts = line.split()
                    if len(parts) == 6:
                        seen.add((parts[2], parts[3]))
                while position < len(due) and due[position][0] + args.abort_lag_s < now:
                    position += 1
                late = sum(1 for _, key in due[:position] if key not in seen)
                if not aborted and late > max(3, 0.02 * position):
                    aborted = f"stopped: {late} occurrences not started {args.abort_lag_s:g} s after their time"
                if not aborted and mem_available_gib() < args.min_memory_gib:
                    aborted = f"stopped: memory available below {args.min_memory_gib:g} GiB"
                if aborted and not stopped_at:
                    say(aborted)
                    stopped_at = now
                    for pid in alive:
                        os.kill(pid, signal.SIGTERM)
                if stopped_at and now - stopped_at > 30:
                    for pid in alive:
                        os.kill(pid, signal.SIGKILL)
                for pid in list(alive):
                    done, _, usage = os.wait4(pid, os.WNOHANG)
                    if done:
                        alive.pop(pid).returncode = 0
                        cpu += usage.ru_utime + usage.ru_stime
        self.launchers = []
        return aborted, cpu

    def stop_launchers(self) -> None:
        """SIGTERM the node timers (each kills its wrappers); SIGKILL what is left after 20 s."""
        for proc in self.launchers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.launchers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.launchers = []


def sweep(network: Network) -> None:
    """SIGKILL anything still alive in this run's namespaces (only this run starts processes there)."""
    for ns in network.names:
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
        for pid in (int(p) for p in listed.split() if p.isdigit()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/scale.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the report and raw records")
    parser.add_argument("--clients", default="10,30", help="client counts, comma-separated (one cluster each)")
    parser.add_argument("--jobs-per-minute", default="25,50,100,250,500,1000", help="loads, comma-separated")
    parser.add_argument("--duration", default="60s", help="firings per phase (60s: each job fires once)")
    parser.add_argument("--peer", choices=("consul-lock", "none"), default="consul-lock")
    parser.add_argument("--spread", default="100ms", help="each firing's random delay at most (RandomizedDelaySec=)")
    parser.add_argument("--drain", default="60s", help="how long wrappers may outlive the last firing")
    parser.add_argument("--abort-lag", default="30s", help="stop a phase whose occurrences stay unstarted this long")
    parser.add_argument("--min-memory-gib", type=float, default=3.0, help="stop a phase below this MemAvailable")
    parser.add_argument("--max-live-per-node", type=int, default=20,
                        help="a node starts no wrapper while this many of its own live (the machine's memory)")
    parser.add_argument("--all-levels", action="store_true", help="measure every load, past the knee too")
    parser.add_argument("--always", default="", help="loads measured even past the knee, comma-separated")
    parser.add_argument("--idle", default="15s", help="how long the idle cluster is measured first")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        args.clients_list = [int(x) for x in args.clients.split(",")]
        args.always_loads = {int(x) for x in args.always.split(",") if x}
        args.loads = sorted({int(x) for x in args.jobs_per_minute.split(",")} | args.always_loads)
    except ValueError:
        parser.error("--clients and --jobs-per-minute take comma-separated whole numbers")
    if min(args.clients_list) < 1 or min(args.loads) < 1 or max(args.loads) > 60_000:
        parser.error("--clients at least 1; --jobs-per-minute from 1 to 60000")
    for name in ("duration", "spread", "drain", "abort_lag", "idle"):
        try:
            setattr(args, f"{name}_s", parse_duration(getattr(args, name)) / 1000)
        except DurationError as exc:
            parser.error(f"--{name.replace('_', '-')}: {exc}")
    args.window_s = args.duration_s
    if args.window_s < 1:
        parser.error("--duration: at least 1s")
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if os.geteuid() != 0:
        print("error: bench/scale.py needs root (network namespaces)", file=sys.stderr)
        return 2
    script = str(Path(sys.executable).parent / "consulrun")
    if not os.access(script, os.X_OK):
        print(f"error: {script} is missing; install consulrun into this Python first (scripts/test does)",
              file=sys.stderr)
        return 2
    binary = consul_binary()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "consulrun")], check=True, env=env)
    args.out.mkdir(parents=True, exist_ok=True)
    tools = ["consulrun"] + (["consul lock"] if args.peer == "consul-lock" else [])
    meta = {"command": "bench/scale.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "spread_s": args.spread_s, "window_s": args.window_s, "python": sys.version.split()[0],
            "cpus": os.cpu_count() or 1, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "uptime_start": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), "idle": {}}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    bench = Bench(args, binary, script)
    status = 0
    try:
        for clients in args.clients_list:
            run_cluster(bench, clients, tools, meta)
    except _Stop as stop:
        say("interrupted: everything this run started is stopped and removed")
        status = 128 + stop.args[0]
    finally:
        meta["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        report = markdown(bench.phases, meta)
        report += (f"\nuptime at the start: `{meta['uptime_start']}`; at the end: `{meta['uptime_end']}`. Idle cluster "
                   f"before the phases: " + "; ".join(f"{c} clients {i}" for c, i in meta["idle"].items()) + ".\n")
        (args.out / "report.md").write_text(report)
        (args.out / "phases.jsonl").write_text("".join(json.dumps(p) + "\n" for p in bench.phases))
        (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(report)
    return status


def run_cluster(bench: Bench, clients: int, tools: list[str], meta: dict[str, Any]) -> None:
    """One cluster of `clients` clients: the loads in turn until the knee, then everything it made is removed."""
    args = bench.args
    network = Network(3 + clients, subnet=SUBNET, tag="s")
    cluster: BigCluster | None = None
    try:
        network.up()
        say(f"starting 3 servers and {clients} clients")
        cluster = start_big_cluster(bench.binary, args.out / f"agents-{clients}", network, servers=3,
                                    clients=clients, fast_gossip=False)
        settle(cluster)
        idle_before = {a.name: process_cpu_s(a.process.pid) for a in cluster.agents}
        applied, started = cluster.applied_index(), time.time()
        time.sleep(args.idle_s)
        elapsed = time.time() - started
        bench.idle_rate = {a.name: (process_cpu_s(a.process.pid) - idle_before[a.name]) / elapsed for a in cluster.agents}
        meta["idle"][clients] = (f"{((cluster.applied_index() or 0) - (applied or 0)) / elapsed:.1f} Raft writes/s, "
                                 f"agents {100 * sum(bench.idle_rate.values()):.0f} % of a core (servers "
                                 f"{100 * sum(bench.idle_rate[a.name] for a in cluster.servers):.1f} %), over "
                                 f"{elapsed:.0f} s")
        knee_at = None
        for step, load in enumerate(args.loads):
            if knee_at is not None and load not in args.always_loads:
                continue
            phases = []
            for tool in (tools if step % 2 == 0 else tools[::-1]):
                phases.append(bench.phase(cluster, tool, load))
                bench.phases.append(phases[-1])
                settle(cluster)
            ours = next(p for p in phases if p["tool"] == "consulrun")
            if past_knee(ours) and not args.all_levels and knee_at is None:
                knee_at = load
                say(f"{clients} clients: past the knee at {load} jobs/min; higher loads run only if --always names them")
    finally:
        bench.stop_launchers()
        if cluster:
            cluster.stop()
        sweep(network)
        network.down()


if __name__ == "__main__":
    sys.exit(main())
