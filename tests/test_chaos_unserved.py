"""Red team (rt12) on 29d5bb7: when a `retry` occurrence lost while Consul served no client is no violation.

The excuse is sound only where the outage covered the wrappers' own start budgets (from each wrapper's fire,
min(120 s, half the time to the next occurrence)): a wrapper that Consul served throughout its budget and that
still ran nothing is consulrun's failure, whatever Consul did later in the interval. Pure checker tests, in the
model of tests/test_chaos.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_chaos import OCC, T0, _fires, _write


def _probes(down_from: float, down_to: float) -> list[dict]:
    lines = [{"t": T0 - 1, "ev": "probe", "node": n, "served": True, "why": "404"} for n in ("c1", "c2", "c3")]
    lines += [{"t": down_from, "ev": "probe", "node": n, "served": False, "why": "500 No cluster leader"}
              for n in ("c1", "c2", "c3")]
    lines += [{"t": down_to, "ev": "probe", "node": n, "served": True, "why": "404"} for n in ("c1", "c2", "c3")]
    return sorted(lines, key=lambda line: line["t"])


def test_an_outage_after_every_wrapper_gave_up_does_not_excuse_a_lost_retry_occurrence(tmp_path: Path) -> None:
    """Every wrapper fired at T0 and exited 0 at T0 + 0.3 having run nothing (a consulrun bug: Consul served
    every client then); Consul then served no client from T0 + 3 to T0 + 5, after every wrapper's start budget
    (2.5 s for a 5 s interval) had ended. The outage cannot have lost the occurrence: it is a violation."""
    exits = [{"t": T0 + 0.3, "ev": "exit", "node": n, "job": "r", "sched": OCC[0], "status": 0}
             for n in ("c1", "c2", "c3")]
    history = sorted([*_fires("r", 0), *exits], key=lambda line: line["t"])
    report = _write(tmp_path, history, [], probes=_probes(T0 + 3.0, T0 + 5.0))
    assert report["jobs"]["r"]["lost_while_no_client_served"] == [], report["jobs"]["r"]
    assert [v["kind"] for v in report["violations"]] == ["lost under retry"]
