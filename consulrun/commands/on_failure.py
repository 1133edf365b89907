"""`consulrun on-failure`: the units' OnFailure= handler, which runs a job's on_failure command."""

from __future__ import annotations

import logging
import sys

import click

from consulrun.commands.runargs import setup_logging as _setup_logging
from consulrun.errors import UsageError


@click.command("on-failure", context_settings={"allow_interspersed_args": False},
               short_help="Run a notifier because a run of a job failed.")
@click.option("--unit", required=True, metavar="UNIT", help="The job's service unit, the one that failed.")
@click.option("--skip-exit-code", type=click.IntRange(0, 255), default=0, show_default=True,
              help="The job's skip code: a run that exited with it never notifies.")
@click.argument("job")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def on_failure(job: str, command: tuple[str, ...], unit: str, skip_exit_code: int) -> None:
    """Run COMMAND because JOB failed, was lost or timed out (what <prefix>-onfailure@JOB.service runs).

    \b
    consulrun on-failure --unit UNIT JOB -- COMMAND [ARG]...

    COMMAND gets CONSULRUN_JOB, CONSULRUN_NODE, CONSULRUN_UNIT, CONSULRUN_RESULT
    (systemd's: exit-code, timeout, signal...), CONSULRUN_EXIT_STATUS,
    CONSULRUN_OCCURRENCE, CONSULRUN_INVOCATION_ID and CONSULRUN_JOURNAL (the
    run's last journal lines, also on its standard input). Its exit status is
    passed through. A run that exited 69 (Consul unavailable) is told once per
    outage: until a run of the job reaches Consul again, COMMAND is not run.
    """
    from consulrun.protocol.notify import failure_facts, is_skip, run_on_failure, stopped_before_running
    from consulrun.protocol.outage import already_told, quiet_line, told_line

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command given: consulrun on-failure --unit UNIT JOB -- COMMAND [ARG]...")
    _setup_logging()
    facts = failure_facts(job, unit)
    if is_skip(facts, skip_exit_code):
        logging.getLogger("consulrun").info("%s: exit status %s is the skip code; not a failure", job, skip_exit_code)
        return
    if stopped_before_running(facts):
        logging.getLogger("consulrun").info("%s: %s was stopped (%s) while waiting for the lock, before it ran the "
                                            "job; this node did not run it, so nothing is reported", job, unit,
                                            facts["CONSULRUN_RESULT"] or "result unknown")
        return
    status = facts["CONSULRUN_EXIT_STATUS"]
    if facts["CONSULRUN_RESULT"] == "exit-code" and (since := already_told(job, unit, status)):
        logging.getLogger("consulrun").info("%s", quiet_line(job, since))  # one notification per outage
        return
    logging.getLogger("consulrun").info("%s", told_line(job, unit, facts["CONSULRUN_RESULT"], status,
                                                        facts["CONSULRUN_OCCURRENCE"]))
    sys.exit(run_on_failure(list(command), facts))
