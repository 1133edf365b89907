"""`consulrun generate`: render a manifest into units, or check that a folder is up to date."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from consulrun.commands.common import read_manifest
from consulrun.commands.options import (
    consulrun_path_option,
    manifest_name_option,
    templates_option,
)
from consulrun.errors import ExitCode


@click.command(short_help="Render a manifest into systemd units.")
@click.argument("manifest", type=click.Path(allow_dash=True, path_type=Path))
@click.option("-o", "--output", "output", required=True, metavar="DIR",
              help="Folder to write the units into, or - to print them.")
@click.option("--check", is_flag=True, help="Change nothing; print a diff and exit 1 if DIR is out of date.")
@templates_option
@consulrun_path_option("Absolute path of consulrun as the units' ExecStart= calls it.")
@manifest_name_option
def generate(manifest: Path, output: str, check: bool, templates: Path | None, consulrun_path: str,
             manifest_name: str | None) -> None:
    """Render MANIFEST into <prefix>-<job>.service/.timer files. MANIFEST may be - (standard input).

    Each file names the manifest it came from (`name:`, else the file name,
    and then the file's path relative to DIR); files in DIR that this manifest
    made and no longer makes are removed (and listed), another manifest's are
    left alone, and one of another manifest's in the way of a unit, or units of
    another manifest of the same name (another jobs.yaml), are refused (exit 2).
    """
    from consulrun.manifest.hardening import relaxed_lines
    from consulrun.units.guarantees import warnings
    from consulrun.units.install import plan
    from consulrun.units.owner import identity, named
    from consulrun.units.render import render, unowned_units, unowned_warning, write_units

    loaded, _ = read_manifest(manifest)
    loaded = named(loaded, manifest_name)
    ident = identity(loaded, None if output == "-" else Path(output), writing=output != "-")
    units = render(loaded, consulrun_path, templates, ident)
    for line in [*warnings(loaded), *relaxed_lines(loaded, consulrun_path)]:
        click.echo(f"warning: {line}", err=True)
    if output == "-":
        for name, text in units.items():
            click.echo(f"# --- {name}\n{text}", nl=False)
        return
    outdir = Path(output)
    if check:
        diff = plan(units, outdir, ident).diff()
        if diff:
            click.echo(diff, nl=False)
            click.echo(f"{outdir} is out of date with {manifest}", err=True)
            sys.exit(ExitCode.FAILURE)
        click.echo(f"{outdir} is up to date")
        return
    unowned = unowned_units(outdir, units, loaded.unit_prefix)
    if unowned:
        click.echo(f"warning: {unowned_warning(outdir, unowned)}", err=True)
    written, removed = write_units(units, outdir, ident)
    for path in written:
        click.echo(str(path))
    for path in removed:
        click.echo(f"removed {path}")
