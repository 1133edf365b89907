"""`consulrun import-crontab`: a crontab's lines as manifest jobs."""

from __future__ import annotations

from pathlib import Path

import click

from consulrun.commands.common import read_text


@click.command("import-crontab")
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

    text, source = read_text(crontab)
    system = system or str(crontab) == "/etc/crontab" or str(crontab.parent) == "/etc/cron.d"
    try:
        click.echo(convert(text, source, system=system), nl=False)
    except CrontabError as exc:
        click.echo(exc.manifest, nl=False)
        raise
