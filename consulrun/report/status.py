"""What Consul knows about each job: who holds it, is that holder alive, did the runs happen and succeed.

`collect` reads everything under the prefix in one (optionally blocking)
query, plus the session and node health of each holder, and returns plain
data that the CLI prints as a table or as JSON (the JSON shape is documented
in docs/commands/status.md and kept stable).

Never green when blind: every read here fails with PermissionDenied (exit 77)
when Consul's ACLs hid part of the answer, and a prefix with no state at all
is said to be empty (exit 6) rather than reported as all well.

Why this module is long: the verdicts (missed, overdue, dead holder, a record
from the future, a malformed value) are judged from one read of the prefix
and must agree with each other; `status`, the exporter and the watchdog all
take them from here, so they cannot disagree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Callable

from consulrun.consul.client import Client, decoded
from consulrun.errors import ConsulrunError, MalformedValue, PermissionDenied
from consulrun.manifest import calendar
from consulrun.protocol import clockskew, keys as names, procinfo
from consulrun.protocol.health import LAST_FIELDS
from consulrun.protocol.occurrence import future_limit, future_text
from consulrun.protocol.pause import EPISODES, in_force as pause_in_force, since as pause_skips, value_of as pause_value_of
from consulrun.protocol.turns import TURN_MAX_S
from consulrun.report import chains, eachnode
from consulrun.timefmt import parse_time, seconds_between

if TYPE_CHECKING:  # `run` (the health check of its finish) must not pay for the manifest validator
    from consulrun.manifest.loader import Job, Manifest

DEFAULT_GRACE_S = 60.0
# A miss recorded in the history (an occurrence lock-delay kept from every node) is reported this long after its
# scheduled time, even once later occurrences ran: long enough for a once-a-minute watchdog and a 5-minute check.
RECORDED_MISS_REPORT_S = 900.0
UNKNOWN_ACCURACY_S = 60.0  # systemd's AccuracySec= default, assumed when no manifest says better


class Health(enum.IntEnum):
    """Overall verdict, as the exit status of `consulrun status` (for monitoring checks); the worst one wins."""

    OK = 0
    LAST_RUN_FAILED = 1  # a job's last run exited non-zero, was lost or was abandoned
    MISSED = 3  # a due occurrence was claimed by no node in time (dead-man's switch)
    OVERDUE = 4  # a run has lasted longer than its job's timeout
    HOLDER_UNHEALTHY = 5  # a lock is held by a session that is gone, critical, or whose process is dead
    NO_STATE = 6  # nothing under the prefix (or for the job asked about): nothing to judge
    MALFORMED_VALUE = 65  # a job's value is not one consulrun writes: that job is not judged


# Most urgent first: a job that cannot be judged hides whatever is wrong with it, so it outranks
# every finding (65 is what a malformed value has always made status exit); a stuck lock explains
# a missed run, a missed run matters more than a slow one.
SEVERITY = [Health.MALFORMED_VALUE, Health.HOLDER_UNHEALTHY, Health.MISSED, Health.OVERDUE,
            Health.LAST_RUN_FAILED]
# A record in the future ("future") stops every run until it is removed: as good as missed.
# A node's clock ahead of ours ("skew") runs occurrences before they are due and jumps over one: as good as missed.
PROBLEM_HEALTH = {"unhealthy": Health.HOLDER_UNHEALTHY, "missed": Health.MISSED, "future": Health.MISSED,
                  "skew": Health.MISSED,
                  "overdue": Health.OVERDUE,
                  "failed": Health.LAST_RUN_FAILED, "lost": Health.LAST_RUN_FAILED,
                  "abandoned": Health.LAST_RUN_FAILED,
                  "unplaced": Health.MISSED,  # no healthy node may run it: its occurrences run nowhere
                  # an each-node job's node is down: its share runs nowhere
                  "node-down": Health.MISSED,
                  # a chained run asked of the job that no node took (report/chains.py)
                  "stalled": Health.MISSED,
                  "malformed_value": Health.MALFORMED_VALUE}


class NoState(ConsulrunError):
    """The job (or the whole prefix) has no state in Consul: a wrong name or prefix, or nothing ever ran."""

    exit_code = Health.NO_STATE

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index  # a watcher blocks on it until state appears


@dataclass
class JobStatus:
    job: str
    state: str  # held | free | never run | orphaned | unknown
    in_manifest: bool
    holders: list[dict[str, Any]] = field(default_factory=list)
    last: dict[str, Any] | None = None
    next: str | None = None
    problems: list[dict[str, Any]] = field(default_factory=list)
    paused: dict[str, Any] | None = None  # the pause in force: by, at, reason, until
    skipped: list[dict[str, Any]] = field(default_factory=list)  # occurrences skipped while paused, since the last
    nodes: list[dict[str, Any]] | None = None  # mode: each-node: each node's latest occurrence (report/eachnode.py)

    def health(self) -> Health:
        kinds = {PROBLEM_HEALTH[p["kind"]] for p in self.problems}
        return next((h for h in SEVERITY if h in kinds), Health.OK)

    def problem(self, kind: str, detail: str, **extra: Any) -> None:
        self.problems.append({"kind": kind, "detail": detail, **extra})


def iso(when: datetime | None) -> str | None:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if when else None


def session_health(info: dict[str, Any] | None, node_checks: Callable[[str], tuple[list[dict[str, Any]], bool]],
                   client: Client) -> tuple[bool, str]:
    """(healthy, why) of a session (`info`, None if gone), as Consul judges it: a session lives until it is
    destroyed or a bound check is critical. A check in `warning` does not invalidate a session, so it leaves the
    holder healthy (the reason says so). `node_checks` gives the checks the token sees and whether ACLs hid some:
    a hidden check that the session binds is refused (exit 77), never taken for gone."""
    if not info:
        return False, "session no longer exists"
    bound = set(info.get("NodeChecks") or []) | {c.get("ID") for c in info.get("ServiceChecks") or []}
    found, hidden = node_checks(info["Node"])
    checks = {c["CheckID"]: c["Status"] for c in found}
    if hidden and bound - checks.keys():  # Consul hid checks of services the token may not read: only bound ones matter
        raise client.hidden_checks_refused(info["Node"], sorted(bound - checks.keys()))
    critical = sorted(cid for cid in bound if checks.get(cid, "critical") == "critical")
    if critical:
        return False, f"check(s) critical or gone on {info['Node']}: {', '.join(critical)}"
    warning = sorted(cid for cid in bound if checks.get(cid) != "passing")
    if warning:
        return True, f"passing; warning (Consul keeps the session): {', '.join(warning)}"
    return True, "passing"


class HolderJudge:
    """Judges holders: Consul's view of the session, plus, on the holder's own node, whether its process lives."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._node: str | None | bool = False  # False: not asked yet
        # One health read per node, however many holders: (the checks the token sees, whether ACLs hid some).
        self._checks: dict[str, tuple[list[dict[str, Any]], bool]] = {}

    def node_checks(self, node: str) -> tuple[list[dict[str, Any]], bool]:
        if node not in self._checks:
            self._checks[node] = self.client.node_health(node)
        return self._checks[node]

    def local_node(self) -> str | None:
        if self._node is False:
            try:
                self._node = self.client.node_name()
            except PermissionDenied:  # no agent:read: dead pids cannot be proven, Consul's view still stands
                self._node = None
        return self._node  # type: ignore[return-value]

    def holder(self, entry: dict[str, Any], malformed_ok: bool = False) -> dict[str, Any]:
        """The holder of `entry`'s lock: its node as Consul's session says (the value may be rewritten by anyone
        with KV write), and the value's pid judged only where it agrees with that session (procinfo).

        With `malformed_ok`, a value consulrun never writes leaves the holder judged from its session alone, the
        value's fault named in its health, instead of raising MalformedValue."""
        malformed = None
        try:
            value = decoded(entry)
        except MalformedValue as exc:
            if not malformed_ok:
                raise
            value, malformed = {}, exc.message
        info = self.client.session_visible(entry["Session"])
        healthy, why = session_health(info, self.node_checks, self.client)
        why = f"{why}; {malformed}" if malformed else why
        if healthy and value.get("boot_id") and value.get("boot_id") == procinfo.boot_id():
            dead = procinfo.provably_dead(value, self.local_node(), info)
            if dead:
                healthy, why = False, dead
        return {"key": entry["Key"], "node": (info or {}).get("Node") or value.get("node"),
                "since": value.get("started"), "session": entry["Session"], "pid": value.get("pid"),
                "unit": value.get("unit"), "healthy": healthy, "health": why}


