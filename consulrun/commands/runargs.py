"""`consulrun run`: its options read without click on the timer's hot path, and the one function that starts it.

Every timer tick starts `consulrun run` on every node, and all but one skip:
importing click costs a skipping run about a sixth of its CPU. So the entry
point (consulrun/entry.py) hands `run`'s arguments to `read()` first, which
takes only what it is sure click would take the same way: the long options
below (`--opt VALUE` or `--opt=VALUE`), JOB, then the command. Anything else
(`--help`, an unknown or misspelt option, a value it would have to second-guess)
goes to click, which parses it again and reports any error. click's `run`
stays the only definition of the command line: a test checks this table
against its parameters, and another gives both readers the same arguments and
wants the same values or a refusal from this one.
"""

from __future__ import annotations

import os
import sys

from consulrun.errors import ConsulrunError, UsageError, output_guard
from consulrun.manifest.durations import (
    DURATION_MAX_MS,
    LOCK_DELAY_RANGE_MS,
    TTL_RANGE_MS,
    DurationError,
    parse_duration,
)
from consulrun.manifest.schema import kv_prefix_problem, name_problem, schedule_problem

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any, Callable, NoReturn

ATTEMPTS_MAX = 100  # consulrun.protocol.retries.ATTEMPTS_MAX (a test holds them equal)
WATCHDOG_JOB = "_watchdog"  # consulrun.protocol.health.WATCHDOG_JOB, kept here so `run` imports nothing more


class _Declined(Exception):
    """An argument the lean reader leaves to click."""


def _duration(bounds: tuple[int, int]) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            ms = parse_duration(text)
        except DurationError:
            raise _Declined() from None
        if not bounds[0] <= ms <= bounds[1]:
            raise _Declined()
        return ms
    return convert


