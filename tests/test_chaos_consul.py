"""The chaos suite's Consul faults: a rolling restart of the servers keeps the guarantees, and the checker
counts what a snapshot restore repeats apart from violations (bench/chaos/consul_faults.py, docs/chaos.md)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import artifact_dir, require_tool
from tests.harness.chaos import (
    OCC,
    T0,
    fire_lines as _fires,
    kept_on_failure,
    run_chaos,
    run_lines as _run,
    write_and_check as _write,
)

REPO = Path(__file__).resolve().parents[1]


def test_checker_counts_a_rerun_after_a_snapshot_restore_apart(tmp_path: Path) -> None:
    """A skip occurrence started twice is a duplicate; with a snapshot restore between the two starts (which took
    the claim back) it is the restore's documented repeat, counted apart; the restore's summary is reported."""
    first = _run("s", "c1", 100, OCC[0], 10, T0 + 0.5, 10)
    again = _run("s", "c2", 200, OCC[0], 20, T0 + 3.0, 10)
    history = sorted([*_fires("s", 0), *first, *again], key=lambda line: line["t"])
    plain = _write(tmp_path / "plain", history, [])
    assert [v["kind"] for v in plain["violations"]] == ["duplicate under skip"]
    nemesis = [{"t": T0 - 20, "ev": "snapshot", "node": "s1", "status": 0, "index": 40},
               {"t": T0 + 2.0, "ev": "fault", "id": 1, "kind": "snapshot-restore", "node": "s1", "index": 40,
                "age_s": 22.0, "holder": None, "job": None},
               {"t": T0 + 2.2, "ev": "heal", "id": 1, "kind": "snapshot-restore", "healed": T0 + 2.1,
                "recovered": T0 + 2.2, "status": 0, "took_s": 0.1}]
    report = _write(tmp_path / "restored", history, nemesis)
    assert report["violations"] == []
    job = report["jobs"]["s"]
    assert [r["occurrence"] for r in job["repeated_after_restore"]] == [OCC[0]]
    assert job["repeated_after_restore"][0]["restores"] == ["snapshot-restore@s1#1"]
    assert report["consul_faults"]["restores"][0]["snapshot_age_s"] == 22.0


@pytest.mark.cluster
@pytest.mark.consul
def test_rolling_restart_of_the_servers_keeps_the_guarantees(consul_bin: str, tmp_path: Path,
                                                            request: pytest.FixtureRequest) -> None:
    """Timers on 3 clients while the 3 servers are restarted one at a time, round after round (followers first,
    the leader last, each back as a caught-up voter before the next): no overlap, no duplicate under skip, no
    retry occurrence lost."""
    require_tool("ip")
    if os.geteuid() != 0:
        pytest.fail("the chaos run needs root for network namespaces", pytrace=False)
    out = tmp_path / "chaos"
    cmd = [sys.executable, "-m", "bench.chaos", "--duration", "75s", "--out", str(out), "--seed",
           os.environ.get("CONSULRUN_CHAOS_SEED", "11"), "--faults", "rolling-restart",
           "--job", "skip10:skip:4:*:*:0/10", "--job", "retry30:retry:1:*:*:0/30"]
    proc, stderr = run_chaos(cmd, 400, 120)
    with kept_on_failure(request, out, stderr):
        report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
        assert report is not None, f"the run made no report (exit {proc.returncode}):\n{stderr[-3000:]}"
        restarts = report["consul_faults"]["restarts"]
        rounds = {r["round"]: [x for x in restarts if x["round"] == r["round"]] for r in restarts}
        # A round the run's end cut short (its waits stopped) has no times to judge; any other must have them all.
        whole = [steps for steps in rounds.values() if len(steps) == 3 and not any(s["cut_short"] for s in steps)]
        assert whole, f"no whole round of restarts: {restarts}"
        for steps in whole:
            assert {s["node"] for s in steps} == {"server1", "server2", "server3"}
            assert [s["was_leader"] for s in steps] == [False, False, True], "the leader is restarted last"
            for step in steps:
                assert step["voter_after_s"] is not None and step["caught_up_after_s"] is not None, step
        assert report["jobs"]["skip10"]["completed"] > 0 and report["jobs"]["retry30"]["completed"] > 0
        assert proc.returncode == 0 and not report["violations"], \
            f"violations (history in {artifact_dir(request.node)}):\n{(out / 'report.md').read_text()[-6000:]}"
