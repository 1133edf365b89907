"""`consulrun install`: put a manifest's units on this node, or on each --host over ssh."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from consulrun.commands.options import Folder, consulrun_path_option, manifest_name_option, ssh_option
from consulrun.errors import ConsulrunError, UsageError

if TYPE_CHECKING:
    from consulrun.manifest.loader import Manifest
from consulrun.commands.common import read_manifest


@click.command(short_help="Install a manifest's units on this node or over ssh.")
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
@consulrun_path_option("Absolute path of consulrun on the node(s), as units call it.")
@click.option("--host", "hosts", multiple=True, metavar="NODE",
              help="Install on NODE ([USER@]HOST) over ssh (repeatable; a node given twice is installed once).")
@click.option("--hosts-file", type=click.Path(dir_okay=False, path_type=Path),
              help="File with one NODE per line (# comments allowed).")
@ssh_option
@click.option("--parallel", type=click.IntRange(1, 256), default=10, show_default=True, help="Nodes at a time.")
@click.option("--with-package", "package", type=click.Path(dir_okay=False, path_type=Path), metavar="PATH.deb",
              help="With --host: first put this .deb (scripts/package builds it) on each node over ssh and dpkg -i "
                   "it, so a bare node needs only python3 and sshd; --consulrun-path then defaults to "
                   "/usr/bin/consulrun.")
@click.option("--stdin-bundle", is_flag=True, hidden=True,
              help="Standard input is the JSON bundle `install --host --templates` sends: manifest and templates.")
@manifest_name_option
def install(manifest: Path, root: Path | None, unit_dir: Path, dry_run: bool, no_start: bool, templates: Path | None,
            consulrun_path: str, hosts: tuple[str, ...], hosts_file: Path | None,
            ssh_options: tuple[str, ...], parallel: int, package: Path | None, stdin_bundle: bool,
            manifest_name: str | None) -> None:
    """Install MANIFEST's units on this node, or on each --host over ssh.

    Writes only units it generated (a foreign file with one of their names is
    an error, another manifest's is refused with exit 2, and so are units of
    another manifest of the same name, e.g. another jobs.yaml), removes (and lists)
    this manifest's units for jobs no longer in it, never another's, runs
    systemctl daemon-reload and enables (and starts) the timers. A second run
    with the same manifest changes nothing. If anything fails, the previous
    units are put back. MANIFEST may be - (standard input).
    """
    from consulrun.units.owner import named, owner
    from consulrun.units.remote import make_bundle, read_hosts

    if stdin_bundle:
        _install_bundle(manifest, root=root, unit_dir=unit_dir, dry_run=dry_run, no_start=no_start,
                        consulrun_path=consulrun_path, manifest_name=manifest_name)
        return
    loaded, text = read_manifest(manifest)
    loaded = named(loaded, manifest_name)
    targets = read_hosts(hosts, hosts_file) if hosts or hosts_file else None
    package_bytes = None
    if package is not None:
        package_bytes, consulrun_path = _package_options(package, targets is not None, dry_run, root, consulrun_path)
    if targets is not None:
        if not targets.names:
            raise UsageError(f"--hosts-file: {hosts_file}: names no host")
        for host in targets.duplicates:
            click.echo(f"warning: {host} is listed more than once; installing there once", err=True)
        flags = (["--dry-run"] if dry_run else []) + (["--no-start"] if no_start else []) + \
            (["--root", str(root)] if root else []) + ["--unit-dir", str(unit_dir), "--consulrun-path", consulrun_path,
                                                       "--name", owner(loaded)]  # the node reads it from stdin
        if templates is not None:  # the override templates go along with the manifest, on standard input
            text = make_bundle(text, templates)
            flags.append("--stdin-bundle")
        _install_remote(targets.names, text, [consulrun_path, "install", "-", *flags], list(ssh_options), parallel,
                        dry_run, package_bytes)
        return
    _print_report(loaded, root=root, unit_dir=unit_dir, dry_run=dry_run, no_start=no_start, templates=templates,
                  consulrun_path=consulrun_path)


PACKAGED_CONSULRUN = "/usr/bin/consulrun"  # where the .deb puts the command


def _consulrun_path_given() -> bool:
    """Whether the operator named --consulrun-path (else it is the consulrun running now, or the package's)."""
    source = click.get_current_context().get_parameter_source("consulrun_path")
    return source is not click.core.ParameterSource.DEFAULT


def _package_options(package: Path, remote: bool, dry_run: bool, root: Path | None,
                     consulrun_path: str) -> tuple[bytes, str]:
    """The package's bytes and the consulrun path the units call; the options --with-package cannot go with."""
    from consulrun.units.remote import read_package

    if not remote:
        raise UsageError("--with-package needs --host or --hosts-file (on this node, run dpkg -i yourself)")
    if dry_run:
        raise UsageError("--with-package installs a package, which --dry-run must not: dry-run without it")
    if root is not None:
        raise UsageError("--with-package installs into each node's own root, not into --root")
    if not _consulrun_path_given():
        consulrun_path = PACKAGED_CONSULRUN
    return read_package(package), consulrun_path


def _install_bundle(manifest: Path, manifest_name: str | None, **options: Any) -> None:
    """The node's side of `install --host --templates`: templates into a private folder, then the local install."""
    import tempfile

    from consulrun.manifest.loader import parse_manifest
    from consulrun.units.owner import named
    from consulrun.units.remote import open_bundle

    if str(manifest) != "-":
        raise UsageError("--stdin-bundle reads standard input: give MANIFEST as -")
    with tempfile.TemporaryDirectory(prefix="consulrun-templates-") as folder:
        text = open_bundle(sys.stdin.read(), Path(folder))
        _print_report(named(parse_manifest(text, "<stdin>"), manifest_name), templates=Path(folder), **options)


def _this_node(loaded: "Manifest", root: Path | None) -> tuple[tuple[str, dict[str, str]] | None, list[str]]:
    """This node's Consul name and meta when a job's `nodes:` needs them (else None), and why they are not known."""
    placed = [job.name for job in loaded.jobs if job.placement is not None]
    if not placed:
        return None, []
    if root is not None:
        return None, [f"an image has no Consul node yet: {', '.join(placed)} installed whatever their nodes: say "
                      "(a run on a node they do not name skips)"]
    from consulrun.commands.options import units_consul_config
    from consulrun.consul.client import Client

    try:
        return Client(units_consul_config(loaded.consul)).node_identity(), []
    except ConsulrunError as exc:
        return None, [f"this node's Consul name and meta cannot be read ({exc}): {', '.join(placed)} installed "
                      "whatever their nodes: say (a run on a node they do not name skips)"]


def _print_report(loaded: "Manifest", *, root: Path | None, unit_dir: Path, dry_run: bool, no_start: bool,
                  templates: Path | None, consulrun_path: str) -> None:
    from consulrun.units.install import install_local

    node, unknown = _this_node(loaded, root)
    report = install_local(loaded, root=root, unit_dir=unit_dir, dry_run=dry_run, start=not no_start,
                           templates=templates, consulrun_path=consulrun_path,
                           consulrun_path_given=_consulrun_path_given(), node=node)
    for line in unknown + report.warnings:
        click.echo(f"warning: {line}", err=True)
    click.echo("".join(report.diff), nl=False)
    for line in report.lines:
        click.echo(line)


def _install_remote(hosts: list[str], text: str, remote_argv: list[str], ssh_options: list[str], parallel: int,
                    dry_run: bool, package: bytes | None = None) -> None:
    from consulrun.consul.values import printable
    from consulrun.units.remote import HostResult, install_all

    # What a node's ssh session printed is the node's to choose: no control character of it reaches the terminal
    # (a title, a cleared screen, a line that looks like another node's `[1/1] ...: ok`).
    def progress(result: HostResult, done: int, total: int) -> None:
        click.echo(f"[{done}/{total}] {result.host}: {'ok' if result.ok else 'FAILED'}: {printable(result.summary)}",
                   err=True)
        for warning in result.warnings:
            click.echo(f"warning: {result.host}: {printable(warning)}", err=True)

    results = install_all(hosts, text, remote_argv, ssh_options, parallel, timeout_s=300, progress=progress,
                          package=package)
    if dry_run:  # each node's own diff and systemctl calls, not only its last line
        for r in results:
            if r.ok:
                click.echo(f"==> {r.host} <==")
                click.echo("".join(printable(line) + "\n" for line in r.stdout.splitlines()), nl=False)
    width = max(len(r.host) for r in results + [HostResult("HOST", True, "")])
    click.echo(f"{'HOST'.ljust(width)}  RESULT  DETAIL")
    for r in results:
        click.echo(f"{r.host.ljust(width)}  {'ok    ' if r.ok else 'FAILED'}  {printable(r.summary)}")
    failed = [r.host for r in results if not r.ok]
    if failed:
        raise ConsulrunError(f"install failed on {len(failed)} of {len(results)} node(s): {', '.join(failed)}")
