"""`consulrun import-crontab`: a crontab's lines as manifest jobs."""

from __future__ import annotations

from pathlib import Path

import click

from consulrun.commands.common import read_text


@click.command("import-crontab")
@click.argument("crontabs", metavar="CRONTAB...", nargs=-1, required=True,
                type=click.Path(allow_dash=True, path_type=Path))
@click.option("--system", is_flag=True,
              help="The /etc/crontab and /etc/cron.d format: a user column before the command "
                   "[default: on for /etc/crontab and /etc/cron.d/*].")
def import_crontab(crontabs: tuple[Path, ...], system: bool) -> None:
    """Print one manifest for the jobs of each CRONTAB (a file, or - for standard input).

    Jobs are named after what their lines run (past guards such as `test -x X &&`), or, for a
    system file, after the file (`import-crontab --system /etc/cron.d/*`); names are unique
    across all the files. Lines it cannot convert are reported on stderr with their line
    numbers (exit 2); the manifest of the others is still printed.
    """
    from consulrun.manifest.crontab import CrontabError, convert_all

    inputs = []
    for crontab in crontabs:
        text, source = read_text(crontab)
        inputs.append((text, source, system or str(crontab) == "/etc/crontab" or str(crontab.parent) == "/etc/cron.d"))
    try:
        click.echo(convert_all(inputs), nl=False)
    except CrontabError as exc:
        click.echo(exc.manifest, nl=False)
        raise
