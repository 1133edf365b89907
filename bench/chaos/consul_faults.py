"""Consul's own life as nemesis faults: the servers restarted one at a time (an upgrade), and a snapshot restore.

Opt-in kinds (not in the default fault set: `--faults rolling-restart,snapshot-restore,...`):

  rolling-restart   every server restarted in turn, followers first and the leader last, as an upgrade does:
                    SIGTERM (a server's default `leave_on_terminate: false`, so it does not leave the Raft
                    configuration: what `systemctl restart consul` or a package upgrade does), down 1-3 s (the
                    binary swapped), started again with its data directory; the next one only once the server
                    itself sees a leader, is a voter in `operator/raft/configuration`, has applied what the
                    leader had when it came back, and autopilot calls it and the cluster healthy. Each server's
                    restart is its own fault line (`step` 1..3; `round`: the id of the round's first step),
                    healed with the times of those conditions.
  snapshot-restore  `consul snapshot save` of the whole state, jobs running on for 15-45 s, then (3 times in 4
                    right after a job started, so the restore hits a holder) `consul snapshot restore` of it:
                    the KV store, sessions and all go back to the saved moment while the jobs run.

Why not `consul leave` before the restart: leaving takes the server out of the Raft configuration, so a
three-server cluster runs on two voters (quorum 2 of 2) until it rejoins and a second failure meanwhile loses
the quorum; a restart without leave keeps it a voter, and the cluster counts its absence as one tolerated
failure. Consul's upgrade page (developer.hashicorp.com/consul/docs/upgrade) says the same: one server at a
time, restart the service with the service manager, wait until it is healthy and has rejoined (its 1.9 page
still said `consul leave` first). Half the rounds hand the leadership over before the leader's restart
(`consul operator raft transfer-leader`), so the report compares an election with a hand-over.

What Consul does on a restore (tests/test_consul_restore.py pins it against the real agent): sessions are
restored as they were saved (one created since is gone: its renewal is a 404; one destroyed since is back,
holding what it held, and expires 2 x TTL after the restore unless renewed), every lock-delay in force is
forgotten, a blocked query wakes with its pre-restore answer, and the next blocking read with that index
waits for its full `wait` before it answers with the lower, restored index.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import requests

if TYPE_CHECKING:
    from bench.chaos.nemesis import Nemesis
    from tests.harness.agents import Agent

KINDS = {"rolling-restart": 1, "snapshot-restore": 1}
RESTORE_KINDS = {"snapshot-restore"}  # the checker counts what follows a restore apart
WAIT_HEALTHY_S = 120
STOP_TIMEOUT_S = 30


def inject(nemesis: "Nemesis", kind: str) -> None:
    if kind == "rolling-restart":
        rolling_restart(nemesis)
    elif kind == "snapshot-restore":
        snapshot_restore(nemesis)
    else:
        raise ValueError(f"not a Consul fault kind: {kind}")


# --- rolling restart


def _graceful_stop(agent: "Agent") -> float:
    """SIGTERM and wait for the exit (SIGKILL if it hangs); when it exited."""
    if agent.alive():
        agent.process.send_signal(signal.SIGTERM)
        try:
            agent.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            agent.kill()
    return time.time()


def _ask(agent: "Agent", path: str) -> Any:
    response = requests.get(f"{agent.url}/v1/{path}", timeout=2)
    response.raise_for_status()
    return response.json()


def _sees_leader(server: "Agent") -> bool:
    """The restarted server itself answers and knows a leader (it rejoined the Raft cluster)."""
    try:
        return bool(_ask(server, "status/leader"))
    except (requests.RequestException, ValueError):
        return False


def _is_voter(server: "Agent") -> bool:
    """The server is a voter in the Raft configuration, asked of the server itself (the leader answers)."""
    try:
        config = _ask(server, "operator/raft/configuration")
    except (requests.RequestException, ValueError):
        return False
    return any(s.get("Node") == server.name and s.get("Voter") for s in config.get("Servers", []))


def _applied(agent: "Agent") -> int:
    try:
        return int(_ask(agent, "agent/self")["Stats"]["raft"]["applied_index"])
    except (requests.RequestException, ValueError, KeyError):
        return 0


def _autopilot_healthy(leader: "Agent | None", name: str) -> bool:
    """Autopilot (on the leader) calls the cluster healthy and this server among the healthy ones."""
    if leader is None:
        return False
    try:
        health = _ask(leader, "operator/autopilot/health")
    except (requests.RequestException, ValueError):
        return False
    servers = {s.get("Name"): s for s in health.get("Servers", [])}
    return bool(health.get("Healthy")) and bool(servers.get(name, {}).get("Healthy"))


def _until(condition: Callable[[], object], nemesis: "Nemesis", timeout: float = WAIT_HEALTHY_S) -> float | None:
    deadline = time.time() + timeout
    while time.time() < deadline and not nemesis.stop_event.is_set():
        if condition():
            return round(time.time(), 4)
        nemesis.stop_event.wait(0.1)
    return None


def _transfer_leadership(nemesis: "Nemesis", leader: "Agent") -> tuple[str | None, float | None]:
    """Ask the leader to hand over: the new leader's name and how long until it led (None: it did not)."""
    asked = time.time()
    subprocess.run([nemesis.cluster.binary, "operator", "raft", "transfer-leader", "-http-addr", leader.http_addr],
                   capture_output=True, text=True, timeout=60, check=False)
    led = _until(lambda: cluster_leader_other_than(nemesis, leader), nemesis, timeout=30)
    if led is None:
        return None, None
    new = nemesis.cluster.leader()
    return (new.name if new else None), round(led - asked, 3)


