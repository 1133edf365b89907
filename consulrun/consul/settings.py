"""How a manifest's `consul:` section reaches an agent: the settings record the manifest fills in."""

from __future__ import annotations

from dataclasses import dataclass

# The environment variables that carry a Consul credential (the consul CLI's names: an ACL token, a file holding
# one, HTTP basic auth's user:password). consulrun keeps them from a job's environment and out of unit files.
CREDENTIAL_VARIABLES = frozenset({"CONSUL_HTTP_TOKEN", "CONSUL_HTTP_TOKEN_FILE", "CONSUL_HTTP_AUTH"})


@dataclass(frozen=True)
class ConsulSettings:
    address: str | None = None
    token_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    tls_server_name: str | None = None
