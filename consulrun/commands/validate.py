"""`consulrun validate`: check a manifest as `generate` would, writing nothing (as `nomad job validate` does)."""

from __future__ import annotations

from pathlib import Path

import click

from consulrun.commands.common import read_manifest
from consulrun.commands.options import (
    consulrun_path_option,
    manifest_name_option,
    templates_option,
)


@click.command(short_help="Check a manifest without writing anything.")
@click.argument("manifest", type=click.Path(allow_dash=True, path_type=Path))
@templates_option
@consulrun_path_option("Absolute path of consulrun as the units' ExecStart= would call it.")
@manifest_name_option
def validate(manifest: Path, templates: Path | None, consulrun_path: str, manifest_name: str | None) -> None:
    """Check MANIFEST as `generate` does (schema, schedules, every unit rendered) and print its warnings.

    Writes nothing and talks to nothing: exit 0 if `generate` would accept
    MANIFEST, 2 (with the file, line and field) if not. MANIFEST may be -.
    """
    from consulrun.units.guarantees import warnings
    from consulrun.units.owner import named
    from consulrun.units.render import render

    loaded, _ = read_manifest(manifest)
    loaded = named(loaded, manifest_name)
    units = render(loaded, consulrun_path, templates)  # a template that cannot render a job is caught here too
    for line in warnings(loaded):
        click.echo(f"warning: {line}", err=True)
    jobs = len(loaded.jobs)
    click.echo(f"{manifest}: valid: {jobs} job{'s' if jobs != 1 else ''}, {len(units)} unit file"
               f"{'s' if len(units) != 1 else ''}")