def cluster_leader_other_than(nemesis: "Nemesis", server: "Agent") -> bool:
    leader = nemesis.cluster.leader()
    return leader is not None and leader is not server and leader.alive()


def rolling_restart(nemesis: "Nemesis") -> None:
    cluster = nemesis.cluster
    leader = cluster.leader()
    order = [s for s in cluster.servers if s is not leader] + ([leader] if leader is not None else [])
    round_id = nemesis.counter + 1
    # Half the rounds hand the leadership over before the leader's restart (`consul operator raft
    # transfer-leader`, Consul 1.15+), so its step costs no election timeout: the two are compared.
    transfer = nemesis.rng.random() < 0.5
    for step, server in enumerate(order, 1):
        if nemesis.stop_event.is_set():
            return
        was_leader = cluster.leader() is server
        transferred, transfer_s = None, None
        if was_leader and transfer:
            transferred, transfer_s = _transfer_leadership(nemesis, server)
        nemesis._start("rolling-restart", lambda s=server: cluster.restart(s), node=server.name, step=step,
                       of=len(order), round=round_id, was_leader=was_leader, transfer=was_leader and transfer,
                       transferred_to=transferred, transfer_s=transfer_s)
        fault_id = nemesis.counter
        stopped = _graceful_stop(server)
        status = server.process.returncode
        nemesis._sleep(nemesis.rng.uniform(1, 3))  # the binary swapped
        nemesis._heal = None
        started = time.time()
        cluster.restart(server)
        leader_at = _until(lambda: _sees_leader(server) and cluster.leader() is not None, nemesis)
        voter_at = _until(lambda: _is_voter(server), nemesis)
        # Caught up: it applied what the leader had applied when it came back (autopilot's health alone can be
        # its view from before the stop: it did not notice a server down for a second or two).
        target = _applied(cluster.leader() or server)
        caught_up_at = _until(lambda: _applied(server) >= target > 0, nemesis)
        healthy_at = _until(lambda: _autopilot_healthy(cluster.leader(), server.name), nemesis)
        recovered = nemesis._wait_recovered()
        new_leader = cluster.leader()
        nemesis.log.emit("heal", id=fault_id, kind="rolling-restart", healed=round(started, 4), recovered=recovered,
                         stopped=round(stopped, 4), exit_status=status, leader_at=leader_at, voter_at=voter_at,
                         caught_up_at=caught_up_at, autopilot_healthy_at=healthy_at,
                         leader=new_leader.name if new_leader else None,
                         cut_short=nemesis.stop_event.is_set())  # the run's end stopped the waits: times unknown
        nemesis._sleep(nemesis.rng.uniform(1, 3))


