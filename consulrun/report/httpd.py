"""The exporter's HTTP server: one thread, a bounded number of connections, each with a deadline.

prometheus-client's own server gives every connection a thread and never
times one out: a thousand idle, half-sent requests held about 870 threads
until their client left (issue 28). Here one thread multiplexes every
connection with `selectors`; a request must arrive whole, and its answer be
taken, within `timeout_s`, or the connection is closed; when `max_connections`
are open, a new one closes the oldest. So a scraper's request, which arrives
at once, is answered however many idle connections others hold open.
Each answer closes its connection (Prometheus opens one per scrape anyway).
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_CONNECTIONS = 64
TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 16 * 1024


@dataclass
class _Conn:
    deadline: float
    received: bytearray = field(default_factory=bytearray)
    answer: bytes = b""


class MetricsServer:
    """Serves `render()` at /metrics (and /) on `listen`; `serve_forever` runs the loop in the calling thread."""

    def __init__(self, listen: tuple[str, int], render: Callable[[], bytes], content_type: str, *,
                 max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S) -> None:
        host, port = listen
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        self.sock = socket.socket(family, kind, proto)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(address)
            self.sock.listen(128)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self._render, self._content_type = render, content_type
        self._max, self._timeout = max_connections, timeout_s
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}  # in the order they were accepted: the oldest first

    def serve_forever(self) -> None:
        while True:
            self.serve_once(1.0)

    def serve_once(self, wait_s: float) -> None:
        now = time.monotonic()
        soonest = min((c.deadline for c in self._conns.values()), default=now + wait_s)
        for key, mask in self._selector.select(max(0.0, min(wait_s, soonest - now))):
            if key.fileobj is self.sock:
                self._accept()
            elif key.fileobj in self._conns:
                self._serve(key.fileobj, mask)  # type: ignore[arg-type]
        now = time.monotonic()
        for sock in [s for s, c in self._conns.items() if c.deadline <= now]:
            self._close(sock)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or the client left before we took it: the next one may do
                return
            if len(self._conns) >= self._max:
                self._close(next(iter(self._conns)))
            sock.setblocking(False)
            self._conns[sock] = _Conn(deadline=time.monotonic() + self._timeout)
            self._selector.register(sock, selectors.EVENT_READ)

    def _serve(self, sock: socket.socket, mask: int) -> None:
        conn = self._conns[sock]
        try:
            if conn.answer:
                if mask & selectors.EVENT_WRITE:
                    conn.answer = conn.answer[sock.send(conn.answer):]
                    if not conn.answer:
                        self._close(sock)
                return
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(sock)
            return
        if not data:
            self._close(sock)
            return
        conn.received += data
        end = conn.received.find(b"\r\n\r\n")
        if end < 0:
            end = conn.received.find(b"\n\n")
        if end < 0:
            if len(conn.received) > MAX_REQUEST_BYTES:
                self._close(sock)
            return
        conn.answer = self._answer(bytes(conn.received[:end]))
        conn.deadline = time.monotonic() + self._timeout
        self._selector.modify(sock, selectors.EVENT_WRITE)

    def _answer(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
        method, path = (parts[0], parts[1].split(b"?", 1)[0]) if len(parts) >= 2 else (b"", b"")
        if method not in (b"GET", b"HEAD"):
            return _response("405 Method Not Allowed", b"only GET\n", "text/plain; charset=utf-8")
        if path not in (b"/metrics", b"/"):
            return _response("404 Not Found", b"see /metrics\n", "text/plain; charset=utf-8")
        body = self._render()
        return _response("200 OK", body, self._content_type, head_only=method == b"HEAD")

    def _close(self, sock: socket.socket) -> None:
        self._conns.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def close(self) -> None:
        for sock in list(self._conns):
            self._close(sock)
        self._selector.close()
        self.sock.close()


def _response(status: str, body: bytes, content_type: str, head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode("ascii")
    return head + (b"" if head_only else body)
