"""`consulrun run`: the click declaration of the wrapper every unit runs (`--help`, and the rare
invocation `runargs` leaves to click); the run itself is `runargs.start`."""

from __future__ import annotations

import click

from consulrun.commands.options import Duration, agent_options, job_prefix_option
from consulrun.commands.runargs import ATTEMPTS_MAX, job_missing, start
from consulrun.manifest.durations import DURATION_MAX_MS, LOCK_DELAY_RANGE_MS, TTL_RANGE_MS, range_text


class _RunCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if job_missing(args):  # click would read `run -- echo hi` as JOB `echo`, COMMAND `hi`
            raise click.UsageError("Missing argument 'JOB': it goes before `--`, and what follows `--` is the "
                                   "command (consulrun run [OPTIONS] JOB -- COMMAND [ARG]...)", ctx)
        return super().parse_args(ctx, args)


@click.command(cls=_RunCommand, context_settings={"allow_interspersed_args": False},
               short_help="Run a job's command if this node gets its lock.")
@job_prefix_option
@click.option("--ttl", type=Duration(TTL_RANGE_MS), default="15s", show_default=True,
              help=f"Session TTL ({range_text(TTL_RANGE_MS)}).")
@click.option("--lock-delay", type=Duration(LOCK_DELAY_RANGE_MS), default="15s", show_default=True,
              help=f"Consul lock-delay ({range_text(LOCK_DELAY_RANGE_MS)}). "
                   "The job is killed within this long of losing touch with Consul.")
@click.option("--check", "checks", multiple=True, metavar="ID",
              help="Extra node or service check bound to the session (repeatable); serfHealth is always bound.")
@click.option("--wait", type=Duration(), default="0s", show_default=True,
              help="How long to wait for a held lock; 0 tries once.")
@click.option("--concurrency", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="How many nodes may run the job at once.")
@click.option("--skip-exit-code", type=click.IntRange(0, 255), default=0, show_default=True,
              help="Exit status when the lock is held elsewhere and the job is skipped.")
@click.option("--schedule", "schedules", multiple=True, metavar="SPEC",
              help="The timer's OnCalendar= spec (repeatable): run each scheduled occurrence on one node only.")
@click.option("--on-holder-loss", type=click.Choice(["skip", "retry"]), default="skip", show_default=True,
              help="With --schedule: if an occurrence's runner dies mid-job, skip it (at most once) "
                   "or let a standby run it again (at least once).")
@click.option("--history", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="With --schedule: how many past occurrences to keep in <prefix>/<JOB>/history/.")
@click.option("--ping-url", metavar="URL",
              help="Healthchecks.io-style monitor: URL/start when the job starts here, then URL (exit 0), "
                   "URL/<status> or URL/fail (lost). A skipping node sends nothing; a failed ping never fails the job.")
@click.option("--ping-output-lines", type=click.IntRange(1, 1000), metavar="N",
              help="With --ping-url: the final ping is a POST of the last N lines of this run's journal (under a "
                   "systemd unit; at most 10 kB).")
@click.option("--health-check", is_flag=True,
              help="Also set the job's Consul health check (on the prefix's external node) from the result, "
                   "in the same transaction; if Consul refuses the check, the result is recorded without it.")
@click.option("--timeout", type=Duration((1, DURATION_MAX_MS)), metavar="DURATION",
              help="Stop the job this long after it started (SIGTERM, SIGKILL lock-delay - 1s later), however long "
                   "this node stood by or waited before; its status is then the job's own.")
@click.option("--skip-when-stopped", is_flag=True,
              help="A termination signal before this node took the lock (waiting, standing by) exits with "
                   "--skip-exit-code, not 128+N: this node ran nothing, so systemd counts the stop a success.")
@click.option("--attempts", type=click.IntRange(1, ATTEMPTS_MAX), default=1, show_default=True,
              help="With --schedule: run a failed occurrence (non-zero exit, or its --timeout) up to this many times "
                   "in all, the first run included, on this node while it keeps the lock; a stop, a skip or a lost "
                   "lock is never retried, nor a retry made that the next occurrence would overtake.")
@click.option("--retry-backoff", type=Duration((0, DURATION_MAX_MS)), default="10s", show_default=True,
              metavar="DURATION", help="The wait before the first retry; doubled before each next one.")
@click.option("--retry-max-backoff", type=Duration((0, DURATION_MAX_MS)), default="5min", show_default=True,
              metavar="DURATION", help="The longest wait between two attempts.")
