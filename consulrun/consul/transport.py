"""HTTP/1.1 to the local Consul agent over one kept-alive socket: the little of HTTP that the agent speaks.

`http.client` imports the `email` package and `ssl` to parse headers we read
two of, and that import alone cost a skipping run more than its whole exchange
with the agent (bench/RESULTS.md). What this module reads is what Go's
net/http sends: a status line, header lines, then a body delimited by
Content-Length, by chunked transfer coding, or by the end of the connection.
Anything else is a malformed answer (`BadAnswer`), never a guess. TLS is the
caller's: it hands over a socket it already wrapped.
"""

from __future__ import annotations

import socket
import time

# Limits on what is read, as http.client has them for lines and headers: a broken or hostile peer cannot make us
# buffer without end. The largest answer consulrun asks for is a KV tree of a few MB.
MAX_LINE = 65536
MAX_HEADERS = 100
MAX_BODY = 256 * 1024 * 1024
_HEX = b"0123456789abcdefABCDEF"


class NoAnswer(ConnectionResetError):
    """The agent closed the connection before sending a status line (e.g. an idle connection it had dropped)."""

    def __init__(self) -> None:
        super().__init__("the agent closed the connection without an answer")


class BadAnswer(ConnectionError):
    """What came back is not the HTTP/1.x answer the agent sends: cut short, too large, or not HTTP at all."""


