"""A Consul agent's address as the `consul` CLI takes it: `[http[s]://]host[:port]` or `unix:///path`.

One parser for the command line, the environment and the manifest, so a
value accepted in one place is accepted in all of them. It refuses what the
old lenient reading turned silently into port 8500 (`:99999`, `:abc`, `:0`),
and brackets IPv6 literals so they can be put back into a URL.
"""

from __future__ import annotations

import re

from consulrun.records import record

_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")
_HOST_PORT = re.compile(r"(?P<host>\[[^\]]*\]|[^:/\[\]]*)(?::(?P<port>[^/]*))?/?")
DEFAULT_PORTS = {"http": 8500, "https": 8501}


class AddressError(ValueError):
    """The text is not an address Consul's CLI would take; the message says why."""


@record
class Endpoint:
    """Where an agent listens: a URL's scheme, host (IPv6 in brackets) and port, or a unix socket path."""

    scheme: str
    host: str = ""
    port: int = 0
    socket_path: str | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}" if self.socket_path else f"{self.scheme}://{self.host}:{self.port}"


def parse_address(text: str, ssl: bool | None = None) -> Endpoint:
    """Read `text`; `ssl` (CONSUL_HTTP_SSL) true makes the scheme https, also over an explicit http:// (api.go:
    "Never revert to http if TLS was explicitly requested"), so a token never leaves in cleartext once TLS was
    asked for; an explicit https:// is https whatever `ssl` says."""
    value = text.strip()
    if value.startswith("unix://"):
        path = value[len("unix://"):]
        if not path.startswith("/") or any(ord(ch) < 0x20 for ch in path):
            raise AddressError(f"{text!r}: a unix socket address is unix:///absolute/path")
        return Endpoint(scheme="unix", socket_path=path)
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = "", value
    elif scheme not in DEFAULT_PORTS:
        raise AddressError(f"{text!r}: scheme must be http, https or unix, not {scheme!r}")
    scheme = "https" if ssl else (scheme or "http")
    if rest.count(":") > 1 and not rest.startswith("["):
        raise AddressError(f"{text!r}: put an IPv6 address in brackets, e.g. [::1]:8500")
    match = _HOST_PORT.fullmatch(rest)
    if not match or not match.group("host"):
        raise AddressError(f"{text!r} is not [http[s]://]host[:port] or unix:///path")
    host = match.group("host")
    if host.startswith("["):
        try:
            import ipaddress

            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise AddressError(f"{text!r}: {host} is not an IPv6 address") from None
    elif not _HOST_NAME.fullmatch(host):
        raise AddressError(f"{text!r}: {host!r} is not a host name or IP address")
    port_text = match.group("port")
    if port_text is None:
        return Endpoint(scheme=scheme, host=host, port=DEFAULT_PORTS[scheme])
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 1 <= int(port_text) <= 65535:
        raise AddressError(f"{text!r}: port must be a number from 1 to 65535, not {port_text!r}")
    return Endpoint(scheme=scheme, host=host, port=int(port_text))
