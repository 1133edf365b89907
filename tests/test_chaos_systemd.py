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
from tests.harness.agents import wait_for
from tests.harness.chaos import (
    kept_on_failure,
    our_namespaces as _our_namespaces,
    processes_mentioning as _processes_mentioning,
    run_chaos,
)
from tests.harness.nspawn import _cgroup_dirs

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
    proc, stderr = run_chaos(cmd, 420, 300)
    with kept_on_failure(request, out, stderr, ignore=shutil.ignore_patterns("nodes")):
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


def test_the_nodes_manifest_renders_and_systemd_accepts_its_units_with_the_drop_in(tmp_path: Path) -> None:
    """What every node installs: a manifest consulrun accepts, whose units (with the run's drop-in beside each
    job's service) systemd-analyze verify passes without a word."""
    from bench.chaos.nodes import drop_in, manifest_text
    from bench.chaos.run import DEFAULT_JOBS, parse_job
    from bench.chaos.timers import LockSettings

    jobs = [parse_job(j) for j in DEFAULT_JOBS]
    text = manifest_text(jobs, LockSettings(max_delay_s=2.0))
    (tmp_path / "chaos.yaml").write_text(text)
    units = tmp_path / "units"
    done = subprocess.run([sys.executable, "-m", "consulrun", "generate", str(tmp_path / "chaos.yaml"), "-o",
                           str(units)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    timer = (units / "consulrun-retry30.timer").read_text()
    assert "AccuracySec=1s\n" in timer and "RandomizedDelaySec=1s\n" in timer and "Persistent=true\n" in timer
    assert (units / "consulrun-_watchdog.timer").exists()  # health_checks: the watchdog runs under chaos too
    service = (units / "consulrun-retry30.service").read_text()
    assert "OnFailure=" in service and "--on-holder-loss retry" in service
    for job in jobs:
        extra = units / f"consulrun-{job.name}.service.d"
        extra.mkdir()
        (extra / "chaos.conf").write_text(drop_in(job))
    require_tool("systemd-analyze")
    files = sorted(str(p) for p in units.iterdir() if p.suffix in (".service", ".timer"))
    # verify adds each file's directory to the unit path: the drop-ins beside the services are read too
    verify = subprocess.run(["systemd-analyze", "verify", "--man=no", *files], capture_output=True, text=True,
                            cwd=units, check=False)
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr


def test_the_unit_hook_writes_what_the_checker_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fire: the occurrence `run` computes; exit: systemd's view of the wrapper's end as the emulated fleet writes
    it (a signal as 128+N), with the occurrence fire kept; pids carry the node's base."""
    from bench.chaos import unit_hook
    from bench.chaos.checker import load_runs

    log, nodefile = tmp_path / "history.log", tmp_path / "node.json"
    nodefile.write_text(json.dumps({"node": "client2", "index": 2, "boot": 1, "pid_base": 20_100_000}))
    monkeypatch.setattr(unit_hook, "STATE", tmp_path / "run")
    monkeypatch.setattr(unit_hook, "_main_pid", lambda unit: 42)
    monkeypatch.setattr(unit_hook, "_last_line", lambda pid: "consulrun: j: released chaos/j/lock")
    unit_hook.main(["fire", str(log), str(nodefile), "j", "*:*:0/10"])
    monkeypatch.setenv("EXIT_CODE", "killed")
    monkeypatch.setenv("EXIT_STATUS", "KILL")
    monkeypatch.setenv("SERVICE_RESULT", "signal")
    unit_hook.main(["exit", str(log), str(nodefile), "j", "*:*:0/10"])
    monkeypatch.setenv("CONSULRUN_JOB", "j")
    unit_hook.main(["on-failure", str(log), str(nodefile)])
    fire, exit_, failure = [json.loads(line) for line in log.read_text().splitlines()]
    assert fire["ev"] == "fire" and fire["node"] == "client2" and fire["sched"].endswith("0Z")
    assert (exit_["status"], exit_["wrapper"], exit_["sched"]) == (137, 20_100_042, fire["sched"])
    assert failure["ev"] == "on-failure" and failure["sched"] == fire["sched"]
    runs, timer_events = load_runs(log)
    assert not runs and [e["ev"] for e in timer_events] == ["fire", "exit", "on-failure"]


def test_a_pause_marks_only_the_runs_alive_at_it(tmp_path: Path) -> None:
    """A node booted again numbers its pids from 1: a later run with a frozen run's pid was not frozen (its tail
    would be counted from a thaw long before it started)."""
    from tests.harness.chaos import (
        OCC,
        T0,
        fire_lines as _fires,
        run_lines as _run,
        write_and_check as _write,
    )

    frozen = _run("s", "c1", 100, OCC[0], 10, T0 + 0.5, 10)
    again = _run("s", "c1", 100, OCC[2], 20, T0 + 10.5, 10)  # the same pid, after a reboot
    history = sorted([*_fires("s", 0), *_fires("s", 2), *frozen, *again], key=lambda line: line["t"])
    nemesis = [{"t": T0 + 0.7, "ev": "fault", "id": 1, "kind": "freeze", "node": "c1", "pids": [100, 99]},
               {"t": T0 + 3, "ev": "heal", "id": 1, "kind": "freeze", "healed": T0 + 3, "recovered": T0 + 3}]
    report = _write(tmp_path, history, nemesis)
    assert report["violations"] == []
    assert report["jobs"]["s"]["fenced_after_pause_s"]["n"] == 1
    assert report["jobs"]["s"]["fenced_after_pause_s"]["max"] < 1


def test_ctrl_c_leaves_no_node_mount_namespace_or_process(consul_bin: str, tmp_path: Path) -> None:
    """Ctrl-C while the nodes run their jobs: exit 130, and no container, overlay, cgroup, namespace or process of
    the run is left."""
    require_tool("systemd-nspawn")
    if os.geteuid() != 0:
        pytest.fail("the chaos run needs root (network namespaces, containers)", pytrace=False)
    out = tmp_path / "chaos"
    proc = subprocess.Popen([sys.executable, "-m", "bench.chaos", "--nodes", "systemd", "--duration", "10m",
                             "--out", str(out), "--job", "skip10:skip:4:*:*:0/10"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: '"start"' in (out / "history.log").read_text(), 180, "a job to start on a booted node")
        assert _our_namespaces(f"x{proc.pid % 100000}") and _left_mounts(out)
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert not _our_namespaces(f"x{proc.pid % 100000}")
    assert not _left_mounts(out)
    containers = json.loads((out / "run.json").read_text())["containers"]
    assert len(containers) == 3 and not [d for c in containers for d in _cgroup_dirs(c) if d.exists()]
    assert not _processes_mentioning(str(out))
