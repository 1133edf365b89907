"""Agents with ACLs (default deny, bootstrapped) and TLS material: tests of tokens and certificates.

`acl_agent` is a fixture (tests/conftest.py registers this module as a plugin): (agent, management
token).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.harness.agents import Agent, start_dev_agent, wait_for


@pytest.fixture
def acl_agent(consul_bin: str, tmp_path: Path) -> Iterator[tuple[Agent, str]]:
    agent = start_dev_agent(consul_bin, tmp_path, name="acl1",
                            extra_config={"acl": {"enabled": True, "default_policy": "deny", "down_policy": "deny"}})
    try:
        management = wait_for(lambda: requests.put(f"{agent.url}/v1/acl/bootstrap", timeout=10).json()["SecretID"],
                              30, "ACL bootstrap")
        yield agent, management
    finally:
        agent.stop()


def acl(agent: Agent, management: str, method: str, path: str, body: dict) -> dict:
    response = requests.request(method, f"{agent.url}/v1/{path}", json=body, headers={"X-Consul-Token": management},
                                timeout=10)
    response.raise_for_status()
    return response.json()


def token_file(tmp_path: Path, name: str, secret: str) -> Path:
    path = tmp_path / name
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path


def tls_material(consul_bin: str, where: Path) -> dict[str, Path]:
    where.mkdir()

    def tls(*args: str) -> None:
        subprocess.run([consul_bin, "tls", *args], cwd=where, check=True, capture_output=True)

    tls("ca", "create", "-domain", "consul")
    tls("cert", "create", "-server", "-dc", "dc1")
    tls("cert", "create", "-client", "-dc", "dc1")
    return {"ca": where / "consul-agent-ca.pem", "cert": where / "dc1-server-consul-0.pem",
            "key": where / "dc1-server-consul-0-key.pem", "client": where / "dc1-client-consul-0.pem",
            "client_key": where / "dc1-client-consul-0-key.pem"}


class RawListener:
    """A loopback TCP listener that records the bytes each connection sends, and answers nothing: what a client
    would hand an address, seen before any protocol could hide it."""

    def __init__(self) -> None:
        import socket
        import threading

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import socket

        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            with conn:
                conn.settimeout(2)
                data = b""
                try:
                    while len(data) < 65536 and (chunk := conn.recv(65536)):
                        data += chunk
                except OSError:
                    pass
                self.received.append(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close()

    def __enter__(self) -> "RawListener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
