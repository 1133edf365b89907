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
  * the watchdog (`consulrun watchdog`, report/watchdog.py; itself a consulrun job run once a
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

from consulrun.timefmt import duration, seconds_between

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

PASSING, WARNING, CRITICAL = "passing", "warning", "critical"
WATCHDOG_JOB = "_watchdog"  # not a manifest job name (those start with a letter or digit): never collides
WATCHDOG_SCHEDULE = "*-*-* *:*:00"
# The fields of a run's record that say how it ended: `status` shows them, the check summarises them.
LAST_FIELDS = ("occurrence", "state", "node", "exit_status", "started", "ended", "takeover", "attempt", "reason")


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
    if kind == "missed":  # it ran nowhere: no node to name
        return CRITICAL, f"{run} was missed: {record.get('reason') or 'no reason recorded'}"
    if kind == "running":
        return PASSING, f"{run} is running on {node} since {record.get('started')}"
    code = record.get("exit_status")
    took = seconds_between(record.get("started"), record.get("ended"))
    after = f" after {duration(took)}" if took is not None else ""
    output = f"{run} ran on {node}: exit status {code}{after} (ended {record.get('ended')})"
    return (PASSING if code == 0 else CRITICAL), output


def finish_op(prefix: str, job: str, record: dict[str, Any]) -> dict[str, Any]:
    """The check operation a run's finish carries: its result, set unconditionally (a result always wins)."""
    status, output = summary({k: record.get(k) for k in (*LAST_FIELDS, "lost")})
    return check_op(prefix, job, status, output)


def registration(prefix: str) -> dict[str, Any]:
    """The catalog registration of the external node and its service (no address to probe: nothing listens)."""
    name = node_name(prefix)
    return {"Node": name, "Address": "127.0.0.1",
            "NodeMeta": {"external-node": "true", "external-probe": "false", "consulrun-prefix": prefix.strip("/")},
            "Service": {"ID": name, "Service": name, "Meta": {"consulrun-prefix": prefix.strip("/")},
                        "Tags": ["consulrun"]}}