def _jobs_from_entries(base: str, entries: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    jobs: dict[str, dict[str, dict[str, Any]]] = {}
    for entry in entries:
        rest = entry["Key"][len(base):].split("/", 1)
        if len(rest) == 2 and rest[0] and not rest[0].startswith("_"):  # "_watchdog": consulrun's own, not a job
            jobs.setdefault(rest[0], {})[rest[1]] = entry
    return jobs


def probe(client: Client, key: str) -> None:
    """Read one key directly: Consul answers 403 (PermissionDenied) where a listing would only leave it out."""
    client.kv_get(key)


def read_prefix(client: Client, base: str, *, index: int | None = None,
                wait_s: float | None = None) -> tuple[int, dict[str, dict[str, dict[str, Any]]]]:
    """(index, job -> key -> entry) for everything under `base` (ending in '/'); 77 if any of it is hidden."""
    idx, entries = client.kv_tree(base, index=index, wait_s=wait_s)
    if not entries:
        probe(client, base)
    return idx, _jobs_from_entries(base, entries)


@dataclass(frozen=True)
class Expectations:
    """What a job's schedule lets `status` expect: occurrences claimed in time, runs ending in time."""

    schedules: tuple[str, ...]
    lag_s: float  # how long after its scheduled time an occurrence may still be unclaimed
    timeout_s: float | None

    @classmethod
    def of(cls, job: Job | None, record: dict[str, Any] | None, grace_s: float) -> "Expectations | None":
        if job is not None and not job.schedules:  # it only runs after other jobs: no time it is due by
            return None
        if job is not None:
            lag = (job.timer.accuracy_ms + job.timer.randomized_delay_ms) / 1000 + TURN_MAX_S + grace_s
            return cls(job.schedules, lag, job.timeout_ms / 1000 if job.timeout_ms else None)
        stored = (record or {}).get("schedule")
        if isinstance(stored, list) and stored and all(isinstance(s, str) for s in stored):
            return cls(tuple(stored), UNKNOWN_ACCURACY_S + grace_s, None)
        return None


ABANDONED_UNRECORDED = "its runner's session no longer holds the lock and no result was recorded"


def which_run(record: dict[str, Any], otherwise: str = "the last run") -> str:
    """The run a record is of, for a line: its occurrence (a run without --schedule has none: its start), and
    its node when known; never a placeholder."""
    if record.get("occurrence"):
        what = f"occurrence {record['occurrence']}"
    elif record.get("started"):
        what = f"the run started {record['started']}"
    else:
        what = otherwise
    return what + (f" on {record['node']}" if record.get("node") else "")


def _judge_record(status: JobStatus, record: dict[str, Any], expect: Expectations | None, now: datetime) -> None:
    state = record.get("state")
    if state is None and record.get("lost"):  # a run without --schedule: only the lock's `last` tells
        state = "lost"
        status.last = {**(status.last or {}), "state": "lost", "reason": str(record["lost"])}
    sessions = {h["session"] for h in status.holders}
    if state == "running" and record.get("session") and record["session"] not in sessions:
        status.last = {**(status.last or {}), "state": "abandoned",
                       "reason": ABANDONED_UNRECORDED}
        state = "abandoned"
    if state in ("lost", "abandoned"):
        reason = (status.last or {}).get("reason") or "no reason recorded"
        status.problem(state, f"{which_run(record)} was {state}: {reason}", occurrence=record.get("occurrence"))
    elif state == "missed":
        status.problem("missed", f"occurrence {record.get('occurrence')} ran on no node: "
                                 f"{record.get('reason') or 'no reason recorded'}", occurrence=record.get("occurrence"))
    elif record.get("exit_status") not in (None, 0):
        status.problem("failed", f"{which_run(record, 'last run')} exited {record['exit_status']}",
                       occurrence=record.get("occurrence"))
    if record.get("occurrence"):  # a record "in the future" is a finding, not an order (runs refuse it)
        following = calendar.following(list(expect.schedules), now) if expect and expect.schedules else None
        limit = future_limit(following, now)
        if record["occurrence"] > limit:
            status.problem("future", future_text(record["occurrence"], limit), occurrence=record["occurrence"])
    if expect is None:
        return
    started = parse_time(record.get("started"))
    if state == "running" and expect.timeout_s and started and now - started > timedelta(seconds=expect.timeout_s):
        status.problem("overdue", f"{which_run(record)} has run for {(now - started).total_seconds():.0f}s, "
                                  f"longer than its timeout ({expect.timeout_s:.0f}s)",
                       occurrence=record.get("occurrence"))
    due = calendar.previous(list(expect.schedules), now - timedelta(seconds=expect.lag_s)) if expect.schedules else None
    if due is None:
        return
    if record.get("occurrence"):
        if calendar.occurrence_id(due) > str(record["occurrence"]):
            status.problem("missed", f"occurrence {calendar.occurrence_id(due)} was claimed by no node within "
                                     f"{expect.lag_s:.0f}s; the last claimed is {record['occurrence']}",
                           occurrence=calendar.occurrence_id(due))
        return
    # Runs without --schedule (a job with concurrency > 1) record no occurrence: their start times must do.
    starts = [t for t in [parse_time(record.get("started")), *(parse_time(h["since"]) for h in status.holders)] if t]
    if starts and max(starts) < due:
        status.problem("missed", f"no run started since {calendar.occurrence_id(due)} (within {expect.lag_s:.0f}s); "
                                 f"the last started at {iso(max(starts))}", occurrence=calendar.occurrence_id(due))


def _overdue_holders(status: JobStatus, expect: Expectations | None, now: datetime) -> None:
    """A holder past the job's timeout, for runs that keep no occurrence record (concurrency > 1)."""
    if expect is None or not expect.timeout_s or any(p["kind"] == "overdue" for p in status.problems):
        return
    for holder in status.holders:
        since = parse_time(holder["since"])
        if since and (now - since).total_seconds() > expect.timeout_s:
            status.problem("overdue", f"{holder['key']} has been held by {holder['node']} for "
                                      f"{(now - since).total_seconds():.0f}s, longer than the job's timeout "
                                      f"({expect.timeout_s:.0f}s)")


def _record_of(keys: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    if "occurrence" in keys:
        return decoded(keys["occurrence"]) or None
    chained = [decoded(e) for k, e in keys.items() if k.startswith(names.HISTORY) and names.is_chained(k)]
    if chained:  # a job that only runs after others: its newest run, named by the parent run it followed
        newest = max(chained, key=lambda r: str(r.get("started") or r.get("ended") or ""))
        return {**newest, "occurrence": newest.get("run")}
    runs = []
    for key, entry in sorted(keys.items()):
        if key != "lock" and not key.startswith("slots/"):
            continue
        value = decoded(entry)
        if isinstance(value.get("last"), dict):  # released: how the run ended
            runs.append(value["last"])
        elif not entry.get("Session") and value.get("session") and value.get("started"):
            # A holder's value that no session holds: its runner died (or lost the lock) and never recorded an
            # end. Judged as an occurrence record saying "running" whose session is gone: abandoned.
            runs.append({**{k: value.get(k) for k in ("node", "started", "session")}, "state": "running"})
    return max(runs, key=lambda r: str(r.get("started") or "")) if runs else None  # the newest of the slots


def _operators_key(key: str) -> bool:
    """A key an operator's command writes (a pause, its ended episodes, a trigger request): no sign of a run."""
    return key in ("pause", "trigger") or key.startswith(EPISODES)


def judge_job(name: str, keys: dict[str, dict[str, Any]], manifest: Manifest | None, judge: HolderJudge,
              now: datetime, grace_s: float) -> JobStatus:
    wanted = {job.name: job for job in manifest.jobs} if manifest else {}
    job = wanted.get(name)
    status = JobStatus(job=name, state="never run", in_manifest=job is not None)
    if manifest is not None and job is None:
        status.state = "orphaned" if keys else "unknown"
    elif manifest is None and not keys:
        status.state = "unknown"
    _holders(status, keys, judge)
    each_node = getattr(job, "mode", None) == "each-node" or any(key.startswith("nodes/") for key in keys)
    record = eachnode.newest(eachnode.node_records(keys)) if each_node else _record_of(keys)
    if record:
        status.last = _last_of(record)
    if status.state == "never run" and any(not _operators_key(key) for key in keys):
        status.state = "held" if status.holders else "free"
    expect = _expectations(status, job, record, keys, grace_s, now)
    if record:
        _judge_record(status, record, expect, now)
        lead = clockskew.ahead_of_us(record, now)
        if lead and not any(p["kind"] == "future" for p in status.problems):  # beyond the allowed skew: said
            status.problem("skew", clockskew.note(record, lead), node=clockskew.writer(record),
                           ahead_s=clockskew.reported(lead), occurrence=record.get("occurrence"))
    if each_node:
        eachnode.judge(status, keys, expect.schedules if expect else (), expect.lag_s if expect else None, now, record)
        eachnode.recorded_misses(status, keys, now, RECORDED_MISS_REPORT_S)
    _clock_findings(status, keys, now)
    _recorded_misses(status, keys, record, now)
    _overdue_holders(status, expect, now)
    chains.judge(status, keys, job, now)
    return status


def _holders(status: JobStatus, keys: dict[str, dict[str, Any]], judge: HolderJudge) -> None:
    """The lock's (or the slots') holders, each judged alive or not; an unhealthy one is a problem."""
    for key, entry in sorted(keys.items()):
        if (key == "lock" or key.startswith("slots/")) and entry.get("Session"):
            status.holders.append(judge.holder(entry))
    for holder in status.holders:
        if not holder["healthy"]:
            status.problem("unhealthy", f"held by {holder['node']} (session {holder['session']}): {holder['health']}")


def _last_of(record: dict[str, Any]) -> dict[str, Any]:
    """The fields of the latest record `status` shows as the job's last run."""
    last = {k: record.get(k) for k in (*LAST_FIELDS, "retry_at")}
    if isinstance(record.get("after"), dict):  # the parent run it ran after (chain.py)
        last["after"] = record["after"]
    last["duration_s"] = seconds_between(record.get("started"), record.get("ended"))
    return last


def _expectations(status: JobStatus, job: Any, record: dict[str, Any] | None, keys: dict[str, dict[str, Any]],
                  grace_s: float, now: datetime) -> Expectations | None:
    """What the job's schedule expects by now (None for a job no manifest names), less what a pause covers:
    the occurrences skipped while paused are counted in `status`, and the job's pause noted there."""
    expect = Expectations.of(job, record, grace_s) if status.state != "orphaned" else None
    if expect is not None:
        status.next = iso(calendar.following(list(expect.schedules), now))
        # Occurrences skipped while paused since the last claimed one (without occurrence records, its start).
        last = (record or {}).get("occurrence") or iso(parse_time((record or {}).get("started")))
        status.skipped, covered = pause_skips(keys, list(expect.schedules), last, expect.lag_s, now)
        if covered:  # the latest due occurrence fell in a pause that has ended since: skipped, not missed
            expect = replace(expect, schedules=())
    paused = pause_value_of(keys.get("pause"))
    if pause_in_force(paused, now):
        status.paused = paused
        # Nobody runs a paused job's occurrences: not claiming them is what was asked for, not a miss.
        expect = replace(expect, schedules=()) if expect else None
    return expect


def malformed_job(name: str, manifest: Manifest | None, exc: MalformedValue) -> JobStatus:
    """A job one of whose values consulrun never writes: not judged (its other keys may say
    anything), but named, with the one line why, beside the jobs that could be."""
    jobs = manifest.jobs if manifest else ()
    status = JobStatus(job=name, state="malformed_value",
                       in_manifest=any(job.name == name for job in jobs))
    status.problem("malformed_value", exc.message, key=exc.key)
    return status


def _clock_findings(status: JobStatus, keys: dict[str, dict[str, Any]], now: datetime) -> None:
    """Fresh findings the nodes recorded about each other's clocks (protocol/clockskew.py): a node they found
    ahead stays reported while they keep finding it, not only while its latest record is young."""
    named = {p["node"] for p in status.problems if p["kind"] == "skew"}
    for key, entry in sorted(keys.items()):
        parts = [names.unsegment(part) for part in key.split("/")]
        if len(parts) != 3 or parts[0] != names.CLOCK[:-1] or parts[1] in named:
            continue
        value = decoded(entry)
        at, ahead = parse_time(value.get("at")), value.get("ahead_s")
        if at is None or not isinstance(ahead, (int, float)) or isinstance(ahead, bool) or ahead <= 0 \
                or abs((now - at).total_seconds()) > clockskew.FINDING_FRESH_S:
            continue
        named.add(parts[1])
        status.problem("skew", f"{parts[1]}'s clock was found at least {ahead:.0f}s ahead of {parts[2]}'s at "
                               f"{at:%H:%M:%S} UTC (by {parts[2]}'s clock), in its record of occurrence "
                               f"{value.get('occurrence')}",
                       node=parts[1], ahead_s=float(ahead), occurrence=value.get("occurrence"))


def _recorded_misses(status: JobStatus, keys: dict[str, dict[str, Any]], record: dict[str, Any] | None,
                     now: datetime) -> None:
    """Misses recorded in the history within RECORDED_MISS_REPORT_S, other than the live record's (judged above):
    the next occurrence running on time must not hide the one that ran nowhere."""
    current = (record or {}).get("occurrence")
    for key, entry in sorted(keys.items()):
        if not key.startswith(names.HISTORY) or names.is_manual(key):
            continue
        value = decoded(entry)
        when = parse_time(value.get("occurrence"))
        if value.get("state") != "missed" or value.get("occurrence") == current or when is None \
                or (now - when).total_seconds() > RECORDED_MISS_REPORT_S:
            continue
        status.problem("missed", f"occurrence {value['occurrence']} ran on no node: "
                                 f"{value.get('reason') or 'no reason recorded'}", occurrence=value["occurrence"])


def collect(client: Client, prefix: str, manifest: Manifest | None, *, only: tuple[str, ...] = (),
            index: int | None = None, wait_s: float | None = None, now: datetime | None = None,
            grace_s: float = DEFAULT_GRACE_S,
            per_job_malformed: bool = False) -> tuple[int, list[JobStatus]]:
    """(Consul index for a blocking follow-up, one JobStatus per job); manifest jobs first, then the others.

    `only` limits the answer to those jobs. Raises PermissionDenied when ACLs
    hide anything this needs to read, NoState when there is nothing to judge,
    MalformedValue for a value consulrun never writes, unless `per_job_malformed`:
    then that job alone is `malformed_value` (`malformed_job`), the others are judged.
    """
    base = prefix.strip("/") + "/"
    idx, found = read_prefix(client, base, index=index, wait_s=wait_s)
    now = now or datetime.now(timezone.utc)
    names = [job.name for job in manifest.jobs] if manifest else []
    names += sorted(set(found) - set(names))
    if only:
        names = list(only)
    if not found and not only:
        raise NoState(f"no job has any state under {base} in Consul"
                      + (" (no job of the manifest has run yet?)" if manifest else " (wrong --prefix?)"), idx)
    judge = HolderJudge(client)
    statuses = []
    for name in names:
        if name not in found and found:
            probe(client, f"{base}{name}/lock")  # listing hides per-key denials from nobody but us: ask directly
        try:
            statuses.append(judge_job(name, found.get(name, {}), manifest, judge, now, grace_s))
        except MalformedValue as exc:
            if not per_job_malformed:
                raise
            statuses.append(malformed_job(name, manifest, exc))
            continue
        if statuses[-1].nodes is not None:
            eachnode.down_nodes(client, statuses[-1], next((j for j in manifest.jobs if j.name == name), None)
                                if manifest else None)
    _unplaced(client, manifest, statuses)
    unknown = [s.job for s in statuses if s.state == "unknown"]
    if unknown:
        raise NoState(f"no such job under {base}: {', '.join(unknown)}"
                      + (" (in neither the manifest nor Consul)" if manifest else " (no state in Consul)"), idx)
    return idx, statuses


def _unplaced(client: Client, manifest: Manifest | None, statuses: list[JobStatus]) -> None:
    """A problem for each job of the manifest whose `nodes:` no healthy catalog node matches (two stale reads,
    only when a job has `nodes:`)."""
    # (The watchdog's jobs carry no placement: it judges the rest, and status and the exporter judge this.)
    placed = {job.name: job.placement for job in (manifest.jobs if manifest else ())
              if getattr(job, "placement", None) is not None}
    if not placed:
        return
    metas, hidden = client.node_metas()
    failing = client.failing_nodes()
    healthy = {name: meta for name, meta in metas.items() if name not in failing}
    for status in statuses:
        placement = placed.get(status.job)
        if placement is not None and not any(placement.matches(n, m) for n, m in healthy.items()):
            status.problem("unplaced", f"no healthy node is one it runs on (nodes: {placement.describe()}"
                                       + ("; the ACL token hides some nodes" if hidden else "") + ")")


def job_holders(client: Client, prefix: str, job: str, malformed_ok: bool = False) -> list[dict[str, Any]]:
    """The judged holders of one job's lock (or slots); NoState if the job has no state at all.

    With `malformed_ok` (`unlock --force`), a lock whose value is not one consulrun writes is still a holder,
    judged from its session alone: breaking a lock must not depend on what anyone with KV write put in it."""
    base = f"{prefix.strip('/')}/{job}/"
    _, entries = client.kv_tree(base)
    if not entries:
        probe(client, base + "lock")
        raise NoState(f"job {job!r} has no state under {prefix.strip('/')}/ in Consul: nothing to unlock "
                      "(wrong job name or --prefix?)")
    judge = HolderJudge(client)
    keys = {e["Key"][len(base):]: e for e in entries}
    return [judge.holder(e, malformed_ok) for k, e in sorted(keys.items())
            if (k == "lock" or k.startswith("slots/")) and e.get("Session")]


def verdict(statuses: list[JobStatus]) -> Health:
    kinds = {s.health() for s in statuses}
    return next((h for h in SEVERITY if h in kinds), Health.OK)


def as_json(prefix: str, statuses: list[JobStatus], health: Health, now: datetime) -> dict[str, Any]:
    return {"prefix": prefix, "verdict": health.name.lower(), "checked_at": iso(now), "jobs": [
        {"job": s.job, "state": s.state, "in_manifest": s.in_manifest, "verdict": s.health().name.lower(),
         "problems": s.problems, "holders": s.holders, "last": s.last, "next": s.next, "paused": s.paused,
         "skipped": s.skipped, **({"nodes": s.nodes} if s.nodes is not None else {})}
        for s in statuses]}


ERROR_VERDICTS = {2: "usage_error", 6: "no_state", 65: "malformed_value", 69: "consul_unavailable",
                  70: "unexpected_answer", 77: "permission_denied"}


def error_json(prefix: str, exc: ConsulrunError, now: datetime) -> dict[str, Any]:
    """What `status --json` prints when it could not judge: never an empty, healthy-looking answer."""
    return {"prefix": prefix, "verdict": ERROR_VERDICTS.get(exc.exit_code, "error"), "checked_at": iso(now),
            "error": exc.format_message(), "exit_status": int(exc.exit_code), "jobs": None}


def table(statuses: list[JobStatus], now: datetime) -> list[list[str]]:
    """Rows for the terminal: STATE names the worst problem when there is one, else the lock's state."""
    from consulrun.timefmt import cell, span

    rows = [["JOB", "STATE", "HOLDER", "SINCE", "HEALTH", "LAST OCCURRENCE", "LAST RESULT", "NEXT"]]
    for s in statuses:
        holder = s.holders[0] if s.holders else {}
        last = s.last or {}
        result = ""
        if last:
            took = f" in {span(last['duration_s'])}" if last.get("duration_s") is not None else ""
            code = f"exit {last['exit_status']}" if last.get("exit_status") is not None else (last.get("state") or "")
            if last.get("state") in ("lost", "abandoned", "running", "missed"):
                code = last["state"]
            if last.get("state") == "running" and last.get("retry_at") and last.get("retry_at") == last.get("started"):
                code = f"retrying (attempt {last.get('attempt')})"
            result = f"{code}{took}" + (f" on {last['node']}" if last.get("node") else "") + \
                (" (takeover)" if last.get("takeover") else "")
        worst = s.health()
        kind = next((p["kind"] for p in s.problems if PROBLEM_HEALTH[p["kind"]] == worst), None)
        state = kind or ("paused" if s.paused else s.state)
        if kind and s.paused:  # a paused job whose last run failed: both, the problem first
            state = f"{kind}, paused"
        rows.append([s.job, state + (f" ({len(s.holders)})" if len(s.holders) > 1 else ""),
                     holder.get("node") or "-", cell(holder.get("since"), now),
                     holder.get("health", "-") if holder else "-", cell(last.get("occurrence"), now), result or "-",
                     cell(s.next, now)])
        for node in s.nodes or []:  # each-node: a row per node, its own latest occurrence
            code = f"exit {node['exit_status']}" if node.get("exit_status") is not None and node["state"] == "done" \
                else node["state"] or "-"
            rows.append([f"{s.job}@{node['node']}", "down" if not node["healthy"] else (node["state"] or "-"), "-",
                         "-", "-", cell(node.get("occurrence"), now), code, "-"])
    return rows


def problem_lines(statuses: list[JobStatus]) -> list[str]:
    from consulrun.protocol.pause import describe, skipped_lines

    return [f"{s.job}: {p['kind']}: {p['detail']}" for s in statuses for p in s.problems] + \
        [f"{s.job}: {describe(s.paused)}" for s in statuses if s.paused] + \
        [line for s in statuses for line in skipped_lines(s.job, s.skipped)]
