"""`consulrun watchdog`: bring each job's Consul health check in line with `status`."""

from __future__ import annotations

import glob
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import click

from consulrun.commands.common import read_manifest
from consulrun.commands.options import Duration, consul_config, consul_options, manifest_prefix_option
from consulrun.commands.runargs import setup_logging as _setup_logging
from consulrun.errors import UsageError, os_reason

if TYPE_CHECKING:
    from collections.abc import Callable

    from consulrun.report.watchdog import Watched


@click.command(short_help="Bring each job's Consul health check up to date.")
@click.argument("manifest", required=False, type=click.Path(allow_dash=True, path_type=Path))
@manifest_prefix_option
@click.option("--jobs", "jobs_json", metavar="JSON", default=None,
              help="The jobs' schedules, timers and timeouts as JSON (instead of MANIFEST).")
@click.option("--jobs-file", type=click.Path(path_type=Path), default=None,
              help="The same, from a file generate writes beside the units.")
@click.option("--jobs-glob", metavar="PATTERN", default=None,
              help="The same, from every file PATTERN matches (a shell glob), judged together: "
                   "one for each manifest beside the watchdog unit, which passes it.")
@click.option("--grace", type=Duration(), default="60s", show_default=True,
              help="How long past its time (plus accuracy and randomized delay) an occurrence may stay unclaimed.")
@consul_options
def watchdog(manifest: Path | None, prefix: str | None, jobs_json: str | None,
             jobs_file: Path | None, jobs_glob: str | None, grace: int,
             **consul: str | None) -> None:
    """Bring every job's Consul health check in line with `status`: missed, overdue, dead holders, pauses.

    Registers the prefix's external node and service if missing, then writes
    (check-and-set) only the checks whose status or output changes. The
    units `generate` makes for `health_checks: true` run it once a minute
    on one node, under a consulrun lock (job `_watchdog`), with the job lists
    of every manifest installed beside it.
    """
    from consulrun.consul.client import Client
    from consulrun.report import watchdog as health

    if [manifest, jobs_json, jobs_file, jobs_glob].count(None) != 3:
        raise UsageError("give one of MANIFEST, --jobs, --jobs-file or --jobs-glob "
                         "(the watchdog unit passes --jobs-glob)")
    loaded = read_manifest(manifest)[0] if manifest else None
    if loaded:
        watched = health.Watched.from_manifest(loaded)
    elif jobs_json is not None:
        watched = _read("--jobs", lambda: jobs_json or "")
    else:
        files = [jobs_file] if jobs_file else [Path(p) for p in sorted(glob.glob(jobs_glob or ""))]
        if not files:  # judging no job would remove every job's check
            raise UsageError(f"--jobs-glob {jobs_glob}: no file matches")
        watched = health.Watched.merged([_read(f"{'--jobs-file ' if jobs_file else ''}{path}",
                                               lambda path=path: _json(path)) for path in files])
    kv_prefix = prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")
    _setup_logging()
    client = Client(consul_config(consul, loaded.consul if loaded else None), label="watchdog")
    report = health.watchdog(client, kv_prefix, watched, grace_s=grace / 1000)
    for line in report.changed:
        logging.getLogger("consulrun").info("watchdog: check %s", line)


def _json(path: Path) -> str:
    """A job list's JSON: the file without its `#` lines (the header, the watchdog's settings)."""
    return "".join(line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                   if not line.startswith("#"))


def _read(where: str, text: "Callable[[], str]") -> "Watched":
    from consulrun.report.watchdog import Watched

    try:
        return Watched.from_json(text())
    except OSError as exc:
        raise UsageError(f"{where}: {os_reason(exc)}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: {exc}") from None
