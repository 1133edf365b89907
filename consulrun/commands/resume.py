"""`consulrun resume`: let paused jobs run again."""

from __future__ import annotations

import click

from consulrun.commands.common import complete_jobs
from consulrun.commands.options import all_jobs_option, consul_options, manifest_prefix_option
from consulrun.commands.pause import pause_targets


@click.command(short_help="End the pause of jobs.")
@click.argument("targets", nargs=-1, metavar="[MANIFEST] [JOB]...",
                shell_complete=complete_jobs(many=True))
@all_jobs_option
@manifest_prefix_option
@consul_options
def resume(targets: tuple[str, ...], all_jobs: bool, prefix: str | None, **consul: str | None) -> None:
    """End the pause of JOBs: their next occurrence runs as scheduled (skipped ones are not run again)."""
    from datetime import datetime, timezone

    from consulrun.protocol import pause as pausing

    client, kv_prefix, jobs = pause_targets(targets, all_jobs, prefix, consul)
    now = datetime.now(timezone.utc)
    ended = pausing.resume(client, kv_prefix, jobs, now=now)
    for job in jobs:
        if job not in ended:
            click.echo(f"{job}: not paused; nothing to resume")
        elif not pausing.in_force(ended[job], now):
            click.echo(f"{job}: not paused (its pause ran out by itself at {ended[job].get('until')}); "
                       "nothing to resume")
        else:
            click.echo(f"{job}: resumed ({pausing.why(ended[job])})")
