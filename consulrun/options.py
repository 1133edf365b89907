"""Click options shared by the commands that talk to Consul, each defined once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from consulrun.durations import DurationError, parse_duration

if TYPE_CHECKING:
    from consulrun.consulapi import ConsulConfig
    from consulrun.manifest import ConsulSettings


class Duration(click.ParamType):
    """A duration as Consul and systemd write it (`500ms`, `15s`, `1m30s`), as milliseconds."""

    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_duration(str(value))
        except DurationError as exc:
            self.fail(str(exc), param, ctx)


CONSUL_OPTIONS = [
    click.option("--http-addr", envvar="CONSUL_HTTP_ADDR", show_envvar=True, metavar="[SCHEME://]HOST:PORT",
                 help="Address of the local Consul agent [default: 127.0.0.1:8500]."),
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
    return ConsulConfig.from_env(
        env, address=kwargs.pop("http_addr"), token_file=kwargs.pop("token_file"), ca_file=kwargs.pop("ca_file"),
        client_cert=kwargs.pop("client_cert"), client_key=kwargs.pop("client_key"),
        tls_server_name=kwargs.pop("tls_server_name"))
