"""`consulrun uninstall`: remove every unit of one manifest from this node, and nothing of another's."""

from __future__ import annotations

from pathlib import Path

import click

from consulrun.commands.common import read_manifest
from consulrun.commands.options import manifest_name_option
from consulrun.errors import UsageError


@click.command(short_help="Remove a manifest's units from this node.")
@click.argument("manifest", required=False, type=click.Path(allow_dash=True, path_type=Path))
@click.option("--root", type=click.Path(file_okay=False, path_type=Path),
              help="Uninstall from this root file system (offline: timers are disabled, nothing is stopped).")
@click.option("--unit-dir", type=click.Path(path_type=Path), default=Path("/etc/systemd/system"), show_default=True,
              help="Unit folder (inside --root if given).")
@click.option("--dry-run", is_flag=True, help="Print the diff and the systemctl actions; change nothing.")
@manifest_name_option
def uninstall(manifest: Path | None, root: Path | None, unit_dir: Path, dry_run: bool,
              manifest_name: str | None) -> None:
    """Remove every unit MANIFEST owns from this node: disable and stop its timers, remove the files, reload systemd.

    The units are found by the manifest's name they carry (`name:`, else the
    file name, and then the file), not by the jobs the manifest has now, so
    units of jobs since removed from it go too, and no other manifest's unit is
    touched. Without MANIFEST (a manifest since deleted or moved), --name NAME
    says which: every unit of that name goes, whichever file wrote it. If a step
    fails, the units are put back. State in Consul is kept (see `forget`).
    """
    from consulrun.units.install import uninstall_local
    from consulrun.manifest.loader import Manifest
    from consulrun.units.owner import named

    which: Manifest | str
    if manifest is None:
        if not manifest_name:
            raise UsageError("give MANIFEST, or --name NAME of a manifest whose file is gone")
        which = named_only(manifest_name)
    else:
        which = named(read_manifest(manifest)[0], manifest_name)
    report = uninstall_local(which, root=root, unit_dir=unit_dir, dry_run=dry_run)
    click.echo("".join(report.diff), nl=False)
    for line in report.lines:
        click.echo(line)


def named_only(name: str) -> str:
    from consulrun.manifest.schema import name_problem

    problem = name_problem(name)
    if problem:
        raise UsageError(f"--name: {problem.removeprefix('job name ')}")
    return name
