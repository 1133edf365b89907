"""`status` of a `mode: each-node` job: each node's latest occurrence, and the nodes that are down.

Which nodes the job is installed on, as far as Consul can say: every node that
has ever recorded a run of it (`<prefix>/<job>/nodes/<node>/`), and, for a job
with `nodes:`, every catalog node its placement matches (`install` puts its
units exactly there). Without `nodes:` the catalog alone cannot tell a node
that has the job from one that does not (a server, a node of another
manifest), so only recording nodes count: naming every catalog node would
report nodes that never had the job.

A node that is down (its serfHealth critical) runs none of the job's
occurrences until it is back, and nobody waits for it (its slot is freed by
its session's invalidation): it is reported, a problem of kind `node-down`,
as serious as a missed occurrence.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from consulrun.consul.client import Client, decoded
from consulrun.manifest import calendar
from consulrun.protocol.eachnode import node_of_key
from consulrun.protocol.keys import segment, stamp
from consulrun.timefmt import parse_time

if TYPE_CHECKING:
    from consulrun.manifest.loader import Job
    from consulrun.report.status import JobStatus

NODE_FIELDS = ("occurrence", "state", "exit_status", "started", "ended", "attempt", "reason")


def node_records(keys: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Node name (from its key, never from a field a writer chose) -> its latest occurrence record."""
    found = {}
    for key, entry in keys.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "nodes" and parts[2] == "occurrence":
            found[node_of_key(parts[1])] = decoded(entry)
    return found


def newest(records: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The record of the newest occurrence any node claimed (the latest start among them): the job's `last`."""
    if not records:
        return None
    return max(records.values(), key=lambda r: (str(r.get("occurrence") or ""), str(r.get("started") or "")))


def judge(status: JobStatus, keys: dict[str, dict[str, Any]], schedules: tuple[str, ...], lag_s: float | None,
          now: datetime, judged: dict[str, Any] | None) -> None:
    """Each node's row in `status.nodes`, and a problem for each node whose latest run failed, was lost or missed
    (the `judged` record, the job's own `last`, was judged already), or which is an occurrence behind: it neither
    ran nor recorded missed an occurrence whose every wait is over."""
    records = node_records(keys)
    sessions = {h["session"] for h in status.holders}
    due = calendar.previous(list(schedules), now - timedelta(seconds=lag_s)) if schedules and lag_s is not None \
        else None
    prior = calendar.previous(list(schedules), due - timedelta(seconds=1)) if due is not None else None
    status.nodes = []
    for node in sorted(records):
        record = records[node]
        state = record.get("state")
        if state == "running" and record.get("session") not in sessions:
            state = "abandoned"
        status.nodes.append({"node": node, **{k: record.get(k) for k in NODE_FIELDS}, "state": state,
                             "healthy": True})
        if record == judged:  # the job's own `last`, judged already
            continue
        what = f"occurrence {record.get('occurrence')} on {node}"
        if state in ("lost", "abandoned"):
            status.problem(state, f"{what} was {state}: {record.get('reason') or 'no reason recorded'}",
                           occurrence=record.get("occurrence"), node=node)
        elif state == "missed":
            status.problem("missed", f"{what} was missed: {record.get('reason') or 'no reason recorded'}",
                           occurrence=record.get("occurrence"), node=node)
        elif record.get("exit_status") not in (None, 0):
            status.problem("failed", f"{what} exited {record['exit_status']}", occurrence=record.get("occurrence"),
                           node=node)
        if prior is not None and str(record.get("occurrence") or "") < calendar.occurrence_id(prior) \
                and not _in_history(keys, node, calendar.occurrence_id(prior)):
            status.problem("missed", f"occurrence {calendar.occurrence_id(prior)} neither ran nor was recorded "
                                     f"missed on {node}; its latest is {record.get('occurrence')}",
                           occurrence=calendar.occurrence_id(prior), node=node)


def _in_history(keys: dict[str, dict[str, Any]], node: str, occurrence: str) -> bool:
    """Whether `node`'s history has an entry for `occurrence` (a miss recorded there alone, while the node's
    own earlier run still held its record)."""
    return f"nodes/{segment(node)}/history/{stamp(occurrence)}" in keys


def recorded_misses(status: JobStatus, keys: dict[str, dict[str, Any]], now: datetime,
                    window_s: float) -> None:
    """Misses recorded in a node's history within `window_s`, other than its record's (judged above): a node
    whose own run of an earlier occurrence outlived its interval records the next one missed in its history
    entry alone, and the record, that run's, then ends `done`."""
    records = node_records(keys)
    for key, entry in sorted(keys.items()):
        parts = key.split("/")
        if len(parts) != 4 or parts[0] != "nodes" or parts[2] != "history":
            continue
        node, value = node_of_key(parts[1]), decoded(entry)
        when = parse_time(value.get("occurrence"))
        if value.get("state") != "missed" or when is None or (now - when).total_seconds() > window_s \
                or value.get("occurrence") == records.get(node, {}).get("occurrence"):
            continue
        status.problem("missed", f"occurrence {value['occurrence']} on {node} was missed: "
                                 f"{value.get('reason') or 'no reason recorded'}",
                       occurrence=value["occurrence"], node=node)


def down_nodes(client: Client, status: JobStatus, job: Job | None) -> None:
    """A `node-down` problem for each node the job is installed on (see the module's note) whose serfHealth is
    critical; its row says so. Two stale reads (the catalog only for a job with `nodes:`)."""
    rows = {row["node"]: row for row in status.nodes or []}
    installed = set(rows)
    placement = getattr(job, "placement", None)
    if placement is not None:
        metas, _ = client.node_metas()
        installed |= {name for name, meta in metas.items() if placement.matches(name, meta)}
    if not installed:
        return
    failing = client.failing_nodes()
    for node in sorted(installed & failing):
        if node not in rows:
            rows[node] = {"node": node, **{k: None for k in NODE_FIELDS}, "state": "never run"}
            (status.nodes or []).append(rows[node])
        rows[node]["healthy"] = False
        status.problem("node-down", f"{node} is failing in Consul (serfHealth critical): it runs none of the job's "
                                    "occurrences until it is back; the other nodes do not wait for it", node=node)
    if status.nodes is not None:
        status.nodes.sort(key=lambda row: row["node"])
