"""The HTTP/1.1 the client speaks to the agent (consulrun/consul/transport.py).

The real agent proves the shapes Go's net/http sends (a short answer with
Content-Length, a long one in chunks, a kept-alive connection reused); a
local socket that answers with bytes the test writes proves each malformed or
cut-short answer is an error that names what was wrong, never a body guessed
at, and that the client's error lines say the same as before.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from consulrun.consul import transport
from consulrun.consul.client import Client, ConsulConfig
from consulrun.errors import ConsulUnavailable


def test_short_and_chunked_answers_from_the_agent_and_one_connection_for_both(consul) -> None:
    host, port = consul.http_addr.rsplit(":", 1)
    consul.api("PUT", "kv/big/one", data="x")
    for n in range(60):  # a tree listing well past Go's 2 KiB before it switches to chunked coding
        consul.api("PUT", f"kv/big/k{n:03d}", data="v" * 40)
    conn = transport.Connection(transport.connect_tcp(host, int(port), 10), consul.http_addr)
    try:
        status, fields, body = conn.request("GET", "/v1/kv/big/one", None, {}, 10)
        assert status == 200 and "content-length" in fields and "transfer-encoding" not in fields
        assert json.loads(body)[0]["Key"] == "big/one"
        first = conn.sock
        status, fields, body = conn.request("GET", "/v1/kv/big/?recurse=1", None, {}, 10)
        assert status == 200 and fields.get("transfer-encoding") == "chunked", fields
        assert len(json.loads(body)) == 61
        status, fields, body = conn.request("PUT", "/v1/kv/big/put", b"written", {}, 10)
        assert (status, body.strip()) == (200, b"true")
        assert conn.sock is first  # kept alive through all three
        status, _, body = conn.request("GET", "/v1/kv/missing", None, {}, 10)
        assert status == 404 and body == b""
    finally:
        conn.close()
    assert consul.api("GET", "kv/big/put?raw").text == "written"


class Scripted:
    """A local server that answers the requests of each connection with the answers given, in turn, then closes.

    With `pace`, each answer is sent a byte at a time, `pace` seconds apart.
    """

    def __init__(self, *answers: bytes, pace: float = 0.0) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.answers = answers
        self.pace = pace
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                peer, _ = self.server.accept()
            except OSError:
                return
            with peer:
                try:
                    self._converse(peer)
                except OSError:
                    pass

    def _converse(self, peer: socket.socket) -> None:
        data = b""
        for answer in self.answers:
            while b"\r\n\r\n" not in data:
                chunk = peer.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, data = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(data) < length:
                data += peer.recv(65536)
            self.requests.append(head + b"\r\n\r\n" + data[:length])
            data = data[length:]
            if not self.pace:
                peer.sendall(answer)
            for n in range(len(answer) if self.pace else 0):
                peer.sendall(answer[n:n + 1])
                time.sleep(self.pace)

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def scripted() -> Iterator[type[Scripted]]:
    made: list[Scripted] = []

    def make(*answers: bytes, **kwargs: float) -> Scripted:
        made.append(Scripted(*answers, **kwargs))
        return made[-1]

    yield make  # type: ignore[misc]
    for server in made:
        server.close()


def ask(server: Scripted, method: str = "GET", body: bytes | None = None, timeout: float = 10
        ) -> tuple[int, dict[str, str], bytes]:
    conn = transport.Connection(transport.connect_tcp("127.0.0.1", server.port, 10), f"127.0.0.1:{server.port}")
    try:
        return conn.request(method, "/v1/kv/a%20b?index=3", body, {"X-Consul-Token": "secret"}, timeout)
    finally:
        conn.close()


def test_the_request_sent_is_plain_http_1_1_with_host_token_and_length(scripted) -> None:
    server = scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert ask(server, "PUT", b'{"a":1}') == (200, {"content-length": "2"}, b"ok")
    assert server.requests == [f"PUT /v1/kv/a%20b?index=3 HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                               "Accept-Encoding: identity\r\nX-Consul-Token: secret\r\nContent-Length: 7\r\n\r\n"
                               '{"a":1}'.encode()]
    ask(server, "PUT")  # a PUT without a body still says so: the agent waits for no body
    assert b"Content-Length: 0\r\n" in server.requests[1]
    ask(server, "GET")
    assert b"Content-Length" not in server.requests[2]


@pytest.mark.parametrize("answer, body", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\nA\r\n0123456789\r\n0\r\nX-T: 1\r\n\r\n",
     b"abc0123456789"),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", b"until the end"),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nyes", b"yes"),
    (b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n", b""),
    (b"HTTP/1.1 200 OK\r\ncontent-LENGTH: 4\r\nX-Consul-Index: 7\r\n\r\nfour", b"four"),
])
def test_each_way_an_answer_may_end(scripted, answer: bytes, body: bytes) -> None:
    assert ask(scripted(answer))[2] == body


@pytest.mark.parametrize("answer, said", [
    (b"", "the agent closed the connection without an answer"),
    (b"SSH-2.0-OpenSSH_9.2\r\n", "not an HTTP answer"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP answer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "cut short: 5 of 10 bytes"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "not a Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", "not a Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3", "ended inside its headers"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "not a header line"),
    (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n", "more than 100 header lines"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000 + b"\r\n\r\n", "too long"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "not a chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n", "not a chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "cut short: 2 of 5 bytes"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n", "does not end where its size says"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n", "cut short in its chunks"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n", "cut short after its last chunk"),
    (b"HTTP/1.1 2\xb20 OK\r\n\r\n", "not an HTTP answer"),  # digits beyond ASCII (str.isdigit takes them)
    (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", "not a Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n0\r\n\r\n", "not a chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n", "not a chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 17 + b"\r\n", "not a chunk size"),
    # Sizes no memory holds end as an error, not a MemoryError or OverflowError from reading them.
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999\r\n\r\nab", "larger than 256 MiB"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7fffffffffffffff\r\n", "larger than 256 MiB"),
])
def test_a_malformed_or_cut_short_answer_is_an_error_that_says_what(scripted, answer: bytes, said: str) -> None:
    with pytest.raises(ConnectionError, match=said):
        ask(scripted(answer))


def test_bytes_after_an_answer_are_never_read_as_the_next_answer(scripted) -> None:
    """The same answer twice in one segment: the second copy was unasked for, so the connection is dropped and
    the next request, on a new connection, gets its own answer."""
    first = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"
    server = scripted(first + first, b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond")
    conn = transport.Connection(transport.connect_tcp("127.0.0.1", server.port, 10), "here")
    assert conn.request("GET", "/one", None, {}, 10)[2] == b"first"
    assert conn.sock is None
    stray = scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]\r\n",
                     b'HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}')
    client = Client(ConsulConfig(address=f"127.0.0.1:{stray.port}"))
    assert client.kv_get("a", recurse=True)[1] == []
    assert client._local.conn.sock is None  # a stray line break after the body: not reused either
    assert client.kv_get("b", recurse=True)[1] == []  # answered on a new connection, the first answer again


def test_an_answer_trickled_a_byte_at_a_time_ends_at_the_timeout_not_after_it(scripted) -> None:
    body = b"x" * 200
    server = scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 200\r\n\r\n" + body, pace=0.05)  # 12 s in all
    with pytest.raises(TimeoutError):
        ask(server, timeout=1)


def test_the_client_reports_a_bad_answer_as_the_agent_unreachable_and_drops_the_connection(scripted) -> None:
    server = scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
    client = Client(ConsulConfig(address=f"127.0.0.1:{server.port}"))
    with pytest.raises(ConsulUnavailable) as caught:
        client.kv_get("a")
    assert str(caught.value) == (f"reading a via http://127.0.0.1:{server.port}: Consul agent not reachable: "
                                 "the answer was cut short: 5 of 10 bytes")
    assert client._local.conn is None
    silent = scripted(b"")
    with pytest.raises(ConsulUnavailable, match="the agent closed the connection without an answer$"):
        Client(ConsulConfig(address=f"127.0.0.1:{silent.port}")).kv_get("a")


def test_a_host_name_connects_without_loading_the_idna_codec_http_client_or_ssl(consul) -> None:
    import subprocess
    import sys

    port = consul.http_addr.rsplit(":", 1)[1]
    probe = ("import sys; from consulrun.consul.client import Client, ConsulConfig; "
             f"print(Client(ConsulConfig(address='localhost:{port}')).kv_get('nothing')[1]); "
             "print('encodings.idna' in sys.modules, 'http.client' in sys.modules, 'ssl' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:2] == ["None", "False False False"], done.stderr
