"""`consulrun watchdog`: bring each job's Consul health check in line with `status`."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from consulrun.commands.common import read_manifest
from consulrun.commands.options import Duration, consul_config, consul_options, manifest_prefix_option
from consulrun.commands.runargs import setup_logging as _setup_logging
from consulrun.errors import UsageError, os_reason


@click.command(short_help="Bring each job's Consul health check up to date.")
@click.argument("manifest", required=False, type=click.Path(allow_dash=True, path_type=Path))
@manifest_prefix_option
@click.option("--jobs", "jobs_json", metavar="JSON", default=None,
              help="The jobs' schedules, timers and timeouts as JSON (instead of MANIFEST).")
@click.option("--jobs-file", type=click.Path(path_type=Path), default=None,
              help="The same, from the file generate writes beside the units (the watchdog unit passes it).")
@click.option("--grace", type=Duration(), default="60s", show_default=True,
              help="How long past its time (plus accuracy and randomized delay) an occurrence may stay unclaimed.")
@consul_options
def watchdog(manifest: Path | None, prefix: str | None, jobs_json: str | None, jobs_file: Path | None, grace: int,
             **consul: str | None) -> None:
    """Bring every job's Consul health check in line with `status`: missed, overdue, dead holders, pauses.

    Registers the prefix's external node and service if missing, then writes
    (check-and-set) only the checks whose status or output changes. The
    units `generate` makes for `health_checks: true` run it once a minute
    on one node, under a consulrun lock (job `_watchdog`).
    """
    from consulrun.consul.client import Client
    from consulrun.report import watchdog as health

    if [manifest, jobs_json, jobs_file].count(None) != 2:
        raise UsageError("give one of MANIFEST, --jobs or --jobs-file (the watchdog unit passes --jobs-file)")
    loaded = read_manifest(manifest)[0] if manifest else None
    where = f"--jobs-file {jobs_file}" if jobs_file else "--jobs"
    try:
        if jobs_file:
            jobs_json = "".join(line for line in jobs_file.read_text(encoding="utf-8").splitlines(keepends=True)
                                if not line.startswith("#"))  # the generated-by header
        watched = health.Watched.from_manifest(loaded) if loaded else health.Watched.from_json(jobs_json or "")
    except OSError as exc:
        raise UsageError(f"{where}: {os_reason(exc)}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: {exc}") from None
    kv_prefix = prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")
    _setup_logging()
    client = Client(consul_config(consul, loaded.consul if loaded else None), label="watchdog")
    report = health.watchdog(client, kv_prefix, watched, grace_s=grace / 1000)
    for line in report.changed:
        logging.getLogger("consulrun").info("watchdog: check %s", line)
