"""An HTTP proxy in front of a real agent that fails chosen requests, for faults a test must land exactly.

Each rule matches a request by method and a text its body (or path) holds,
for its next `times` matches, and either refuses it (answers as a server in
an election does, without forwarding: nothing is written), stalls it (holds
it `stall_s`, past a client's timeout, as an agent holds a request while the
servers elect a leader, then refuses it) or loses the answer (forwards it, so
Consul applies it, then answers 500 instead of Consul's answer). Everything else is forwarded as it is, on loopback only.

With `strict_keys`, it also answers as Consul 1.21.5 did to a KV key outside
that release's rule (hashicorp/consul#22822, #22835): its message, with 400
(`refused_status`; the UI in #22835 printed "500: invalid key name ...", so
1.21.5 may have answered 500, which consulrun takes for Consul unavailable),
for the key in any /v1/kv/ path and for every KV operation of a /v1/txn body
(1.21.5 checked the KV endpoints; a later release may check transactions
too, so this is the stricter of the two). Nothing refused is forwarded, and
each refusal is kept in `refusals` for the test to assert there are none.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

ELECTION = b"No cluster leader"
# Consul 1.21.5's rule (agent/kvs_endpoint.go, from #22682), written out here rather than taken from
# consulrun.protocol.keys, so that a wrong rule there cannot pass for a right one. Go's `$` is the end of text.
KV_KEY_RULE = r"^[a-zA-Z0-9,_./\-?&=]+$"
KV_KEY_REFUSED = f"invalid key name, keys should respect the {json.dumps(KV_KEY_RULE)} format".encode()


def refused_keys(method: str, path: str, body: bytes) -> list[str]:
    """The keys of a request a strict Consul refuses: the one in a /v1/kv/ path (the empty one, a listing of the
    root, is not checked), and those of a transaction's KV operations."""
    where, _, _ = path.partition("?")
    if where.startswith("/v1/kv/"):
        key = urllib.parse.unquote(where[len("/v1/kv/"):])
        return [key] if key and not re.fullmatch(KV_KEY_RULE, key) else []
    if where == "/v1/txn" and method == "PUT":
        try:
            ops = json.loads(body or b"[]")
        except ValueError:
            return []
        return [str(op["KV"].get("Key")) for op in ops if isinstance(op, dict) and isinstance(op.get("KV"), dict)
                and op["KV"].get("Key") and not re.fullmatch(KV_KEY_RULE, str(op["KV"]["Key"]))]
    return []


@dataclass
class Rule:
    method: str
    holds: str  # a text the request's path or body holds
    action: str  # "refuse", "stall", "lose-answer", or "forward" (only its `then` happens first)
    times: int = 1
    then: Callable[[str], None] | None = None  # given the request; done before answering: another node's move
    hits: list[str] = field(default_factory=list)  # what it matched, for the test to check
    answer: bytes = ELECTION  # the 500's text when refused: an election by default, which callers retry
    stall_s: float = 12.0  # how long "stall" holds the request: past consulrun's 10 s client timeout


class FaultProxy:
    def __init__(self, upstream: str, strict_keys: bool = False, refused_status: int = 400) -> None:
        host, port = upstream.rsplit(":", 1)
        self.rules: list[Rule] = []
        self.strict_keys = strict_keys
        self.refused_status = refused_status
        self.refusals: list[str] = []  # "METHOD path: key" of each request refused for its key
        self.requests: list[str] = []  # "METHOD path" of every request, with strict_keys: what was exercised
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.strict_keys:
                    bad = refused_keys(self.command, self.path, body)
                    with proxy._lock:
                        proxy.requests.append(f"{self.command} {self.path}\n{body.decode('utf-8', 'replace')}")
                        proxy.refusals += [f"{self.command} {self.path}: {key}" for key in bad]
                    if bad:
                        return self._answer(proxy.refused_status, KV_KEY_REFUSED)
                rule = proxy._match(self.command, self.path, body)
                if rule and rule.then:
                    rule.then(self.path + "\n" + body.decode("utf-8", "replace"))
                if rule and rule.action == "stall":
                    time.sleep(rule.stall_s)
                if rule and rule.action in ("refuse", "stall"):
                    return self._answer(500, rule.answer)
                upstream_conn = http.client.HTTPConnection(host, int(port), timeout=600)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    upstream_conn.request(self.command, self.path, body=body or None, headers=headers)
                    answer = upstream_conn.getresponse()
                    data = answer.read()
                    if rule and rule.action == "lose-answer":  # Consul applied it; the caller never learns
                        return self._answer(500, ELECTION)
                    self._answer(answer.status, data, {k: v for k, v in answer.getheaders()
                                                       if k.lower().startswith("x-consul")})
                finally:
                    upstream_conn.close()

            def _answer(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
                try:
                    self.send_response(status)
                    for key, value in (headers or {}).items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the caller gave up waiting (a stall's aim)
                    pass

            do_GET = do_PUT = do_POST = do_DELETE = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _match(self, method: str, path: str, body: bytes) -> Rule | None:
        text = path + "\n" + body.decode("utf-8", "replace")
        with self._lock:
            for rule in self.rules:
                if rule.times > 0 and rule.method == method and rule.holds in text:
                    rule.times -= 1
                    rule.hits.append(text)
                    return rule
        return None

    def fail(self, method: str, holds: str, action: str, times: int = 1,
             then: Callable[[str], None] | None = None, answer: bytes = ELECTION) -> Rule:
        rule = Rule(method, holds, action, times, then, answer=answer)
        with self._lock:
            self.rules.append(rule)
        return rule

    def retire(self, rule: Rule) -> None:
        """`rule` matches nothing from now on: what it refused is forwarded again."""
        with self._lock:
            rule.times = 0

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
