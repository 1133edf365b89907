"""Click options shared by the commands that talk to Consul, each defined once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from consulrun.errors import UsageError
from consulrun.manifest.durations import (
    DURATION_MAX_MS,
    DurationError,
    format_duration,
    parse_duration,
    range_text,
    unit_hint,
)
from consulrun.manifest.schema import kv_prefix_problem

if TYPE_CHECKING:
    from consulrun.consul.client import ConsulConfig
    from consulrun.consul.settings import ConsulSettings


def _option_name(param: click.Parameter | None) -> str:
    return (param.opts[0] if param is not None and param.opts else (param.name if param else "value")) or "value"


class Duration(click.ParamType):
    """A duration as systemd writes it (`500ms`, `15s`, `1m30s`, `10 min`), as milliseconds, within `bounds`.

    A malformed value and an out-of-range one give the same one-line
    `Error: --ttl: ...`, with bounds written the way durations are printed.
    """

    name = "DURATION"

    def __init__(self, bounds: tuple[int, int] = (0, DURATION_MAX_MS)) -> None:
        self.bounds = bounds

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            ms = parse_duration(str(value))
        except DurationError as exc:
            raise UsageError(f"{_option_name(param)}: {exc}") from None
        if not self.bounds[0] <= ms <= self.bounds[1]:
            raise UsageError(f"{_option_name(param)}: {format_duration(ms)} is out of range: "
                             f"must be {range_text(self.bounds)}{unit_hint(str(value))}")
        return ms


class KvPrefix(click.ParamType):
    """A Consul KV prefix, held to the same rule as the manifest's `kv_prefix`."""

    name = "PREFIX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        problem = kv_prefix_problem(str(value))
        if problem:
            raise UsageError(f"{_option_name(param)}: {problem}")
        return str(value)


class AbsolutePath(click.ParamType):
    """An absolute path without control characters: what a unit's ExecStart= and a remote shell can both take."""

    name = "PATH"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if not text.startswith("/") or any(ord(ch) < 0x20 or ord(ch) == 0x7f for ch in text):
            raise UsageError(f"{_option_name(param)}: {text[:200]!r} must be an absolute path without control characters")
        return text


class Folder(click.ParamType):
    """An existing folder; a missing one is a one-line error, not a usage block."""

    name = "DIR"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        path = Path(value)
        if not path.is_dir():
            raise UsageError(f"{_option_name(param)}: {path}: {'not a directory' if path.exists() else 'no such file'}")
        return path


# The options several commands share, each defined once.
manifest_prefix_option = click.option(
    "--prefix", type=KvPrefix(), default=None, help="KV prefix [default: the manifest's kv_prefix, else consulrun].")
job_prefix_option = click.option(
    "--prefix", type=KvPrefix(), default="consulrun", show_default=True,
    help="KV prefix; the job's keys are <prefix>/<JOB>/.")
all_jobs_option = click.option(
    "--all", "all_jobs", is_flag=True, help="Every job of the manifest (without one: every job in Consul).")
yes_option = click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
templates_option = click.option(
    "--templates", type=Folder(),
    help="Folder with service.j2, timer.j2 and/or onfailure.j2 overriding the shipped templates.")


ssh_option = click.option("--ssh-option", "ssh_options", multiple=True, metavar="OPT",
                          help="Passed to ssh as -o OPT (repeatable).")


def consulrun_path_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--consulrun-path`: where the units' ExecStart= finds consulrun (default: the consulrun running now)."""
    from consulrun.commands.common import default_consulrun_path

    return click.option("--consulrun-path", type=AbsolutePath(), default=default_consulrun_path,
                        show_default="this consulrun", help=help_text)


manifest_name_option = click.option(
    "--name", "manifest_name", default=None, metavar="NAME",
    help="The manifest's name, which its units carry, when it has no `name:` [default: its file name without the "
         "extension; needed for standard input].")


CONSUL_OPTIONS = [
    click.option("--http-addr", envvar="CONSUL_HTTP_ADDR", show_envvar=True, metavar="ADDRESS",
                 help="Address of the local Consul agent: [http[s]://]HOST[:PORT], an IPv6 HOST in brackets, or "
                      "unix:///PATH of its socket [default: 127.0.0.1:8500]."),
    click.option("--token-file", envvar="CONSUL_HTTP_TOKEN_FILE", show_envvar=True, metavar="FILE",
                 help="File holding the ACL token; a token in it wins over CONSUL_HTTP_TOKEN, as in the consul CLI "
                      "(no option puts a token on the command line)."),
    click.option("--ca-file", envvar="CONSUL_CACERT", show_envvar=True, metavar="FILE", help="CA certificate for HTTPS."),
    click.option("--ca-path", envvar="CONSUL_CAPATH", show_envvar=True, metavar="DIR",
                 help="Folder of CA certificates for HTTPS (every file in it, sub-folders too; --ca-file wins)."),
    click.option("--client-cert", envvar="CONSUL_CLIENT_CERT", show_envvar=True, metavar="FILE",
                 help="Client certificate for HTTPS."),
    click.option("--client-key", envvar="CONSUL_CLIENT_KEY", show_envvar=True, metavar="FILE",
                 help="Client key for HTTPS."),
    click.option("--tls-server-name", envvar="CONSUL_TLS_SERVER_NAME", show_envvar=True, metavar="NAME",
                 help="Server name to verify the agent's certificate against."),
]


TRUST_MANIFEST_CONSUL = click.option(
    "--trust-manifest-consul", is_flag=True,
    help="Send the ACL token to the address the manifest's consul: section names (refused otherwise, unless it is "
         "the default 127.0.0.1:8500: a manifest does not choose where a local secret goes).")


def agent_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The connection options of a command that reads no manifest (run, reap)."""
    for option in reversed(CONSUL_OPTIONS):
        func = option(func)
    return func


def consul_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The connection options of a command that may read a manifest, with its `consul:` settings."""
    return agent_options(TRUST_MANIFEST_CONSUL(func))


CONSUL_PARAMETERS = ("http_addr", "token_file", "ca_file", "ca_path", "client_cert", "client_key", "tls_server_name")


def consul_config(kwargs: dict[str, Any], manifest_consul: "ConsulSettings | None" = None) -> "ConsulConfig":
    """consulrun.consul.client.consul_config, imported only by the commands that talk to Consul."""
    from consulrun.consul.client import consul_config as build

    return build(kwargs, manifest_consul)


def units_consul_config(manifest_consul: "ConsulSettings | None") -> "ConsulConfig":
    """Consul as the units a manifest installs reach it: the environment and the manifest's `consul:`, no option
    (the manifest being installed chooses where its units send the token)."""
    return consul_config({**dict.fromkeys(CONSUL_PARAMETERS), "trust_manifest_consul": True}, manifest_consul)
