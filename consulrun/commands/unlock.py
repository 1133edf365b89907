"""`consulrun unlock`: break a job's lock, refusing a healthy holder unless forced."""

from __future__ import annotations

import logging

import click

from consulrun.commands.common import complete_jobs, confirm, manifest_and_jobs, with_suggestion
from consulrun.commands.options import consul_config, consul_options, manifest_prefix_option, yes_option
from consulrun.commands.runargs import setup_logging as _setup_logging
from consulrun.errors import ConsulrunError, UsageError


@click.command(short_help="Break a job's stuck lock.")
@click.argument("targets", nargs=-1, required=True, metavar="[MANIFEST] JOB",
                shell_complete=complete_jobs(many=False))
@manifest_prefix_option
@yes_option
@click.option("--force", is_flag=True, help="Break the lock even if its holder looks healthy.")
@consul_options
def unlock(targets: tuple[str, ...], prefix: str | None, yes: bool, force: bool, **consul: str | None) -> None:
    """Break JOB's stuck lock by destroying the holder's session.

    Refuses when the holder is healthy as Consul judges it (session alive, no
    bound check critical) and, on the holder's own node, its wrapper process
    still runs, unless --force: destroying a live holder's session makes it
    kill its job (exit 75). Either way lock-delay applies: nobody can take
    the lock for the session's lock-delay. Exit 6 if JOB has no state at all.
    """
    from consulrun.consul.client import Client
    from consulrun.consul.values import printable
    from consulrun.report import status as state

    _setup_logging()
    loaded, jobs = manifest_and_jobs(targets)
    if len(jobs) != 1:
        raise UsageError("unlock takes one JOB, after an optional MANIFEST")
    job = jobs[0]
    kv_prefix = prefix or (loaded.kv_prefix if loaded else "consulrun")
    client = Client(consul_config(consul, loaded.consul if loaded else None))
    try:
        holders = state.job_holders(client, kv_prefix, job, malformed_ok=force)
    except state.NoState as exc:
        raise with_suggestion(exc, jobs, loaded, client, kv_prefix) from None
    if not holders:
        click.echo(f"{job} is not locked")
        return
    for holder in holders:
        holder = {k: printable(v) if isinstance(v, str) else v for k, v in holder.items()}  # text from Consul
        facts = [f"pid {holder['pid']}" if holder["pid"] is not None else "",
                 f"since {holder['since']}" if holder["since"] else ""]
        who = f"{holder['node'] or 'a session with no node'}" + (f" ({', '.join(f for f in facts if f)})"
                                                                    if any(facts) else "")
        if holder["healthy"] and not force:
            raise ConsulrunError(f"{job} is held by {who} with session {holder['session']}, which is healthy "
                                 f"({holder['health']}); use --force to break it anyway")
        click.echo(f"{job}: will destroy session {holder['session']} of {who} ({holder['health']}); Consul then "
                   "frees the lock and keeps it from everyone for the session's lock-delay"
                   + ("; a live holder kills its job (exit 75)" if holder["healthy"] else ""), err=True)
        if not yes:
            confirm(f"Destroy session {holder['session']} of {who}?")
        if client.session_visible(holder["session"]) is None:
            click.echo(f"session {holder['session']} was already gone")
            continue
        client.session_destroy(holder["session"])
        logging.getLogger("consulrun").warning("%s: unlocked: destroyed session %s held by %s (%s)", job,
                                               holder["session"], holder["node"], holder["health"])
