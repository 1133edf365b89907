"""Each job's health as a Consul health check, where the Consul UI and anything built on Consul health look.

Shape (consul-esm's pattern for things no agent runs on): one external catalog
node per KV prefix (node meta `external-node: "true"`, `external-probe:
"false"`, so no agent and no ESM ever probes or reaps it), one service on it,
and one service check per job (CheckID `job:<job>`). The node and the service
are named after the prefix (`ops/cron` -> `ops-cron`), so two prefixes do not
share checks (two that differ only in case or by `/` against `-` would: the
node's `consulrun-prefix` meta says whose it is, and the other's watchdog
refuses, as it does for a node of that name that a real agent owns).

Who writes a check, and why nodes never fight over it:
  * the node that ran an occurrence, in the same transaction as its finish
    (the result, the history entry and the release): no extra Raft write. It
    `set`s the check: a run's result always wins.
  * the watchdog (`consulrun watchdog`, itself a consulrun job run once a
    minute on one node), for what only a clock can see: missed and overdue
    occurrences, dead holders, pauses. It reads the checks before the KV
    state and writes with `cas` on each check's ModifyIndex, so a run that
    finished in between makes its write fail instead of being overwritten by a
    verdict older than it. It writes only a check whose status or output
    would change: in the steady state it writes nothing.
Both derive the output from the same record fields with `summary`, so what
the runner wrote is exactly what the watchdog would write.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime

from consulrun.report import status as state
from consulrun.consul.client import Client
from consulrun.errors import ConsulProtocolError, PermissionDenied, UsageError
from consulrun.protocol.pause import describe as describe_pause

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger("consulrun")

PASSING, WARNING, CRITICAL = "passing", "warning", "critical"
_RANK = {PASSING: 0, WARNING: 1, CRITICAL: 2}
WATCHDOG_JOB = "_watchdog"  # not a manifest job name (those start with a letter or digit): never collides
WATCHDOG_SCHEDULE = "*-*-* *:*:00"
# Problems only a clock (the watchdog) sees; a record's own failure is in its summary already.
CLOCK_PROBLEMS = ("missed", "overdue", "unhealthy")


def node_name(prefix: str) -> str:
    """The external node (and service) of a KV prefix: its segments joined by '-'."""
    return prefix.strip("/").replace("/", "-")


def check_id(job: str) -> str:
    """`job:<job>`, each capital written `^` + its lower case: Consul compares check IDs ignoring case, and job
    names are case-sensitive (`Backup` and `backup` are two jobs, with two checks). `^` is in no job name."""
    return "job:" + "".join(f"^{c.lower()}" if c.isupper() else c for c in job)


def check_op(prefix: str, job: str, status: str, output: str, *, verb: str = "set",
             index: int | None = None) -> dict[str, Any]:
    """One `Check` operation of a transaction on `job`'s check (a service check: ACLs ask service:write)."""
    name = node_name(prefix)
    check: dict[str, Any] = {"Node": name, "CheckID": check_id(job), "Name": job, "Status": status,
                             "Output": output, "ServiceID": name, "ServiceName": name,
                             "Notes": f"consulrun job {job}: keys under {prefix.strip('/')}/{job}/"}
    if index is not None:
        check["ModifyIndex"] = index
    return {"Check": {"Verb": verb, "Check": check}}


def summary(record: dict[str, Any] | None) -> tuple[str, str]:
    """(status, output) for a job's last run, from the fields `status` keeps of it (LAST_FIELDS).

    A run without `--schedule` keeps its result in the lock's value, where a
    lost run has `lost` (its reason) and no `state`.
    """
    if not record:
        return PASSING, "never run"
    run = f"occurrence {record['occurrence']}" if record.get("occurrence") else f"run started {record.get('started')}"
    node = record.get("node") or "?"
    kind = record.get("state") or ("lost" if record.get("lost") else "done")
    if kind in ("lost", "abandoned"):
        reason = record.get("reason") or record.get("lost") or "no reason recorded"
        return CRITICAL, f"{run} on {node} was {kind}: {reason}"
    if kind == "running":
        return PASSING, f"{run} is running on {node} since {record.get('started')}"
    code = record.get("exit_status")
    took = state.seconds_between(record.get("started"), record.get("ended"))
    duration = f" after {took:.1f}s" if took is not None else ""
    output = f"{run} ran on {node}: exit status {code}{duration} (ended {record.get('ended')})"
    return (PASSING if code == 0 else CRITICAL), output


def finish_op(prefix: str, job: str, record: dict[str, Any]) -> dict[str, Any]:
    """The check operation a run's finish carries: its result, set unconditionally (a result always wins)."""
    status, output = summary({k: record.get(k) for k in (*state.LAST_FIELDS, "lost")})
    return check_op(prefix, job, status, output)


def _clock_text(problem: dict[str, Any]) -> str:
    """A problem's line in the check output, without anything that changes by the minute (no rewrite each tick)."""
    if problem["kind"] == "overdue":
        what = f"occurrence {problem['occurrence']}" if problem.get("occurrence") else "a run"
        return f"overdue: {what} has run longer than the job's timeout"
    return f"{problem['kind']}: {problem['detail']}"


def verdict(job: state.JobStatus) -> tuple[str, str] | None:
    """What the watchdog wants `job`'s check to say; None when a healthy run is under way (keep the check)."""
    status, output = summary(job.last)
    clock = [p for p in job.problems if p["kind"] in CLOCK_PROBLEMS]
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
                                    j.timeout_ms) for j in manifest.jobs))

    def to_json(self) -> str:
        return json.dumps({j.name: {"schedules": list(j.schedules), "accuracy_ms": j.timer.accuracy_ms,
                                    "randomized_delay_ms": j.timer.randomized_delay_ms, "timeout_ms": j.timeout_ms}
                           for j in self.jobs}, sort_keys=True, separators=(",", ":"))

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


def registration(prefix: str) -> dict[str, Any]:
    """The catalog registration of the external node and its service (no address to probe: nothing listens)."""
    name = node_name(prefix)
    return {"Node": name, "Address": "127.0.0.1",
            "NodeMeta": {"external-node": "true", "external-probe": "false", "consulrun-prefix": prefix.strip("/")},
            "Service": {"ID": name, "Service": name, "Meta": {"consulrun-prefix": prefix.strip("/")},
                        "Tags": ["consulrun"]}}


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
