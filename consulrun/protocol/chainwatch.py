"""`consulrun chain-watch`: on every node where a chained job is installed, start its unit for each run asked of it.

One long-running process per chained job and node (`<unit_prefix>-after@<job>.service`) holds a blocking read
on the job's `after/` keys (chain.py): while nothing is pending it makes one read every few minutes and no
write. When a request appears it starts the job's own unit with `systemctl start`, as `consulrun trigger`
does, so the run has the unit's user, environment, credentials and cgroup; the unit's `consulrun run` claims
the request with the lock. All the job's nodes see the request at once; so that they do not all make a
session for one claim, they take turns as for an unclaimed occurrence (turns.py): the first in a per-request
order starts at once, the next only if the request is still pending after its turn. A request left pending
after the unit ran (the job was running, Consul failed) is tried again, each time after a longer pause.
"""

from __future__ import annotations

import logging
import time

from consulrun.consul.values import printable
from consulrun.errors import ConsulrunError, ConsulUnavailable
from consulrun.protocol import turns
from consulrun.protocol.chain import read_requests, requests_prefix

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    import subprocess
    from typing import Any, Callable

    from consulrun.consul.client import Client
    from consulrun.manifest.placement import Placement

log = logging.getLogger("consulrun")

WAIT_S = 300.0  # one blocking read at most this long: Consul's own cap
RETRY_S = (2.0, 5.0, 15.0, 30.0)  # pauses before starting the unit again for a request still pending


def _pending(client: Client, base: str, index: int | None, wait_s: float | None) -> tuple[int, list[str]]:
    """The keys of the well-formed requests, oldest parent run first: a malformed one (said, by read_requests)
    starts nothing, or the unit would be started for it again and again, skipping each time."""
    idx, entries = client.kv_get(requests_prefix(base), index=index, wait_s=wait_s, recurse=True)
    return idx, [r.key for r in read_requests({e["Key"]: e for e in entries or []}, base)]


def _turn_s(client: Client, base: str, key: str, placement: Placement | None) -> float:
    """How long this node leaves the request `key` to the nodes before it in its order (0: it goes first)."""
    try:
        members, hidden = client.alive_members()
        me = client.node_name()
        if placement is not None:
            metas = client.node_metas()[0] if placement.needs_meta() else {}
            members = [(n, s) for n, s in members if placement.matches(n, metas.get(n, {}))]
    except ConsulrunError:
        return 0.0  # the turns only save writes: without them this node claims at once, as safely
    kinds = dict(members)
    if hidden or me not in kinds:
        return 0.0
    order = turns.order(f"{base}\n{key}", members, server=kinds[me])
    return turns.wait_s(order.index(me), None)


def _may_run_here(client: Client, placement: Placement | None) -> bool:
    if placement is None:
        return True
    name, meta = client.node_identity()
    return placement.matches(name, meta)


def watch(client: Client, base: str, unit: str, start_unit: Callable[[str], subprocess.CompletedProcess[str]],
          placement: Placement | None = None, stop: Callable[[], bool] = lambda: False) -> None:
    """Start `unit` for each run asked of the job at `base`, until `stop()` says so (a signal, in the unit)."""
    job = base.rsplit("/", 1)[-1]
    index: int | None = None
    tries = 0
    said_placement = False
    while not stop():
        try:
            index, pending = _pending(client, base, index, WAIT_S if index else None)
            if stop():
                break
            if not pending:
                tries = 0
                continue
            if not _may_run_here(client, placement):
                if not said_placement:
                    log.info("%s: a run after another job is pending, but this node is not one the job runs on",
                             job)
                    said_placement = True
                continue
            _, lock = client.kv_get(f"{base}/lock")
            if lock and lock.get("Session"):  # the job is running: start it again when it ends
                client.kv_get(f"{base}/lock", index=int(lock["ModifyIndex"]), wait_s=WAIT_S)
                index = None
                continue
            wait = _turn_s(client, base, pending[0], placement) if tries == 0 else 0.0
            if wait > 0:
                moved, still = _pending(client, base, index, wait)
                if not still or still[0] != pending[0]:  # another node took it: look again
                    index = moved
                    continue
            log.info("%s: starting %s for %s", job, unit, printable(pending[0][len(requests_prefix(base)):]))
            started = start_unit(unit)
            if started.returncode != 0:
                said = (started.stderr or started.stdout or "").strip().splitlines()
                log.warning("%s: systemctl start %s exited %d%s", job, unit, started.returncode,
                            f": {printable(said[-1])}" if said else "")
            index, after = _pending(client, base, None, None)
            if after and after[0] == pending[0]:  # not consumed: the run skipped, failed early, or found it held
                time.sleep(RETRY_S[min(tries, len(RETRY_S) - 1)])
                tries += 1
                index = None
            else:
                tries = 0
        except ConsulUnavailable as exc:
            log.warning("%s: Consul cannot answer (%s); watching again in 5s", job, exc)
            index = None
            time.sleep(5.0)
