"""A Healthchecks.io stand-in on loopback: the `monitor` fixture (tests/conftest.py registers this
module as a plugin) records every request a run's pings make.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest


class Paths(list):
    """The paths requested, in order; `.requests` has each request's (method, path, body)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str, bytes]] = []


class _Recorder(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        self.server.requests.append((self.command, self.path, self.rfile.read(length)))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"OK")

    do_POST = do_HEAD = do_GET  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def monitor() -> Iterator[tuple[str, list[str]]]:
    """A Healthchecks.io stand-in on loopback: (base URL of one check, the paths requested, in order)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.paths = Paths()  # type: ignore[attr-defined]
    server.requests = server.paths.requests  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/ping/c0ffee", server.paths  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
