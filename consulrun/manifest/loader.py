"""Loading and validating a job manifest into typed, immutable settings.

The JSON Schema shipped beside this module is the single statement of the
manifest's shape (it is also what docs/manifest.md's table documents, checked by a test);
this module adds what a schema cannot say: positions, duplicate keys, value
ranges, calendar syntax and whether a value can be written to a unit file.

Why this module is long: it is the manifest's records and one checker per section, each
naming the file, line and field of what it refuses; the sections refer to each other (defaults,
jobs, timers, locks), so the checks read as one pass over one document.
"""

from __future__ import annotations

import difflib
import gc
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from consulrun.consul.address import AddressError, parse_address
from consulrun.consul.client import CREDENTIAL_VARIABLES
from consulrun.consul.settings import ConsulSettings
from consulrun.errors import ManifestError, os_reason
from consulrun.manifest import chains, hardening, shellsyntax, unitescape, unitsettings
from consulrun.manifest.durations import (
    DURATION_MAX_MS,
    LOCK_DELAY_RANGE_MS,
    TTL_RANGE_MS,
    DurationError,
    format_duration,
    parse_duration,
    range_text,
    unit_hint,
)
from consulrun.manifest.placement import Placement
from consulrun.manifest.schema import SCHEMA, conforms, schedule_problem
from consulrun.manifest.yamlsource import LimitError, Located, explain, load


@dataclass(frozen=True)
class LockSettings:
    ttl_ms: int = 15_000
    lock_delay_ms: int = 15_000
    checks: tuple[str, ...] = ()
    wait_ms: int = 0
    concurrency: int = 1
    skip_exit_code: int = 0


@dataclass(frozen=True)
class TimerSettings:
    accuracy_ms: int = 1_000
    randomized_delay_ms: int = 0
    persistent: bool = False


@dataclass(frozen=True)
class RetrySettings:
    """`retries:` (consulrun.protocol.retries does the arithmetic): at most `attempts` runs, the first included."""

    attempts: int = 1
    backoff_ms: int = 10_000
    max_backoff_ms: int = 300_000


@dataclass(frozen=True)
class Job:
    name: str
    command: tuple[str, ...]
    schedules: tuple[str, ...]
    description: str
    user: str | None
    group: str | None
    working_directory: str | None
    environment: tuple[tuple[str, str], ...]
    environment_file: str | None
    timeout_ms: int | None
    lock: LockSettings
    timer: TimerSettings
    on_holder_loss: str = "skip"
    history: int = 20
    shell: bool = False
    service_settings: tuple[tuple[str, str], ...] = ()  # extra [Service] lines, in order
    timer_settings: tuple[tuple[str, str], ...] = ()  # extra [Timer] lines, in order
    on_failure: tuple[str, ...] = ()  # argv run by <unit_prefix>-onfailure@<job>.service (OnFailure=)
    ping_url: str | None = None
    ping_output_lines: int = 0  # the final ping's body: the run's journal's last lines (0: a GET, no body)
    pass_consul_token: bool = False  # the job's environment keeps the wrapper's CONSUL_HTTP_TOKEN(_FILE)
    hardening: str = "none"  # a sandbox preset (manifest.hardening), written before service_settings
    placement: Placement | None = None  # `nodes:`: which Consul nodes may run it (None: any)
    start_deadline_ms: int | None = None  # an occurrence not started this long after its time is missed, not run
    retries: RetrySettings = RetrySettings()
    after: tuple[tuple[str, str], ...] = ()  # (parent job, on): run once per parent occurrence ended so (chains.py)
    mode: str = "once"  # each-node: every node runs each occurrence once, lock.concurrency at a time


@dataclass(frozen=True)
class Manifest:
    source: str
    unit_prefix: str
    kv_prefix: str
    consul: ConsulSettings
    jobs: tuple[Job, ...]
    health_checks: bool = False  # each job's state as a Consul health check, and the watchdog units
    name: str | None = None  # the top-level `name:`: which manifest owns the units (see units.owner)