@click.option("--start-deadline", type=Duration((1, DURATION_MAX_MS)), metavar="DURATION",
              help="With --schedule: an occurrence not started this long after its scheduled time (a catch-up after "
                   "a long outage) is recorded missed, not run.")
@click.option("--after", "after", multiple=True, metavar="JOB",
              help="This job runs once after each run of JOB that asks for it (repeatable; docs/chains.md): started "
                   "by its chain-watch unit rather than its timer, it runs the oldest pending such run instead of an "
                   "occurrence, or skips if none is pending.")
@click.option("--then", "then", multiple=True, metavar="JOB:ON",
              help="When this job's occurrence ends as ON says (success, failure or always), ask for one run of JOB "
                   "after it, in the transaction that records the result (repeatable).")
@click.option("--each-node", is_flag=True,
              help="With --schedule: every node runs each occurrence once (its own record under "
                   "<prefix>/<JOB>/nodes/), at most --concurrency nodes at a time; a node finding every slot held "
                   "waits for one until its next occurrence is due, then records the occurrence missed for itself.")
@click.option("--pass-consul-token", is_flag=True,
              help="Leave CONSUL_HTTP_TOKEN, CONSUL_HTTP_TOKEN_FILE and CONSUL_HTTP_AUTH in the job's environment "
                   "(by default the job gets none of them).")
@click.option("--node-meta", "node_meta", multiple=True, metavar="KEY=VALUE",
              help="Run only on a node whose Consul node meta has KEY=VALUE (repeatable: every pair); elsewhere "
                   "skip without a write. The turns rank only such nodes.")
@click.option("--node-name", "node_names", multiple=True, metavar="GLOB",
              help="Run only on a node whose Consul node name matches GLOB (repeatable: any of them).")
@agent_options
@click.argument("job")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(job: str, command: tuple[str, ...], prefix: str, ttl: int, lock_delay: int, checks: tuple[str, ...],
        wait: int, concurrency: int, skip_exit_code: int, schedules: tuple[str, ...], on_holder_loss: str,
        history: int, ping_url: str | None, health_check: bool, pass_consul_token: bool, timeout: int | None,
        skip_when_stopped: bool, node_meta: tuple[str, ...], node_names: tuple[str, ...], attempts: int,
        retry_backoff: int, retry_max_backoff: int, start_deadline: int | None, ping_output_lines: int | None,
        after: tuple[str, ...], then: tuple[str, ...], each_node: bool, **consul: str | None) -> None:
    """Run COMMAND for JOB on this node only if this node gets JOB's Consul lock.

    \b
    consulrun run [OPTIONS] JOB -- COMMAND [ARG]...

    Options go before JOB; everything after it is the command. Durations are
    written as systemd writes them (500ms, 15s, 1m30s, 10 min, 1h 30min).

    The job gets CONSULRUN_JOB, CONSULRUN_NODE (Consul's name for this node),
    CONSULRUN_SESSION, CONSULRUN_LOCK_KEY and
    CONSULRUN_FENCING_TOKEN (the lock key's ModifyIndex: larger for every later
    holder, so the job can refuse a stale holder's write), CONSULRUN_ATTEMPT
    (1, then 2, 3, ... for each retry of --attempts; a takeover's goes on from
    the attempts recorded before it) and CONSULRUN_TAKEOVER (1 when the run
    takes over from a dead runner, else 0) in its environment (a run
    after another job also CONSULRUN_PARENT_JOB, CONSULRUN_PARENT_OCCURRENCE,
    CONSULRUN_PARENT_STATE and CONSULRUN_PARENT_EXIT_STATUS),
    and not the wrapper's Consul credentials, CONSUL_HTTP_TOKEN, CONSUL_HTTP_TOKEN_FILE
    and CONSUL_HTTP_AUTH (unless --pass-consul-token). Its own exit status is
    passed through. If the lock cannot be confirmed,
    every process of the job (also those that left its process group) is
    killed and the status is 75; the lock is never released while one lives.
    """
    start(job, command, prefix=prefix, ttl=ttl, lock_delay=lock_delay, checks=checks, wait=wait,
          concurrency=concurrency, skip_exit_code=skip_exit_code, schedules=schedules, on_holder_loss=on_holder_loss,
          history=history, ping_url=ping_url, health_check=health_check, pass_consul_token=pass_consul_token,
          timeout=timeout, skip_when_stopped=skip_when_stopped, node_meta=node_meta, node_names=node_names,
          attempts=attempts, retry_backoff=retry_backoff, retry_max_backoff=retry_max_backoff,
          start_deadline=start_deadline, ping_output_lines=ping_output_lines, after=after, then=then,
          each_node=each_node, **consul)
