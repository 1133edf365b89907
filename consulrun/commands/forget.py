"""`consulrun forget`: delete one job's state in Consul (a job gone from the manifest, or a phantom)."""

from __future__ import annotations

import click

from consulrun.commands.common import check_jobs, complete_jobs, confirm, manifest_and_jobs
from consulrun.commands.options import consul_config, consul_options, manifest_prefix_option, yes_option
from consulrun.errors import UsageError


@click.command(short_help="Delete everything Consul holds about a job.")
@click.argument("targets", nargs=-1, required=True, metavar="[MANIFEST] JOB",
                shell_complete=complete_jobs(many=False))
@manifest_prefix_option
@yes_option
@consul_options
def forget(targets: tuple[str, ...], prefix: str | None, yes: bool, **consul: str | None) -> None:
    """Delete every key of JOB under the prefix (lock, occurrence, history, pauses) and its health check.

    Refuses while JOB is held or running. Shows what it will delete and asks
    (unless --yes), then deletes it in one transaction, with check-and-set on
    every key: a run that starts meanwhile makes the transaction fail, and
    nothing is deleted. JOB must have state in Consul (exit 6 otherwise, with
    a "did you mean"); it need not be in MANIFEST, which gives the prefix and
    the Consul settings. Units are not touched (see `uninstall`).
    """
    from consulrun.consul.client import Client
    from consulrun.protocol import forget as forgetting

    loaded, jobs = manifest_and_jobs(targets)
    if len(jobs) != 1:
        raise UsageError("forget takes one JOB, after an optional MANIFEST")
    job = jobs[0]
    kv_prefix = (prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")).strip("/")
    client = Client(consul_config(consul, loaded.consul if loaded else None))
    # The state in Consul is what is forgotten, in the manifest or not (so no manifest can help find it).
    check_jobs(jobs, None, client, kv_prefix, manifest_helps=False)
    found = forgetting.look(client, kv_prefix, job)
    click.echo(f"{job}: will delete:", err=True)
    for line in found.lines():
        click.echo(line, err=True)
    if loaded is not None and job in {j.name for j in loaded.jobs}:
        click.echo(f"warning: {job} is still a job of {loaded.source}: its next run starts its state afresh",
                   err=True)
    if not yes:
        confirm(f"Forget {job}?")
    forgetting.forget(client, found)
    click.echo(f"{job}: forgotten ({len(found.keys)} key(s)" + (", its health check" if found.check else "") + ")")