class _Problems:
    """Collects `FILE:LINE:COL: where: message` lines so all are reported at once."""

    def __init__(self, source: str, located: Located) -> None:
        self.source = source
        self.located = located
        self.lines: list[tuple[tuple[int, int], str]] = []

    def add(self, path: tuple[Any, ...], message: str, *, key: bool = False) -> None:
        line, col = self.located.where(path, key=key)
        where = _dotted(path)
        entry = ((line, col), f"{self.source}:{line}:{col}: {where + ': ' if where else ''}{message}")
        if entry not in self.lines:  # jsonschema reports `required` once per missing key, each naming them all
            self.lines.append(entry)

    def raise_if_any(self) -> None:
        if self.lines:
            raise ManifestError([text for _, text in sorted(self.lines)])


def _dotted(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        elif isinstance(part, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", part):
            out += f".{part}" if out else part
        else:  # a key that would garble the message (a newline, a dot, 2 MB): quoted and cut short
            out += f"[{_shown(part)}]"
    return out


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "a list", dict: "a mapping", type(None): "an empty value"}
_SCHEMA_TYPES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
                 "array": "a list", "object": "a mapping", "null": "an empty value"}


def _describe(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """A value for a message: quoted, and cut short so a 2 MB value makes a one-line error."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(value) if isinstance(value, str) else len(text)} characters)"


def _placement(nodes: dict[str, Any] | None) -> Placement | None:
    if not nodes:
        return None
    return Placement(meta=tuple(sorted(nodes.get("meta", {}).items())), names=tuple(nodes.get("names", ())))


def _schema_problem(err: jsonschema.ValidationError, problems: _Problems) -> None:
    path = tuple(err.absolute_path)
    kind = err.validator
    schema = err.schema
    if kind == "additionalProperties":
        _unknown_keys(err, path, problems)
    elif kind == "required":
        for missing in (k for k in err.validator_value if k not in err.instance):
            problems.add(path, f"missing required key {missing!r}")
    elif kind == "type":
        wanted = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        expected = schema.get("x-expected") or " or ".join(_SCHEMA_TYPES.get(w, w) for w in wanted)
        problems.add(path, schema.get("x-type-message") or f"expected {expected}, got {_describe(err.instance)}")
    elif kind == "pattern" and err.relative_schema_path and "propertyNames" in err.relative_schema_path:
        problems.add(path + (err.instance,), f"{_shown(err.instance)} {schema.get('x-message', 'is not allowed')}",
                     key=True)
    elif kind in ("pattern", "enum"):
        problems.add(path, f"{_shown(err.instance)} {schema.get('x-message', 'is not allowed')}")
    elif kind == "oneOf" and err.instance in ("", []) and "x-empty" in schema:
        problems.add(path, schema["x-empty"])
    elif kind == "oneOf" and "x-message" in schema:
        problems.add(path, f"{_shown(err.instance)} {schema['x-message']}")
    elif kind == "oneOf":
        _string_or_list(err, path, problems)
    elif kind in ("minimum", "maximum"):
        low, high = schema.get("minimum"), schema.get("maximum")
        seconds = "x-expected" in schema  # a duration given as a number of seconds
        problems.add(path, f"{err.instance} is out of range: seconds must be from {low} to {high}" if seconds
                     else f"must be between {low} and {high}, not {err.instance}")
    elif kind == "minProperties":
        problems.add(path, schema.get("x-empty", "must define at least one job"))
    elif kind in ("minItems", "minLength"):
        problems.add(path, "must not be empty")
    elif kind == "maxLength":
        problems.add(path, f"is too long: at most {err.validator_value} characters, got {len(err.instance)}")
    elif kind == "maxItems":
        problems.add(path, f"has too many entries: at most {err.validator_value}, got {len(err.instance)}")
    elif kind == "maxProperties":
        problems.add(path, f"has too many keys: at most {err.validator_value}, got {len(err.instance)}")
    else:
        problems.add(path, err.message if len(err.message) < 200 else err.message[:197] + "...")


def _unknown_keys(err: jsonschema.ValidationError, path: tuple[Any, ...], problems: _Problems) -> None:
    """Each key the schema does not know, with the nearest known one (or the list of them)."""
    schema = err.schema
    known = sorted(schema.get("properties", {}))
    patterns = list(schema.get("patternProperties", {}))
    extras = {k for k in set(err.instance) - set(known)
              if not (isinstance(k, str) and any(re.search(pat, k) for pat in patterns))}
    for extra in sorted(extras, key=str):
        hint = difflib.get_close_matches(str(extra), known, n=1)
        suffix = f" (did you mean {hint[0]!r}?)" if hint else f" (known keys: {', '.join(known)})"
        problems.add(path + (extra,), f"unknown key {_shown(extra)}{suffix}", key=True)


def _string_or_list(err: jsonschema.ValidationError, path: tuple[Any, ...], problems: _Problems) -> None:
    """A value that is a string or a list of strings: what is wrong inside the branch of its type, else its
    type."""
    kind_of = {str: "string", list: "array"}.get(type(err.instance))
    branch = next((i for i, sub in enumerate(err.validator_value) if sub.get("type") == kind_of), None)
    inner = [e for e in err.context if e.relative_schema_path and e.relative_schema_path[0] == branch]
    for sub_error in inner:  # the value has the right type: say what is wrong inside it
        _schema_problem(sub_error, problems)
    if not inner:
        problems.add(path, "expected a non-empty string or a non-empty list of strings, got "
                           f"{_describe(err.instance)}")


def _ms(value: str | int) -> int:
    """A manifest duration: text as Consul/systemd write it, or a bare number of seconds."""
    return value * 1000 if isinstance(value, int) else parse_duration(value)


def _check_duration(problems: _Problems, path: tuple[Any, ...], value: Any, bounds: tuple[int, int] | None = None,
                    why: str = "") -> None:
    """Range-check a duration the schema let through; a malformed one is the schema's to report, once."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return
    try:
        ms = _ms(value)
    except DurationError as exc:
        if "finer than" in str(exc):
            problems.add(path, str(exc))
        return
    if bounds is not None and not bounds[0] <= ms <= bounds[1]:
        hint = unit_hint(value) if isinstance(value, str) else ""
        problems.add(path, f"{_shown(value)} is out of range: {why.format(range=range_text(bounds))}{hint}")
    elif bounds is None and ms > DURATION_MAX_MS and isinstance(value, str):
        problems.add(path, f"{_shown(value)} is out of range: at most {format_duration(DURATION_MAX_MS)}"
                           f"{unit_hint(value)}")


def _split_command(problems: _Problems, path: tuple[Any, ...], command: str | list[str],
                   shell: bool = False) -> tuple[str, ...]:
    if isinstance(command, list):
        return tuple(command)
    if shell:
        return (SHELL, "-c", command)
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        problems.add(path, f"cannot split command: {exc}")
        return ()
    if not argv:
        problems.add(path, "must not be empty")
    return tuple(argv)


SHELL = "/bin/sh"


def _check_shell(problems: _Problems, job: dict[str, Any], jpath: tuple[Any, ...]) -> None:
    """A command string with shell syntax needs `shell: true`; `shell: true` needs a command string."""
    for field, message in shellsyntax.command_problems(job.get("command"), job.get("shell")):
        problems.add(jpath + (field,), message)


def _check_settings(problems: _Problems, block: Any, path: tuple[Any, ...], section: str) -> None:
    for where, message, key in unitsettings.block_problems(block, section):
        problems.add(path + where, message, key=key)


def _check_representable(problems: _Problems, job: dict[str, Any], jpath: tuple[Any, ...]) -> None:
    checks: list[tuple[tuple[Any, ...], str, unitescape.Context]] = []
    if isinstance(job.get("description"), str):
        checks.append((jpath + ("description",), job["description"], unitescape.Context.PLAIN))
    for name in ("working_directory", "environment_file"):
        if isinstance(job.get(name), str):
            checks.append((jpath + (name,), job[name], unitescape.Context.PLAIN))
    if isinstance(job.get("command"), str) and job.get("shell") is True:
        checks.append((jpath + ("command",), job["command"], unitescape.Context.EXEC_ARG))
    for name in ("command", "on_failure"):
        if isinstance(job.get(name), list):
            checks += [(jpath + (name, i), arg, unitescape.Context.EXEC_ARG)
                       for i, arg in enumerate(job[name]) if isinstance(arg, str)]
        elif isinstance(job.get(name), str) and not (name == "command" and job.get("shell") is True):
            try:  # a string is split first; each word must fit ExecStart= too
                words = shlex.split(job[name])
            except ValueError:
                words = []  # reported by _split_command
            checks += [(jpath + (name,), arg, unitescape.Context.EXEC_ARG) for arg in words]
    if isinstance(job.get("environment"), dict):
        checks += [(jpath + ("environment", k), f"{k}={v}", unitescape.Context.ENV_ASSIGNMENT)
                   for k, v in job["environment"].items() if isinstance(v, (str, int))]
        for name in sorted(CREDENTIAL_VARIABLES & set(job["environment"])):
            problems.add(jpath + ("environment", name), f"{name} is refused: unit files are world-readable, and a "
                         "credential never goes in one; set consul.token_file (a root-only file, passed with "
                         "LoadCredential=) and, if the job itself needs the token, pass_consul_token: true", key=True)
    for path, value, context in checks:
        try:
            unitescape.escape(value, context)
        except unitescape.UnrepresentableError as exc:
            problems.add(path, f"cannot be written to a unit file: {exc}")


def _semantic_checks(problems: _Problems, data: dict[str, Any]) -> None:
    defaults = data.get("defaults") if isinstance(data.get("defaults"), dict) else {}
    lock_blocks = [(("defaults", "lock"), defaults.get("lock"))]
    timer_blocks = [(("defaults", "timer"), defaults.get("timer"))]
    _check_settings(problems, defaults.get("service"), ("defaults", "service"), "service")
    if isinstance(data.get("consul"), dict) and isinstance(data["consul"].get("address"), str):
        address = data["consul"]["address"]
        try:
            if re.search(r"[\x00-\x20\x7f-\x9f\u2028\u2029]", address):  # parse_address would cut a "\n" off
                raise AddressError(f"{_shown(address)} holds whitespace or a control character")
            parse_address(address)
        except AddressError as exc:
            problems.add(("consul", "address"), str(exc))
    _check_representable(problems, defaults, ("defaults",))  # its on_failure reaches every job's unit
    if isinstance(defaults.get("on_failure"), str):  # checked even where every job overrides it
        _split_command(problems, ("defaults", "on_failure"), defaults["on_failure"])
    jobs = data.get("jobs") if isinstance(data.get("jobs"), dict) else {}
    for name, job in jobs.items():
        if not isinstance(job, dict):
            continue
        jpath = ("jobs", name)
        lock_blocks.append((jpath + ("lock",), job.get("lock")))
        timer_blocks.append((jpath + ("timer",), job.get("timer")))
        _check_duration(problems, jpath + ("timeout",), job.get("timeout"))
        schedules = job.get("schedule")
        for i, spec in enumerate([schedules] if isinstance(schedules, str) else schedules if isinstance(schedules, list) else []):
            problem = schedule_problem(spec) if isinstance(spec, str) else None
            if problem:
                problems.add(jpath + ("schedule",) + ((i,) if isinstance(schedules, list) else ()), problem)
        if isinstance(job.get("command"), str) and job.get("shell") is not True:
            _split_command(problems, jpath + ("command",), job["command"])
        if isinstance(job.get("on_failure"), str):
            _split_command(problems, jpath + ("on_failure",), job["on_failure"])
        _check_shell(problems, job, jpath)
        _check_settings(problems, job.get("service"), jpath + ("service",), "service")
        _check_representable(problems, job, jpath)
    for path, block in lock_blocks:
        if not isinstance(block, dict):
            continue
        _check_duration(problems, path + ("ttl",), block.get("ttl"), TTL_RANGE_MS, "Consul accepts a session TTL from {range}")
        _check_duration(problems, path + ("lock_delay",), block.get("lock_delay"), LOCK_DELAY_RANGE_MS,
                        "lock_delay must be {range}; less would let another node start before a partitioned "
                        "holder stops")
        _check_duration(problems, path + ("wait",), block.get("wait"))
    _check_retries(problems, defaults, jobs)
    _check_start_deadline(problems, defaults, jobs)
    chains.check(jobs, defaults, problems.add)
    _check_each_node(problems, defaults, jobs)
    for path, block in timer_blocks:
        _check_settings(problems, block, path, "timer")
        if isinstance(block, dict):
            for name in ("accuracy", "randomized_delay"):
                _check_duration(problems, path + (name,), block.get(name))


def _check_retries(problems: _Problems, defaults: dict[str, Any], jobs: dict[str, Any]) -> None:
    """Durations in range, max_backoff not below backoff (as merged with defaults), and one holder at a time."""
    base = defaults.get("retries") if isinstance(defaults.get("retries"), dict) else {}
    blocks = [(("defaults", "retries"), base, {})]
    blocks += [(("jobs", name, "retries"), job.get("retries") if isinstance(job.get("retries"), dict) else {}, job)
               for name, job in jobs.items() if isinstance(job, dict)]
    for path, block, job in blocks:
        for name in ("backoff", "max_backoff"):
            _check_duration(problems, path + (name,), block.get(name))
        if not job:
            continue
        merged = {**base, **block}
        values = [merged.get(k, d) for k, d in (("backoff", "10s"), ("max_backoff", "5min"))]
        try:
            backoff, cap = (_ms(v) for v in values) if all(
                isinstance(v, (str, int)) and not isinstance(v, bool) for v in values) else (0, 0)
        except DurationError:
            backoff, cap = 0, 0  # reported above or by the schema
        where = path if block else ("defaults", "retries")
        if cap < backoff <= DURATION_MAX_MS:
            problems.add(where + ("max_backoff",) if "max_backoff" in (block or base) else where,
                         f"max_backoff ({format_duration(cap)}) must be at least backoff ({format_duration(backoff)})")
        concurrency = {**(defaults.get("lock") or {}), **(job.get("lock") or {})}.get("concurrency", 1) \
            if isinstance(job.get("lock", {}), dict) and isinstance(defaults.get("lock", {}), dict) else 1
        if isinstance(merged.get("attempts"), int) and merged["attempts"] > 1 and isinstance(concurrency, int) \
                and concurrency > 1 and job.get("mode") != "each-node":  # each-node: a node retries its own share
            problems.add(where + ("attempts",) if "attempts" in (block or base) else where,
                         "retries are of one occurrence, run by one holder: they need lock.concurrency: 1")


def _check_start_deadline(problems: _Problems, defaults: dict[str, Any], jobs: dict[str, Any]) -> None:
    """A start deadline is of an occurrence: a job with several holders at once has none (refused, not ignored)."""
    for name, job in jobs.items():
        if not isinstance(job, dict) or "start_deadline" not in job and "start_deadline" not in defaults:
            continue
        locks = [block for block in (defaults.get("lock"), job.get("lock")) if isinstance(block, dict)]
        concurrency = {k: v for block in locks for k, v in block.items()}.get("concurrency", 1)
        if isinstance(concurrency, int) and concurrency > 1 and job.get("mode") != "each-node":
            where = ("jobs", name, "start_deadline") if "start_deadline" in job else ("defaults", "start_deadline")
            problems.add(where, "a start deadline is of a scheduled occurrence, run by one holder: it needs "
                                "lock.concurrency: 1")
    for name, job in jobs.items():  # the final ping's body needs a ping (here or in defaults) to travel in
        if isinstance(job, dict) and "ping_output_lines" in job and "ping_url" not in job and "ping_url" not in defaults:
            problems.add(("jobs", name, "ping_output_lines"), "sends the output with the final ping: it needs ping_url")


def _check_each_node(problems: _Problems, defaults: dict[str, Any], jobs: dict[str, Any]) -> None:
    """`mode: each-node` runs a node's own share of each occurrence: no other node may take it over (so no
    `on_holder_loss: retry`), and a node waits for a slot until its next occurrence is due (so no `lock.wait`)."""
    for name, job in jobs.items():
        if not isinstance(job, dict) or job.get("mode") != "each-node":
            continue
        policy = job.get("on_holder_loss", defaults.get("on_holder_loss", "skip"))
        if policy == "retry":
            where = ("jobs", name, "on_holder_loss") if "on_holder_loss" in job else ("jobs", name, "mode")
            problems.add(where, "mode: each-node runs each node's own share of an occurrence, which no other node "
                                "may take over: it needs on_holder_loss: skip (a lost run is recorded lost for that "
                                "node; retries: reruns a failed one on the same node)"
                         + ("" if "on_holder_loss" in job else " (defaults.on_holder_loss is retry)"))
        if isinstance(job.get("lock"), dict) and "wait" in job["lock"]:
            problems.add(("jobs", name, "lock", "wait"), "mode: each-node waits for a free slot until the node's "
                                                         "next occurrence is due: lock.wait has no meaning here")


def _retries(raw: dict[str, Any]) -> RetrySettings:
    base = RetrySettings()
    return RetrySettings(attempts=raw.get("attempts", base.attempts),
                         backoff_ms=_ms(raw["backoff"]) if "backoff" in raw else base.backoff_ms,
                         max_backoff_ms=_ms(raw["max_backoff"]) if "max_backoff" in raw else base.max_backoff_ms)


def _lock(raw: dict[str, Any]) -> LockSettings:
    base = LockSettings()
    return LockSettings(
        ttl_ms=_ms(raw["ttl"]) if "ttl" in raw else base.ttl_ms,
        lock_delay_ms=_ms(raw["lock_delay"]) if "lock_delay" in raw else base.lock_delay_ms,
        checks=tuple(raw.get("checks", base.checks)),
        wait_ms=_ms(raw["wait"]) if "wait" in raw else base.wait_ms,
        concurrency=raw.get("concurrency", base.concurrency),
        skip_exit_code=raw.get("skip_exit_code", base.skip_exit_code),
    )


def _timer(raw: dict[str, Any]) -> TimerSettings:
    base = TimerSettings()
    return TimerSettings(
        accuracy_ms=_ms(raw["accuracy"]) if "accuracy" in raw else base.accuracy_ms,
        randomized_delay_ms=_ms(raw["randomized_delay"]) if "randomized_delay" in raw else base.randomized_delay_ms,
        persistent=raw.get("persistent", base.persistent),
    )


def _settings(raw: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """Extra unit lines from a merged settings mapping: systemd names only, sorted, a list giving one line per item."""
    return tuple((name, text) for name in sorted(k for k in raw if unitsettings.is_setting_name(k))
                 for text in unitsettings.values(raw[name]))


def _on_failure(problems: _Problems, name: str, raw: dict[str, Any], defaults: dict[str, Any]) -> tuple[str, ...]:
    if "on_failure" in raw:
        return _split_command(problems, ("jobs", name, "on_failure"), raw["on_failure"])
    if "on_failure" in defaults:
        return _split_command(problems, ("defaults", "on_failure"), defaults["on_failure"])
    return ()


def _build(source: str, data: dict[str, Any], problems: _Problems) -> Manifest:
    defaults = data.get("defaults", {})
    jobs = []
    for name in sorted(data["jobs"]):
        raw = data["jobs"][name]
        schedule = raw.get("schedule", [])
        jobs.append(Job(
            name=name,
            command=_split_command(problems, ("jobs", name, "command"), raw["command"], raw.get("shell", False)),
            schedules=tuple([schedule] if isinstance(schedule, str) else schedule),
            description=raw.get("description", f"consulrun job {name}"),
            user=raw.get("user"),
            group=raw.get("group"),
            working_directory=raw.get("working_directory"),
            environment=tuple(sorted((k, str(v)) for k, v in raw.get("environment", {}).items())),
            environment_file=raw.get("environment_file"),
            timeout_ms=_ms(raw["timeout"]) if "timeout" in raw else None,
            lock=_lock({**defaults.get("lock", {}), **raw.get("lock", {})}),
            timer=_timer({**defaults.get("timer", {}), **raw.get("timer", {})}),
            on_holder_loss=raw.get("on_holder_loss", defaults.get("on_holder_loss", "skip")),
            history=raw.get("history", defaults.get("history", 20)),
            shell=raw.get("shell", False),
            service_settings=_settings({**defaults.get("service", {}), **raw.get("service", {})}),
            timer_settings=_settings({**defaults.get("timer", {}), **raw.get("timer", {})}),
            on_failure=_on_failure(problems, name, raw, defaults),
            ping_url=raw.get("ping_url", defaults.get("ping_url")),
            # In defaults it is for the jobs that ping: a job without ping_url sends nothing (and is not refused).
            ping_output_lines=raw.get("ping_output_lines", defaults.get("ping_output_lines", 0))
            if raw.get("ping_url", defaults.get("ping_url")) else 0,
            pass_consul_token=raw.get("pass_consul_token", False),
            hardening=raw.get("hardening", defaults.get("hardening", "none")),
            placement=_placement(raw.get("nodes", defaults.get("nodes"))),
            start_deadline_ms=_ms(raw["start_deadline"]) if "start_deadline" in raw else
            (_ms(defaults["start_deadline"]) if "start_deadline" in defaults else None),
            retries=_retries({**defaults.get("retries", {}), **raw.get("retries", {})}),
            after=chains.parents(raw),
            mode=raw.get("mode", "once"),
        ))
    return Manifest(
        source=source,
        unit_prefix=data.get("unit_prefix", "consulrun"),
        kv_prefix=data.get("kv_prefix", "consulrun"),
        consul=ConsulSettings(**data.get("consul", {})),
        jobs=tuple(jobs),
        health_checks=bool(data.get("health_checks", False)),
        name=data.get("name"),
    )


def parse_manifest(text: str, source: str) -> Manifest:
    """Validate manifest text; every problem found is raised together as one `ManifestError`.

    Python's cyclic garbage collector is paused meanwhile: a big manifest
    makes millions of objects and no reference cycles worth collecting, and
    the collector's passes over them were a third of parsing and validating
    10,000 jobs (bench/RESULTS.md). Whatever cycles there are wait for the
    next pass after this.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        try:
            located = load(text)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
            raise ManifestError([f"{where}: YAML syntax error: {explain(exc, text)}"]) from None
        except yaml.YAMLError as exc:
            raise ManifestError([f"{source}: YAML error: {exc}"]) from None
        except LimitError as exc:
            line, col = exc.position()
            raise ManifestError([f"{source}:{line}:{col}: {exc.message}"]) from None
        return validate(located, source)
    finally:
        if collecting:
            gc.enable()


def _get_in(data: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        data = data[part]
    return data


def validate(located: Located, source: str) -> Manifest:
    """Check parsed data (with its positions) against the schema and the rules a schema cannot state."""
    problems = _Problems(source, located)
    for pos, message in located.problems:
        problems.lines.append((pos, f"{source}:{pos[0]}:{pos[1]}: {message}"))
    data = located.data
    if data is None:
        raise ManifestError([f"{source}:1:1: the manifest is empty; it needs at least a 'jobs' mapping"])
    if not isinstance(data, dict):
        problems.add((), f"the top level must be a mapping with a 'jobs' key, not {_describe(data)}")
        problems.raise_if_any()
    for path in located.integral_floats:
        # JSON Schema counts 1.0 as an integer: `concurrency: 1.0` would reach a unit as "1.0", and a duration of
        # 0.0 was a traceback. No manifest value is a number with a point.
        problems.add(path, f"{_shown(_get_in(data, path))} is a number with a decimal point; write an integer, "
                           "or quote it as a string")
    if not conforms(data):
        for err in jsonschema.Draft202012Validator(SCHEMA).iter_errors(data):
            _schema_problem(err, problems)
    _semantic_checks(problems, data)
    problems.raise_if_any()
    manifest = _build(source, data, problems)
    for job in manifest.jobs:
        where = ("jobs", job.name, "hardening") if "hardening" in data["jobs"][job.name] else ("defaults", "hardening")
        for message in hardening.problems(manifest, job):
            problems.add(where, message)
    problems.raise_if_any()
    return manifest


def load_manifest(path: Path) -> Manifest:
    """Read and validate the manifest at `path`."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError([f"{path}: {os_reason(exc)}"]) from None
    except UnicodeDecodeError as exc:
        raise ManifestError([f"{path}: not UTF-8 text (byte {exc.start})"]) from None
    return parse_manifest(text, str(path))
