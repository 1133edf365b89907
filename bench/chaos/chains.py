"""The checker's rule for chained jobs (`after:`): no chained run without its parent's end, as asked, and at
most one per parent run.

A chained run says which parent run it follows in its occurrence, `<parent occurrence>~after~<parent>`
(CONSULRUN_OCCURRENCE, docs/chains.md). The chaos job exits 0 whenever it ends, so a parent run "succeeded" if
its end line came, and "failed" if it died (fenced, killed) without one. A chained run is judged against the
parent's runs of that occurrence as the history shows them at the instant the chained run started:
  success  some parent run of it had ended;
  failure  some had started, none had ended, and none was still alive (its last line was before);
  always   some had ended or died.
Two chained runs for one parent run under two fencing tokens are two holders: a duplicate; so are more runs
to their end than the child's `attempts` (its retries included).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

SEPARATOR = "~after~"


def _ended_as(on: str, parents: list[Any], at: float) -> bool:
    before = [p for p in parents if p.start <= at]
    ended = [p for p in before if p.ended and p.last <= at]
    gone = [p for p in before if p.last <= at]
    if on == "success":
        return bool(ended)
    if on == "failure":
        return bool(before) and not ended and len(gone) == len(before)
    return bool(gone)


def judge(spec: dict[str, Any], runs_by_job: dict[str, list[Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The job's chain entries for the report, and the violations; ({}, []) for a job that runs after nothing."""
    after = {a["job"]: a.get("on", "success") for a in spec.get("after") or []}
    if not after:
        return {}, []
    name = spec["name"]
    groups: dict[tuple[str, str], list[Any]] = defaultdict(list)
    without: list[dict[str, Any]] = []
    for run in runs_by_job.get(name, []):
        parent_occ, sep, parent = run.occ.rpartition(SEPARATOR)
        if not sep:
            continue  # a run of the job's own schedule
        groups[(parent, parent_occ)].append(run)
        parents = [p for p in runs_by_job.get(parent, []) if p.occ == parent_occ]
        if parent not in after or not _ended_as(after[parent], parents, run.start):
            without.append({"run": _describe(run), "parent": parent, "parent_occurrence": parent_occ,
                            "on": after.get(parent), "parent_runs": [_describe(p) for p in parents],
                            "evidence": [*run.lines, *(ln for p in parents for ln in p.lines)]})
    # Two holders for one parent run, or more runs to their end than the child's attempts (its retries): a
    # retry that could not start must not give the request back for another node to run again.
    allowed = int(spec.get("attempts", 1))
    twice = [{"parent": parent, "parent_occurrence": occ, "runs": [_describe(r) for r in rs],
              "evidence": [ln for r in rs for ln in r.lines]}
             for (parent, occ), rs in sorted(groups.items())
             if len({r.token for r in rs}) > 1 or sum(r.ended for r in rs) > allowed]
    entry = {"after": after, "chained_runs": sum(len(rs) for rs in groups.values()),
             "chained_without_parent_end": without, "chained_twice": twice}
    violations = [{"kind": "chained run without its parent's end", "job": name, **item} for item in without]
    violations += [{"kind": "chained run twice for one parent run", "job": name, **item} for item in twice]
    return entry, violations


def _describe(run: Any) -> str:
    how = "ended" if run.ended else "died"
    return f"{run.node} pid {run.pid} occ {run.occ} token {run.token} {run.start:.3f}-{run.last:.3f} {how}"
