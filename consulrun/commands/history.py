"""`consulrun history`: a job's past occurrences, as Consul keeps them."""

from __future__ import annotations

import click

from consulrun.commands.common import complete_jobs, manifest_and_jobs, to_json, with_suggestion
from consulrun.commands.options import consul_config, consul_options, manifest_prefix_option
from consulrun.errors import UsageError


@click.command(short_help="List a job's runs across the cluster.")
@click.argument("targets", nargs=-1, required=True, metavar="[MANIFEST] JOB",
                shell_complete=complete_jobs(many=False))
@manifest_prefix_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of runs instead of a table.")
@click.option("-n", "limit", type=click.IntRange(1, 100_000), default=20, show_default=True, help="How many runs.")
@consul_options
def history(targets: tuple[str, ...], prefix: str | None, as_json: bool, limit: int, **consul: str | None) -> None:
    """List JOB's runs across the cluster, newest first, every attempt of a taken-over occurrence included.

    What is kept is what the runs recorded: the newest `history` (manifest;
    `--history` of `run`) occurrences, and the last run made without
    --schedule (marked manual). Occurrences skipped while the job was paused
    are listed too (from the kept pauses and the schedule). Exit 6 if JOB has
    no state at all, unless it is a job of MANIFEST that has not run yet (an
    empty history).
    """
    from datetime import datetime, timezone

    from consulrun.consul.client import Client
    from consulrun.report import history as past

    loaded, jobs = manifest_and_jobs(targets)
    if len(jobs) != 1:
        raise UsageError("history takes one JOB, after an optional MANIFEST")
    kv_prefix = prefix or (loaded.kv_prefix if loaded else "consulrun")
    schedules = next((job.schedules for job in loaded.jobs if job.name == jobs[0]), ()) if loaded else ()
    client = Client(consul_config(consul, loaded.consul if loaded else None))
    try:
        rows = past.runs(client, kv_prefix, jobs[0], limit, schedules=schedules)
    except past.NoState as exc:
        if not (loaded and any(job.name == jobs[0] for job in loaded.jobs)):
            raise with_suggestion(exc, jobs, loaded, client, kv_prefix) from None
        rows = []  # a job of the manifest that has not run yet: an empty history, as `status` says "never run"
        if not as_json:
            click.echo(f"{jobs[0]}: no runs yet (a job of {loaded.source} that has never run)", err=True)
            return
    if as_json:
        click.echo(to_json({"prefix": kv_prefix, "job": jobs[0], "runs": rows}, compact=False))
        return
    from consulrun.consul.values import printable

    table = [[printable(cell) for cell in row] for row in past.table(rows, datetime.now(timezone.utc))]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
