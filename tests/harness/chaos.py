"""The chaos suite's test helpers: made-up histories for its checker, and a chaos run to its end.

A made-up history starts at T0 (2030-01-01T00:00:00Z), an occurrence every 5 s (OCC), clients c1-c3.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.chaos.checker import check
from tests.conftest import artifact_dir

REPO = Path(__file__).resolve().parents[2]
OCC = ["2030-01-01T00:00:00Z", "2030-01-01T00:00:05Z", "2030-01-01T00:00:10Z"]
T0 = 1893456000.0  # 2030-01-01T00:00:00Z


def write_and_check(out: Path, history: list[dict], nemesis: list[dict], retry_condition: bool = True,
                    probes: list[dict] | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if probes is not None:
        (out / "probes.log").write_text("".join(json.dumps(line) + "\n" for line in probes))
    meta = {"ttl_s": 10, "lock_delay_s": 5, "fire_until": T0 + 15, "t_end": T0 + 20, "clients": ["c1", "c2", "c3"],
            "applied_before": 100, "applied_after": 130,
            "jobs": [{"name": "s", "policy": "skip", "schedule": "*:*:0/5", "seconds": 1, "interval_s": 5,
                      "condition_holds": False},
                     {"name": "r", "policy": "retry", "schedule": "*:*:0/5", "seconds": 1, "interval_s": 5,
                      "condition_holds": retry_condition}]}
    (out / "run.json").write_text(json.dumps(meta))
    (out / "history.log").write_text("".join(json.dumps(line) + "\n" for line in history))
    (out / "nemesis.log").write_text("".join(json.dumps(line) + "\n" for line in nemesis))
    return check(out)


def run_lines(job: str, node: str, pid: int, occ: str, token: int, start: float, beats: int,
              ended: bool = True) -> list[dict]:
    lines = [{"t": start, "ev": "start", "job": job, "pid": pid, "token": token, "node": node, "wrapper": pid - 1,
              "occ": occ}]
    lines += [{"t": start + 0.1 * (i + 1), "ev": "hb", "job": job, "pid": pid, "token": token} for i in range(beats)]
    if ended:
        lines.append({"t": start + 0.1 * beats + 0.01, "ev": "end", "job": job, "pid": pid, "token": token})
    return lines


def fire_lines(job: str, occ_index: int) -> list[dict]:
    return [{"t": T0 + 5 * occ_index, "ev": "fire", "node": n, "job": job, "sched": OCC[occ_index], "wrapper": 1}
            for n in ("c1", "c2", "c3")]


def run_chaos(cmd: list[str], timeout_s: float, cleanup_s: float) -> tuple[subprocess.Popen[str], str]:
    """Run a chaos command to its end (it stops by itself); past `timeout_s`, Ctrl-C it (it cleans up) and fail."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=cleanup_s)
        pytest.fail(f"the chaos run did not stop by itself:\n{stderr[-3000:]}")
    return proc, stderr


@contextlib.contextmanager
def kept_on_failure(request: pytest.FixtureRequest, out: Path, stderr: str,
                    ignore: Callable[..., Any] | None = None) -> Iterator[None]:
    """On a failure inside: the run's directory and its stderr into the test's artifacts, for the history."""
    try:
        yield
    except BaseException:
        dest = artifact_dir(request.node)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(out, dest / "chaos", dirs_exist_ok=True, ignore=ignore)
        (dest / "runner.stderr").write_text(stderr)
        raise


def our_namespaces(tag: str) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.split() and line.split()[0].endswith("-" + tag)]


def processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found
