"""The watchdog: what only a clock can see (missed and overdue occurrences, dead holders, pauses), as each job's check.

`consulrun watchdog` is itself a consulrun job, run once a minute on one
node. It judges every job as `status` does and writes each job's Consul
check (protocol/health.py says the shape, and who else writes there) only
where its status or output would change: in the steady state it writes
nothing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime

from consulrun.consul.client import Client
from consulrun.errors import ConsulProtocolError, PermissionDenied, UsageError
from consulrun.protocol.health import CRITICAL, PASSING, WARNING, check_id, check_op, node_name, registration, summary
from consulrun.protocol.pause import describe as describe_pause
from consulrun.report import status as state

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger("consulrun")

_RANK = {PASSING: 0, WARNING: 1, CRITICAL: 2}
# Problems only a clock (the watchdog) sees; a record's own failure is in its summary already.
CLOCK_PROBLEMS = ("missed", "future", "skew", "overdue", "unhealthy", "stalled")


def _clock_text(problem: dict[str, Any]) -> str:
    """A problem's line in the check output, without anything that changes by the minute (no rewrite each tick)."""
    if problem["kind"] == "overdue":
        what = f"occurrence {problem['occurrence']}" if problem.get("occurrence") else "a run"
        return f"overdue: {what} has run longer than the job's timeout"
    if problem["kind"] == "skew":  # its detail names a lead that shrinks as the record ages
        return (f"skew: {problem['node']}'s clock is ahead of another node's (the watchdog's, or the one that found "
                "it) by more than 2s: it claims occurrences before they are due")
    if problem["kind"] == "future":  # its detail names a limit that moves with the clock
        return (f"future: the occurrence record claims {problem['occurrence']}, later than the next occurrence plus "
                "the allowed clock skew; runs refuse it until it is removed")
    if problem["kind"] == "stalled":  # its detail says how long it has waited: that grows
        return (f"stalled: the run after {problem['parent']}'s run {problem['run']} has waited "
                f"since {problem['since']} and no node took it (is chain-watch running where "
                "the job is installed?)")
    return f"{problem['kind']}: {problem['detail']}"


def verdict(job: state.JobStatus) -> tuple[str, str] | None:
    """What the watchdog wants `job`'s check to say; None when a healthy run is under way (keep the check)."""
    status, output = summary(job.last)
    # An each-node job's runs write no check (one check cannot hold every node's result): the watchdog says a
    # node's failed, lost or missed run and a node that is down (status names the node in each such problem).
    clock = [p for p in job.problems if p["kind"] in CLOCK_PROBLEMS or (job.nodes is not None and p.get("node"))]
    lines = [_clock_text(p) for p in clock]
    if clock:
        status = CRITICAL
    if job.paused:
        lines.append(describe_pause(job.paused))
        status = status if _RANK[status] >= _RANK[WARNING] else WARNING
    if not lines and (job.last or {}).get("state") == "running":
        return None
    return status, "\n".join([*lines, output])


@dataclass(frozen=True)
class WatchedTimer:
    accuracy_ms: int
    randomized_delay_ms: int


@dataclass(frozen=True)
class WatchedJob:
    """What `status` needs of a manifest job to judge missed and overdue runs."""

    name: str
    schedules: tuple[str, ...]
    timer: WatchedTimer
    timeout_ms: int | None


@dataclass(frozen=True)
class Watched:
    """The jobs a watchdog judges: the manifest's schedules and timeouts, carried in its unit's command line."""

    jobs: tuple[WatchedJob, ...]

    @classmethod
    def from_manifest(cls, manifest: Any) -> "Watched":
        return cls(tuple(WatchedJob(j.name, tuple(j.schedules), WatchedTimer(j.timer.accuracy_ms, j.timer.randomized_delay_ms),
                                    j.timeout_ms) for j in manifest.jobs
                         if j.schedules))  # a job that only runs after others has no time to be missed by

    def to_json(self) -> str:
        return json.dumps({j.name: {"schedules": list(j.schedules), "accuracy_ms": j.timer.accuracy_ms,
                                    "randomized_delay_ms": j.timer.randomized_delay_ms, "timeout_ms": j.timeout_ms}
                           for j in self.jobs}, sort_keys=True, separators=(",", ":"))

    @classmethod
    def merged(cls, lists: list["Watched"]) -> "Watched":
        """Several manifests' lists judged as one (they share a watchdog unit); a job in two lists
        is judged by the first."""
        jobs: dict[str, WatchedJob] = {}
        for watched in lists:
            for job in watched.jobs:
                if job.name in jobs and jobs[job.name] != job:
                    log.warning("watchdog: job %s is in two manifests' job lists with different "
                                "schedules or timeouts; judged by the first", job.name)
                jobs.setdefault(job.name, job)
        return cls(tuple(jobs[name] for name in sorted(jobs)))

    @classmethod
    def from_json(cls, text: str) -> "Watched":
        try:
            data = json.loads(text)
            watched = cls(tuple(WatchedJob(name, tuple(str(s) for s in v["schedules"]),
                                           WatchedTimer(int(v["accuracy_ms"]), int(v["randomized_delay_ms"])),
                                           int(v["timeout_ms"]) if v.get("timeout_ms") is not None else None)
                                for name, v in sorted(data.items())))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not the watchdog's job list ({type(exc).__name__}: {exc})") from None
        from consulrun.manifest.schema import schedule_problem

        for job in watched.jobs:
            problems = [p for p in map(schedule_problem, job.schedules) if p] or \
                ([] if job.schedules else ["no schedule"])
            if problems:
                raise ValueError(f"job {job.name}: {problems[0]}")
        return watched