class Connection:
    """One HTTP/1.1 connection on a connected socket; `request` may be called again while the agent keeps it open.

    Bytes are read into our own buffer. Whatever is in it after a whole answer
    came from the agent unasked, so the connection is closed rather than let
    those bytes be read as the next request's answer.
    """

    def __init__(self, sock: socket.socket, host: str) -> None:
        self.sock: socket.socket | None = sock
        self._host = host  # the Host header: the address as the user gave it, or "localhost" for a unix socket
        self._buffer = bytearray()
        self._deadline = 0.0

    def close(self) -> None:
        sock, self.sock = self.sock, None
        self._buffer.clear()
        if sock is not None:
            sock.close()

    def request(self, method: str, target: str, body: bytes | None, headers: dict[str, str], timeout: float
                ) -> tuple[int, dict[str, str], bytes]:
        """Send one request and read its whole answer: (status, headers with lower-case names, body).

        `timeout` bounds the whole exchange, not each read: an answer trickled
        a byte at a time ends at it too (TimeoutError).
        """
        if self.sock is None:
            raise BadAnswer("the connection is closed")
        self._deadline = time.monotonic() + timeout
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._host}", "Accept-Encoding: identity"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if body is not None or method in ("PUT", "POST"):
            lines.append(f"Content-Length: {len(body or b'')}")
        self._sock(timeout).sendall("\r\n".join(lines).encode("ascii") + b"\r\n\r\n" + (body or b""))
        status, version, fields = self._head()
        while 100 <= status < 200:  # an interim answer (the agent sends none unasked): the real one follows
            status, version, fields = self._head()
        if method == "HEAD" or status in (204, 304):
            content = b""
        elif "chunked" in fields.get("transfer-encoding", "").lower():
            content = self._chunked()
        elif "content-length" in fields:
            content = self._exactly(_length(fields["content-length"]))
        else:  # delimited by the end of the connection
            content = self._rest()
            fields["connection"] = "close"
        pending = getattr(self.sock, "pending", None)  # TLS: bytes decrypted but not read yet
        if "close" in fields.get("connection", "").lower() or version == "HTTP/1.0" or self._buffer or \
                (pending is not None and pending()):
            self.close()
        return status, fields, content

    def _sock(self, timeout: float | None = None) -> socket.socket:
        """The socket, its timeout set to what is left until the deadline; TimeoutError if nothing is left."""
        assert self.sock is not None
        left = self._deadline - time.monotonic() if timeout is None else timeout
        if left <= 0:
            raise TimeoutError("timed out")
        self.sock.settimeout(left)
        return self.sock

    def _fill(self) -> bool:
        """Add what the socket has to the buffer (waiting up to the deadline); False at the end of the stream."""
        data = self._sock().recv(65536)
        self._buffer += data
        return bool(data)

    def _take(self, size: int) -> bytes:
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def _line(self) -> bytes:
        """The next line with its line break; at the end of the stream what is left (b"" if nothing)."""
        searched = 0
        while True:
            end = self._buffer.find(b"\n", searched)
            if end >= 0:
                if end >= MAX_LINE:
                    raise BadAnswer("a line of the answer is too long")
                return self._take(end + 1)
            if len(self._buffer) >= MAX_LINE:
                raise BadAnswer("a line of the answer is too long")
            searched = len(self._buffer)
            if not self._fill():
                return self._take(len(self._buffer))

    def _head(self) -> tuple[int, str, dict[str, str]]:
        first = self._line()
        if not first:
            raise NoAnswer()
        parts = first.decode("iso-8859-1").rstrip("\r\n").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not _digits(parts[1]) or len(parts[1]) != 3:
            raise BadAnswer(f"not an HTTP answer: {first[:80]!r}")
        fields: dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            line = self._line()
            if line in (b"\r\n", b"\n"):
                return int(parts[1]), parts[0], fields
            if not line.endswith(b"\n"):
                raise BadAnswer("the answer ended inside its headers")
            name, colon, value = line.decode("iso-8859-1").partition(":")
            if not colon:
                raise BadAnswer(f"not a header line: {line[:80]!r}")
            name = name.strip().lower()
            value = value.strip()
            fields[name] = f"{fields[name]}, {value}" if name in fields else value
        raise BadAnswer(f"more than {MAX_HEADERS} header lines")

    def _exactly(self, size: int, so_far: int = 0) -> bytes:
        """`size` bytes of body, `so_far` bytes already read of it (chunks)."""
        if so_far + size > MAX_BODY:
            raise BadAnswer(f"the answer is larger than {MAX_BODY // 1024 // 1024} MiB")
        while len(self._buffer) < size:
            if not self._fill():
                raise BadAnswer(f"the answer was cut short: {len(self._buffer)} of {size} bytes")
        return self._take(size)

    def _rest(self) -> bytes:
        while self._fill():
            if len(self._buffer) > MAX_BODY:
                raise BadAnswer(f"the answer is larger than {MAX_BODY // 1024 // 1024} MiB")
        return self._take(len(self._buffer))

    def _chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            line = self._line()
            if not line.endswith(b"\n"):
                raise BadAnswer("the answer was cut short in its chunks")
            size_text = line.split(b";", 1)[0].strip()
            if not size_text or size_text.strip(_HEX) or len(size_text) > 16:
                raise BadAnswer(f"not a chunk size: {line[:80]!r}")
            size = int(size_text, 16)
            if size == 0:
                break
            parts.append(self._exactly(size, total))
            total += size
            if self._line() not in (b"\r\n", b"\n"):
                raise BadAnswer("a chunk does not end where its size says")
        for _ in range(MAX_HEADERS + 1):  # trailer fields, unused, up to the blank line
            line = self._line()
            if line in (b"\r\n", b"\n"):
                return b"".join(parts)
            if not line.endswith(b"\n"):
                raise BadAnswer("the answer was cut short after its last chunk")
        raise BadAnswer(f"more than {MAX_HEADERS} trailer lines")


def _digits(text: str) -> bool:
    """ASCII digits only (str.isdigit also takes "²")."""
    return text.isascii() and text.isdigit()


def _length(text: str) -> int:
    values = {v.strip() for v in text.split(",")}
    if len(values) != 1 or not _digits(next(iter(values))):
        raise BadAnswer(f"not a Content-Length: {text[:80]!r}")
    return int(values.pop())


def connect_tcp(host: str, port: int, timeout: float) -> socket.socket:
    """A connected TCP socket to host:port (a name, an IPv4 or a bare IPv6 address), Nagle off."""
    try:  # an ASCII name or address needs no IDNA codec: leave its import (and unicodedata's) out of every run
        name: str | bytes = host.encode("ascii")
    except UnicodeEncodeError:
        name = host
    sock = socket.create_connection((name, port), timeout)  # type: ignore[arg-type]
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect_unix(path: str, timeout: float) -> socket.socket:
    """A socket connected to the agent's unix socket; a failure names the path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, exc.strerror or str(exc), path) from None
    return sock
