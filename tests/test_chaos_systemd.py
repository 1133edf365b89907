"""A short chaos run on booted systemd nodes: real timers and units under faults only such nodes have.

`python -m bench.chaos --nodes systemd` (bench/chaos/systemd_run.py): 3
servers, 3 client nodes that are booted containers running the units
`consulrun install` wrote, the nemesis's systemd kinds (unit-kill, freeze,
poweroff, power-cut) beside agent kills, partitions and leader kills, and the
same checker as the emulated run. On failure the run's history, nemesis log,
node journals and report are kept in test-artifacts/.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import artifact_dir, require_tool
from tests.test_chaos import _our_namespaces

pytestmark = [pytest.mark.systemd, pytest.mark.consul, pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[1]


def _left_mounts(out: Path) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(out) in line]


def test_short_chaos_run_on_systemd_nodes_keeps_the_guarantees(consul_bin: str, tmp_path: Path,
                                                                request: pytest.FixtureRequest) -> None:
    """90 s of real timers on 3 booted nodes under random faults (every systemd kind among them): no overlap
    outside a freeze, no duplicate under skip, no retry occurrence lost while a node was healthy; and nothing of
    the run is left behind (containers, mounts, namespaces)."""
    require_tool("systemd-nspawn")
    require_tool("ip")
    if os.geteuid() != 0:
        pytest.fail("the chaos run needs root (network namespaces, containers)", pytrace=False)
    out = tmp_path / "chaos"
    cmd = [sys.executable, "-m", "bench.chaos", "--nodes", "systemd", "--duration", "90s", "--out", str(out),
           "--seed", os.environ.get("CONSULRUN_CHAOS_SEED", "5"),
           "--job", "skip10:skip:4:*:*:0/10", "--job", "retry30:retry:1:*:*:0/30"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=420)  # ~15 s of boots, 90 s of timers, then a drain
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # it cleans up on Ctrl-C
        _, stderr = proc.communicate(timeout=300)
        pytest.fail(f"the chaos run did not stop by itself:\n{stderr[-3000:]}")
    try:
        report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
        assert report is not None, f"the run made no report (exit {proc.returncode}):\n{stderr[-3000:]}"
        assert not _our_namespaces(f"x{proc.pid % 100000}"), "the run left network namespaces behind"
        assert not _left_mounts(out), "the run left a node's overlay mounted"
        assert json.loads((out / "run.json").read_text())["drained"], "units were still running after the drain"
        assert sum(report["faults"].values()) >= 3, f"too few faults injected: {report['faults']}"
        history = [json.loads(line) for line in (out / "history.log").read_text().splitlines()]
        assert {line["node"] for line in history if line["ev"] == "fire"} == {"client1", "client2", "client3"}
        assert report["jobs"]["skip10"]["completed"] > 0 and report["jobs"]["retry30"]["completed"] > 0
        assert report["jobs"]["retry30"]["retry_condition_holds"] is True
        assert proc.returncode == 0 and not report["violations"], \
            f"violations (history in {artifact_dir(request.node)}):\n{(out / 'report.md').read_text()[-6000:]}"
    except BaseException:
        dest = artifact_dir(request.node)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(out, dest / "chaos", dirs_exist_ok=True, ignore=shutil.ignore_patterns("nodes"))
        (dest / "runner.stderr").write_text(stderr)
        raise
