"""Telling monitors about a run: Healthchecks.io-style pings, and the `on_failure` command systemd starts.

Pings go out from one background thread per run, in order (`/start` is never
overtaken by the result), each with a short timeout. Nothing here can delay
or fail the job: a ping that fails is logged and dropped, and at exit the
wrapper waits for an unsent ping at most PING_TIMEOUT_S, however the network
behaves (a hanging DNS lookup included: the thread is a daemon, the wait is
bounded by a join).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import re
import socket
import subprocess
import threading
import time

from consulrun.timefmt import duration

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger("consulrun")

PING_TIMEOUT_S = 5.0
PING_URL_RE = re.compile(r"https?://[^\s/?#]+(/[^\s?#]*)?")  # no query or fragment: suffixes are appended to the path


def ping_url_problem(url: str) -> str | None:
    """None if `url` can take Healthchecks.io's suffixes (`/start`, `/fail`, `/<status>`), else why not."""
    if len(url) > 2048:
        return "ping URL is too long: at most 2048 characters"
    if not PING_URL_RE.fullmatch(url):
        return (f"{url[:80]!r} is not a ping URL: http:// or https://, no whitespace, no query or fragment "
                "(consulrun appends /start, /fail or /<exit status>)")
    return None


def result_suffix(outcome: dict[str, Any]) -> str:
    """'' for a run that exited 0, `/<status>` for another exit status, `/fail` for a run lost or never started."""
    status = outcome.get("exit_status")
    if outcome.get("lost") or not isinstance(status, int):
        return "/fail"
    return "" if status == 0 else f"/{status}"


OUTPUT_BYTES_MAX = 10_000  # of the journal's tail in the final ping: Healthchecks.io keeps 100 kB, mail less
OUTPUT_MARK = "the run's last journal lines go with the final ping"
OUTPUT_WAIT_S = 1.0  # for journald to store the mark; then the tail goes as it is


class Pings:
    """The pings of one run: `start()` when the job has started, `finish(outcome)` when it is over.

    With `output_lines`, the final ping is a POST whose body is the last lines of this run's journal (the
    job's output and the wrapper's lines, by systemd's INVOCATION_ID: only under a unit), read in the ping
    thread when the run has ended: what journald has stored by then.
    """

    def __init__(self, url: str | None, job: str, timeout_s: float = PING_TIMEOUT_S, rid: str | None = None,
                 output_lines: int = 0) -> None:
        self.url = url.rstrip("/") if url else None
        self.job = job
        self.output_lines = output_lines
        # Healthchecks.io's run id (a UUID) pairs a run's start and end pings, so two runs overlapping in the
        # monitor's view (a takeover on another node) are timed apart; the run's Consul session id is one.
        self.query = f"?rid={rid}" if rid else ""
        self.timeout_s = timeout_s
        self._queue: queue.Queue[tuple[str, bool] | None] = queue.Queue()  # (URL, with the journal's tail)
        self._thread: threading.Thread | None = None
        self._finished = False
        self._sending: str | None = None  # the URL being requested now, for the exit-time warning

    def start(self) -> None:
        self._send("/start")

    def finish(self, outcome: dict[str, Any]) -> None:
        if self._finished:
            return
        self._finished = True
        if self.output_lines and self.url and os.environ.get("INVOCATION_ID"):
            # The job's output and this line share the unit's one journal stream, in order: once journald has
            # stored this line, it has stored all the job wrote before it (the ping thread waits for it).
            log.info("%s: %s", self.job, OUTPUT_MARK)
        self._send(result_suffix(outcome), with_output=self.output_lines > 0)
        if self._thread is not None:
            self._queue.put(None)
            atexit.register(self._wait, time.monotonic() + self.timeout_s)

    def _wait(self, give_up: float) -> None:
        """At exit: give the last pings until `give_up`, then leave them (the daemon thread dies with us)."""
        thread = self._thread
        if thread is None:
            return
        thread.join(max(0.0, give_up - time.monotonic()))
        if thread.is_alive():
            sending = self._sending
            log.warning("%s: ping %s failed: no answer within %s; not waiting longer", self.job,
                        _redacted(sending) if sending else "(queued)", duration(self.timeout_s))

    def _send(self, suffix: str, with_output: bool = False) -> None:
        if not self.url:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="consulrun-ping", daemon=True)
            self._thread.start()
        self._queue.put((self.url + suffix + self.query, with_output))

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            url, with_output = item
            self._sending = url
            try:
                import urllib.request  # here: a run without a ping URL (most) does not pay for it

                body = self._output() if with_output else None
                request = urllib.request.Request(url, data=body, headers={
                    "User-Agent": "consulrun", **({"Content-Type": "text/plain; charset=utf-8"} if with_output else {})})
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - http(s) only
                    response.read(1024)
            except (OSError, ValueError) as exc:  # urllib.error.URLError is an OSError
                log.warning("%s: ping %s failed: %s", self.job, _redacted(url), getattr(exc, "reason", exc))


    def _output(self) -> bytes:
        """The tail of this run's journal, at most OUTPUT_BYTES_MAX bytes of it; empty outside a unit."""
        invocation = os.environ.get("INVOCATION_ID", "")
        if not re.fullmatch(r"[0-9a-f]{32}", invocation):
            return b""
        give_up = time.monotonic() + OUTPUT_WAIT_S
        while True:
            tail = _journal(invocation, "", self.output_lines + 1)
            if OUTPUT_MARK in tail or time.monotonic() > give_up:
                break
            time.sleep(0.1)
        lines = [line for line in tail.splitlines() if not line.endswith(OUTPUT_MARK)][-self.output_lines:]
        return "\n".join(lines).encode("utf-8", "replace")[-OUTPUT_BYTES_MAX:]


