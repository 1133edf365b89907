"""One node's timers for bench/scale.py: fire every planned wrapper on time, and record what each cost.

Runs inside the node's network namespace (started by `ip netns exec`, which
execs it, so everything it starts is in that namespace and talks to the
node's own agent on 127.0.0.1), as the node's systemd would: it starts each
wrapper at its planned time with posix_spawn, and, as systemd does for a
oneshot service whose previous run still lives, starts nothing for a job
whose previous wrapper on this node is still running ("busy"). Unlike
systemd, it also starts nothing while `max_live` wrappers live on the node
("shed"): thirty emulated nodes share one machine's memory, and an overload
must not take it. Each wrapper
is reaped with wait4(2), which gives its CPU (user + system, the job's
included: the job is the wrapper's child). Not its peak RSS: a child that
posix_spawn made with vfork reports the parent's (bench/hot_path.py has
the wrappers' memory).

It waits for a child's exit or the next firing in one select() on the
signal wake-up pipe (SIGCHLD), so thirty of these cost next to nothing when
idle. SIGTERM (bench/scale.py stopping a run, or a Ctrl-C there) kills every
live wrapper and its descendants by PID, reaps them, writes what it has and
exits. Standard library only, no imports from the repo: it starts once per
node and phase, and what it costs is not what is measured.

Usage: python scale_node.py PLAN.json OUT.jsonl
PLAN: {"node": str, "env": {...}, "stderr": path, "drain_s": float, "max_live": int,
       "firings": [[planned_epoch_s, job, occurrence, [argv...]], ...]}   (sorted by time)
OUT: one JSON line per firing: node, job, occ, planned, spawned, ended, cpu, status
     (status: exit status, 128+N for signal N, "busy" or "shed" when not started, "killed" when stopped by us,
     "not fired" when the run was stopped before its time).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

from procs import descendants  # bench/procs.py, beside this script (it runs as a script, not from the repo)

_stopping = False


def _on_term(_signum: int, _frame: object) -> None:
    global _stopping
    _stopping = True


def main(plan_path: str, out_path: str) -> int:
    plan = json.loads(open(plan_path, encoding="utf-8").read())
    node, env, firings = plan["node"], plan["env"], plan["firings"]
    drain_s = float(plan.get("drain_s", 120))
    max_live = int(plan.get("max_live", 1_000_000))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
               (os.POSIX_SPAWN_OPEN, 2, plan["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)]
    live: dict[int, dict] = {}
    live_jobs: set[str] = set()
    done: list[dict] = []
    nxt = 0
    last_planned = firings[-1][0] if firings else time.time()

    def reap(block: bool = False) -> None:
        while live:
            try:
                pid, status, usage = os.wait4(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            record = live.pop(pid, None)
            if record is None:
                continue
            live_jobs.discard(record["job"])
            code = os.waitstatus_to_exitcode(status)
            record.update(ended=time.time(), cpu=round(usage.ru_utime + usage.ru_stime, 6),
                          status=record.get("status", 128 - code if code < 0 else code))
            done.append(record)

    while (nxt < len(firings) or live) and not _stopping:
        now = time.time()
        while nxt < len(firings) and firings[nxt][0] <= now:
            planned, job, occ, argv = firings[nxt]
            nxt += 1
            record = {"node": node, "job": job, "occ": occ, "planned": planned}
            if job in live_jobs or len(live) >= max_live:
                status = "busy" if job in live_jobs else "shed"
                done.append({**record, "spawned": None, "ended": None, "cpu": 0.0, "status": status})
                continue
            record["spawned"] = time.time()
            pid = os.posix_spawn(argv[0], argv, env, file_actions=actions)
            live[pid] = record
            live_jobs.add(job)
        reap()
        if nxt == len(firings) and not live:
            break
        if nxt < len(firings):
            timeout: float | None = max(0.0, firings[nxt][0] - time.time())
        else:
            left = last_planned + drain_s - time.time()
            if left <= 0:
                break  # wrappers that outlived the drain: stopped below, recorded "killed"
            timeout = left
        select.select([wake_r], [], [], timeout)
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
    for pid, record in list(live.items()):
        record["status"] = "killed"
        for victim in [pid, *descendants(pid)]:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
    reap(block=True)
    for planned, job, occ, _ in firings[nxt:]:  # never fired: the run was stopped
        done.append({"node": node, "job": job, "occ": occ, "planned": planned, "spawned": None, "ended": None,
                     "cpu": 0.0, "status": "not fired"})
    with open(out_path, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(record) + "\n" for record in done)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
