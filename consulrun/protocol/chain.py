"""Job chains (`after:`): a job run once for each occurrence of another that ended as asked.

The parent's end is a request key, `<prefix>/<child>/after/<parent>/<run>`
({parent, run, state, exit_status, node, ended}), written in the very
transaction that records the parent's final result (`then_ops`, carried by the
occurrence record's check-and-set): there is no instant at which the parent
has ended and the request does not exist, so the node that ran the parent may
die the moment after. `<run>` is the parent run's own id: its occurrence, or,
for a parent that is itself chained, its `<occurrence>~after~<grandparent>`.

Every node where the child is installed watches its `after/` keys with
blocking reads (`consulrun chain-watch`, chainwatch.py: no write while
idle) and starts the child's unit; the child's `consulrun run` takes the lock
and consumes the request in one transaction: check-and-delete of the request
and check-and-set, from nothing, of its history entry
`history/<run's segment>,after,<parent>` (keys.py), so of all the nodes racing for it one runs it,
once, and even a request written again later (a re-recorded parent) cannot run
it twice. The run is then recorded like a manual run, in that history entry,
and its own end is a request for its own children.

A request that finds no node (every node with the child down) waits in KV and
runs when one comes back, unless the child has a `start_deadline` and the
parent ended longer ago than that: then it is recorded missed, not run. A
request arriving while the child is paused is recorded skipped (as a paused
job's occurrences are); one from a job the child no longer runs after (the
manifest changed) is removed, said once.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from consulrun.consul.client import decoded, kv_op
from consulrun.consul.values import printable
from consulrun.errors import ConsulrunError, MalformedValue
from consulrun.protocol import keys, pause
from consulrun.protocol.lock import describe_holder, now_iso
from consulrun.records import record
from consulrun.timefmt import duration

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

    from consulrun.protocol.lock import Held, Locker
    from consulrun.protocol.occurrence import Ledger

log = logging.getLogger("consulrun")

SEPARATOR = keys.CHAIN_SEPARATOR  # no job name holds a `~`: `<run>~after~<parent>` splits at its last one
ON_VALUES = ("success", "failure", "always")
WHERE_IT_RAN = ("host", "unit", "invocation_id")  # occurrence.WHERE_IT_RAN


def requests_prefix(base: str) -> str:
    return keys.after_prefix(base)


def succeeded(result: dict[str, Any]) -> bool:
    return result.get("state") == "done" and result.get("exit_status") == 0 and not result.get("lost")


def ends_as(on: str, result: dict[str, Any]) -> bool:
    """Whether a parent run ended as `on` asks: success is exit 0; failure is a non-zero exit (its own timeout
    included), lost or abandoned; always is either."""
    return on == "always" or succeeded(result) == (on == "success")


def run_id(claim: dict[str, Any]) -> str:
    """The id of the run a claim is for: its occurrence, or a chained run's own `<run>~after~<parent>`."""
    return str(claim.get("run") or claim["occurrence"])


