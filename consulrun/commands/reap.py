"""`consulrun reap`: free a lock whose holder is a dead wrapper on this node (the units' ExecStopPost=)."""

from __future__ import annotations

import click

from consulrun.commands.common import job_problem
from consulrun.commands.options import agent_options, consul_config, job_prefix_option
from consulrun.commands.runargs import setup_logging as _setup_logging
from consulrun.errors import UsageError


@click.command(short_help="Free a job's lock held by a dead wrapper on this node.")
@job_prefix_option
@click.option("--concurrency", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="The job's concurrency (which lock keys to look at).")
@agent_options
@click.argument("job")
def reap(job: str, prefix: str, concurrency: int, **consul: str | None) -> None:
    """Free JOB's lock if its holder is a wrapper on this node that is dead.

    Units run it as ExecStopPost= when a run ends other than cleanly (the
    wrapper was killed, e.g. by the OOM killer): systemd has stopped every
    process of the unit by then, so the dead wrapper's session is destroyed at
    once instead of living until its TTL runs out. Lock-delay still applies.
    A live holder, or one on another node, is never touched.
    """
    problem = job_problem(job)
    if problem:
        raise UsageError(problem)
    from consulrun.consul.client import Client
    from consulrun.protocol.lock import Locker, LockSpec

    _setup_logging()
    locker = Locker(Client(consul_config(consul), label=job), LockSpec(job=job, prefix=prefix, concurrency=concurrency))
    _, entries = locker.entries()
    locker.reap_dead_holder(entries)
