"""Several runs of bench/scale.py side by side: each phase's varying figures as min / median / max over the runs.

One run's lags and CPU figures are one sample of a machine's scheduling; the
counts (ran once, more, not) and Raft writes per occurrence barely vary. This
reads each run's `phases.jsonl` and prints, per clients x jobs a minute x tool,
how many runs had that phase, the totals of the counts, and min / median / max
of the rest (Markdown).

Usage: python bench/scale_runs.py DIR [DIR ...]      (each DIR the --out of one bench/scale.py run)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

FIGURES = [  # (column, how to get it from a phase, format)
    ("Raft writes per occurrence", lambda p: p.get("writes_per_occurrence"), "{:.2f}"),
    ("lag p50 (s)", lambda p: p["lag_s"].get("p50"), "{:.2f}"),
    ("lag p99 (s)", lambda p: p["lag_s"].get("p99"), "{:.2f}"),
    ("loser CPU p50 (ms)", lambda p: p["loser_cpu_ms"].get("p50"), "{:.0f}"),
    ("winner CPU p50 (ms)", lambda p: p["winner_cpu_ms"].get("p50"), "{:.0f}"),
    ("leader CPU (% of a core)", lambda p: p["cpu_pct"].get("leader"), "{:.1f}"),
    ("machine CPU (% of a core)", lambda p: p["cpu_pct"].get("machine"), "{:.0f}"),
]


def spread(values: list[float], fmt: str) -> str:
    """min / median / max, or the one value, or `-` when no run measured it."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def load(dirs: list[Path]) -> dict[tuple[int, int, str], list[dict[str, Any]]]:
    phases: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for d in dirs:
        for line in (d / "phases.jsonl").read_text().splitlines():
            phase = json.loads(line)
            phases.setdefault((phase["clients"], phase["jobs_per_minute"], phase["tool"]), []).append(phase)
    return phases


def markdown(dirs: list[Path]) -> str:
    phases = load(dirs)
    head = ["clients", "jobs/min", "tool", "runs", "occurrences", "ran once / more / not", "stopped or shed",
            *[name for name, _, _ in FIGURES]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (clients, jobs, tool), got in sorted(phases.items()):
        def total(key: str, got: list[dict[str, Any]] = got) -> int:
            return sum(int(p.get(key) or 0) for p in got)

        cut = sum(1 for p in got if p.get("aborted") or p.get("shed"))
        cells = [str(clients), str(jobs), tool, str(len(got)), str(total("occurrences")),
                 f"{total('ran_once')} / {total('ran_more')} / {total('ran_none')}", f"{cut} of {len(got)}"]
        for _, get, fmt in FIGURES:
            cells.append(spread([float(v) for p in got if (v := get(p)) is not None], fmt))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(markdown([Path(a) for a in sys.argv[1:]]), end="")