def then_ops(prefix: str, parent: str, final: dict[str, Any],
             thens: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    """The requests a parent run's final record makes, one per child whose `on` it matches: `set`, so a finish
    retried after a lost answer writes the same again; the child's history entry keeps it to one run."""
    if not thens:
        return []
    rid = run_id(final)
    # `run`, not `occurrence`: a chained parent's run id (`<run>~after~<grandparent>`) is no time, and readers
    # hold an `occurrence` field to be one.
    request = {"parent": parent, "run": rid, "state": final.get("state"),
               "exit_status": final.get("exit_status"), "node": final.get("node"),
               "ended": final.get("ended") or now_iso()}
    return [kv_op("set", keys.chain_request_key(keys.job_base(prefix, child), parent, rid), request)
            for child, on in thens if ends_as(on, final)]


@record
class Request:
    key: str
    index: int
    parent: str
    occurrence: str
    value: dict[str, Any]

    @property
    def run(self) -> str:
        return f"{self.occurrence}{SEPARATOR}{self.parent}"


def read_requests(entries: dict[str, dict[str, Any]], base: str) -> list[Request]:
    """The well-formed requests under `base`'s after/ keys, oldest parent run first; a malformed one is said and
    left alone (anyone with KV write can write one; it neither runs the job nor stops the others)."""
    out = []
    prefix = requests_prefix(base)
    for key, entry in entries.items():
        if not key.startswith(prefix):
            continue
        parent_segment, _, run_segment = key[len(prefix):].partition("/")
        parent, occ = keys.unsegment(parent_segment), keys.run_of_segment(run_segment) if run_segment else ""
        try:
            value = decoded(entry)
            why = None if value.get("parent") == parent and value.get("run") == occ and occ else \
                "it does not name the parent run its key does"
        except MalformedValue as exc:
            value, why = {}, exc.message
        if why:
            log.warning("%s: ignoring the chain request %s: %s", base.rsplit("/", 1)[-1], printable(key), why)
            continue
        out.append(Request(key=key, index=int(entry["ModifyIndex"]), parent=parent, occurrence=occ, value=value))
    return sorted(out, key=lambda r: (r.occurrence, r.parent))


def _age_s(request: Request) -> float | None:
    try:
        ended = datetime.fromisoformat(str(request.value.get("ended")).replace("Z", "+00:00"))
    except ValueError:
        return None
    return (datetime.now(timezone.utc) - ended).total_seconds() if ended.tzinfo else None


def _settle_ops(ledger: Ledger, request: Request, state: str, reason: str, node: str) -> list[dict[str, Any]]:
    """Consume `request` without running it: recorded `state` (missed, skipped) in the history entry it would
    have run as; both or neither."""
    entry = {"run": request.run, "after": _parent_of(request), "state": state, "node": None, "recorded_by": node,
             "reason": reason, "ended": now_iso()}
    return [kv_op("delete-cas", request.key, Index=request.index),
            kv_op("cas", ledger.manual_key({'after': True, 'run': request.run}), entry, Index=0)]


def _parent_of(request: Request) -> dict[str, Any]:
    return {"job": request.parent, "run": request.occurrence,
            **{k: request.value.get(k) for k in ("state", "exit_status", "node", "ended")}}


def acquire(locker: Locker, ledger: Ledger, parents: tuple[str, ...], start_deadline_s: float | None
            ) -> tuple[Held | None, dict[str, Any] | None, str] | None:
    """Claim the oldest pending chained run: (held lock, claim, "") or (None, None, why this node does not run
    one); None if no request is pending (the caller goes on to the scheduled occurrence, if the job has one).

    Reads decide: a node that finds nothing pending, or the job running, writes nothing.
    """
    base = ledger.base
    entries = locker.client.read_trees([ledger.lock_key, requests_prefix(base), ledger.pause_key], consistent=True)
    node = locker.node_name()
    runnable = []
    for request in read_requests(entries, base):
        if request.parent not in parents:  # the manifest no longer chains it: a request nobody wants
            if locker.client.txn([kv_op("delete-cas", request.key, Index=request.index)]) is not None:
                log.info("%s: removed the chain request %s: the job no longer runs after %s", locker.spec.job,
                         request.key, request.parent)
            continue
        runnable.append(request)
    if not runnable:
        return None
    request = runnable[0]
    paused = pause.value_of(entries.get(ledger.pause_key))
    age = _age_s(request)
    why = None
    if pause.in_force(paused):
        state, why = "skipped", f"{pause.describe(paused or {})} when {request.parent} ended"
    elif start_deadline_s is not None and age is not None and age > start_deadline_s:
        state, why = "missed", (f"not started within its start_deadline ({duration(start_deadline_s)}) after "
                                f"{request.parent}'s run {request.occurrence} ended; it would have started "
                                f"{duration(age)} late")
    if why:
        if locker.client.txn(_settle_ops(ledger, request, state, why, node)) is None:
            return None, None, _lost_race(locker, ledger, request)
        return None, None, printable(f"the run after {request.parent}'s {request.occurrence}: {why}; recorded it "
                                     f"{state}")
    lock = entries.get(ledger.lock_key)
    if (lock or {}).get("Session"):
        return None, None, (f"a run after {request.parent}'s {request.occurrence} is pending, but the job is running: "
                            f"{describe_holder(lock or {})}; it runs when the lock is free")
    claimed: dict[str, Any] = {}
    pause_index = int(entries[ledger.pause_key]["ModifyIndex"]) if ledger.pause_key in entries else 0

    def claim(holder: dict[str, Any]) -> list[dict[str, Any]]:
        claimed["record"] = {"run": request.run, "after": _parent_of(request), "state": "running",
                             "node": holder.get("node"), "session": holder.get("session"),
                             "started": holder.get("started"), **{k: holder[k] for k in WHERE_IT_RAN if holder.get(k)}}
        return [kv_op("delete-cas", request.key, Index=request.index),
                kv_op("cas", ledger.manual_key({'after': True, 'run': request.run}), claimed["record"], Index=0),
                pause.unchanged_op(base, pause_index)]

    held = locker.try_once({ledger.lock_key: lock} if lock else {}, claim=claim)
    if held:
        return held, claimed["record"], ""
    return None, None, _lost_race(locker, ledger, request)


def _lost_race(locker: Locker, ledger: Ledger, request: Request) -> str:
    """Why the claim failed; a request whose run is in the history already (written again after it ran) is
    removed, so it does not start the job again and again."""
    _, entry = locker.client.kv_get(ledger.manual_key({'after': True, 'run': request.run}), consistent=True)
    if entry is None:
        return f"the run after {request.parent}'s {request.occurrence} was taken by another node first"
    try:
        locker.client.txn([kv_op("delete-cas", request.key, Index=request.index)])
    except ConsulrunError as exc:
        log.warning("%s: could not remove the spent chain request %s (%s)", locker.spec.job, request.key, exc)
    return f"the run after {request.parent}'s {request.occurrence} has run already (its history entry exists)"