def _redacted(url: str) -> str:
    """A ping URL for the log: the host and the suffix, not the check's secret path."""
    scheme, _, rest = url.split("?", 1)[0].partition("://")  # the run id is no secret, but says nothing here
    host, _, path = rest.partition("/")
    last = path.rsplit("/", 1)[-1] if "/" in path else ""
    shown = last if last in ("start", "fail") or last.isdigit() else ""
    return f"{scheme}://{host}/...{'/' + shown if shown else ''}"


# --- on_failure: what systemd's OnFailure= unit runs -------------------------------------------------------------

JOURNAL_LINES = 20
OCCURRENCE_ID = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"  # calendar.occurrence_id's form, and nothing after it


def failure_facts(job: str, unit: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """What the on_failure command is told: job, node, unit, result, exit status, occurrence, journal lines.

    systemd (251 and later) hands an OnFailure= unit the failed unit's result,
    exit status and invocation id in MONITOR_* variables; the run's own
    journal lines are found by that invocation id.
    """
    env = dict(os.environ if env is None else env)
    invocation = env.get("MONITOR_INVOCATION_ID", "")
    result = env.get("MONITOR_SERVICE_RESULT", "")
    status = env.get("MONITOR_EXIT_STATUS", "")
    if not (invocation and result):  # older systemd: ask it about the failed unit
        shown = _systemctl_show(unit, ["InvocationID", "Result", "ExecMainStatus"])
        invocation = invocation or shown.get("InvocationID", "")
        result = result or shown.get("Result", "")
        status = status or shown.get("ExecMainStatus", "")
    journal = _journal(invocation, unit)
    node, occurrence = acquired(job, journal)
    if not node and invocation:  # the line is near the run's start, before the last lines shown
        node, occurrence = acquired(job, _journal_head(invocation))
    if result == "exit-code" and re.search(rf"^consulrun: {re.escape(job)}: {TIMED_OUT_LINE}", journal, re.M):
        result = "timeout"  # the wrapper's own timeout (run --timeout) stopped the job, as TimeoutStartSec= did
    return {"CONSULRUN_JOB": job, "CONSULRUN_NODE": node or socket.gethostname(), "CONSULRUN_UNIT": unit,
            "CONSULRUN_RESULT": result, "CONSULRUN_EXIT_STATUS": status, "CONSULRUN_INVOCATION_ID": invocation,
            "CONSULRUN_OCCURRENCE": occurrence, "CONSULRUN_JOURNAL": journal,
            "_ran": "1" if node else ""}  # not for the command: see run_on_failure


TIMED_OUT_LINE = "the job exceeded its timeout"  # stops.JobTimeout's line
STOPPED_WAITING_LINE = "while waiting for the lock; not running"  # runner.run's line for a stop before the lock


def acquired(job: str, journal: str) -> tuple[str, str]:
    """(Consul node name, occurrence) from the run's last `acquired` line; ("", "") if it never acquired.

    The node is Consul's name for it (the rest of consulrun names nodes so; it may differ from the host name);
    the occurrence is only what has the occurrence id's own form, so the prose around it (`..., taking over
    from a dead runner`) never becomes part of it; a manual run has none.
    """
    pattern = re.compile(rf"^consulrun: {re.escape(job)}: acquired \S+ (?:for occurrence ({OCCURRENCE_ID})(?=[ ,])"
                         rf".*?)?.*\(node (\S+), session ", re.M)
    found = pattern.findall(journal)
    if not found:
        return "", ""
    occurrence, node = found[-1]
    return node, occurrence


def stopped_before_running(facts: dict[str, str]) -> bool:
    """The failed run was stopped (`systemctl stop`, the unit's timeout, a shutdown) while it waited or stood by,
    before it took the lock: this node did not run the job, so it has nothing to report.

    A run that failed before the lock for another reason (Consul unreachable, a bad command) still notifies.
    """
    return not facts.get("_ran") and bool(
        re.search(rf"^consulrun: {re.escape(facts['CONSULRUN_JOB'])}: SIG[A-Z]+ {STOPPED_WAITING_LINE}",
                  facts["CONSULRUN_JOURNAL"], re.M))


def _journal_head(invocation: str, lines: int = 200) -> str:
    """The first `lines` lines of one invocation's journal."""
    try:
        with subprocess.Popen(["journalctl", "--no-pager", "-q", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={invocation}"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
            head = [line for _, line in zip(range(lines), proc.stdout or [])]
            proc.kill()
    except OSError:
        return ""
    return "".join(head)


def _systemctl_show(unit: str, props: list[str]) -> dict[str, str]:
    try:
        out = subprocess.run(["systemctl", "show", unit, *[f"--property={p}" for p in props]], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _journal(invocation: str, unit: str, lines: int = JOURNAL_LINES) -> str:
    match = [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
    try:
        out = subprocess.run(["journalctl", "--no-pager", "-q", "-o", "cat", "-n", str(lines), *match],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.rstrip("\n")


def is_skip(facts: dict[str, str], skip_exit_code: int) -> bool:
    """A skip is never a failure (systemd already counts the skip code as success; this holds if it did not)."""
    return facts["CONSULRUN_RESULT"] == "exit-code" and facts["CONSULRUN_EXIT_STATUS"] == str(skip_exit_code)


def run_on_failure(command: list[str], facts: dict[str, str]) -> int:
    """Run the manifest's on_failure command with the facts in its environment and the journal on stdin."""
    try:
        done = subprocess.run(command, input=facts["CONSULRUN_JOURNAL"] + "\n", text=True,
                              env={**os.environ, **{k: v for k, v in facts.items() if k.startswith("CONSULRUN_")}})
    except OSError as exc:
        log.error("%s: on_failure: cannot start %s: %s", facts["CONSULRUN_JOB"], command[0], exc.strerror or exc)
        return 127
    return done.returncode
