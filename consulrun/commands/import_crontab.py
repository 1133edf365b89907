"""`consulrun import-crontab`: a crontab's lines as manifest jobs."""

from __future__ import annotations

from pathlib import Path

import click

from consulrun.commands.common import read_text


@click.command("import-crontab", short_help="Turn crontab lines into a manifest.")
@click.argument("crontabs", metavar="CRONTAB...", nargs=-1, required=True,
                type=click.Path(allow_dash=True, path_type=Path))
@click.option("--system", is_flag=True,
              help="The /etc/crontab and /etc/cron.d format: a user column before the command "
                   "[default: on for /etc/crontab and /etc/cron.d/* (also copies: etc/crontab, "
                   "cron.d/*)].")
@click.option("--user", metavar="NAME",
              help="Whom a user crontab's jobs run as (the crontab's owner); required for a user "
                   "crontab, whose lines name no user.")
@click.option("--package-files", type=click.Choice(["leave", "each-node"]), default="leave",
              show_default=True,
              help="A file a Debian package owns (dpkg-query -S) is per-node housekeeping: leave "
                   "it to cron (one line each on stderr), or convert it to mode: each-node jobs.")
def import_crontab(crontabs: tuple[Path, ...], system: bool, user: str | None,
                   package_files: str) -> None:
    """Print one manifest for the jobs of each CRONTAB (a file, or - for standard input).

    Jobs are named after what their lines run (past guards such as `test -x X &&`), or, for a
    system file, after the file (`import-crontab --system /etc/cron.d/*`); names are unique
    across all the files. A user crontab needs --user (exit 2 without it, nothing printed).
    Lines it cannot convert are reported on stderr with their line numbers (exit 2); the
    manifest of the others is still printed.
    """
    from consulrun.manifest.crontab import CrontabError, convert_all
    from consulrun.manifest.cronowner import package_owner

    inputs, packages = [], {}
    for crontab in crontabs:
        text, source = read_text(crontab)
        # By where it lies, also as a copy given by a relative path (etc/crontab, etc/cron.d/billing).
        is_system = system or crontab.name == "crontab" and crontab.parent.name == "etc" \
            or crontab.parent.name == "cron.d"
        inputs.append((text, source, is_system))
        owner = package_owner(str(crontab)) if is_system else None
        if owner:
            packages[source] = owner
    try:
        manifest = convert_all(inputs, user=user, packages=packages,
                               each_node_packaged=package_files == "each-node")
    except CrontabError as exc:
        _left_out(packages, package_files)
        click.echo(exc.manifest, nl=False)
        raise
    _left_out(packages, package_files)
    click.echo(manifest, nl=False)


def _left_out(packages: dict[str, str], package_files: str) -> None:
    """One line for each package's file left to cron."""
    from consulrun.manifest.crontab import packaged_note

    if package_files == "leave":
        for source, package in packages.items():
            click.echo(f"warning: {packaged_note(source, package)}", err=True)
