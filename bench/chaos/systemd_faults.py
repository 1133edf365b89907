"""Faults only booted systemd nodes have, registered with the nemesis (nemesis.EXTRA_KINDS).

  unit-kill   `systemctl kill -s KILL` of a job's service whose job has just started: half the time
              `--kill-whom=main` (the wrapper alone, as the OOM killer picks one process: systemd then stops
              what is left of the unit, SIGTERM then SIGKILL after TimeoutStopSec=, and runs ExecStopPost=
              reap), half the time `--kill-whom=all` (the whole cgroup at once)
  freeze      the node's whole cgroup frozen (cgroup v2 cgroup.freeze: its agent, systemd, wrappers and jobs,
              as a VM pause), thawed after lock-delay + 1-3 s, or (half the time) after 2 x TTL + 1 s to
              2 x TTL + lock-delay + 3 s
  poweroff    the node powered off cleanly (its systemd stops every unit, the agent last), booted again after
              2-6 s off: its Persistent=true timers catch up on what they missed
  power-cut   every process of the node SIGKILLed at once (cgroup.kill: power lost), booted again after 2-6 s
With `agent-kill` (`systemctl kill -s KILL consul.service`, started again after 2-6 s: the node's agent is a
unit) and `partition-client`, `partition-server`, `leader-kill` as the nemesis has them. Node faults hit, 3 times
in 4, the node of a run that has just started (bench.chaos.nemesis).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.chaos.nemesis import EXTRA_KINDS, Nemesis
from bench.chaos.nodes import NodeFleet, SystemdCluster, boot
from tests.harness.nspawn import Container, _cgroup_dirs

# What a run with systemd nodes injects by default, and how often (weights, as nemesis.KINDS).
SYSTEMD_KINDS = {"agent-kill": 2, "partition-client": 2, "partition-server": 1, "leader-kill": 1, "unit-kill": 2,
                 "freeze": 2, "poweroff": 1, "power-cut": 1}
OFF_S = (2.0, 6.0)


def _unified(ctr: Container, name: str) -> Path:
    """A cgroup v2 interface file of the node's own cgroup (freeze, kill)."""
    for path in _cgroup_dirs(ctr.name):
        if (path / name).exists():
            return path / name
    raise RuntimeError(f"no cgroup v2 {name} for {ctr.name} (needs the unified hierarchy, Linux 5.2+/5.14+)")


def _parts(nemesis: Nemesis) -> tuple[SystemdCluster, NodeFleet]:
    assert isinstance(nemesis.cluster, SystemdCluster) and isinstance(nemesis.fleet, NodeFleet)
    return nemesis.cluster, nemesis.fleet


def _target(nemesis: Nemesis) -> tuple[Container, str] | None:
    """A running node: the one of a fresh holder 3 times in 4 (nemesis._client_target), else any."""
    cluster, fleet = _parts(nemesis)
    name = nemesis._client_target()
    ctr = cluster.node_of(cluster.by_name(name))
    return (ctr, name) if fleet.running(ctr) else None


def _live_pids(fleet: NodeFleet, node: str) -> list[int]:
    return sorted({p for h in fleet.tail.holders(node=node) for p in (h.pid, h.wrapper)})


def unit_kill(nemesis: Nemesis) -> None:
    cluster, fleet = _parts(nemesis)
    holder = nemesis._holder()
    if holder is None:
        return
    ctr = cluster.node_of(cluster.by_name(holder.node))
    if not fleet.running(ctr):
        return
    whom = nemesis.rng.choice(("main", "all"))
    done = ctr.systemctl("kill", "-s", "KILL", f"--kill-whom={whom}", f"consulrun-{holder.job}.service", check=False)
    nemesis._start("unit-kill", lambda: None, node=holder.node, job=holder.job, wrapper=holder.wrapper,
                   pids=[holder.pid, holder.wrapper], whom=whom, status=done.returncode)


def freeze(nemesis: Nemesis) -> None:
    cluster, fleet = _parts(nemesis)
    target = _target(nemesis)
    if target is None:
        return
    ctr, name = target
    control = _unified(ctr, "cgroup.freeze")
    lock = fleet.lock
    if nemesis.rng.random() < 0.5:
        seconds = lock.lock_delay_s + nemesis.rng.uniform(1, 3)
    else:
        seconds = 2 * lock.ttl_s + nemesis.rng.uniform(1, lock.lock_delay_s + 3)
    control.write_text("1")
    nemesis._start("freeze", lambda: control.write_text("0"), node=name, pids=_live_pids(fleet, name),
                   seconds=round(seconds, 3))
    nemesis._sleep(seconds)


def _power_cycle(nemesis: Nemesis, kind: str) -> None:
    cluster, fleet = _parts(nemesis)
    target = _target(nemesis)
    if target is None:
        return
    ctr, name = target
    pids = _live_pids(fleet, name)
    if kind == "poweroff":
        ctr.power_off()  # nspawn asks the node's systemd to stop every unit and power off
    else:
        _unified(ctr, "cgroup.kill").write_text("1")
    nemesis._start(kind, lambda: boot(ctr), node=name, pids=pids)
    if ctr.process is not None:
        try:
            ctr.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass  # stop() below kills what is left
    ctr.stop()
    nemesis._sleep(nemesis.rng.uniform(*OFF_S))


def poweroff(nemesis: Nemesis) -> None:
    _power_cycle(nemesis, "poweroff")


def power_cut(nemesis: Nemesis) -> None:
    _power_cycle(nemesis, "power-cut")


def thaw_all(cluster: SystemdCluster) -> None:
    """No node left frozen (a run's end, an error): a frozen cgroup cannot be stopped."""
    for ctr in cluster.nodes:
        for path in _cgroup_dirs(ctr.name):
            if (path / "cgroup.freeze").exists():
                try:
                    (path / "cgroup.freeze").write_text("0")
                except OSError:
                    pass


EXTRA_KINDS.update({"unit-kill": unit_kill, "freeze": freeze, "poweroff": poweroff, "power-cut": power_cut})
