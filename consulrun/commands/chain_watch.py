"""`consulrun chain-watch`: the per-node watcher a chained job's `<unit_prefix>-after@<job>.service` runs."""

from __future__ import annotations

import click

from consulrun.commands.common import job_problem
from consulrun.commands.options import agent_options, consul_config, job_prefix_option
from consulrun.commands.runargs import _placement, setup_logging
from consulrun.errors import UsageError


@click.command("chain-watch", short_help="Start a chained job's runs on this node as asked.")
@job_prefix_option
@click.option("--unit", default=None, help="The job's service unit [default: consulrun-<JOB>.service].")
@click.option("--node-meta", "node_meta", multiple=True, metavar="KEY=VALUE",
              help="The job's placement, as run takes it: on another node, start nothing (repeatable).")
@click.option("--node-name", "node_names", multiple=True, metavar="GLOB",
              help="The job's placement by node name (repeatable: any of them).")
@agent_options
@click.argument("job")
def chain_watch(job: str, prefix: str, unit: str | None, node_meta: tuple[str, ...], node_names: tuple[str, ...],
                **consul: str | None) -> None:
    """Start JOB's unit on this node for each run asked of it by a job it runs after (docs/chains.md).

    Runs until stopped: a blocking read of <prefix>/<JOB>/after/ (no write
    while nothing is asked), then `systemctl start` of the unit, whose run
    claims the request under the job's lock, so of all the nodes that watch,
    one runs it, once. Needs root (it runs systemctl start).
    """
    problem = job_problem(job)
    if problem:
        raise UsageError(problem)
    from consulrun.consul.client import Client
    from consulrun.protocol.chainwatch import watch
    from consulrun.protocol.trigger import systemctl_start

    setup_logging()
    placement = _placement(node_meta, node_names) if node_meta or node_names else None
    watch(Client(consul_config(consul), label=job), f"{prefix.strip('/')}/{job}", unit or f"consulrun-{job}.service",
          systemctl_start, placement=placement)
