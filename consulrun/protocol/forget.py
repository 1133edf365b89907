"""Forget one job: delete every key under `<prefix>/<job>/` and its health check, never under a live run.

The keys are read, shown, and deleted with check-and-set: every key by
`delete-cas` on the ModifyIndex it was read with, and a lock or occurrence key
that was absent checked still absent. A run that takes the lock (or claims an
occurrence) between the look and the delete changes one of those indexes, so
Consul rolls the whole transaction back and nothing is deleted; a slot key
a run creates meanwhile is simply not among the keys deleted. An old
history or pause entry whose key is outside Consul's strict rule (keys.py)
cannot be named in a request a strict Consul takes: it goes with a
`delete-tree` of its hour's prefix, which reaches no other kind of key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from consulrun.consul.client import Client, decoded, kv_op
from consulrun.errors import ConsulrunError
from consulrun.protocol import health, keys, testhook

MAX_TXN_OPS = 128  # Consul refuses a transaction of more operations
GUARDED = ("lock", "occurrence")  # a starting run writes one of these first: absent ones must stay absent


class JobBusy(ConsulrunError):
    """The job is held or running, or a run started while it was being forgotten: nothing was deleted."""


@dataclass
class Forgetting:
    """What forgetting a job deletes: its keys (key -> ModifyIndex) and its health check, if it has one."""

    base: str
    keys: dict[str, int] = field(default_factory=dict)
    check: dict[str, Any] | None = None  # {"Node", "CheckID"} of the job's check in the catalog
    left: list[str] = field(default_factory=list)  # keys outside Consul's strict rule no consulrun wrote

    def lines(self) -> list[str]:
        out = [f"{len(self.keys)} key(s) under {self.base}/:"] + [f"  {key}" for key in sorted(self.keys)]
        if self.left:
            out.append(f"left as they are ({len(self.left)}: outside Consul's strict key rule, and not written by "
                       "consulrun; `consul kv delete` them on a Consul that takes them):")
            out += [f"  {key}" for key in sorted(self.left)]
        if self.check:
            out.append(f"health check {self.check['CheckID']} on node {self.check['Node']}")
        return out


def look(client: Client, prefix: str, job: str) -> Forgetting:
    """Read what forgetting `job` would delete; JobBusy if a session holds its lock or a live run claims it."""
    base = keys.job_base(prefix, job)
    _, entries = client.kv_tree(base + "/")
    found = Forgetting(base=base, keys={e["Key"]: int(e["ModifyIndex"]) for e in entries})
    found.left = _past_ops(found)[1]
    for key in found.left:
        del found.keys[key]
    for entry in entries:
        rest = entry["Key"][len(base) + 1:]
        if (rest == "lock" or rest.startswith("slots/")) and entry.get("Session"):
            holder = decoded(entry)
            raise JobBusy(f"{job} is held by {holder.get('node') or '?'} (session {entry['Session']}): nothing "
                          "forgotten; let the run end (or `unlock` it) first")
        if rest == "occurrence":
            record = decoded(entry)
            if record.get("state") == "running" and record.get("session") and \
                    client.session_visible(str(record["session"])) is not None:
                raise JobBusy(f"{job} is running on {record.get('node') or '?'} (occurrence "
                              f"{record.get('occurrence')}): nothing forgotten; let it end first")
    node = health.node_name(prefix)
    if client.catalog_node(node) is not None:
        wanted = health.check_id(job)
        if any(c.get("CheckID") == wanted for c in client.node_checks(node)):
            found.check = {"Node": node, "CheckID": wanted}
    return found


def _guards(found: Forgetting) -> list[dict[str, Any]]:
    return [kv_op("check-not-exists", f"{found.base}/{key}") for key in GUARDED  # lock, occurrence (keys.py)
            if f"{found.base}/{key}" not in found.keys]


def _past_ops(found: Forgetting) -> tuple[list[dict[str, Any]], list[str]]:
    """The deletes of the keys that only record the past (each `delete-cas` on its index; old keys outside the
    strict rule by their hour's `delete-tree`), and the keys no delete can name."""
    listed = sorted(found.keys)
    live = [k for k in listed if _live(found, k)]
    past = [k for k in listed if k not in live]
    ops: list[dict[str, Any]] = []
    left: list[str] = []
    for directory in (keys.history_prefix(found.base), keys.episodes_prefix(found.base)):
        mine = [k for k in past if k.startswith(directory)]
        done, cannot = keys.delete_ops(mine, listed, directory,
                                       op=lambda k: kv_op("delete-cas", k, Index=found.keys[k]))
        ops += done
        left += cannot
    others = [k for k in past if not k.startswith((keys.history_prefix(found.base), keys.episodes_prefix(found.base)))]
    ops += [kv_op("delete-cas", k, Index=found.keys[k]) for k in others if keys.nameable(k)]
    return ops, left + [k for k in others if not keys.nameable(k)]


def _live(found: Forgetting, key: str) -> bool:
    rest = key[len(found.base) + 1:]
    return rest in GUARDED or rest.startswith(keys.SLOTS)


def forget(client: Client, found: Forgetting) -> None:
    """Delete what `look` found, in one transaction (in batches, each guarded, if Consul's limit requires),
    the lock-bearing keys last; JobBusy, with nothing more deleted, if a run started since the look."""
    testhook.pause("forget-before-delete")
    guards = _guards(found)
    live = [k for k in sorted(found.keys) if _live(found, k)]
    # Keys that only record the past go first if they must be split off; the last batch holds the live ones.
    past = _past_ops(found)[0]
    check_ops = [{"Check": {"Verb": "delete", "Check": found.check}}] if found.check else []
    chunk = MAX_TXN_OPS - len(guards) - len(live) - len(check_ops)
    cut = max(0, len(past) - chunk)
    for n in range(0, cut, chunk):  # each guarded by the live keys' indexes, so a run starting meanwhile stops it
        ops = guards + [kv_op("check-index", k, Index=found.keys[k]) for k in live] + past[n:min(n + chunk, cut)]
        if client.txn(ops) is None:
            raise _started(found)
    ops = guards + past[cut:] + [kv_op("delete-cas", k, Index=found.keys[k]) for k in live] + check_ops
    if client.txn(ops) is None:
        raise _started(found)


def _started(found: Forgetting) -> JobBusy:
    return JobBusy(f"{found.base}/ changed while being forgotten (a run started?): the transaction was refused and "
                   "nothing more was deleted; look again")
