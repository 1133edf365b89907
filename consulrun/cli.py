"""The command group: `consulrun --help`, its exit statuses, and the list of commands.

Each command is a module of `consulrun.commands`. Exit statuses are listed in
`consulrun --help` and in docs/guarantees.md; they come from `consulrun.errors.ExitCode`
and nowhere else.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from consulrun import __version__
from consulrun.commands import (
    acl_policy,
    chain_watch,
    exporter,
    forget,
    generate,
    history,
    import_crontab,
    install,
    logs,
    on_failure,
    pause,
    reap,
    resume,
    run,
    status,
    trigger,
    uninstall,
    unlock,
    validate,
    watchdog,
)
from consulrun.errors import ConsulrunError, output_guard

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
  6   `status`, `unlock`, `history`, `logs`: no state in Consul for the prefix or job asked about
      `pause`, `resume`, `trigger`: no such job (in the manifest, else in Consul); `forget`: in Consul
  65  a value in Consul is not one consulrun writes (malformed, or a record in the
      future): the line names its key; `run` starts nothing
  69  Consul unavailable: nothing was started
  70  Consul answered something unexpected, or `run` failed after taking the lock
      (the job's processes were killed first)
  74  writing output failed
  75  lock lost while the job ran: the job was killed
  77  permission denied by Consul ACLs: nothing was started (`status`: ACLs hide part of the state)
  127 `run`: the job's command could not be started (`on-failure`: its command)
  128+N `run`: signal N arrived while no job was running to receive it
"""


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


@click.group(cls=_Main, epilog=EXIT_CODES_HELP,
             context_settings={"help_option_names": ["-h", "--help"]},
             short_help="Run each occurrence of a scheduled job on one node only.")
@click.version_option(__version__, prog_name="consulrun")
def main() -> None:
    """Run each occurrence of a scheduled job on exactly one node, locked through Consul.

    A manifest of jobs becomes paired systemd .timer/.service units
    (`generate`, `install`); each unit runs `consulrun run`, which holds a
    Consul session lock while the job runs.
    """


for _command in (generate.generate, run.run, reap.reap, install.install, status.status, unlock.unlock,
                 import_crontab.import_crontab, watchdog.watchdog, acl_policy.acl_policy, history.history, logs.logs,
                 pause.pause, resume.resume, trigger.trigger, on_failure.on_failure, exporter.exporter,
                 validate.validate, uninstall.uninstall, forget.forget, chain_watch.chain_watch):
    main.add_command(_command)
