"""`consulrun status`: who holds each lock, whether the holder lives, whether runs happen and succeed."""

from __future__ import annotations

import sys

import click

from consulrun.commands.common import (
    complete_jobs,
    interruptible,
    manifest_and_jobs,
    to_json,
    with_suggestion,
)
from consulrun.commands.options import Duration, consul_config, consul_options, manifest_prefix_option
from consulrun.errors import ConsulrunError, UsageError

STATUS_EXIT_HELP = """
\b
Exit status (for monitoring checks; the first that applies wins):
  65 a value in Consul is malformed: that job is shown as malformed_value
     (a line on stderr names its key), the other jobs as they are
  5  a lock is held by a session that is gone, whose bound check is critical,
     or (seen from the holder's own node) whose wrapper process is dead
  3  missed: a due occurrence was claimed by no node in time, or a chained
     run asked of a job was taken by no node in time (stalled)
  4  overdue: a run has lasted longer than its job's timeout
  1  a job's last run failed, was lost or was abandoned
  0  all of the above are fine (a bound check in warning does not count:
     Consul keeps such sessions)
  6  nothing to judge: no state under the prefix, or a JOB with none
  69 Consul unavailable; 77 ACLs hide part of what status must read
"""


@click.command(epilog=STATUS_EXIT_HELP,
               short_help="Show each job's lock holder, last runs and health.")
@click.argument("targets", nargs=-1, metavar="[MANIFEST] [JOB]...",
                shell_complete=complete_jobs(many=True))
@manifest_prefix_option
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON structure instead of a table.")
@click.option("--watch", is_flag=True,
              help="Redraw whenever Consul's state changes (blocking queries) and at least every 10s; Ctrl-C ends it.")
@click.option("--grace", type=Duration(), default="60s", show_default=True,
              help="How long past its time (plus the timer's accuracy and randomized delay) an occurrence may stay "
                   "unclaimed before it counts as missed.")
@consul_options
def status(targets: tuple[str, ...], prefix: str | None, as_json: bool, watch: bool, grace: int,
           **consul: str | None) -> None:
    """Show who holds each job's lock, whether that holder lives, and whether runs happen and succeed.

    With MANIFEST, every job of the manifest is shown (with missed and
    overdue runs judged from its schedules, timer settings and timeouts) and
    Consul is reached with the manifest's `consul:` settings unless the
    environment or an option overrides them. JOB names limit the output.
    """
    from datetime import datetime, timezone

    from consulrun.consul.client import Client
    from consulrun.report import status as state

    kv_prefix = prefix or "consulrun"
    try:
        loaded, jobs = manifest_and_jobs(targets)
        kv_prefix = prefix or (loaded.kv_prefix if loaded else "consulrun")
        if watch:
            _watch_status(lambda: Client(consul_config(dict(consul), loaded.consul if loaded else None)), kv_prefix,
                          loaded, jobs, as_json, grace / 1000)
        client = Client(consul_config(consul, loaded.consul if loaded else None))
        try:
            _, statuses = state.collect(client, kv_prefix, loaded, only=jobs, grace_s=grace / 1000,
                                        per_job_malformed=True)
        except state.NoState as exc:
            raise with_suggestion(exc, jobs, loaded, client, kv_prefix) from None
    except ConsulrunError as exc:
        if as_json:  # a monitoring parser gets an answer it cannot take for "all well"
            click.echo(to_json(state.error_json(kv_prefix, exc, datetime.now(timezone.utc)), compact=False))
        raise
    health = state.verdict(statuses)
    _show_status(kv_prefix, statuses, health, as_json, compact=False)
    _say_malformed(statuses)
    sys.exit(health)


def _say_malformed(statuses: list) -> None:
    """One line per value consulrun never writes, on stderr as every reader says it (exit 65)."""
    from consulrun.consul.values import printable

    for s in statuses:
        for p in s.problems:
            if p["kind"] == "malformed_value":
                click.echo(f"Error: {printable(p['detail'])}", err=True)


def _show_status(kv_prefix: str, statuses: list, health: int, as_json: bool, compact: bool) -> None:
    from datetime import datetime, timezone

    from consulrun.report import status as state

    now = datetime.now(timezone.utc)
    if as_json:
        click.echo(to_json(state.as_json(kv_prefix, statuses, state.Health(health), now), compact))
        return
    from consulrun.consul.values import printable

    # Cells and problem lines quote what anyone with KV write may have written: no control character reaches the
    # terminal (a record's node must not clear the screen, a reason must not print a line of its own).
    rows = [[printable(cell) for cell in row] for row in state.table(statuses, now)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for line in state.problem_lines(statuses):
        click.echo(printable(line))


WATCH_REFRESH_S = 10.0  # redraw at least this often, so relative times and NEXT stay true


def _watch_status(make_client, kv_prefix: str, loaded, jobs: tuple[str, ...], as_json: bool,  # noqa: ANN001
                  grace_s: float) -> None:
    """Redraw until Ctrl-C (exit 130, quietly); an unreachable agent is retried with backoff and said so."""
    import time
    from datetime import datetime, timezone

    from consulrun.report import status as state

    interruptible()
    index: int | None = None
    delay = 1.0
    refreshed = "never"
    client = None
    try:
        while True:
            try:
                client = client or make_client()
                index, statuses = state.collect(
                    client, kv_prefix, loaded, only=jobs, index=index,
                    wait_s=WATCH_REFRESH_S if index else None, grace_s=grace_s,
                    per_job_malformed=True)
            except state.NoState as exc:  # state may appear: wait for it with a blocking query
                if as_json:
                    click.echo(to_json(state.error_json(kv_prefix, exc, datetime.now(timezone.utc)), compact=True))
                else:
                    click.clear()
                    click.echo(f"{exc.format_message()}; watching for it (Ctrl-C to quit)")
                if index is not None and exc.index == index:
                    time.sleep(1.0)  # the blocking query returned without a change; do not spin
                index = exc.index or None
                sys.stdout.flush()
                continue
            except UsageError:
                raise  # e.g. an unreadable token file: waiting will not fix it
            except ConsulrunError as exc:  # agent restarting, connection dropped, leader election, ACL change
                if as_json:
                    click.echo(to_json({**state.error_json(kv_prefix, exc, datetime.now(timezone.utc)),
                                      "reconnecting_in_s": delay}, compact=True))
                else:
                    click.echo(f"{exc.format_message()}; reconnecting in {delay:.0f}s "
                               f"(last refreshed {refreshed})", err=False)
                sys.stdout.flush()
                time.sleep(delay)
                delay, index = min(delay * 2, 30.0), None
                continue
            delay = 1.0
            refreshed = datetime.now().strftime("%H:%M:%S")
            health = state.verdict(statuses)
            if not as_json:
                click.clear()
            _show_status(kv_prefix, statuses, health, as_json, compact=True)
            if not as_json:
                click.echo(f"-- refreshed {refreshed}; verdict {health.name.lower()} ({int(health)}); Ctrl-C to quit")
            sys.stdout.flush()  # a redraw must reach a pipe (watch | tee) now, not when a buffer fills
    except KeyboardInterrupt:
        sys.exit(130)