def _count(low: int, high: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
            raise _Declined()
        return int(text)
    return convert


def _one_of(*choices: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in choices:
            raise _Declined()
        return text
    return convert


def _prefix(text: str) -> str:
    if kv_prefix_problem(text):
        raise _Declined()
    return text


def _text(text: str) -> str:
    return text


# option -> (parameter, conversion, default, repeatable, environment variable); a conversion of None is a flag.
OPTIONS: dict[str, tuple[str, Callable[[str], Any] | None, Any, bool, str | None]] = {
    "--prefix": ("prefix", _prefix, "consulrun", False, None),
    "--ttl": ("ttl", _duration(TTL_RANGE_MS), "15s", False, None),
    "--lock-delay": ("lock_delay", _duration(LOCK_DELAY_RANGE_MS), "15s", False, None),
    "--check": ("checks", _text, (), True, None),
    "--wait": ("wait", _duration((0, DURATION_MAX_MS)), "0s", False, None),
    "--concurrency": ("concurrency", _count(1, 1000), "1", False, None),
    "--skip-exit-code": ("skip_exit_code", _count(0, 255), "0", False, None),
    "--schedule": ("schedules", _text, (), True, None),
    "--on-holder-loss": ("on_holder_loss", _one_of("skip", "retry"), "skip", False, None),
    "--history": ("history", _count(1, 1000), "20", False, None),
    "--ping-url": ("ping_url", _text, None, False, None),
    "--ping-output-lines": ("ping_output_lines", _count(1, 1000), None, False, None),
    "--health-check": ("health_check", None, False, False, None),
    "--pass-consul-token": ("pass_consul_token", None, False, False, None),
    "--timeout": ("timeout", _duration((1, DURATION_MAX_MS)), None, False, None),
    "--skip-when-stopped": ("skip_when_stopped", None, False, False, None),
    "--node-meta": ("node_meta", _text, (), True, None),
    "--node-name": ("node_names", _text, (), True, None),
    "--attempts": ("attempts", _count(1, ATTEMPTS_MAX), "1", False, None),
    "--retry-backoff": ("retry_backoff", _duration((0, DURATION_MAX_MS)), "10s", False, None),
    "--retry-max-backoff": ("retry_max_backoff", _duration((0, DURATION_MAX_MS)), "5min", False, None),
    "--start-deadline": ("start_deadline", _duration((1, DURATION_MAX_MS)), None, False, None),
    "--after": ("after", _text, (), True, None),
    "--then": ("then", _text, (), True, None),
    "--each-node": ("each_node", None, False, False, None),
    "--http-addr": ("http_addr", _text, None, False, "CONSUL_HTTP_ADDR"),
    "--token-file": ("token_file", _text, None, False, "CONSUL_HTTP_TOKEN_FILE"),
    "--ca-file": ("ca_file", _text, None, False, "CONSUL_CACERT"),
    "--ca-path": ("ca_path", _text, None, False, "CONSUL_CAPATH"),
    "--client-cert": ("client_cert", _text, None, False, "CONSUL_CLIENT_CERT"),
    "--client-key": ("client_key", _text, None, False, "CONSUL_CLIENT_KEY"),
    "--tls-server-name": ("tls_server_name", _text, None, False, "CONSUL_TLS_SERVER_NAME"),
}


def read(args: list[str], environ: dict[str, str] | os._Environ[str]) -> dict[str, Any] | None:
    """`run`'s parameters from ARGS (what follows `run`) as click's `run` would get them, or None: ask click."""
    given: dict[str, Any] = {}
    rest = list(args)
    try:
        while rest and rest[0].startswith("-"):
            token = rest.pop(0)
            name, has_value, value = token.partition("=")
            if name not in OPTIONS:
                return None  # `--help`, `--`, `-`, a short option, an unknown one: click's to read or refuse
            param, convert, _, repeatable, _ = OPTIONS[name]
            if convert is None:
                if has_value:
                    return None
                given[param] = True
                continue
            if not has_value:
                if not rest or rest[0].startswith("-"):
                    return None  # a missing value, or one that looks like an option: let click say which
                value = rest.pop(0)
            if repeatable:
                given[param] = (*given.get(param, ()), convert(value))
            elif param in given:
                return None  # given twice: click takes the last, but say nothing clever here
            else:
                given[param] = convert(value)
        if len(rest) < 2:
            return None  # no JOB, or no COMMAND: click's usage error
        params: dict[str, Any] = {"job": rest[0], "command": tuple(rest[1:])}
        for param, convert, default, repeatable, envvar in OPTIONS.values():
            if param in given:
                params[param] = given[param]
            elif envvar and environ.get(envvar):
                params[param] = environ[envvar]
            else:
                params[param] = default if convert is None or repeatable or default is None else convert(default)
    except _Declined:
        return None
    return params


def job_missing(args: list[str]) -> bool:
    """True if `--` comes before any JOB (`run -- echo hi`): click would take the command's first word for JOB.

    Options are skipped by this module's table (a value given apart is skipped with its option); an option the
    table does not know ends the look, for click to report."""
    rest = list(args)
    while rest:
        token = rest.pop(0)
        if token == "--":
            return True
        name, has_value, _ = token.partition("=")
        if not token.startswith("-") or name not in OPTIONS:
            return False
        if OPTIONS[name][1] is not None and not has_value and rest:
            rest.pop(0)
    return False


def main(args: list[str]) -> None:
    """Run `consulrun run ARGS` without click if `read` takes them; return (for click to do it) if not."""
    params = read(args, os.environ)
    if params is None:
        return
    try:
        with output_guard():
            start(**params)
    except ConsulrunError as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # as click reports it: Ctrl-C before the job's signal handling is in place
        print("\nAborted!", file=sys.stderr)
        sys.exit(1)


def start(job: str, command: tuple[str, ...], prefix: str, ttl: int, lock_delay: int, checks: tuple[str, ...],
          wait: int, concurrency: int, skip_exit_code: int, schedules: tuple[str, ...], on_holder_loss: str,
          history: int, ping_url: str | None, health_check: bool, pass_consul_token: bool = False,
          timeout: int | None = None, skip_when_stopped: bool = False, node_meta: tuple[str, ...] = (),
          node_names: tuple[str, ...] = (), attempts: int = 1, retry_backoff: int = 10_000,
          retry_max_backoff: int = 300_000, start_deadline: int | None = None, ping_output_lines: int | None = None,
          after: tuple[str, ...] = (), then: tuple[str, ...] = (), each_node: bool = False,
          **consul: str | None) -> NoReturn:
    """Check what the options cannot check alone, then run the job under its lock and exit with its status."""
    problem = None if job == WATCHDOG_JOB else name_problem(job)  # the watchdog's own lock is one to run
    if problem:
        raise UsageError(problem)
    _check_schedule_options(schedules, concurrency, each_node, on_holder_loss)
    thens = _chain_options(job, after, then, concurrency)
    if each_node and (after or then):
        raise UsageError("--each-node runs an occurrence on every node: a chain (--after, --then) joins one run to one")
    if attempts > 1 and not (schedules or after):
        raise UsageError("--attempts retries a scheduled occurrence: it needs --schedule (or --after)")
    if start_deadline is not None and not (schedules or after):
        raise UsageError("--start-deadline is about a scheduled occurrence: it needs --schedule (or --after)")
    if retry_max_backoff < retry_backoff:
        raise UsageError("--retry-max-backoff must be at least --retry-backoff")
    _check_ping_options(ping_url, ping_output_lines)
    command = _the_command(job, command)
    placement = _placement(node_meta, node_names) if node_meta or node_names else None
    from consulrun.consul.client import consul_config
    from consulrun.protocol.lock import LockSpec
    from consulrun.protocol.runner import RunRequest, run as run_job

    spec = LockSpec(job=job, prefix=prefix, ttl_ms=ttl, lock_delay_ms=lock_delay, checks=checks, wait_ms=wait,
                    concurrency=concurrency, placement=placement)
    setup_logging()
    request = RunRequest(spec=spec, command=command, skip_exit_code=skip_exit_code, schedules=schedules,
                         on_holder_loss=on_holder_loss, history=history, ping_url=ping_url,
                         health_check=health_check, pass_consul_token=pass_consul_token, timeout_ms=timeout,
                         skip_when_stopped=skip_when_stopped, attempts=attempts, retry_backoff_ms=retry_backoff,
                         retry_max_backoff_ms=retry_max_backoff, start_deadline_ms=start_deadline,
                         ping_output_lines=ping_output_lines or 0, after=after, thens=thens,
                         each_node=each_node)
    sys.exit(run_job(request, consul_config(consul)))


def _check_schedule_options(schedules: tuple[str, ...], concurrency: int, each_node: bool,
                            on_holder_loss: str) -> None:
    """--schedule, --each-node, --concurrency and --on-holder-loss together, and each schedule's spec."""
    if schedules and concurrency != 1 and not each_node:
        raise UsageError("--schedule runs each occurrence once; it cannot be combined with --concurrency "
                         "(unless --each-node: every node once, --concurrency at a time)")
    if each_node and not schedules:
        raise UsageError("--each-node runs each scheduled occurrence once on every node: it needs --schedule")
    if each_node and on_holder_loss == "retry":
        raise UsageError("--each-node runs this node's own share, which no other node may take over: it needs "
                         "--on-holder-loss skip")
    for spec_text in schedules:
        problem = schedule_problem(spec_text)
        if problem:
            raise UsageError(f"--schedule: {problem}")


def _check_ping_options(ping_url: str | None, ping_output_lines: int | None) -> None:
    if ping_output_lines is not None and ping_url is None:
        raise UsageError("--ping-output-lines sends the output with the final ping: it needs --ping-url")
    if ping_url is not None:
        from consulrun.protocol.notify import ping_url_problem

        problem = ping_url_problem(ping_url)
        if problem:
            raise UsageError(f"--ping-url: {problem}")


def _the_command(job: str, command: tuple[str, ...]) -> tuple[str, ...]:
    """COMMAND without a leading `--`; options after JOB, or no command, refused."""
    if command and command[0] == "--":
        command = command[1:]
    elif command and command[0].startswith("-"):
        # `run JOB --ttl 10s -- cmd` must not run `--ttl` as the job: options go before JOB.
        raise UsageError(f"options go before JOB: {command[0]!r} follows {job!r}; "
                         "write consulrun run [OPTIONS] JOB -- COMMAND [ARG]...")
    if not command:
        raise UsageError("no command given: consulrun run JOB -- COMMAND [ARG]...")
    return command


def _chain_options(job: str, after: tuple[str, ...], then: tuple[str, ...],
                   concurrency: int) -> tuple[tuple[str, str], ...]:
    """`--after JOB` and `--then JOB:ON` checked as the manifest checks `after:`; the (job, on) pairs of --then."""
    thens = []
    for given in then:
        child, _, on = given.rpartition(":")
        if not child or on not in ("success", "failure", "always") or name_problem(child) or child == job:
            raise UsageError(f"--then: {given[:80]!r} is not JOB:ON (ON: success, failure or always; JOB another "
                             "job's name)")
        thens.append((child, on))
    for parent in after:
        if name_problem(parent) or parent == job:
            raise UsageError(f"--after: {parent[:80]!r} is not another job's name")
    if (after or then) and concurrency != 1:
        raise UsageError("--after and --then join occurrences: they cannot be combined with --concurrency")
    return tuple(thens)


def _placement(node_meta: tuple[str, ...], node_names: tuple[str, ...]) -> Any:
    """The manifest's `nodes:` as `run` takes it, checked as the schema checks it."""
    import re

    from consulrun.manifest.placement import Placement

    pairs = []
    for given in node_meta:
        key, equals, value = given.partition("=")
        if not equals or not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", key) or len(value) > 512 or \
                any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise UsageError(f"--node-meta: {given[:80]!r} is not KEY=VALUE (KEY: 1-128 of A-Za-z0-9_-; VALUE: "
                             "at most 512 characters, no control characters)")
        pairs.append((key, value))
    for glob in node_names:
        if not glob or len(glob) > 128 or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in glob):
            raise UsageError(f"--node-name: {glob[:80]!r} is not a node name glob (1-128 characters, no whitespace)")
    return Placement(meta=tuple(sorted(pairs)), names=tuple(node_names))


def setup_logging() -> None:
    """Log lines go to stderr as `consulrun: <message>` (the journal adds the rest)."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("consulrun: %(message)s"))
    logger = logging.getLogger("consulrun")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
