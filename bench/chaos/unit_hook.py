"""What a booted chaos node's units tell the history: `fire`, `exit` and `on-failure` lines, as the emulated timers do.

The units are the ones `consulrun install` wrote; this script runs from a
drop-in the chaos run adds beside them (`consulrun-<job>.service.d/chaos.conf`),
never from the units themselves, so nothing of the product is changed:

  fire        ExecStartPre=-  the timer (or a Persistent=true catch-up) started the service: the occurrence
                              the wrapper will compute (the latest scheduled time at or before now, as `run`
                              computes it), kept in /run for `exit`
  exit        ExecStopPost=   after consulrun's own `reap`: the wrapper's exit status as systemd saw it
                              (EXIT_CODE/EXIT_STATUS, a signal as 128+N), its pid and its last journal line
  on-failure  the manifest's on_failure command (OnFailure=): which node's unit failed, and how

Usage: unit_hook.py fire|exit LOG NODEFILE JOB SPEC...   |   unit_hook.py on-failure LOG NODEFILE
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from consulrun.manifest import calendar

STATE = Path("/run/consulrun-chaos")


def _emit(log: str, event: str, **fields: object) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps({"t": round(time.time(), 4), "ev": event, **fields}) + "\n").encode())
    finally:
        os.close(fd)


def _status() -> int:
    """The wrapper's exit as the emulated fleet writes it: its code, or 128+N for a signal."""
    code, status = os.environ.get("EXIT_CODE", ""), os.environ.get("EXIT_STATUS", "")
    if status.isdigit():
        return int(status)
    if code in ("killed", "dumped") and status:
        try:
            return 128 + signal.Signals[f"SIG{status}"].value
        except KeyError:
            return -1
    return -1


def _main_pid(unit: str) -> int:
    shown = subprocess.run(["systemctl", "show", unit, "-p", "ExecMainPID", "--value"], capture_output=True,
                           text=True, timeout=10, check=False).stdout.strip()
    return int(shown) if shown.isdigit() else 0


def _last_line(pid: int) -> str:
    """The wrapper's last line in this run's journal (its stderr goes there)."""
    invocation = os.environ.get("INVOCATION_ID", "")
    if not pid or not invocation:
        return ""
    out = subprocess.run(["journalctl", "--no-pager", "-o", "cat", "-n", "1", f"_PID={pid}",
                          f"_SYSTEMD_INVOCATION_ID={invocation}"], capture_output=True, text=True, timeout=10,
                         check=False).stdout.strip()
    return out.splitlines()[-1][:300] if out else ""


def main(argv: list[str]) -> int:
    what, log, nodefile = argv[0], argv[1], argv[2]
    identity = json.loads(Path(nodefile).read_text())
    node, base = identity["node"], int(identity["pid_base"])
    if what == "on-failure":
        job = os.environ.get("CONSULRUN_JOB", "")
        try:
            sched = json.loads((STATE / f"{job}.json").read_text())["sched"]
        except (OSError, ValueError, KeyError):
            sched = ""
        _emit(log, "on-failure", node=node, job=job, sched=sched,
              result=os.environ.get("CONSULRUN_RESULT", ""), status=os.environ.get("CONSULRUN_EXIT_STATUS", ""))
        return 0
    job, specs = argv[3], argv[4:]
    state = STATE / f"{job}.json"
    if what == "fire":
        when = calendar.previous(specs, datetime.now(timezone.utc))
        sched = calendar.occurrence_id(when) if when else ""
        STATE.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps({"sched": sched, "t": time.time()}))
        _emit(log, "fire", node=node, job=job, sched=sched, wrapper=None)
        return 0
    try:
        fired = json.loads(state.read_text())
    except (OSError, ValueError):
        fired = {"sched": "", "t": time.time()}
    pid = _main_pid(f"consulrun-{job}.service")
    _emit(log, "exit", node=node, job=job, sched=fired["sched"], wrapper=(base + pid) if pid else None,
          status=_status(), result=os.environ.get("SERVICE_RESULT", ""), ran=round(time.time() - fired["t"], 3),
          last=_last_line(pid))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
