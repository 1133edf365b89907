"""`consulrun exporter`: the jobs' state as Prometheus metrics."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from consulrun.commands.common import interruptible
from consulrun.commands.options import Duration, consul_config, consul_options, manifest_prefix_option
from consulrun.commands.runargs import setup_logging as _setup_logging
from consulrun.errors import ConsulrunError, UsageError

EXPORTER_LISTEN = "127.0.0.1:9785"


@click.command(short_help="Serve every job's state as Prometheus metrics.")
@click.argument("manifest", required=False, type=click.Path(dir_okay=False, path_type=Path))
@manifest_prefix_option
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
        interruptible()
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