# --- snapshot restore


def _snapshot(nemesis: "Nemesis", verb: str, server: "Agent", path: str) -> tuple[int, str]:
    done = subprocess.run([nemesis.cluster.binary, "snapshot", verb, "-http-addr", server.http_addr, path],
                          capture_output=True, text=True, timeout=120, check=False)
    said = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, said[-1] if said else ""


def snapshot_restore(nemesis: "Nemesis") -> None:
    cluster = nemesis.cluster
    out = nemesis.log.path.parent
    path = str(out / f"snapshot-{nemesis.counter + 1}.snap")
    server = cluster.leader() or nemesis.rng.choice(cluster.servers)
    saved = time.time()
    status, said = _snapshot(nemesis, "save", server, path)
    index = re.search(r"index (\d+)", said)
    nemesis.log.emit("snapshot", node=server.name, status=status, index=int(index.group(1)) if index else None,
                     path=path, said=said)
    if status != 0:
        return
    nemesis._sleep(nemesis.rng.uniform(15, 45))
    if nemesis.stop_event.is_set() or time.time() >= nemesis.stop_at:
        return
    target = nemesis._holder() if nemesis.rng.random() < 0.75 else None
    server = cluster.leader() or nemesis.rng.choice(cluster.servers)
    nemesis._start("snapshot-restore", lambda: None, node=server.name, saved_at=round(saved, 4),
                   index=int(index.group(1)) if index else None, age_s=round(time.time() - saved, 3),
                   holder=target.node if target else None, job=target.job if target else None)
    fault_id = nemesis.counter
    began = time.time()
    status, said = _snapshot(nemesis, "restore", server, path)
    nemesis._heal = None
    restored = time.time()
    recovered = nemesis._wait_recovered()
    nemesis.log.emit("heal", id=fault_id, kind="snapshot-restore", healed=round(restored, 4), recovered=recovered,
                     status=status, said=said, took_s=round(restored - began, 3))


# --- what the report shows of them


