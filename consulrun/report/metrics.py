"""Prometheus metrics for every job under a prefix, from what Consul holds (`consulrun exporter`).

The judgement (held, missed, overdue, lost, ...) is `consulrun status`'s own:
this module calls `status.collect` and turns its answer into gauges. Runs
are counted from the jobs' history records, each run once per exporter
process, so `consulrun_job_runs_total` and the schedule-lag histogram behave
as Prometheus counters (they start from what history still holds when the
exporter starts, and a restart is an ordinary counter reset).

Never green when blind: when Consul cannot be read completely (unreachable,
ACLs hiding part of it), the per-job gauges are withdrawn and
`consulrun_exporter_consul_up` is 0, rather than stale values being served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    write_to_textfile,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from consulrun.consul.client import Client
from consulrun.errors import ConsulrunError, MalformedValue, OutputError, UsageError, os_reason
from consulrun.manifest.loader import Manifest
from consulrun.report import history, status
from consulrun.report.httpd import MetricsServer

log = logging.getLogger("consulrun")

# Jobs are labelled `job_name`: `job` is the label Prometheus gives every target (it would become `exported_job`).
# Schedule lag spans timer accuracy (1s..1min), randomized delays and takeovers (lock-delay + TTLs): 0.1s to 1h.
LAG_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# `state` label values: the lock being held, and every problem `consulrun status` can report.
STATES = ("held", "unhealthy", "missed", "future", "skew", "unplaced", "node-down", "overdue", "failed", "lost",
          "abandoned", "stalled")
OUTCOMES = {"lost": "lost", "abandoned": "abandoned", "missed": "missed"}
REFRESH_S = 15.0  # a blocking query returns at least this often, so missed/overdue follow the clock
MAX_BACKOFF_S = 30.0


def _ts(text: Any) -> float | None:
    when = status.parse_time(text) if text else None
    return when.timestamp() if when else None


def outcome_of(row: dict[str, Any]) -> str | None:
    """success | failed | lost | abandoned | missed for a finished run (or a recorded miss), None for one still
    running or for an attempt that was retried (the run's result is its last attempt's)."""
    if row.get("retried"):
        return None
    if row["state"] in OUTCOMES:
        return OUTCOMES[row["state"]]
    if row["state"] == "running" or row["exit_status"] is None:
        return None
    return "success" if row["exit_status"] == 0 else "failed"


class ClusterMetrics:
    """The metrics registry of one prefix; `refresh` reads Consul, `collect` (called by the registry) reports."""

    def __init__(self, prefix: str, manifest: Manifest | None, grace_s: float = status.DEFAULT_GRACE_S) -> None:
        self.prefix = prefix.strip("/")
        self.manifest = manifest
        self.grace_s = grace_s
        self.registry = CollectorRegistry()
        self.runs = Counter("consulrun_job_runs", "Finished runs seen in the jobs' history, by outcome "
                            "(success, failed, lost, abandoned; missed: an occurrence recorded as run nowhere).",
                            ["job_name", "outcome"], registry=self.registry)
        self.lag = Histogram("consulrun_job_schedule_lag_seconds", "Job start minus its scheduled occurrence, "
                             "per attempt (a takeover's attempt included).", ["job_name"], buckets=LAG_BUCKETS,
                             registry=self.registry)
        self._counted: set[tuple[Any, ...]] = set()
        self._lagged: set[tuple[Any, ...]] = set()
        self._statuses: list[status.JobStatus] = []
        self._success: dict[str, float] = {}
        self._up = False
        self._malformed = False  # the last refresh met a value consulrun never writes (the log names its key)
        self._refreshed: float | None = None
        self.registry.register(self)  # type: ignore[arg-type] - a custom collector: collect() only

    def refresh(self, client: Client, index: int | None = None, wait_s: float | None = None) -> int:
        """Read Consul once (blocking on `index` up to `wait_s`); return the index to block on next."""
        try:
            idx, statuses = status.collect(client, self.prefix, self.manifest, index=index, wait_s=wait_s,
                                           grace_s=self.grace_s)
        except status.NoState as exc:  # nothing ran yet: no job metrics, but Consul answered
            idx, statuses = exc.index, []
        _, tree = status.read_prefix(client, self.prefix + "/")
        present: set[tuple[Any, ...]] = set()
        for job, keys in sorted(tree.items()):
            present |= self._count_runs(job, history.rows_of(keys))
        # A run history no longer holds cannot come back: forget it, so a long-lived exporter stays small.
        self._counted &= present
        self._lagged &= present
        self._statuses, self._up, self._refreshed, self._malformed = statuses, True, time.time(), False
        return idx

    def failed(self, exc: ConsulrunError, quiet: bool = False) -> None:
        """Consul could not be read (completely), or a value in it cannot be judged: withdraw what would now be
        stale, and say which it was."""
        self._statuses, self._up, self._refreshed = [], False, time.time()
        self._malformed = isinstance(exc, MalformedValue)
        if not quiet:
            what = "a value in Consul is malformed" if self._malformed else "cannot read Consul"
            log.warning("exporter: %s: %s", what, exc.format_message())

    def _count_runs(self, job: str, rows: list[dict[str, Any]]) -> set[tuple[Any, ...]]:
        """Count the runs not counted yet; return the keys of all of them."""
        keys = set()
        for row in rows:
            key = (job, row["occurrence"], row["attempt"], row["started"], row["node"], row["session"])
            keys.add(key)
            occurred, started = _ts(row["occurrence"]), _ts(row["started"])
            if key not in self._lagged and occurred is not None and started is not None and not row["manual"]:
                self._lagged.add(key)
                self.lag.labels(job).observe(max(0.0, started - occurred))
            outcome = outcome_of(row)
            if outcome and key not in self._counted:
                self._counted.add(key)
                self.runs.labels(job, outcome).inc()
            ended = _ts(row["ended"])
            if outcome == "success" and ended is not None and ended > self._success.get(job, 0.0):
                self._success[job] = ended
        return keys

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("consulrun_exporter_consul_up",
                               "1 if the last refresh read all of the prefix from Consul, else 0 (job gauges "
                               "are then withdrawn).")
        up.add_metric([], 1.0 if self._up else 0.0)
        yield up
        refreshed = GaugeMetricFamily("consulrun_exporter_last_refresh_timestamp_seconds",
                                      "When the exporter last tried to read Consul.")
        if self._refreshed is not None:
            refreshed.add_metric([], self._refreshed)
        yield refreshed
        malformed = GaugeMetricFamily("consulrun_exporter_malformed_value",
                                      "1 if the last refresh met a value in Consul that consulrun never writes "
                                      "(its log names the key): "
                                      "job gauges are then withdrawn and consul_up is 0, else 0.")
        malformed.add_metric([], 1.0 if self._malformed else 0.0)
        yield malformed
        families = {
            "start": GaugeMetricFamily("consulrun_job_last_start_timestamp_seconds",
                                       "Start of the job's last run (any node).", labels=["job_name"]),
            "end": GaugeMetricFamily("consulrun_job_last_end_timestamp_seconds",
                                     "End of the job's last finished run.", labels=["job_name"]),
            "duration": GaugeMetricFamily("consulrun_job_last_duration_seconds",
                                          "Duration of the job's last finished run.", labels=["job_name"]),
            "exit": GaugeMetricFamily("consulrun_job_last_exit_status",
                                      "Exit status of the job's last finished run.", labels=["job_name"]),
            "success": GaugeMetricFamily("consulrun_job_last_success_timestamp_seconds",
                                         "End of the job's last run that exited 0.", labels=["job_name"]),
            "state": GaugeMetricFamily("consulrun_job_state",
                                       "1 if the job is in this state (held, or a problem `consulrun status` "
                                       "reports), else 0.", labels=["job_name", "state"]),
            "paused": GaugeMetricFamily("consulrun_job_paused_since_timestamp_seconds",
                                        "When the pause in force began (`consulrun pause`); absent for a job "
                                        "that is not paused.", labels=["job_name"]),
            "ahead": GaugeMetricFamily("consulrun_job_clock_ahead_seconds",
                                       "At least how far the clock of the node that wrote the job's occurrence "
                                       "record is ahead of the exporter's (present only beyond 2s; see `status`'s "
                                       "skew).", labels=["job_name", "node"]),
            "health": GaugeMetricFamily("consulrun_job_health",
                                        "`consulrun status` verdict for the job, as its exit status: 0 ok, 1 last "
                                        "run failed/lost/abandoned, 3 missed, 4 overdue, 5 holder unhealthy.",
                                        labels=["job_name"]),
            # mode: each-node: a node's own latest occurrence, from the rows `status` lists (no extra read).
            "node_end": GaugeMetricFamily("consulrun_job_node_last_end_timestamp_seconds",
                                          "Each-node job: end of the node's last finished run.",
                                          labels=["job_name", "node"]),
            "node_exit": GaugeMetricFamily("consulrun_job_node_last_exit_status",
                                           "Each-node job: exit status of the node's last finished run.",
                                           labels=["job_name", "node"]),
            "node_up": GaugeMetricFamily("consulrun_job_node_up",
                                         "Each-node job: 0 if the node is failing in Consul (node-down), else 1.",
                                         labels=["job_name", "node"]),
        }
        for s in self._statuses:
            for row in s.nodes or []:
                labels = [s.job, str(row["node"])]
                families["node_up"].add_metric(labels, 1.0 if row["healthy"] else 0.0)
                for name, value in (("node_end", _ts(row.get("ended"))), ("node_exit", row.get("exit_status"))):
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        families[name].add_metric(labels, float(value))
            last = s.last or {}
            values = {"start": _ts(last.get("started")), "end": _ts(last.get("ended")),
                      "duration": last.get("duration_s"), "exit": last.get("exit_status"),
                      "success": self._success.get(s.job),
                      "paused": _ts((s.paused or {}).get("at")) if s.paused else None}
            for name, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    families[name].add_metric([s.job], float(value))
            kinds = {p["kind"] for p in s.problems} | ({"held"} if s.state == "held" else set())
            for state in STATES:
                families["state"].add_metric([s.job, state], 1.0 if state in kinds else 0.0)
            for p in s.problems:
                if p["kind"] == "skew":
                    families["ahead"].add_metric([s.job, str(p["node"])], float(p["ahead_s"]))
            families["health"].add_metric([s.job], float(int(s.health())))
        yield from families.values()


def exposition(metrics: ClusterMetrics) -> bytes:
    return generate_latest(metrics.registry)


def write_textfile(metrics: ClusterMetrics, path: Path) -> None:
    """Write the metrics for node_exporter's textfile collector: a temporary file renamed over `path`."""
    try:
        write_to_textfile(str(path), metrics.registry)
    except OSError as exc:
        raise OutputError(f"{path}: {os_reason(exc)}") from None


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPV6]:PORT` or `:PORT` (all addresses) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--listen: {text[:80]!r} is not HOST:PORT (a port from 1 to 65535; ':PORT' for all addresses)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", int(port)


def serve(metrics: ClusterMetrics, make_client: Callable[[], Client], listen: tuple[str, int],
          refresh_s: float = REFRESH_S) -> None:
    """Serve /metrics on `listen` and keep the metrics current with blocking queries; never returns.

    Consul being unreachable is not the end: the exporter says so
    (`consulrun_exporter_consul_up 0`) and retries with backoff up to 30s.
    """
    index: int | None = None
    client: Client | None = None
    try:  # the first answer is ready before the first scrape: no spurious `consul_up 0` at start
        client = make_client()
        index = metrics.refresh(client)
    except UsageError:
        raise
    except ConsulrunError as exc:
        metrics.failed(exc)
    try:
        server = MetricsServer(listen, lambda: exposition(metrics), CONTENT_TYPE_LATEST)
    except OSError as exc:
        raise OutputError(f"--listen: cannot listen on {listen[0]}:{listen[1]}: {os_reason(exc)}") from None
    threading.Thread(target=server.serve_forever, name="consulrun-metrics", daemon=True).start()
    log.info("exporter: serving metrics of %s/ on http://%s:%d/metrics", metrics.prefix,
             f"[{listen[0]}]" if ":" in listen[0] else listen[0], listen[1])
    delay = 1.0
    while True:
        try:
            client = client or make_client()
            index = metrics.refresh(client, index, refresh_s if index else None)
            delay = 1.0
        except UsageError:
            raise  # an unreadable token file: waiting will not fix it
        except ConsulrunError as exc:
            metrics.failed(exc)
            time.sleep(delay)
            delay, index = min(delay * 2, MAX_BACKOFF_S), None
