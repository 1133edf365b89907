"""`consulrun trigger`: ask for one manual run of a job on one node, now."""

from __future__ import annotations

import sys

import click

from consulrun.commands.common import (
    check_jobs,
    complete_jobs,
    default_consulrun_path,
    manifest_and_jobs,
)
from consulrun.commands.options import Duration, consul_config, consul_options, manifest_prefix_option
from consulrun.errors import ConsulrunError, ExitCode, UsageError


@click.command(short_help="Run a job once, now, through its systemd unit.")
@click.argument("targets", nargs=-1, required=True, metavar="[MANIFEST] JOB",
                shell_complete=complete_jobs(many=False))
@click.option("--wait", "wait_ms", type=Duration(), default="0s", show_default=True,
              help="If the job is running, wait up to this long for it to end, then trigger.")
@click.option("--unit", default=None, help="The job's service unit [default: <unit_prefix>-<JOB>.service].")
@click.option("--host", default=None, metavar="NODE", help="Trigger on NODE over ssh instead of this node.")
@manifest_prefix_option
@consul_options
def trigger(targets: tuple[str, ...], wait_ms: int, unit: str | None, host: str | None, prefix: str | None,
            **consul: str | None) -> None:
    """Run JOB once, now, on this node (or --host NODE), through its systemd unit.

    Never beside another run of JOB: if it is running anywhere, this says so
    and starts nothing (or waits, with --wait). The run is recorded in
    history as manual, with who asked. Needs root (it runs systemctl start).
    """
    loaded, jobs = manifest_and_jobs(targets)
    if len(jobs) != 1:
        raise UsageError("trigger takes one JOB, after an optional MANIFEST")
    job = jobs[0]
    if loaded and any(j.name == job and j.mode == "each-node" for j in loaded.jobs):
        raise UsageError(f"{job} is an each-node job: every node runs each occurrence once, and it has no manual "
                         "runs (a node's unit started by hand skips an occurrence it has run)")
    chained = next((j for j in loaded.jobs if j.name == job), None) if loaded else None
    if chained is not None and chained.after and not chained.schedules:
        raise UsageError(f"{job} runs only after other jobs ({', '.join(p for p, _ in chained.after)}): it has no "
                         "manual runs; trigger the job it runs after, and it follows as its after: says")
    unit = unit or f"{loaded.unit_prefix if loaded else 'consulrun'}-{job}.service"
    kv_prefix = (prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")).strip("/")
    if host:
        from consulrun.units.remote import run_remote

        if loaded:  # without one, the node's own trigger checks JOB against its Consul
            check_jobs(jobs, loaded, None, kv_prefix)

        argv = ["trigger", "--wait", f"{wait_ms}ms", "--unit", unit, "--prefix", kv_prefix, job]
        sys.exit(run_remote(host, argv, consul_path=default_consulrun_path()))  # the same consulrun path as units
    from consulrun.consul.client import Client
    from consulrun.protocol.trigger import systemctl_start, trigger as run_trigger

    client = Client(consul_config(consul, loaded.consul if loaded else None))
    check_jobs(jobs, loaded, client, kv_prefix)
    outcome = run_trigger(client, f"{kv_prefix}/{job}", unit, wait_s=wait_ms / 1000, start_unit=systemctl_start)
    record = outcome.record
    if record is None:
        from consulrun.consul.values import printable

        said = "; ".join(line.strip() for line in outcome.unit_output.splitlines() if line.strip())
        if outcome.unit_status and "Job for " not in said:  # systemd did not start it (no systemd, no such unit)
            raise ConsulrunError(f"{job}: could not start {unit} (systemctl start exited {outcome.unit_status}"
                                 + (f": {printable(said)}" if said else "") + "); no manual run happened")
        # It ran, but for what this node had to run first (an occurrence), or it skipped.
        raise ConsulrunError(f"{job}: {unit} ran, but not the manual run"
                             + (f" ({printable(said)})" if said else "") + "; see journalctl -u " + unit)
    result = (f"exit status {record.get('exit_status')}" if record.get("state") == "done"
              else f"{record.get('state')}: {record.get('reason', '')}")
    from consulrun.consul.values import printable

    click.echo(printable(f"{job}: manual run on {record.get('node')} started {record.get('started')}: {result}"))
    sys.exit(0 if record.get("state") == "done" and record.get("exit_status") == 0 else ExitCode.FAILURE)
