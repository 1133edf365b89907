"""`python -m bench.chaos --nodes systemd`: the chaos run with booted systemd containers as client nodes.

The same servers, nemesis, history and checker as the emulated run (run.py);
the client nodes are booted containers running what `consulrun install`
wrote (bench/chaos/nodes.py), and the nemesis adds what only they have
(bench/chaos/systemd_faults.py). Everything it makes (containers, their
mounts and cgroups, agents, namespaces, links, the bridge) is removed on every
way out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from bench.chaos import systemd_faults
from bench.chaos.logs import AppendLog
from bench.chaos.nemesis import Nemesis
from bench.chaos.probe import Prober
from bench.chaos.nodes import NodeFleet, SystemdCluster, boot, boot_nodes
from bench.chaos.run import OUTPUTS, SUBNET, _on_signal, _say, _Stop, condition_holds, judge, watch_nemesis
from bench.chaos.timers import LockSettings
from tests.harness.agents import consul_binary, wait_for
from tests.harness.bigcluster import start_big_cluster
from tests.harness.netns import Network

CLIENTS = 3
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main_systemd(args: argparse.Namespace, argv: list[str] | None) -> int:
    if not shutil.which("systemd-nspawn"):
        print("error: systemd-nspawn is missing (Debian package systemd-container)", file=sys.stderr)
        return 2
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    (out / "history.log").touch()
    # RandomizedDelaySec= is max_delay - AccuracySec= (1 s): a timer elapses up to both after its time.
    lock = LockSettings(ttl_s=args.ttl, lock_delay_s=args.lock_delay, max_delay_s=2.0)
    binary = consul_binary()
    for sig in _SIGNALS:
        signal.signal(sig, _on_signal)
    network = Network(3 + CLIENTS, subnet=SUBNET, tag="x")
    servers = None
    cluster: SystemdCluster | None = None
    fleet: NodeFleet | None = None
    nemesis: Nemesis | None = None
    prober: Prober | None = None
    meta = {"command": "python -m bench.chaos " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "nodes": "systemd", "duration_s": args.duration_s, "seed": args.seed, "ttl_s": lock.ttl_s,
            "lock_delay_s": lock.lock_delay_s, "max_delay_s": lock.max_delay_s, "faults": list(args.kinds),
            "load_start": _load_average(),
            "jobs": [{"name": j.name, "policy": j.policy, "schedule": j.schedule, "seconds": j.seconds,
                      "interval_s": j.interval_s(), "condition_holds": condition_holds(j, lock)} for j in args.job]}
    interrupted = False
    try:
        _say(f"network {network.net} ({len(network.names)} namespaces), servers in {out / 'agents'}")
        network.up()
        (out / "agents").mkdir(exist_ok=True)
        servers = start_big_cluster(binary, out / "agents", network, clients=0)
        _say(f"booting {CLIENTS} systemd nodes")
        cluster = boot_nodes(network, servers, binary, out, CLIENTS)
        meta.update(servers=[a.name for a in cluster.servers], clients=[a.name for a in cluster.clients],
                    containers=[c.name for c in cluster.nodes])
        nemesis_log = AppendLog(out / "nemesis.log")
        fleet = NodeFleet(cluster, args.job, lock, out)
        meta["applied_before"] = cluster.applied_index()
        meta["t_start"] = time.time()
        meta["fire_until"] = fire_until = meta["t_start"] + args.duration_s
        (out / "run.json").write_text(json.dumps(meta, indent=1))
        prober = Prober(cluster.clients, lock.prefix, out / "probes.log").start()
        fleet.install()
        _say("installed on every node: " + ", ".join(f"{j.name} ({j.policy}, {j.schedule})" for j in args.job))
        nemesis = Nemesis(cluster, fleet, nemesis_log, args.seed, stop_at=fire_until - 5,  # type: ignore[arg-type]
                          kinds=args.kinds)
        if args.kinds:
            nemesis.start()
        watch_nemesis(nemesis, fire_until, join_s=300, note=lambda: f"; load {_load_average()}")  # type: ignore[arg-type]
        if nemesis.error:
            raise RuntimeError(f"the nemesis failed: {nemesis.error!r}") from nemesis.error
        _heal_everything(cluster)
        fleet.stop_timers()
        wait_s = max(j.interval_s() for j in args.job) + 2 * lock.ttl_s + lock.lock_delay_s + 30
        _say(f"timers stopped; waiting up to {wait_s:.0f}s for the last runs")
        meta["drained"] = fleet.drain(wait_s)
        meta["t_end"] = time.time()
        meta["applied_after"] = cluster.applied_index()
        meta["load_end"] = _load_average()
        fleet.collect()
    except _Stop as stop:
        interrupted = True
        _say(f"{signal.Signals(stop.args[0]).name}: stopping and cleaning up")
    finally:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if prober is not None:
            prober.stop()
        _clean_up(nemesis, fleet, cluster, servers, network)
        meta.setdefault("t_end", time.time())
        if (out / "run.json").exists():
            (out / "run.json").write_text(json.dumps(meta, indent=1))
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
    if interrupted:
        return 130
    return judge(out, f"; load {_load_average()}")


def _clean_up(nemesis: Nemesis | None, fleet: NodeFleet | None, cluster: SystemdCluster | None, servers: object,
              network: Network) -> None:
    if nemesis is not None:
        nemesis.stop()
        if nemesis.is_alive():
            nemesis.join(timeout=300)
    if fleet is not None:
        fleet.stop()
    if cluster is not None:
        systemd_faults.thaw_all(cluster)
        for ctr in cluster.nodes:
            ctr.power_off()
        for ctr in cluster.nodes:
            ctr.stop()
        cluster.stop()
    elif servers is not None:
        servers.stop()  # type: ignore[attr-defined]
    network.down()


def _heal_everything(cluster: SystemdCluster) -> None:
    """Every link up, every node booted, every agent running: the drain and the final Raft index see a whole
    cluster."""
    systemd_faults.thaw_all(cluster)
    for index in range(len(cluster.agents)):
        cluster.network.heal(index)
    for ctr in cluster.nodes:
        if ctr.process is None or ctr.process.poll() is not None:
            ctr.stop()
            boot(ctr)
    for agent in cluster.agents:
        cluster.restart(agent)
    wait_for(lambda: cluster.leader(), 60, "a Raft leader after the run")
    wait_for(lambda: all(a.alive() for a in cluster.clients), 120, "every node's agent after the run")
    wait_for(lambda: cluster.applied_index(), 30, "the servers' applied index")