def ensure_registered(client: Client, prefix: str) -> bool:
    """Register the external node and service unless the catalog already has them as wanted; True if it wrote."""
    wanted = registration(prefix)
    found = client.catalog_node(wanted["Node"]) or {}
    node = found.get("Node") or {}
    meta = node.get("Meta") or {}
    if node and meta.get("external-node") != "true":  # a real agent's node: registering over it would hijack it
        raise UsageError(f"the Consul catalog already has a node {wanted['Node']} that is not consulrun's external "
                         f"node (an agent's); the health checks of prefix {prefix.strip('/')!r} need that name: "
                         "rename the node or use another kv_prefix")
    owner = meta.get("consulrun-prefix")
    if node and owner != prefix.strip("/"):  # node names ignore case, and `a/b` and `a-b` both give `a-b`
        raise UsageError(f"the Consul catalog node {wanted['Node']} holds the health checks of prefix {owner!r}, "
                         f"not {prefix.strip('/')!r}; two prefixes that give one node name (they differ only in "
                         "case, or in '/' against '-') cannot both have health checks")
    service = (found.get("Services") or {}).get(wanted["Service"]["ID"]) or {}
    if node and all((node.get("Meta") or {}).get(k) == v for k, v in wanted["NodeMeta"].items()) and \
            service.get("Service") == wanted["Service"]["Service"]:
        return False
    client.catalog_register(wanted)
    log.info("registered the external node %s and its service %s in the Consul catalog", wanted["Node"],
             wanted["Service"]["ID"])
    return True


@dataclass
class Report:
    registered: bool = False
    changed: list[str] = field(default_factory=list)  # "job: status" for each check written


def watchdog(client: Client, prefix: str, watched: Watched | None, *, grace_s: float = state.DEFAULT_GRACE_S,
             now: datetime | None = None, attempts: int = 3) -> Report:
    """Bring every job's check in line with `status`'s verdict; write only what changes.

    The checks are read before the KV state and written with check-and-set on
    their ModifyIndex: a run's finish between the two reads makes the write
    fail (the run's result stands), and the evaluation starts over.
    """
    node = node_name(prefix)
    try:
        report = Report(registered=ensure_registered(client, prefix))
    except PermissionDenied as exc:
        raise PermissionDenied(f"{exc.message} (the watchdog needs node \"{node}\" and service \"{node}\" write: "
                               "see `consulrun acl-policy`)") from None
    for _ in range(attempts):
        checks = {c["CheckID"]: c for c in client.node_checks(node) if c.get("ServiceID") == node}
        try:
            _, statuses = state.collect(client, prefix, watched, now=now, grace_s=grace_s)  # type: ignore[arg-type]
        except state.NoState:
            statuses = [state.JobStatus(job=j.name, state="never run", in_manifest=True) for j in (watched.jobs if watched else ())]
        ops, changed = [], []
        for job in statuses:
            current = checks.pop(check_id(job.job), None)
            want = verdict(job)
            if want is None and current and current.get("Status") != PASSING:
                want = summary(job.last)  # a run is under way after an alert: say so once
            if want is None or (current and (current.get("Status"), current.get("Output")) == want):
                continue
            ops.append(check_op(prefix, job.job, *want, verb="cas", index=int(current["ModifyIndex"]) if current else 0))
            changed.append(f"{job.job}: {want[0]}")
        for gone in checks.values():  # a job with neither state in Consul nor a place in the manifest
            ops.append({"Check": {"Verb": "delete-cas", "Check": {"Node": node, "CheckID": gone["CheckID"],
                                                                  "ServiceID": node, "ServiceName": node,
                                                                  "ModifyIndex": int(gone["ModifyIndex"])}}})
            changed.append(f"{gone.get('Name') or gone['CheckID']}: removed")
        if not ops:
            return report
        if all(client.txn(ops[i:i + 64]) is not None for i in range(0, len(ops), 64)):
            report.changed = changed
            return report
        log.info("a check changed while the watchdog judged it (a run finished); judging again")
    raise ConsulProtocolError(f"the health checks of {node} kept changing while the watchdog judged them; "
                              "trying again at its next run")
