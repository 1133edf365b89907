"""Command line: parse arguments, call one core function per command, print.

Exit statuses are listed in `consulrun --help` and in the README; they come
from `consulrun.errors.ExitCode` and nowhere else.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from consulrun import __version__
from consulrun.manifest.durations import LOCK_DELAY_RANGE_MS, TTL_RANGE_MS, range_text
from consulrun.errors import ConsulrunError, ExitCode, UsageError, os_reason, output_guard
from consulrun.commands.options import AbsolutePath, Duration, Folder, KvPrefix, consul_config, consul_options
from consulrun.commands.runargs import WATCHDOG_JOB, setup_logging as _setup_logging, start
from consulrun.manifest.schema import name_problem

if TYPE_CHECKING:
    from consulrun.manifest.loader import Manifest


def _job_problem(job: str) -> str | None:
    """Why `job` is not a job name, or None; the watchdog's own lock (`_watchdog`) is one to run, reap, unlock."""
    return None if job == WATCHDOG_JOB else name_problem(job)


EXIT_CODES_HELP = """
\b
Exit statuses:
  0   success (for `run`: the job's own status is passed through)
  1   failure without a more specific status (e.g. `generate --check` found changes);
      `status`: a job's last run failed, was lost or was abandoned
  2   bad usage or invalid manifest; `import-crontab`: a line it could not convert
  3   `status`: a due occurrence was missed (claimed by no node in time)
  4   `status`: a run has lasted longer than its job's timeout
  5   `status`: a lock is held by a vanished or critical session, or a dead process
  6   `status`, `unlock`, `history`: no state in Consul for the prefix or job asked about
  69  Consul unavailable: nothing was started
  70  Consul answered something unexpected, or `run` failed after taking the lock
      (the job's processes were killed first)
  74  writing output failed
  75  lock lost while the job ran: the job was killed
  77  permission denied by Consul ACLs: nothing was started (`status`: ACLs hide part of the state)
  127 `run`: the job's command could not be started (`on-failure`: its command)
  128+N `run`: signal N arrived while no job was running to receive it
"""


def _default_consulrun_path() -> str:
    """The consulrun being run now, so units call the same installation."""
    invoked = Path(sys.argv[0])
    if invoked.name == "consulrun" and invoked.exists():
        return str(invoked.absolute())
    beside = Path(sys.executable).parent / "consulrun"
    if beside.exists():
        return str(beside)
    found = shutil.which("consulrun")
    return os.path.abspath(found) if found else "/usr/local/bin/consulrun"


