"""One chaos run: cluster up, timers and nemesis for the duration, drain, clean up, check.

Everything it makes (network namespaces, veth links, the bridge, agents,
wrappers, jobs) is removed on the way out, whether the run ended, failed, or
was interrupted (Ctrl-C, SIGTERM, SIGHUP).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from consulrun.manifest.durations import parse_duration

from bench.chaos.checker import check
from bench.chaos.logs import AppendLog
from bench.procs import Stopped as _Stop, stop_on_signal as _on_signal
from bench.chaos.nemesis import ALL_KINDS, KINDS, Nemesis
from bench.chaos.probe import Prober
from bench.chaos.report import markdown
from bench.chaos.systemd_faults import SYSTEMD_KINDS
from bench.chaos.timers import FAKETIME_LIB, RETRY_BACKOFF_S, Fleet, JobSpec, LockSettings
from tests.harness.agents import consul_binary, wait_for
from tests.harness.bigcluster import BigCluster, start_big_cluster
from tests.harness.netns import Network

DEFAULT_JOBS = ("skip10:skip:4:*:*:0/10", "retry30:retry:1:*:*:0/30", "retry5:retry:1:*:*:0/5")
SUBNET = "10.213.79.0/24"  # moved by CONSULRUN_TEST_NET_PREFIX like the test harness's subnets


def parse_job(text: str) -> JobSpec:
    try:
        name, policy, seconds, schedule = text.split(":", 3)
        policy, plus, extra = policy.partition("+")
        if plus and not re.fullmatch(r"a[2-9]", extra):
            raise ValueError(f"+{extra}: a retries suffix is +aN, N 2-9 (retries.attempts)")
        attempts = int(extra[1:]) if plus else 1
        after = schedule[len("after="):] if schedule.startswith("after=") else ""
        job = JobSpec(name, policy, "" if after else schedule, float(seconds), after=after, attempts=attempts)
        job.interval_s()
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:skip|retry|eachN[+aN]:SECONDS:ONCALENDAR, or "
                                         f"NAME:skip|retry:SECONDS:after=PARENT ({exc})") from None
    if policy not in ("skip", "retry") and not re.fullmatch(r"each[1-9][0-9]{0,2}", policy):
        raise argparse.ArgumentTypeError(f"{text!r}: policy must be skip, retry or eachN (mode: each-node with "
                                         "lock.concurrency N, e.g. each2)")
    return job


def condition_holds(job: JobSpec, lock: LockSettings) -> bool:
    """The retry condition, counted at its worst here: a holder that starts as late as the timer's random
    delay allows and dies at the end of its run is noticed after up to 2 x TTL (a frozen or SIGKILLed
    wrapper's session lives that long), then lock-delay, then the standby runs the job: all before the next
    occurrence, when standbys give up."""
    worst = lock.max_delay_s + job.seconds + 2 * lock.ttl_s + lock.lock_delay_s + job.seconds
    worst += (job.attempts - 1) * (job.seconds + RETRY_BACKOFF_S)  # a standby's run may need its retries too
    return job.policy == "retry" and not job.after and job.interval_s() > worst


# What a run writes into its output directory (a run there before is removed first); agents/ apart.
OUTPUTS = ("history.log", "nemesis.log", "probes.log", "run.json", "report.json", "report.md")


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", default="10m", help="how long timers fire (e.g. 3m, 90s); then the run drains")
    parser.add_argument("--out", required=True, type=Path, help="directory for the history, logs and report")
    parser.add_argument("--seed", type=int, default=1, help="seed of the timers' delays and of the nemesis")
    parser.add_argument("--job", action="append", type=parse_job, metavar="NAME:POLICY:SECONDS:SPEC",
                        help=f"a job (repeatable); default: {' '.join(DEFAULT_JOBS)}; SPEC after=PARENT: a job "
                             "chained after PARENT (on: success), started by an emulated chain-watch on each node")
    parser.add_argument("--ttl", type=int, default=10, help="session TTL in seconds (minimum 10)")
    parser.add_argument("--lock-delay", type=int, default=5, help="lock-delay in seconds (minimum 5)")
    parser.add_argument("--nodes", choices=("emulated", "systemd"), default="emulated",
                        help="client nodes: namespaces with emulated timers, or booted systemd containers running the "
                             "units `consulrun install` wrote (bench/chaos/systemd_run.py)")
    parser.add_argument("--faults", help="fault kinds the nemesis may inject, comma-separated; 'none' for a "
                                         f"fault-free run; default: {','.join(KINDS)}; also: "
                                         f"{','.join(k for k in ALL_KINDS if k not in KINDS)} (systemd nodes: "
                                         f"{','.join(SYSTEMD_KINDS)})")
    args = parser.parse_args(argv)
    known = SYSTEMD_KINDS if args.nodes == "systemd" else ALL_KINDS
    default = SYSTEMD_KINDS if args.nodes == "systemd" else KINDS
    args.job = args.job or [parse_job(j) for j in DEFAULT_JOBS]
    names = {j.name for j in args.job}
    for job in args.job:
        if job.after and (job.after not in names or job.after == job.name):
            parser.error(f"--job {job.name}: after={job.after} names no other --job")
    try:
        args.duration_s = parse_duration(args.duration) / 1000
    except ValueError as exc:
        parser.error(f"--duration: {exc}")
    kinds = [] if args.faults == "none" else (args.faults or ",".join(default)).split(",")
    unknown = [k for k in kinds if k not in known]
    if unknown:
        parser.error(f"--faults: unknown kind(s) {', '.join(unknown)}; known: {', '.join(known)}")
    args.kinds = {k: known[k] for k in kinds}
    return args


def watch_nemesis(nemesis: Nemesis, fire_until: float, join_s: float, note: Callable[[], str] = lambda: "") -> None:
    """While the timers fire: a line every 30 s, and the nemesis's failure raised at once; then stop it."""
    last_note = time.time()
    while time.time() < fire_until:
        time.sleep(0.5)
        if nemesis.error:
            raise RuntimeError(f"the nemesis failed: {nemesis.error!r}") from nemesis.error
        if time.time() - last_note >= 30:
            last_note = time.time()
            _say(f"{fire_until - last_note:.0f}s to go; {nemesis.counter} faults so far{note()}")
    nemesis.stop()
    if nemesis.is_alive():
        nemesis.join(timeout=join_s)


def _say(text: str) -> None:
    print(f"chaos {time.strftime('%H:%M:%S')}: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if os.geteuid() != 0:
        print("error: the chaos run needs root (network namespaces)", file=sys.stderr)
        return 2
    if args.nodes == "systemd":
        from bench.chaos.systemd_run import main_systemd

        return main_systemd(args, argv)
    if not Path(FAKETIME_LIB).exists():
        print(f"error: {FAKETIME_LIB} is missing (Debian package faketime; scripts/test-deps installs it)",
              file=sys.stderr)
        return 2
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    lock = LockSettings(ttl_s=args.ttl, lock_delay_s=args.lock_delay)
    binary = consul_binary()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    network = Network(6, subnet=SUBNET, tag="x")
    cluster: BigCluster | None = None
    fleet: Fleet | None = None
    nemesis: Nemesis | None = None
    prober: Prober | None = None
    meta = {"command": "python -m bench.chaos " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "duration_s": args.duration_s, "seed": args.seed, "ttl_s": lock.ttl_s, "lock_delay_s": lock.lock_delay_s,
            "max_delay_s": lock.max_delay_s, "faults": list(args.kinds),
            "jobs": [{"name": j.name, "policy": j.policy, "schedule": j.schedule, "seconds": j.seconds,
                      "interval_s": j.interval_s(), "condition_holds": condition_holds(j, lock),
                      **({"after": [{"job": j.after, "on": "success"}]} if j.after else {}),
                      **({"each_node": j.each_node} if j.each_node else {}),
                      **({"attempts": j.attempts} if j.attempts > 1 else {})} for j in args.job]}
    interrupted = False
    try:
        _say(f"network {network.net} ({len(network.names)} namespaces), agents in {out / 'agents'}")
        network.up()
        (out / "agents").mkdir(exist_ok=True)
        cluster = start_big_cluster(binary, out / "agents", network)
        meta.update(servers=[a.name for a in cluster.servers], clients=[a.name for a in cluster.clients])
        history, nemesis_log = AppendLog(out / "history.log"), AppendLog(out / "nemesis.log")
        fleet = Fleet(cluster.clients, args.job, lock, history, out, args.seed)
        meta["applied_before"] = cluster.applied_index()
        meta["t_start"] = time.time()
        meta["fire_until"] = fire_until = meta["t_start"] + args.duration_s
        (out / "run.json").write_text(json.dumps(meta, indent=1))
        prober = Prober(cluster.clients, lock.prefix, out / "probes.log").start()
        fleet.start(fire_until)
        nemesis = Nemesis(cluster, fleet, nemesis_log, args.seed, stop_at=fire_until - 5, kinds=args.kinds)
        if args.kinds:
            nemesis.start()
        _say(f"timers fire for {args.duration_s:.0f}s; jobs: " + ", ".join(f"{j.name} ({j.policy}, "
                                                                          f"{j.schedule or 'after ' + j.after})"
                                                                          for j in args.job))
        watch_nemesis(nemesis, fire_until, join_s=60)
        wait_s = max(j.interval_s() for j in args.job) + 2 * lock.ttl_s + lock.lock_delay_s + 30
        _say(f"timers stopped; waiting up to {wait_s:.0f}s for the last wrappers")
        meta["drained"] = fleet.drain(wait_s)
        meta["t_end"] = time.time()
        _heal_everything(cluster)
        meta["applied_after"] = cluster.applied_index()
    except _Stop as stop:
        interrupted = True
        _say(f"{signal.Signals(stop.args[0]).name}: stopping and cleaning up")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if prober is not None:
            prober.stop()
        if nemesis is not None:
            nemesis.stop()
            if nemesis.is_alive():
                nemesis.join(timeout=30)
        if fleet is not None:
            fleet.kill_all()
        if cluster is not None:
            cluster.stop()
        network.down()
        meta.setdefault("t_end", time.time())
        if (out / "run.json").exists():
            (out / "run.json").write_text(json.dumps(meta, indent=1))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    if interrupted:
        return 130
    return judge(out)


def judge(out: Path, note: str = "") -> int:
    """Check the run's history, write report.json and report.md, print it; 1 if a guarantee was broken."""
    report = check(out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    _say(f"report: {out / 'report.md'}; {len(report['violations'])} violation(s){note}")
    return 1 if report["violations"] else 0


def _heal_everything(cluster: BigCluster) -> None:
    """Every link up and every agent running, so the final Raft index is read from a whole cluster."""
    for index in range(len(cluster.agents)):
        cluster.network.heal(index)
    for agent in cluster.agents:
        cluster.restart(agent)
    wait_for(lambda: cluster.leader(), 60, "a Raft leader after the run")
    wait_for(lambda: cluster.applied_index(), 30, "the servers' applied index")
