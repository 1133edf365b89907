"""`consulrun pause`: stop jobs from starting on any node, for a while or until resumed."""

from __future__ import annotations

import click

from consulrun.commands.common import check_jobs, complete_jobs, manifest_and_jobs
from consulrun.commands.options import (
    Duration,
    all_jobs_option,
    consul_config,
    consul_options,
    manifest_prefix_option,
)
from consulrun.errors import UsageError


def pause_targets(targets: tuple[str, ...], all_jobs: bool, prefix: str | None,
                   consul: dict[str, str | None]) -> tuple[object, str, list[str]]:
    """(client, kv prefix, jobs) for pause/resume: JOBs named (each one of the manifest's, else one with state in
    Consul), or --all of the manifest's (else of Consul's)."""
    from consulrun.consul.client import Client
    from consulrun.report import status as state

    loaded, jobs = manifest_and_jobs(targets)
    if bool(jobs) == all_jobs:
        raise UsageError("name the JOBs, or give --all (with a manifest: its jobs; without: every job in Consul)")
    kv_prefix = prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")
    client = Client(consul_config(consul, loaded.consul if loaded else None))
    if all_jobs:
        jobs = tuple(job.name for job in loaded.jobs) if loaded else tuple(sorted(state.read_prefix(
            client, kv_prefix.strip("/") + "/")[1]))
        if not jobs:
            raise state.NoState(f"no job has any state under {kv_prefix}/ in Consul")
    else:
        check_jobs(jobs, loaded, client, kv_prefix)
    return client, kv_prefix.strip("/"), list(dict.fromkeys(jobs))  # a job named twice is one job


@click.command(short_help="Pause jobs on every node.")
@click.argument("targets", nargs=-1, metavar="[MANIFEST] [JOB]...",
                shell_complete=complete_jobs(many=True))
@all_jobs_option
@click.option("--for", "for_ms", type=Duration(), default=None, metavar="DURATION",
              help="End the pause by itself after this long (e.g. 2h); default: until `resume`.")
@click.option("--reason", default=None, help="Why, shown by status and history.")
@manifest_prefix_option
@consul_options
def pause(targets: tuple[str, ...], all_jobs: bool, for_ms: int | None, reason: str | None, prefix: str | None,
          **consul: str | None) -> None:
    """Pause JOBs on every node: their runs skip (exit with the skip code) until `resume` or --for ends.

    One Consul write for all of them (batches beyond Consul's 128 operations); the skip path stays free of writes.
    """
    from consulrun.protocol import pause as pausing

    client, kv_prefix, jobs = pause_targets(targets, all_jobs, prefix, consul)
    value = pausing.pause(client, kv_prefix, jobs, for_ms=for_ms or None, reason=reason)
    for job in jobs:
        click.echo(f"{job}: {pausing.describe(value)}")