class _Main(click.Group):
    """The command group, guarding every output (`--help` included) against a full disk or a closed pipe,
    and reporting consulrun's own errors (not click exceptions, so `run` can do without click) as click would."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().main(*args, **kwargs)
        except ConsulrunError as exc:
            if not kwargs.get("standalone_mode", args[3] if len(args) > 3 else True):
                raise
            exc.show()
            sys.exit(exc.exit_code)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with output_guard():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        with output_guard():
            return super().invoke(ctx)


@click.group(cls=_Main, epilog=EXIT_CODES_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="consulrun")
def main() -> None:
    """Run each occurrence of a scheduled job on exactly one node, locked through Consul.

    A manifest of jobs becomes paired systemd .timer/.service units
    (`generate`, `install`); each unit runs `consulrun run`, which holds a
    Consul session lock while the job runs.
    """


@main.command()
@click.argument("manifest", type=click.Path(allow_dash=True, path_type=Path))
@click.option("-o", "--output", "output", required=True, metavar="DIR",
              help="Folder to write the units into, or - to print them.")
@click.option("--check", is_flag=True, help="Change nothing; print a diff and exit 1 if DIR is out of date.")
@click.option("--templates", type=Folder(),
              help="Folder with service.j2, timer.j2 and/or onfailure.j2 overriding the shipped templates.")
@click.option("--consulrun-path", type=AbsolutePath(), default=_default_consulrun_path, show_default="this consulrun",
              help="Absolute path of consulrun as the units' ExecStart= calls it.")
def generate(manifest: Path, output: str, check: bool, templates: Path | None, consulrun_path: str) -> None:
    """Render MANIFEST into <prefix>-<job>.service/.timer files. MANIFEST may be - (standard input)."""
    from consulrun.units.install import plan
    from consulrun.units.render import render, write_units

    from consulrun.units.guarantees import warnings

    loaded, _ = _read_manifest(manifest)
    units = render(loaded, consulrun_path, templates)
    for line in warnings(loaded):
        click.echo(f"warning: {line}", err=True)
    if output == "-":
        for name, text in units.items():
            click.echo(f"# --- {name}\n{text}", nl=False)
        return
    outdir = Path(output)
    if check:
        diff = plan(units, outdir, loaded.unit_prefix).diff()
        if diff:
            click.echo(diff, nl=False)
            click.echo(f"{outdir} is out of date with {manifest}", err=True)
            sys.exit(ExitCode.FAILURE)
        click.echo(f"{outdir} is up to date")
        return
    for path in write_units(units, outdir):
        click.echo(str(path))


def _read_manifest(manifest: Path) -> tuple["Manifest", str]:
    """Load and validate MANIFEST, or standard input for `-`; also return its text (sent on by `install --host`)."""
    from consulrun.manifest.loader import parse_manifest  # imported here: `run` should not pay for the validator

    text, source = _read_text(manifest)
    return parse_manifest(text, source), text


@main.command(context_settings={"allow_interspersed_args": False})
@click.option("--prefix", type=KvPrefix(), default="consulrun", show_default=True,
              help="KV prefix; the job's keys are <prefix>/<JOB>/.")
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
@click.option("--health-check", is_flag=True,
              help="Also set the job's Consul health check (on the prefix's external node) from the result, "
                   "in the same transaction; if Consul refuses the check, the result is recorded without it.")
@consul_options
@click.argument("job")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(job: str, command: tuple[str, ...], prefix: str, ttl: int, lock_delay: int, checks: tuple[str, ...],
        wait: int, concurrency: int, skip_exit_code: int, schedules: tuple[str, ...], on_holder_loss: str,
        history: int, ping_url: str | None, health_check: bool, **consul: str | None) -> None:
    """Run COMMAND for JOB on this node only if this node gets JOB's Consul lock.

    \b
    consulrun run [OPTIONS] JOB -- COMMAND [ARG]...

    Options go before JOB; everything after it is the command. Durations are
    written as systemd writes them (500ms, 15s, 1m30s, 10 min, 1h 30min).

    The job gets CONSULRUN_JOB, CONSULRUN_SESSION, CONSULRUN_LOCK_KEY and
    CONSULRUN_FENCING_TOKEN (the lock key's ModifyIndex: larger for every later
    holder, so the job can refuse a stale holder's write) in its environment.
    Its own exit status is passed through. If the lock cannot be confirmed,
    every process of the job (also those that left its process group) is
    killed and the status is 75; the lock is never released while one lives.
    """
    start(job, command, prefix=prefix, ttl=ttl, lock_delay=lock_delay, checks=checks, wait=wait,
          concurrency=concurrency, skip_exit_code=skip_exit_code, schedules=schedules, on_holder_loss=on_holder_loss,
          history=history, ping_url=ping_url, health_check=health_check, **consul)


@main.command()
@click.option("--prefix", type=KvPrefix(), default="consulrun", show_default=True,
              help="KV prefix; the job's keys are <prefix>/<JOB>/.")
@click.option("--concurrency", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="The job's concurrency (which lock keys to look at).")
@consul_options
@click.argument("job")
def reap(job: str, prefix: str, concurrency: int, **consul: str | None) -> None:
    """Free JOB's lock if its holder is a wrapper on this node that is dead.

    Units run it as ExecStopPost= when a run ends other than cleanly (the
    wrapper was killed, e.g. by the OOM killer): systemd has stopped every
    process of the unit by then, so the dead wrapper's session is destroyed at
    once instead of living until its TTL runs out. Lock-delay still applies.
    A live holder, or one on another node, is never touched.
    """
    problem = _job_problem(job)
    if problem:
        raise UsageError(problem)
    from consulrun.consul.client import Client
    from consulrun.protocol.lock import Locker, LockSpec

    _setup_logging()
    locker = Locker(Client(consul_config(consul), label=job), LockSpec(job=job, prefix=prefix, concurrency=concurrency))
    _, entries = locker.entries()
    locker.reap_dead_holder(entries)


def _interruptible() -> None:
    """Ctrl-C (SIGINT) ends a long-running command even when its parent started it with SIGINT ignored
    (a background job of a non-interactive shell): asked for interactively, it must stop when asked to."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)


@main.command()
@click.argument("manifest", type=click.Path(allow_dash=True, path_type=Path))
@click.option("--root", type=click.Path(file_okay=False, path_type=Path),
              help="Install into this root file system (offline: units are enabled, nothing is started); "
                   "with --host, a folder on each node.")
@click.option("--unit-dir", type=click.Path(path_type=Path), default=Path("/etc/systemd/system"), show_default=True,
              help="Unit folder (inside --root if given).")
@click.option("--dry-run", is_flag=True, help="Print the diff and the systemctl actions; change nothing.")
@click.option("--no-start", is_flag=True, help="Enable the timers but do not start them.")
@click.option("--templates", type=Folder(),
              help="Folder with service.j2, timer.j2 and/or onfailure.j2 overriding the shipped templates "
                   "(sent along with --host).")
@click.option("--consulrun-path", type=AbsolutePath(), default=_default_consulrun_path, show_default="this consulrun",
              help="Absolute path of consulrun on the node(s), as units call it.")
@click.option("--host", "hosts", multiple=True, metavar="NODE",
              help="Install on NODE ([USER@]HOST) over ssh (repeatable; a node given twice is installed once).")
@click.option("--hosts-file", type=click.Path(dir_okay=False, path_type=Path),
              help="File with one NODE per line (# comments allowed).")
@click.option("--ssh-option", "ssh_options", multiple=True, metavar="OPT", help="Passed to ssh as -o OPT (repeatable).")
@click.option("--parallel", type=click.IntRange(1, 256), default=10, show_default=True, help="Nodes at a time.")
@click.option("--stdin-bundle", is_flag=True, hidden=True,
              help="Standard input is the JSON bundle `install --host --templates` sends: manifest and templates.")
def install(manifest: Path, root: Path | None, unit_dir: Path, dry_run: bool, no_start: bool, templates: Path | None,
            consulrun_path: str, hosts: tuple[str, ...], hosts_file: Path | None,
            ssh_options: tuple[str, ...], parallel: int, stdin_bundle: bool) -> None:
    """Install MANIFEST's units on this node, or on each --host over ssh.

    Writes only units it generated (a foreign file with one of their names is
    an error), removes its units for jobs no longer in the manifest, runs
    systemctl daemon-reload and enables (and starts) the timers. A second run
    with the same manifest changes nothing. If anything fails, the previous
    units are put back. MANIFEST may be - (standard input).
    """
    from consulrun.units.remote import make_bundle, read_hosts

    if stdin_bundle:
        _install_bundle(manifest, root=root, unit_dir=unit_dir, dry_run=dry_run, no_start=no_start,
                        consulrun_path=consulrun_path)
        return
    loaded, text = _read_manifest(manifest)
    targets = read_hosts(hosts, hosts_file) if hosts or hosts_file else None
    if targets is not None:
        if not targets.names:
            raise UsageError(f"--hosts-file: {hosts_file}: names no host")
        for host in targets.duplicates:
            click.echo(f"warning: {host} is listed more than once; installing there once", err=True)
        flags = (["--dry-run"] if dry_run else []) + (["--no-start"] if no_start else []) + \
            (["--root", str(root)] if root else []) + ["--unit-dir", str(unit_dir), "--consulrun-path", consulrun_path]
        if templates is not None:  # the override templates go along with the manifest, on standard input
            text = make_bundle(text, templates)
            flags.append("--stdin-bundle")
        _install_remote(targets.names, text, [consulrun_path, "install", "-", *flags], list(ssh_options), parallel,
                        dry_run)
        return
    _print_report(loaded, root=root, unit_dir=unit_dir, dry_run=dry_run, no_start=no_start, templates=templates,
                  consulrun_path=consulrun_path)


def _install_bundle(manifest: Path, **options: Any) -> None:
    """The node's side of `install --host --templates`: templates into a private folder, then the local install."""
    import tempfile

    from consulrun.manifest.loader import parse_manifest
    from consulrun.units.remote import open_bundle

    if str(manifest) != "-":
        raise UsageError("--stdin-bundle reads standard input: give MANIFEST as -")
    with tempfile.TemporaryDirectory(prefix="consulrun-templates-") as folder:
        text = open_bundle(sys.stdin.read(), Path(folder))
        _print_report(parse_manifest(text, "<stdin>"), templates=Path(folder), **options)


def _print_report(loaded: "Manifest", *, root: Path | None, unit_dir: Path, dry_run: bool, no_start: bool,
                  templates: Path | None, consulrun_path: str) -> None:
    from consulrun.units.install import install_local

    report = install_local(loaded, root=root, unit_dir=unit_dir, dry_run=dry_run, start=not no_start,
                           templates=templates, consulrun_path=consulrun_path)
    for line in report.warnings:
        click.echo(f"warning: {line}", err=True)
    click.echo("".join(report.diff), nl=False)
    for line in report.lines:
        click.echo(line)


def _install_remote(hosts: list[str], text: str, remote_argv: list[str], ssh_options: list[str], parallel: int,
                    dry_run: bool) -> None:
    from consulrun.units.remote import HostResult, install_all

    def progress(result: HostResult, done: int, total: int) -> None:
        click.echo(f"[{done}/{total}] {result.host}: {'ok' if result.ok else 'FAILED'}: {result.summary}", err=True)
        for warning in result.warnings:
            click.echo(f"warning: {result.host}: {warning}", err=True)

    results = install_all(hosts, text, remote_argv, ssh_options, parallel, timeout_s=300, progress=progress)
    if dry_run:  # each node's own diff and systemctl calls, not only its last line
        for r in results:
            if r.ok:
                click.echo(f"==> {r.host} <==")
                click.echo(r.stdout, nl=False)
    width = max(len(r.host) for r in results + [HostResult("HOST", True, "")])
    click.echo(f"{'HOST'.ljust(width)}  RESULT  DETAIL")
    for r in results:
        click.echo(f"{r.host.ljust(width)}  {'ok    ' if r.ok else 'FAILED'}  {r.summary}")
    failed = [r.host for r in results if not r.ok]
    if failed:
        raise ConsulrunError(f"install failed on {len(failed)} of {len(results)} node(s): {', '.join(failed)}")


def _manifest_and_jobs(targets: tuple[str, ...]) -> tuple[Manifest | None, tuple[str, ...]]:
    """Split `[MANIFEST] [JOB]...`: the first argument is a manifest if it has a '/' or ends in .yaml/.yml/.json."""
    from consulrun.manifest.loader import load_manifest

    loaded = None
    if targets and ("/" in targets[0] or targets[0].endswith((".yaml", ".yml", ".json"))):
        loaded, targets = load_manifest(Path(targets[0])), targets[1:]
    for job in targets:
        problem = _job_problem(job)
        if problem:
            raise UsageError(problem)
    return loaded, targets


STATUS_EXIT_HELP = """
\b
Exit status (for monitoring checks; the first that applies wins):
  5  a lock is held by a session that is gone, whose bound check is critical,
     or (seen from the holder's own node) whose wrapper process is dead
  3  missed: a due occurrence was claimed by no node in time
  4  overdue: a run has lasted longer than its job's timeout
  1  a job's last run failed, was lost or was abandoned
  0  all of the above are fine (a bound check in warning does not count:
     Consul keeps such sessions)
  6  nothing to judge: no state under the prefix, or a JOB with none
  69 Consul unavailable; 77 ACLs hide part of what status must read
"""


@main.command(epilog=STATUS_EXIT_HELP)
@click.argument("targets", nargs=-1, metavar="[MANIFEST] [JOB]...")
@click.option("--prefix", default=None, help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
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

    from consulrun.report import status as state
    from consulrun.consul.client import Client

    kv_prefix = prefix or "consulrun"
    try:
        loaded, jobs = _manifest_and_jobs(targets)
        kv_prefix = prefix or (loaded.kv_prefix if loaded else "consulrun")
        if watch:
            _watch_status(lambda: Client(consul_config(dict(consul), loaded.consul if loaded else None)), kv_prefix,
                          loaded, jobs, as_json, grace / 1000)
        client = Client(consul_config(consul, loaded.consul if loaded else None))
        _, statuses = state.collect(client, kv_prefix, loaded, only=jobs, grace_s=grace / 1000)
    except ConsulrunError as exc:
        if as_json:  # a monitoring parser gets an answer it cannot take for "all well"
            click.echo(_json(state.error_json(kv_prefix, exc, datetime.now(timezone.utc)), compact=False))
        raise
    health = state.verdict(statuses)
    _show_status(kv_prefix, statuses, health, as_json, compact=False)
    sys.exit(health)


def _json(data: object, compact: bool) -> str:
    import json

    return json.dumps(data, sort_keys=True, separators=(",", ":")) if compact else json.dumps(data, indent=2, sort_keys=True)


def _show_status(kv_prefix: str, statuses: list, health: int, as_json: bool, compact: bool) -> None:
    from datetime import datetime, timezone

    from consulrun.report import status as state

    now = datetime.now(timezone.utc)
    if as_json:
        click.echo(_json(state.as_json(kv_prefix, statuses, state.Health(health), now), compact))
        return
    rows = state.table(statuses, now)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for line in state.problem_lines(statuses):
        click.echo(line)


WATCH_REFRESH_S = 10.0  # redraw at least this often, so relative times and NEXT stay true


def _watch_status(make_client, kv_prefix: str, loaded, jobs: tuple[str, ...], as_json: bool,  # noqa: ANN001
                  grace_s: float) -> None:
    """Redraw until Ctrl-C (exit 130, quietly); an unreachable agent is retried with backoff and said so."""
    import time
    from datetime import datetime, timezone

    from consulrun.report import status as state

    _interruptible()
    index: int | None = None
    delay = 1.0
    refreshed = "never"
    client = None
    try:
        while True:
            try:
                client = client or make_client()
                index, statuses = state.collect(client, kv_prefix, loaded, only=jobs, index=index,
                                                wait_s=WATCH_REFRESH_S if index else None, grace_s=grace_s)
            except state.NoState as exc:  # state may appear: wait for it with a blocking query
                if as_json:
                    click.echo(_json(state.error_json(kv_prefix, exc, datetime.now(timezone.utc)), compact=True))
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
                    click.echo(_json({**state.error_json(kv_prefix, exc, datetime.now(timezone.utc)),
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


@main.command()
@click.argument("targets", nargs=-1, required=True, metavar="[MANIFEST] JOB")
@click.option("--prefix", default=None, help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
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
    from consulrun.report import status as state
    from consulrun.consul.client import Client

    _setup_logging()
    loaded, jobs = _manifest_and_jobs(targets)
    if len(jobs) != 1:
        raise UsageError("unlock takes one JOB, after an optional MANIFEST")
    job = jobs[0]
    kv_prefix = prefix or (loaded.kv_prefix if loaded else "consulrun")
    client = Client(consul_config(consul, loaded.consul if loaded else None))
    holders = state.job_holders(client, kv_prefix, job)
    if not holders:
        click.echo(f"{job} is not locked")
        return
    for holder in holders:
        who = f"{holder['node']} (pid {holder['pid']}, since {holder['since']}, session {holder['session']})"
        if holder["healthy"] and not force:
            raise ConsulrunError(f"{job} is held by {who}, which is healthy ({holder['health']}); "
                                 "use --force to break it anyway")
        click.echo(f"{job}: will destroy session {holder['session']} of {who} ({holder['health']}); Consul then "
                   "frees the lock and keeps it from everyone for the session's lock-delay"
                   + ("; a live holder kills its job (exit 75)" if holder["healthy"] else ""), err=True)
        if not yes and not click.confirm(f"Destroy the session of {who}?", err=True):
            raise ConsulrunError("not confirmed; nothing changed")
        if client.session_visible(holder["session"]) is None:
            click.echo(f"session {holder['session']} was already gone")
            continue
        client.session_destroy(holder["session"])
        logging.getLogger("consulrun").warning("%s: unlocked: destroyed session %s held by %s (%s)", job,
                                               holder["session"], holder["node"], holder["health"])


@main.command("import-crontab")
@click.argument("crontab", type=click.Path(allow_dash=True, path_type=Path))
@click.option("--system", is_flag=True,
              help="The /etc/crontab and /etc/cron.d format: a user column before the command "
                   "[default: on for /etc/crontab and /etc/cron.d/*].")
def import_crontab(crontab: Path, system: bool) -> None:
    """Print a manifest for the jobs of CRONTAB (a file, or - for standard input).

    Lines it cannot convert are reported on stderr with their line numbers
    (exit 2); the manifest of the others is still printed.
    """
    from consulrun.manifest.crontab import CrontabError, convert

    text, source = _read_text(crontab)
    system = system or str(crontab) == "/etc/crontab" or str(crontab.parent) == "/etc/cron.d"
    try:
        click.echo(convert(text, source, system=system), nl=False)
    except CrontabError as exc:
        click.echo(exc.manifest, nl=False)
        raise


def _read_text(path: Path) -> tuple[str, str]:
    """The text of PATH, or of standard input for `-`, and the name messages give it."""
    if str(path) == "-":
        return sys.stdin.read(), "<stdin>"
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except OSError as exc:
        raise UsageError(f"{path}: {os_reason(exc)}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start})") from None


@main.command()
@click.argument("manifest", required=False, type=click.Path(allow_dash=True, path_type=Path))
@click.option("--prefix", type=KvPrefix(), default=None,
              help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
@click.option("--jobs", "jobs_json", metavar="JSON", default=None,
              help="The jobs' schedules, timers and timeouts as JSON (instead of MANIFEST).")
@click.option("--jobs-file", type=click.Path(path_type=Path), default=None,
              help="The same, from the file generate writes beside the units (the watchdog unit passes it).")
@click.option("--grace", type=Duration(), default="60s", show_default=True,
              help="How long past its time (plus accuracy and randomized delay) an occurrence may stay unclaimed.")
@consul_options
def watchdog(manifest: Path | None, prefix: str | None, jobs_json: str | None, jobs_file: Path | None, grace: int,
             **consul: str | None) -> None:
    """Bring every job's Consul health check in line with `status`: missed, overdue, dead holders, pauses.

    Registers the prefix's external node and service if missing, then writes
    (check-and-set) only the checks whose status or output changes. The
    units `generate` makes for `health_checks: true` run it once a minute
    on one node, under a consulrun lock (job `_watchdog`).
    """
    from consulrun.protocol import health
    from consulrun.consul.client import Client

    if [manifest, jobs_json, jobs_file].count(None) != 2:
        raise UsageError("give one of MANIFEST, --jobs or --jobs-file (the watchdog unit passes --jobs-file)")
    loaded = _read_manifest(manifest)[0] if manifest else None
    where = f"--jobs-file {jobs_file}" if jobs_file else "--jobs"
    try:
        if jobs_file:
            jobs_json = "".join(line for line in jobs_file.read_text(encoding="utf-8").splitlines(keepends=True)
                                if not line.startswith("#"))  # the generated-by header
        watched = health.Watched.from_manifest(loaded) if loaded else health.Watched.from_json(jobs_json or "")
    except OSError as exc:
        raise UsageError(f"{where}: {os_reason(exc)}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: {exc}") from None
    kv_prefix = prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")
    _setup_logging()
    client = Client(consul_config(consul, loaded.consul if loaded else None), label="watchdog")
    report = health.watchdog(client, kv_prefix, watched, grace_s=grace / 1000)
    for line in report.changed:
        logging.getLogger("consulrun").info("watchdog: check %s", line)


@main.command("acl-policy")
@click.argument("manifest", required=False, type=click.Path(allow_dash=True, path_type=Path))
@click.option("--prefix", type=KvPrefix(), default=None,
              help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
def acl_policy(manifest: Path | None, prefix: str | None) -> None:
    """Print the least-privilege Consul ACL policy (HCL) the nodes need. MANIFEST may be - (standard input)."""
    from consulrun.protocol.aclpolicy import policy_hcl

    loaded = _read_manifest(manifest)[0] if manifest else None
    kv_prefix = prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")
    # A bound check may be a service check; reading those needs service read, so grant it only then.
    service_checks = bool(loaded) and any(job.lock.checks for job in loaded.jobs)
    click.echo(policy_hcl(kv_prefix, service_checks=service_checks,
                          health_checks=bool(loaded) and loaded.health_checks), nl=False)


@main.command()
@click.argument("targets", nargs=-1, required=True, metavar="[MANIFEST] JOB")
@click.option("--prefix", default=None, help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of runs instead of a table.")
@click.option("-n", "limit", type=click.IntRange(1, 100_000), default=20, show_default=True, help="How many runs.")
@consul_options
def history(targets: tuple[str, ...], prefix: str | None, as_json: bool, limit: int, **consul: str | None) -> None:
    """List JOB's runs across the cluster, newest first, every attempt of a taken-over occurrence included.

    What is kept is what the runs recorded: the newest `history` (manifest;
    `--history` of `run`) occurrences, and the last run made without
    --schedule (marked manual). Occurrences skipped while the job was paused
    are listed too (from the kept pauses and the schedule). Exit 6 if JOB has
    no state at all.
    """
    from datetime import datetime, timezone

    from consulrun.report import history as past
    from consulrun.consul.client import Client

    loaded, jobs = _manifest_and_jobs(targets)
    if len(jobs) != 1:
        raise UsageError("history takes one JOB, after an optional MANIFEST")
    kv_prefix = prefix or (loaded.kv_prefix if loaded else "consulrun")
    schedules = next((job.schedules for job in loaded.jobs if job.name == jobs[0]), ()) if loaded else ()
    rows = past.runs(Client(consul_config(consul, loaded.consul if loaded else None)), kv_prefix, jobs[0], limit,
                     schedules=schedules)
    if as_json:
        click.echo(_json({"prefix": kv_prefix, "job": jobs[0], "runs": rows}, compact=False))
        return
    table = past.table(rows, datetime.now(timezone.utc))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _pause_targets(targets: tuple[str, ...], all_jobs: bool, prefix: str | None,
                   consul: dict[str, str | None]) -> tuple[object, str, list[str]]:
    """(client, kv prefix, jobs) for pause/resume: JOBs named, or --all of the manifest's (else of Consul's)."""
    from consulrun.report import status as state
    from consulrun.consul.client import Client

    loaded, jobs = _manifest_and_jobs(targets)
    if bool(jobs) == all_jobs:
        raise UsageError("name the JOBs, or give --all (with a manifest: its jobs; without: every job in Consul)")
    kv_prefix = prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")
    client = Client(consul_config(consul, loaded.consul if loaded else None))
    if all_jobs:
        jobs = tuple(job.name for job in loaded.jobs) if loaded else tuple(sorted(state.read_prefix(
            client, kv_prefix.strip("/") + "/")[1]))
        if not jobs:
            raise state.NoState(f"no job has any state under {kv_prefix}/ in Consul")
    return client, kv_prefix.strip("/"), list(dict.fromkeys(jobs))  # a job named twice is one job


@main.command()
@click.argument("targets", nargs=-1, metavar="[MANIFEST] [JOB]...")
@click.option("--all", "all_jobs", is_flag=True, help="Every job of the manifest (without one: every job in Consul).")
@click.option("--for", "for_ms", type=Duration(), default=None, metavar="DURATION",
              help="End the pause by itself after this long (e.g. 2h); default: until `resume`.")
@click.option("--reason", default=None, help="Why, shown by status and history.")
@click.option("--prefix", type=KvPrefix(), default=None, help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
@consul_options
def pause(targets: tuple[str, ...], all_jobs: bool, for_ms: int | None, reason: str | None, prefix: str | None,
          **consul: str | None) -> None:
    """Pause JOBs on every node: their runs skip (exit with the skip code) until `resume` or --for ends.

    One Consul write for all of them (batches beyond Consul's 128 operations); the skip path stays free of writes.
    """
    from consulrun.protocol import pause as pausing

    client, kv_prefix, jobs = _pause_targets(targets, all_jobs, prefix, consul)
    value = pausing.pause(client, kv_prefix, jobs, for_ms=for_ms or None, reason=reason)
    for job in jobs:
        click.echo(f"{job}: {pausing.describe(value)}")


@main.command()
@click.argument("targets", nargs=-1, metavar="[MANIFEST] [JOB]...")
@click.option("--all", "all_jobs", is_flag=True, help="Every job of the manifest (without one: every job in Consul).")
@click.option("--prefix", type=KvPrefix(), default=None, help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
@consul_options
def resume(targets: tuple[str, ...], all_jobs: bool, prefix: str | None, **consul: str | None) -> None:
    """End the pause of JOBs: their next occurrence runs as scheduled (skipped ones are not run again)."""
    from consulrun.protocol import pause as pausing

    client, kv_prefix, jobs = _pause_targets(targets, all_jobs, prefix, consul)
    pausing.resume(client, kv_prefix, jobs)
    for job in jobs:
        click.echo(f"{job}: resumed")


@main.command()
@click.argument("targets", nargs=-1, required=True, metavar="[MANIFEST] JOB")
@click.option("--wait", "wait_ms", type=Duration(), default="0s", show_default=True,
              help="If the job is running, wait up to this long for it to end, then trigger.")
@click.option("--unit", default=None, help="The job's service unit [default: <unit_prefix>-<JOB>.service].")
@click.option("--host", default=None, metavar="NODE", help="Trigger on NODE over ssh instead of this node.")
@click.option("--prefix", type=KvPrefix(), default=None, help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
@consul_options
def trigger(targets: tuple[str, ...], wait_ms: int, unit: str | None, host: str | None, prefix: str | None,
            **consul: str | None) -> None:
    """Run JOB once, now, on this node (or --host NODE), through its systemd unit.

    Never beside another run of JOB: if it is running anywhere, this says so
    and starts nothing (or waits, with --wait). The run is recorded in
    history as manual, with who asked. Needs root (it runs systemctl start).
    """
    loaded, jobs = _manifest_and_jobs(targets)
    if len(jobs) != 1:
        raise UsageError("trigger takes one JOB, after an optional MANIFEST")
    job = jobs[0]
    unit = unit or f"{loaded.unit_prefix if loaded else 'consulrun'}-{job}.service"
    kv_prefix = (prefix if prefix is not None else (loaded.kv_prefix if loaded else "consulrun")).strip("/")
    if host:
        from consulrun.units.remote import run_remote

        argv = ["trigger", "--wait", f"{wait_ms}ms", "--unit", unit, "--prefix", kv_prefix, job]
        sys.exit(run_remote(host, argv, consul_path=_default_consulrun_path()))  # the same consulrun path as units
    from consulrun.consul.client import Client
    from consulrun.protocol.trigger import systemctl_start, trigger as run_trigger

    client = Client(consul_config(consul, loaded.consul if loaded else None))
    outcome = run_trigger(client, f"{kv_prefix}/{job}", unit, wait_s=wait_ms / 1000, start_unit=systemctl_start)
    record = outcome.record
    if record is None:
        raise ConsulrunError(f"{job}: {unit} ran no manual run (systemctl start: {outcome.unit_status}"
                             + (f", {outcome.unit_output}" if outcome.unit_output else "")
                             + "); see journalctl -u " + unit)
    result = (f"exit status {record.get('exit_status')}" if record.get("state") == "done"
              else f"{record.get('state')}: {record.get('reason', '')}")
    click.echo(f"{job}: manual run on {record.get('node')} started {record.get('started')}: {result}")
    sys.exit(0 if record.get("state") == "done" and record.get("exit_status") == 0 else ExitCode.FAILURE)

@main.command("on-failure", context_settings={"allow_interspersed_args": False})
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
    passed through.
    """
    from consulrun.protocol.notify import failure_facts, is_skip, run_on_failure

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command given: consulrun on-failure --unit UNIT JOB -- COMMAND [ARG]...")
    _setup_logging()
    facts = failure_facts(job, unit)
    if is_skip(facts, skip_exit_code):
        logging.getLogger("consulrun").info("%s: exit status %s is the skip code; not a failure", job, skip_exit_code)
        return
    logging.getLogger("consulrun").info("%s: %s (%s, exit status %s, occurrence %s); running the on_failure command",
                                        job, unit, facts["CONSULRUN_RESULT"] or "?",
                                        facts["CONSULRUN_EXIT_STATUS"] or "?", facts["CONSULRUN_OCCURRENCE"] or "-")
    sys.exit(run_on_failure(list(command), facts))


EXPORTER_LISTEN = "127.0.0.1:9785"


@main.command()
@click.argument("manifest", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--prefix", type=KvPrefix(), default=None,
              help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
@click.option("--listen", default=EXPORTER_LISTEN, show_default=True, metavar="HOST:PORT",
              help="Address to serve /metrics on (:PORT for all addresses, [IPV6]:PORT).")
@click.option("--textfile", metavar="PATH",
              help="Write the metrics once to PATH (atomically, for node_exporter's textfile collector), "
                   "or - for standard output, and exit.")
@click.option("--grace", type=Duration(), default="60s", show_default=True,
              help="As for `status`: how late an occurrence may be claimed before it counts as missed.")
@consul_options
def exporter(manifest: Path | None, prefix: str | None, listen: str, textfile: str | None, grace: int,
             **consul: str | None) -> None:
    """Export every job's state and runs as Prometheus metrics, read from Consul (one exporter per cluster).

    Serves http://HOST:PORT/metrics, following Consul with blocking queries;
    with --textfile, reads Consul once and writes the metrics. MANIFEST, if
    given, adds its jobs' schedules and timeouts (missed and overdue) and its
    `consul:` settings, as for `status`. If Consul cannot be read, the file
    still gets `consulrun_exporter_consul_up 0` and the exit status says why.
    """
    from consulrun.consul.client import Client
    from consulrun.manifest.loader import load_manifest
    from consulrun.report.metrics import ClusterMetrics, exposition, parse_listen, serve, write_textfile

    loaded = load_manifest(manifest) if manifest else None
    kv_prefix = prefix or (loaded.kv_prefix if loaded else "consulrun")
    metrics = ClusterMetrics(kv_prefix, loaded, grace_s=grace / 1000)
    config = consul_config(consul, loaded.consul if loaded else None)
    _setup_logging()
    if textfile is None:
        address = parse_listen(listen)
        _interruptible()
        try:
            serve(metrics, lambda: Client(config), address)
        except KeyboardInterrupt:
            sys.exit(130)
    problem: ConsulrunError | None = None
    try:
        metrics.refresh(Client(config))
    except UsageError:
        raise
    except ConsulrunError as exc:
        metrics.failed(exc, quiet=True)  # the error line says it
        problem = exc
    if textfile == "-":
        click.echo(exposition(metrics).decode(), nl=False)
    else:
        write_textfile(metrics, Path(textfile))
    if problem is not None:
        raise problem
