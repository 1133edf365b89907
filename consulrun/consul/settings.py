"""How a manifest's `consul:` section reaches an agent: the settings record the manifest fills in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConsulSettings:
    address: str | None = None
    token_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    tls_server_name: str | None = None
    agent_unit: str = "consul.service"  # the agent's systemd unit, which every job's service is ordered after
