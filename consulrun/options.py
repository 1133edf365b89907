"""Click options shared by the commands that talk to Consul, each defined once."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from consulrun.durations import DURATION_MAX_MS, DurationError, format_duration, parse_duration, range_text
from consulrun.errors import UsageError
from consulrun.schema import SCHEMA

if TYPE_CHECKING:
    from consulrun.consulapi import ConsulConfig
    from consulrun.manifest import ConsulSettings


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
                             f"must be {range_text(self.bounds)}")
        return ms


class KvPrefix(click.ParamType):
    """A Consul KV prefix, held to the same rule as the manifest's `kv_prefix`."""

    name = "PREFIX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        rule = SCHEMA["properties"]["kv_prefix"]
        text = str(value)
        if not re.fullmatch(rule["pattern"], text) or len(text) > rule["maxLength"]:
            raise UsageError(f"{_option_name(param)}: {text!r} {rule['x-message']}")
        return text


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


CONSUL_OPTIONS = [
    click.option("--http-addr", envvar="CONSUL_HTTP_ADDR", show_envvar=True, metavar="ADDRESS",
                 help="Address of the local Consul agent: [http[s]://]HOST[:PORT], an IPv6 HOST in brackets "
                      "[default: 127.0.0.1:8500]."),
    click.option("--token-file", envvar="CONSUL_HTTP_TOKEN_FILE", show_envvar=True, metavar="FILE",
                 help="File holding the ACL token (CONSUL_HTTP_TOKEN is read too; no option puts a token on the command line)."),
    click.option("--ca-file", envvar="CONSUL_CACERT", show_envvar=True, metavar="FILE", help="CA certificate for HTTPS."),
    click.option("--client-cert", envvar="CONSUL_CLIENT_CERT", show_envvar=True, metavar="FILE",
                 help="Client certificate for HTTPS."),
    click.option("--client-key", envvar="CONSUL_CLIENT_KEY", show_envvar=True, metavar="FILE",
                 help="Client key for HTTPS."),
    click.option("--tls-server-name", envvar="CONSUL_TLS_SERVER_NAME", show_envvar=True, metavar="NAME",
                 help="Server name to verify the agent's certificate against."),
]


def consul_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(CONSUL_OPTIONS):
        func = option(func)
    return func


# The manifest's `consul:` keys and the variables the generated units set from them.
MANIFEST_CONSUL_ENV = {"address": "CONSUL_HTTP_ADDR", "token_file": "CONSUL_HTTP_TOKEN_FILE", "ca_file": "CONSUL_CACERT",
                       "cert_file": "CONSUL_CLIENT_CERT", "key_file": "CONSUL_CLIENT_KEY",
                       "tls_server_name": "CONSUL_TLS_SERVER_NAME"}


def manifest_consul_env(settings: "ConsulSettings | None") -> dict[str, str]:
    """The CONSUL_* variables a manifest's `consul:` settings stand for, as the units get them."""
    if settings is None:
        return {}
    return {var: str(getattr(settings, key)) for key, var in MANIFEST_CONSUL_ENV.items() if getattr(settings, key)}


def consul_config(kwargs: dict[str, Any], manifest_consul: "ConsulSettings | None" = None) -> "ConsulConfig":
    """Build the config from the options (which already fell back to the environment) and the rest of the env.

    A manifest's `consul:` settings come below both: a command pointed at a
    manifest reaches Consul as that manifest's units do, unless the operator's
    environment or options say otherwise.
    """
    import os

    from consulrun.consulapi import ConsulConfig  # the Consul client is imported only by commands that use it

    env = {**manifest_consul_env(manifest_consul), **{k: v for k, v in os.environ.items() if v}}
    config = ConsulConfig.from_env(
        env, address=kwargs.pop("http_addr"), token_file=kwargs.pop("token_file"), ca_file=kwargs.pop("ca_file"),
        client_cert=kwargs.pop("client_cert"), client_key=kwargs.pop("client_key"),
        tls_server_name=kwargs.pop("tls_server_name"))
    config.endpoint(allow_unix=True)  # a bad address is a usage error now, before anything else happens
    return config