def leadership_acquired(agents_dir: Path) -> list[tuple[float, str]]:
    """(when, server) of every `cluster leadership acquired` line in the servers' logs, in time order."""
    found = []
    for log in sorted(agents_dir.glob("server*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "cluster leadership acquired" in line:
                try:
                    stamp = datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc)
                except ValueError:
                    continue
                found.append((stamp.timestamp(), log.stem))
    return sorted(found)


def summary(lines: list[dict[str, Any]], history: list[dict[str, Any]], lock_delay_s: float,
            acquired: list[tuple[float, str]] | None = None) -> dict[str, Any]:
    """Per server restart: how long it was down, without a leader, and until it was a caught-up voter that
    autopilot calls healthy; per restore: the snapshot's age and how long the restore took; for both, the
    wrappers that exited 75 (job stopped: lock lost) or 69 (Consul unavailable) while the fault acted (from
    its start to lock-delay after its clients read again; each exit counted for the latest fault only)."""
    faults = {ln["id"]: ln for ln in lines if ln["ev"] == "fault" and ln.get("kind") in KINDS}
    heals = {ln["id"]: ln for ln in lines if ln["ev"] == "heal" and ln["id"] in faults}
    exits = _exits_by_fault(faults, heals, history, lock_delay_s)
    restarts, restores = [], []
    for fault_id, fault in sorted(faults.items()):
        heal = heals.get(fault_id, {})
        hit = {"fenced": exits[fault_id].count(75), "unavailable": exits[fault_id].count(69)}
        if fault["kind"] == "rolling-restart":
            since = heal.get("healed")

            def after(key: str, since: float | None = since) -> float | None:
                return round(heal[key] - since, 2) if heal.get(key) and since else None
            restarts.append({"round": fault.get("round"), "step": fault.get("step"), "node": fault["node"],
                             "was_leader": fault.get("was_leader"), "transfer": fault.get("transfer"),
                             "transfer_s": fault.get("transfer_s"), "exit_status": heal.get("exit_status"),
                             "down_s": round(since - fault["t"], 2) if since else None,
                             "no_leader_s": _no_leader(fault, acquired or []),
                             "leader_after_s": after("leader_at"), "voter_after_s": after("voter_at"),
                             "caught_up_after_s": after("caught_up_at"),
                             "autopilot_healthy_after_s": after("autopilot_healthy_at"),
                             "clients_read_after_s": after("recovered"), "cut_short": bool(heal.get("cut_short")),
                             **hit})
        else:
            restores.append({"id": fault_id, "server": fault["node"], "snapshot_index": fault.get("index"),
                             "snapshot_age_s": fault.get("age_s"), "holder": fault.get("holder"),
                             "job": fault.get("job"), "status": heal.get("status"), "took_s": heal.get("took_s"),
                             "clients_read_after_s": round(heal["recovered"] - heal["healed"], 2)
                             if heal.get("recovered") and heal.get("healed") else None, **hit})
    return {"restarts": restarts, "restores": restores}


def _no_leader(fault: dict[str, Any], acquired: list[tuple[float, str]]) -> float | None:
    """A leader restarted as it led: from its SIGTERM to another server's `cluster leadership acquired` (the
    servers' logs; the followers' HTTP answers name the stopped leader until their heartbeat timeout)."""
    if not fault.get("was_leader") or fault.get("transfer"):
        return None
    after = [t for t, name in acquired if t >= fault["t"] and name != fault["node"]]
    return round(after[0] - fault["t"], 2) if after else None


def _exits_by_fault(faults: dict[int, dict[str, Any]], heals: dict[int, dict[str, Any]],
                    history: list[dict[str, Any]], lock_delay_s: float) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {fault_id: [] for fault_id in faults}
    ordered = sorted(faults.values(), key=lambda f: f["t"])
    for line in (ln for ln in history if ln["ev"] == "exit" and ln.get("status") in (69, 75)):
        latest = [f for f in ordered if f["t"] <= line["t"]]
        if not latest:
            continue
        fault = latest[-1]
        heal = heals.get(fault["id"], {})
        if line["t"] <= (heal.get("recovered") or heal.get("t") or fault["t"]) + lock_delay_s:
            found[fault["id"]].append(line["status"])
    return found


def _p50_max(values: list[float | None]) -> str:
    known = sorted(v for v in values if v is not None)
    return f"{known[(len(known) - 1) // 2]} / {known[-1]}" if known else "-"


def markdown(summary: dict[str, Any]) -> list[str]:
    """Server restarts grouped by what was restarted (a follower; the leader; the leader after handing its
    leadership over), each restore on its own row."""
    out: list[str] = []
    groups = {"follower": [r for r in summary["restarts"] if not r["was_leader"]],
              "leader, restarted as it led": [r for r in summary["restarts"] if r["was_leader"] and not r["transfer"]],
              "leader, handed over first": [r for r in summary["restarts"] if r["was_leader"] and r["transfer"]]}
    if summary["restarts"]:
        out += ["", "| server restarted (p50 / max, s) | n | down | hand-over | no leader | voter after | caught up "
                "after | autopilot healthy after | clients read after | wrappers exited 75 / 69 |", "|" + "---|" * 10]
        for name, rows in groups.items():
            if rows:
                cols = [_p50_max([r[k] for r in rows]) for k in ("down_s", "transfer_s", "no_leader_s",
                        "voter_after_s", "caught_up_after_s", "autopilot_healthy_after_s", "clients_read_after_s")]
                out.append(f"| {name} | {len(rows)} | " + " | ".join(cols)
                           + f" | {sum(r['fenced'] for r in rows)} / {sum(r['unavailable'] for r in rows)} |")
    if summary["restores"]:
        out += ["", "| restore | server | snapshot index | snapshot age (s) | aimed at | took (s) | exit | "
                "clients read after (s) | wrappers exited 75 / 69 |", "|" + "---|" * 9]
        out += [f"| #{r['id']} | {r['server']} | {r['snapshot_index']} | {r['snapshot_age_s']} "
                f"| {(r['job'] + '@' + r['holder']) if r['holder'] else '-'} | {r['took_s']} | {r['status']} "
                f"| {r['clients_read_after_s']} | {r['fenced']} / {r['unavailable']} |" for r in summary["restores"]]
    return out
