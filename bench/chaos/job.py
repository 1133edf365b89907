"""The chaos run's job: says when it starts, that it is alive every 100 ms, and when it ends.

Every line goes to one append-only log on the host shared by all nodes, as a
single write() on an O_APPEND descriptor, timed by the host's clock: the log
is the run's global oracle. The wrapper may run under libfaketime; the runner
starts this script through `env -u LD_PRELOAD ...`, so its clock is never the
skewed one. Standard library only, started with `python -S` to start fast.

Usage: job.py LOG JOB NODE SECONDS [FAIL_RATE]   (with FAIL_RATE, it exits 3 that often, after its end line:
a retries job's failed attempts)

NODE may be `@PATH`, a JSON file with the node's name and a pid base (a booted
container writes pids of its own PID namespace, numbered from 1 at each boot;
the base, per node and boot, keeps them distinct in the one history).
"""

import json
import os
import random
import sys
import time


def main() -> None:
    log, job, node, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    token = int(os.environ.get("CONSULRUN_FENCING_TOKEN", "0"))
    base = 0
    if node.startswith("@"):
        with open(node[1:], encoding="utf-8") as handle:
            identity = json.load(handle)
        node, base = identity["node"], int(identity["pid_base"])
    pid = base + os.getpid()

    def emit(event: str, **fields: object) -> None:
        line = json.dumps({"t": round(time.time(), 4), "ev": event, "job": job, "pid": pid, "token": token, **fields})
        os.write(fd, (line + "\n").encode())

    emit("start", node=node, wrapper=base + os.getppid(), occ=os.environ.get("CONSULRUN_OCCURRENCE"),
         session=os.environ.get("CONSULRUN_SESSION"), attempt=os.environ.get("CONSULRUN_ATTEMPT"))
    began = time.monotonic()
    beat = 1
    while True:
        due = began + beat * 0.1
        if due > began + seconds:
            break
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        emit("hb")
        beat += 1
    emit("end")
    if len(sys.argv) > 5 and random.Random(pid * 1_000_003 + time.time_ns()).random() < float(sys.argv[5]):
        sys.exit(3)


if __name__ == "__main__":
    main()
