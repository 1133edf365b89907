"""The nemesis: one fault at a time, chosen at random, each healed after a few seconds, all logged.

Faults (kind: what it does, what heals it):
  agent-kill        SIGKILL a client node's agent; restart it after 2-6 s (its data directory kept)
  partition-client  a client node's link down; up after 2-6 s (its agent keeps running, cut off)
  partition-server  a server's link down; up after 2-6 s
  leader-kill       SIGKILL the Raft leader's agent; restart it after 2-5 s
  wrapper-kill      SIGKILL a wrapper whose job runs (as the OOM killer would); nothing to heal
  pause             SIGSTOP a wrapper and its job, then SIGCONT: half the time for lock-delay + 1-3 s, half the
                    time for 2 x TTL + 1 s to 2 x TTL + lock-delay + 3 s, so its session can expire meanwhile
  skew              the wall clock of one node's wrappers (and its timers) off by 0.5-3 s either way for 8-15 s
Client-node faults hit, 3 times in 4, the node of a job that has just started
(a job chosen at random, the fault waiting up to one interval for its next
start), so faults bite holders rather than idle nodes. The log
(`nemesis.log`) has a `fault` line when a fault starts and a `heal` line when
it ends, with the same id, timed by the host clock like the history. After a
heal the nemesis waits until every client agent reads KV through the servers
again (`recovered` in the heal line) before the next fault: one fault at a
time, counting the time a node needs to come back.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Callable

import requests

from bench.chaos import consul_faults
from bench.chaos.logs import AppendLog
from bench.chaos.timers import Fleet, Wrapper, descendants, signal_all
from tests.harness.bigcluster import BigCluster

# Kinds other modules define (bench/chaos/systemd_faults.py), by name: a function of the nemesis that injects one
# fault (starting it with `_start`, waiting with `_sleep`); `inject` heals it after.
EXTRA_KINDS: dict[str, Callable[["Nemesis"], None]] = {}

KINDS = {"agent-kill": 2, "partition-client": 2, "partition-server": 1, "leader-kill": 1, "wrapper-kill": 2,
         "pause": 2, "skew": 1}
# Opt-in kinds, each module's own (`--faults` names them; never in the default set), with the function that
# injects one: `inject(nemesis, kind)`.
OPT_IN = {kind: (weight, consul_faults.inject) for kind, weight in consul_faults.KINDS.items()}
ALL_KINDS = {**KINDS, **{kind: weight for kind, (weight, _) in OPT_IN.items()}}


class Nemesis(threading.Thread):
    def __init__(self, cluster: BigCluster, fleet: Fleet, log: AppendLog, seed: int, stop_at: float,
                 kinds: dict[str, int] | None = None) -> None:
        super().__init__(name="nemesis", daemon=True)
        self.cluster = cluster
        self.fleet = fleet
        self.log = log
        self.rng = random.Random(seed)
        self.stop_at = stop_at
        self.kinds = kinds or KINDS
        self.stop_event = threading.Event()
        self.counter = 0
        self.error: BaseException | None = None
        self._heal: tuple[int, str, Callable[[], object]] | None = None

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        try:
            self.stop_event.wait(self.rng.uniform(3, 6))
            while not self.stop_event.is_set() and time.time() < self.stop_at:
                kind = self.rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0]
                self.inject(kind)
                self.stop_event.wait(self.rng.uniform(1, 4))
        except BaseException as exc:  # noqa: BLE001 - reported by the runner, which then cleans up
            self.error = exc
        finally:
            self.heal()

    def _sleep(self, seconds: float) -> None:
        self.stop_event.wait(max(0.0, min(seconds, self.stop_at + 30 - time.time())))

    def _holder(self) -> Wrapper | None:
        """A wrapper whose job just started, of a job chosen at random, so the fault hits a fresh holder."""
        job = self.rng.choice(self.fleet.jobs)
        wait = min(job.interval_s() + self.fleet.lock.max_delay_s + 1, self.stop_at - time.time())
        return self.fleet.fresh_holder(job.name, wait, self.stop_event) if wait > 0 else None

    def _client_target(self) -> str:
        if self.rng.random() < 0.75:
            holder = self._holder()
            if holder is not None:
                return holder.node
        return self.rng.choice(self.cluster.clients).name

    def _start(self, kind: str, heal: Callable[[], object], **fields: object) -> None:
        self.counter += 1
        self._heal = (self.counter, kind, heal)
        self.log.emit("fault", id=self.counter, kind=kind, **fields)

    def heal(self) -> None:
        if self._heal is None:
            return
        fault_id, kind, action = self._heal
        self._heal = None
        healed = time.time()
        action()
        recovered = self._wait_recovered()
        self.log.emit("heal", id=fault_id, kind=kind, healed=round(healed, 4), recovered=recovered)

    def _wait_recovered(self, timeout: float = 60) -> float | None:
        """When every client agent answered a KV read through the servers again (None: not within timeout)."""
        deadline = time.time() + timeout
        pending = list(self.cluster.clients)
        while pending and time.time() < deadline:
            agent = pending[0]
            try:
                ok = requests.get(f"{agent.url}/v1/kv/chaos-probe", timeout=2).status_code in (200, 404)
            except requests.RequestException:
                ok = False
            if ok:
                pending.pop(0)
            else:
                time.sleep(0.1)
        return None if pending else round(time.time(), 4)

    def inject(self, kind: str) -> None:
        if kind in EXTRA_KINDS:
            EXTRA_KINDS[kind](self)
            return self.heal()
        cluster = self.cluster
        if kind in OPT_IN:
            return OPT_IN[kind][1](self, kind)
        if kind in ("agent-kill", "partition-client"):
            agent = cluster.by_name(self._client_target())
            index = cluster.index_of(agent)
            if kind == "agent-kill":
                cluster.kill(agent)
                self._start(kind, lambda: cluster.restart(agent), node=agent.name)
            else:
                cluster.network.partition(index)
                self._start(kind, lambda: cluster.network.heal(index), node=agent.name)
            self._sleep(self.rng.uniform(2, 6))
        elif kind == "partition-server":
            agent = self.rng.choice(cluster.servers)
            index = cluster.index_of(agent)
            leader = cluster.leader()
            cluster.network.partition(index)
            self._start(kind, lambda: cluster.network.heal(index), node=agent.name,
                        was_leader=leader is agent)
            self._sleep(self.rng.uniform(2, 6))
        elif kind == "leader-kill":
            agent = cluster.leader()
            if agent is None:
                return
            cluster.kill(agent)
            self._start(kind, lambda: cluster.restart(agent), node=agent.name)
            self._sleep(self.rng.uniform(2, 5))
        elif kind in ("wrapper-kill", "pause"):
            target = self._holder()
            if target is None:
                return
            wrapper = target.process.pid
            tree = [*reversed(descendants(wrapper)), wrapper]
            if kind == "wrapper-kill":
                os.kill(wrapper, signal.SIGKILL)
                self._start(kind, lambda: None, node=target.node, job=target.job, wrapper=wrapper, pids=tree)
                return self.heal()
            signal_all(tree, signal.SIGSTOP)
            self._start(kind, lambda: signal_all(list(reversed(tree)), signal.SIGCONT), node=target.node,
                        job=target.job, wrapper=wrapper, pids=tree)
            lock = self.fleet.lock
            if self.rng.random() < 0.5:
                self._sleep(lock.lock_delay_s + self.rng.uniform(1, 3))
            else:
                self._sleep(2 * lock.ttl_s + self.rng.uniform(1, lock.lock_delay_s + 3))
        elif kind == "skew":
            node = self.rng.choice(cluster.clients).name
            seconds = self.rng.choice((-1, 1)) * self.rng.uniform(0.5, 3)
            self.fleet.set_skew(node, seconds)
            self._start(kind, lambda: self.fleet.set_skew(node, 0.0), node=node, seconds=round(seconds, 3))
            self._sleep(self.rng.uniform(8, 15))
        self.heal()
