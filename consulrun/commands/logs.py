"""`consulrun logs`: one run's output, read from the journal of the host that ran it."""

from __future__ import annotations

import click

from consulrun.commands.common import complete_jobs, manifest_and_jobs, with_suggestion
from consulrun.commands.options import consul_config, consul_options, manifest_prefix_option, ssh_option
from consulrun.errors import UsageError

OUTPUTS = ("short-iso", "cat", "short-precise", "verbose", "json")


@click.command(short_help="Print the journal lines of one run of a job.")
@click.argument("targets", nargs=-1, required=True, metavar="[MANIFEST] JOB [OCCURRENCE]",
                shell_complete=complete_jobs(many=False))
@manifest_prefix_option
@click.option("--attempt", type=click.IntRange(1), metavar="N",
              help="Attempt N of the occurrence (after a takeover there are several) [default: the last].")
@click.option("--host", "ssh_host", metavar="[USER@]HOST",
              help="Read the journal on this host over ssh [default: the catalog address of "
                   "the node that ran it, over ssh unless it is this one].")
@ssh_option
@click.option("-o", "--output", type=click.Choice(OUTPUTS), default="short-iso", show_default=True,
              help="journalctl's output mode (cat: only what the run printed).")
@consul_options
def logs(targets: tuple[str, ...], prefix: str | None, attempt: int | None, ssh_host: str | None,
         ssh_options: tuple[str, ...], output: str, **consul: str | None) -> None:
    """Print the journal lines of one run of JOB, wherever in the cluster it ran.

    The run is OCCURRENCE's (as `history` names it, e.g. 2026-12-01T02:00:00Z,
    or as its key in the Consul UI does, 20261201T020000Z), else the newest
    run. Its row in the history names the node and the systemd invocation id;
    its lines (consulrun's and the job's) are read with
    `journalctl _SYSTEMD_INVOCATION_ID=...` on that node: here if it is this
    agent's node, else over ssh (BatchMode, as `install --host`) to the
    node's address in the Consul catalog (a node the catalog does not know is
    refused, exit 2); what comes back over ssh is shown escaped. Nothing of a
    run's output is kept in Consul. Exit 6 if there is no such run, or the
    journal no longer has it; 1 if journalctl or ssh failed.
    """
    from consulrun.consul.client import Client
    from consulrun.consul.values import printable
    from consulrun.report import history as past, logs as journal
    from consulrun.units.remote import host_problem, ssh_argv

    names, occurrence = journal.split_occurrence(targets)
    loaded, jobs = manifest_and_jobs(names)
    if len(jobs) != 1:
        raise UsageError("logs takes one JOB and an optional OCCURRENCE, after an optional MANIFEST")
    job = jobs[0]
    kv_prefix = prefix or (loaded.kv_prefix if loaded else "consulrun")
    client = Client(consul_config(consul, loaded.consul if loaded else None))
    try:
        rows = past.runs(client, kv_prefix, job, limit=100_000)
    except past.NoState as exc:
        raise with_suggestion(exc, jobs, loaded, client, kv_prefix) from None
    row = journal.choose(rows, job, occurrence, attempt)
    argv = journal.journal_argv(job, row, output)
    host, where, aliased = ssh_host, f"on {ssh_host}", []
    if ssh_host is None:  # never the record's `host`: anyone with KV write may have written it
        node, host = journal.run_node(client, job, row)
        if journal.is_local(client, node):
            journal.stream(argv, "on this host", job, row)
            return
        where = f"on {printable(node)} ({printable(host)})"
        # known_hosts entries name the node, as before; a --ssh-option HostKeyAlias= comes first.
        aliased = [f"HostKeyAlias={node}"] if host_problem(node) is None else []
    problem = host_problem(str(host))
    if problem:
        raise UsageError(f"{problem}; give the host to read the journal on with --host")
    journal.stream(ssh_argv(str(host), argv, [*ssh_options, *aliased]), where, job, row,
                   remote=True)
