"""The one module that talks to Consul: configuration, the client, and error translation.

Settings come from the same variables the `consul` CLI reads, with the same
meaning; every failure becomes one of consulrun's errors, so callers never see
a `requests` or `consul` exception.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import consul
import consul.callback
import requests
import requests.adapters
import urllib3
import urllib3.connection
import urllib3.exceptions

from consulrun.errors import ConsulProtocolError, ConsulUnavailable, PermissionDenied, UsageError, os_reason


class SessionInvalid(ConsulProtocolError):
    """Consul no longer knows the session a write named (it expired or was destroyed): make a new one."""


class _ChecksRefused(Exception):
    """Consul refused a transaction for its health-check operations only (not its KV operations)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _truthy(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ConsulConfig:
    """Where and how to reach the local agent."""

    address: str = "127.0.0.1:8500"
    token: str | None = None
    token_file: str | None = None
    ssl: bool | None = None
    ssl_verify: bool = True
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    tls_server_name: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> "ConsulConfig":
        """Read CONSUL_HTTP_* / CONSUL_CACERT / CONSUL_CLIENT_* like the consul CLI; `overrides` win when not None."""
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {
            "address": env.get("CONSUL_HTTP_ADDR") or "127.0.0.1:8500",
            "token": env.get("CONSUL_HTTP_TOKEN") or None,
            "token_file": env.get("CONSUL_HTTP_TOKEN_FILE") or None,
            "ssl": _truthy(env.get("CONSUL_HTTP_SSL")),
            "ssl_verify": _truthy(env.get("CONSUL_HTTP_SSL_VERIFY")) is not False,
            "ca_file": env.get("CONSUL_CACERT") or None,
            "client_cert": env.get("CONSUL_CLIENT_CERT") or None,
            "client_key": env.get("CONSUL_CLIENT_KEY") or None,
            "tls_server_name": env.get("CONSUL_TLS_SERVER_NAME") or None,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def endpoint(self, allow_unix: bool = False) -> tuple[str, str, int]:
        """(scheme, host, port), an IPv6 host in brackets; CONSUL_HTTP_SSL decides the scheme when the address has none.

        A unix socket address gives ("http", "localhost", 80) only to a caller
        that says it routes requests through `UnixSocketAdapter(socket_path)`.
        """
        from consulrun.address import AddressError, parse_address

        try:
            where = parse_address(self.address, self.ssl)
        except AddressError as exc:
            raise UsageError(f"Consul address {exc}") from None
        if where.socket_path:
            if not allow_unix:
                raise UsageError(f"Consul address {self.address!r}: a unix socket cannot be used here; "
                                 "give the agent's HTTP address")
            return "http", "localhost", 80
        return where.scheme, where.host, where.port

    @property
    def socket_path(self) -> str | None:
        """The agent's unix socket for a `unix:///path` address, else None."""
        from consulrun.address import AddressError, parse_address

        try:
            return parse_address(self.address, self.ssl).socket_path
        except AddressError:
            return None

    def resolved_token(self, label: str | None = None) -> str | None:
        if self.token:
            return self.token
        if self.token_file:
            try:
                with open(self.token_file, encoding="utf-8") as handle:
                    if os.fstat(handle.fileno()).st_mode & 0o077:
                        logging.getLogger("consulrun").warning(
                            "%sConsul token file %s is readable by others; make it mode 0600",
                            f"{label}: " if label else "", self.token_file)
                    return handle.read().strip() or None
            except OSError as exc:
                raise UsageError(f"Consul token file {self.token_file}: {os_reason(exc)}") from None
        return None


def readable(value: dict[str, Any]) -> str:
    """JSON as stored in KV: indented, keys sorted, so it reads well in the Consul UI's editor."""
    return json.dumps(value, sort_keys=True, indent=2) + "\n"


def decoded(entry: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON object a KV entry holds (the inverse of `readable`); {} if absent, empty or not an object."""
    raw = (entry or {}).get("Value")
    try:
        value = json.loads(raw) if isinstance(raw, (str, bytes)) and raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def kv_op(verb: str, key: str, value: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """One KV operation of a Consul transaction, its value as readable JSON."""
    op: dict[str, Any] = {"Verb": verb, "Key": key, **extra}
    if value is not None:
        op["Value"] = base64.b64encode(readable(value).encode()).decode()
    return {"KV": op}


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Turn transport and API failures into consulrun errors naming `what` was being done."""
    try:
        yield
    except requests.exceptions.SSLError as exc:
        raise ConsulUnavailable(f"{what}: TLS failure talking to Consul: {_short(exc)}") from None
    except requests.exceptions.Timeout:
        raise ConsulUnavailable(f"{what}: Consul agent did not answer in time") from None
    except requests.exceptions.ConnectionError as exc:
        raise ConsulUnavailable(f"{what}: Consul agent not reachable: {_reason(exc)}") from None
    except consul.ACLPermissionDenied as exc:
        raise PermissionDenied(f"{what}: Consul ACL denied it: {_short(exc)}") from None
    except consul.ConsulException as exc:
        text = _short(exc)
        if text.startswith("5") or "No cluster leader" in text or "rpc error" in text:
            raise ConsulUnavailable(f"{what}: Consul cannot serve the request: {text}",
                                    transient=_election(text)) from None
        raise ConsulProtocolError(f"{what}: unexpected answer from Consul: {text}") from None
    except ValueError as exc:  # a body that is not the JSON Consul promises
        raise ConsulProtocolError(f"{what}: unexpected answer from Consul: {exc}") from None
    except (KeyError, IndexError, TypeError, AttributeError) as exc:  # JSON, but not of the shape Consul promises
        raise ConsulProtocolError(f"{what}: unexpected answer from Consul: {type(exc).__name__}: {_short(exc)}") from None


# What servers answer while they elect a leader or a new leader catches up, and what a client agent answers
# while it has lost every server (a one-server cluster restarting: "No known Consul servers" until serf sees
# one again); worth retrying for a while. Anything else (a bound check in critical state, an unknown
# session) is an answer, not an outage.
_ELECTION_SIGNS = ("No cluster leader", "leadership lost", "not leader", "rpc error getting client",
                   "failed to get conn", "connection refused", "i/o timeout", "EOF", "raft is already shutdown",
                   "Missing check 'serfHealth' registration", "Raft leader not found", "context deadline exceeded",
                   "No known Consul servers")


def _election(text: str) -> bool:
    return any(sign in text for sign in _ELECTION_SIGNS)


def _reason(exc: BaseException) -> str:
    """The innermost cause of a connection failure ("Connection refused"), not urllib3's retry essay."""
    text = str(exc)
    for marker in ("[Errno", "NameResolutionError", "RemoteDisconnected", "ConnectionResetError"):
        if marker in text:
            tail = text[text.index(marker):]
            return tail.split("]", 1)[-1].strip(" '\")") if marker == "[Errno" else marker
    return _short(exc)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    return text if len(text) < 300 else text[:297] + "..."


class _ServerNameAdapter(requests.adapters.HTTPAdapter):
    """Verify the agent's certificate against CONSUL_TLS_SERVER_NAME instead of the address's host."""

    def __init__(self, server_name: str) -> None:
        self.server_name = server_name
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["server_hostname"] = self.server_name
        kwargs["assert_hostname"] = self.server_name
        super().init_poolmanager(*args, **kwargs)


class _UnixSocketConnection(urllib3.connection.HTTPConnection):
    """An HTTP connection to a unix socket (CONSUL_HTTP_ADDR=unix:///path), the host name being only a label."""

    socket_path = ""

    def _new_conn(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout if isinstance(self.timeout, (int, float)) else None)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise urllib3.exceptions.NewConnectionError(self, f"{self.socket_path}: {exc.strerror}") from exc
        return sock


class UnixSocketAdapter(requests.adapters.HTTPAdapter):
    """Send a session's http:// requests to the agent's unix socket; mount it on the Client's session.

    Timeouts, retries and error types stay requests' own, so `translated`
    reports a missing socket as "Consul agent not reachable", exit 69.
    """

    def __init__(self, socket_path: str) -> None:
        super().__init__()
        self._connection = type("_Connection", (_UnixSocketConnection,), {"socket_path": socket_path})

    def get_connection_with_tls_context(self, request: Any, verify: Any, proxies: Any = None,
                                        cert: Any = None) -> urllib3.HTTPConnectionPool:
        pool = urllib3.HTTPConnectionPool("localhost")
        pool.ConnectionCls = self._connection
        return pool

    def request_url(self, request: Any, proxies: Any) -> str:
        return request.path_url


class Client:
    """The handful of Consul calls consulrun makes, each with a bounded timeout."""

    def __init__(self, config: ConsulConfig, timeout: float = 10.0, label: str | None = None) -> None:
        """`label` (a job name) starts every line this client logs."""
        scheme, host, port = config.endpoint(allow_unix=True)
        verify: bool | str = config.ca_file or config.ssl_verify
        cert = (config.client_cert, config.client_key) if config.client_cert and config.client_key else config.client_cert
        self._api = consul.Consul(host=host, port=port, scheme=scheme, verify=verify, cert=cert,
                                  connections_timeout=timeout)
        # py-consul lets CONSUL_HTTP_TOKEN override an explicit token; ours is resolved already.
        self._api.token = config.resolved_token(label)
        if scheme == "https" and config.tls_server_name:
            self._api.http.session.mount("https://", _ServerNameAdapter(config.tls_server_name))
        socket_path = config.socket_path
        if socket_path:
            self._api.http.session.mount("http://", UnixSocketAdapter(socket_path))
        self.address = f"unix://{socket_path}" if socket_path else f"{scheme}://{host}:{port}"
        self.label = label

    def _translated(self, what: str) -> Any:
        return translated(f"{what} via {self.address}")

    def node_name(self) -> str:
        # py-consul's agent.self() sends no ACL token; the raw call with our headers does.
        with self._translated("reading the local agent's node name"):
            return self._api.http.get(consul.callback.CB.json(), "/v1/agent/self",
                                      headers=self._api.prepare_headers())["Config"]["NodeName"]

    def check_kinds(self) -> dict[str, str]:
        """Check ID -> service ID ('' for node checks) of the local agent's checks."""
        with self._translated("listing the local agent's checks"):
            return {cid: c.get("ServiceID", "") for cid, c in self._api.agent.checks().items()}

    def kv_get(self, key: str, *, index: int | None = None, wait_s: float | None = None,
               consistent: bool = False, recurse: bool = False) -> tuple[int, Any]:
        wait = f"{max(1, int(wait_s * 1000))}ms" if wait_s is not None else None
        with self._translated(f"reading {key}"):
            idx, value = self._api.kv.get(key, index=index, wait=wait, recurse=recurse,
                                          consistency="consistent" if consistent else None)
            entries = value if recurse else [value]
            if value is not None and not (isinstance(entries, list) and all(
                    isinstance(e, dict) and isinstance(e.get("Key"), str) for e in entries)):
                raise ValueError(f"not a list of KV entries: {_short(ValueError(json.dumps(value)))}")
            return int(idx), value

    def kv_acquire(self, key: str, value: str, session: str) -> bool:
        with self._translated(f"acquiring {key}"):
            return bool(self._api.kv.put(key, value, acquire=session))

    def kv_release(self, key: str, value: str, session: str) -> bool:
        """Release `key`; a PUT always sets the value, so the caller says what it becomes."""
        with self._translated(f"releasing {key}"):
            return bool(self._api.kv.put(key, value, release=session))

    def txn(self, ops: list[dict[str, Any]], *, optional_checks: bool = False) -> list[dict[str, Any]] | None:
        """Apply `ops` atomically; the results, or None if Consul rolled the transaction back.

        A rollback because our session no longer exists raises SessionInvalid:
        it is neither a lost race nor Consul being unavailable. With
        `optional_checks`, a transaction refused only because of its `Check`
        operations (the external health node not registered yet, a token
        without the catalog rights) is applied again without them, with one
        warning: a job's health check must never cost the run its result.
        """
        try:
            return self._txn(ops)
        except _ChecksRefused as refused:
            if not optional_checks:
                if "Permission denied" in refused.why or "ACL not found" in refused.why:
                    raise PermissionDenied(f"applying a transaction via {self.address}: Consul ACL denied it: "
                                           f"{refused.why}") from None
                return None
            logging.getLogger("consulrun").warning(
                "%sthe job's Consul health check was not updated (%s); the result is recorded without it",
                f"{self.label}: " if self.label else "", refused.why)
            return self._txn([op for op in ops if "Check" not in op])

    def _txn(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        def answer(response: Any) -> list[dict[str, Any]] | None:
            if response.code == 409:
                found = json.loads(response.body or "{}").get("Errors") or []
                if found and all("Check" in ops[int(e.get("OpIndex") or 0)] for e in found
                                 if int(e.get("OpIndex") or 0) < len(ops)):
                    raise _ChecksRefused("; ".join(e.get("What") or "" for e in found))
                errors = [e.get("What") or "" for e in found]
                if any("invalid session" in what for what in errors):
                    raise SessionInvalid("Consul no longer knows the session: " + errors[0])
                if any("Permission denied" in what or "ACL not found" in what for what in errors):
                    raise consul.ACLPermissionDenied("; ".join(errors))
                return None
            consul.callback.CB._status(response)  # noqa: SLF001 - py-consul's own status mapping
            return json.loads(response.body).get("Results") or []

        # py-consul's txn.put sends no ACL token; the raw call with our headers does.
        with self._translated("applying a transaction"):
            return self._api.http.put(answer, "/v1/txn", headers=self._api.prepare_headers(), data=json.dumps(ops))

    def read_trees(self, prefixes: list[str], consistent: bool = False) -> dict[str, dict[str, Any]]:
        """Every key under each of `prefixes`, read in one read-only transaction (no Raft write): one snapshot."""
        ops = [{"KV": {"Verb": "get-tree", "Key": prefix}} for prefix in prefixes]
        params = {"consistent": ""} if consistent else {}

        def answer(response: Any) -> dict[str, dict[str, Any]]:
            consul.callback.CB._status(response)  # noqa: SLF001
            entries = [r["KV"] for r in json.loads(response.body).get("Results") or [] if r.get("KV")]
            for entry in entries:
                if entry.get("Value") is not None:
                    entry["Value"] = base64.b64decode(entry["Value"])
            return {e["Key"]: e for e in entries}

        with self._translated("reading " + ", ".join(prefixes)):
            return self._api.http.put(answer, "/v1/txn", params=list(params.items()),
                                      headers=self._api.prepare_headers(), data=json.dumps(ops))

    def session_create(self, *, name: str, ttl_ms: int, lock_delay_ms: int,
                       node_checks: list[str], service_checks: list[str]) -> str:
        # py-consul's session.create has no NodeChecks/ServiceChecks; use its raw call.
        body: dict[str, Any] = {"Name": name, "TTL": f"{ttl_ms // 1000}s", "LockDelay": f"{lock_delay_ms}ms",
                                "Behavior": "release", "NodeChecks": node_checks}
        if service_checks:
            body["ServiceChecks"] = [{"ID": cid} for cid in service_checks]
        with self._translated("creating a session"):
            return self._api.http.put(consul.callback.CB.json(is_id=True), "/v1/session/create",
                                      headers=self._api.prepare_headers(), data=json.dumps(body))

    def session_renew(self, session: str) -> bool:
        """True if the session still exists after renewal."""
        with self._translated("renewing the session"):
            try:
                return self._api.session.renew(session) is not None
            except consul.NotFound:
                return False

    def session_destroy(self, session: str) -> None:
        with self._translated("destroying the session"):
            self._api.session.destroy(session)

    def node_health(self, node: str) -> list[dict[str, Any]]:
        with self._translated(f"reading the health of node {node}"):
            return self._api.health.node(node)[1] or []

    def session_info(self, session: str) -> dict[str, Any] | None:
        with self._translated("reading a session"):
            return self._api.session.info(session)[1]

    def session_destroy_checked(self, session: str) -> bool:
        """Destroy a session; False if it did not exist."""
        if self.session_info(session) is None:
            return False
        self.session_destroy(session)
        return True

    # --- Reads for status/unlock/history that refuse to be blind -------------------------------------------
    # Consul filters list, session and health answers by ACLs silently, except for one header; these reads
    # turn that header into PermissionDenied, so a hidden key, session or check is never taken for absent.

    def _visible(self, what: str, path: str, params: list[tuple[str, Any]]) -> tuple[int, Any]:
        def answer(response: Any) -> tuple[int, Any]:
            consul.callback.CB._status(response)  # noqa: SLF001 - py-consul's own status mapping (403 included)
            if str(response.headers.get(ACL_FILTERED_HEADER, "")).lower() == "true":
                raise consul.ACLPermissionDenied(f"the token cannot read all of it ({ACL_FILTERED_HEADER})")
            index = int(response.headers.get("X-Consul-Index") or 0)
            return index, (None if response.code == 404 else json.loads(response.body))

        with self._translated(what):
            return self._api.http.get(answer, path, params=params, headers=self._api.prepare_headers())

    def kv_tree(self, prefix: str, *, index: int | None = None, wait_s: float | None = None) -> tuple[int, list[dict[str, Any]]]:
        """Every entry under `prefix` (values decoded to text); PermissionDenied if ACLs hid any of them."""
        params: list[tuple[str, Any]] = [("recurse", "1")]
        if index:
            params += [("index", index), ("wait", f"{max(1, int((wait_s or 300) * 1000))}ms")]
        idx, entries = self._visible(f"reading {prefix}", f"/v1/kv/{prefix}", params)
        for entry in entries or []:
            if entry.get("Value") is not None:
                entry["Value"] = base64.b64decode(entry["Value"]).decode("utf-8", "replace")
        return idx, entries or []

    def session_visible(self, session: str) -> dict[str, Any] | None:
        """The session, None if it does not exist; PermissionDenied if ACLs hid it."""
        _, found = self._visible("reading a session", f"/v1/session/info/{session}", [])
        return found[0] if found else None

    def catalog_node(self, node: str) -> dict[str, Any] | None:
        """The catalog's entry for `node` ({"Node", "Services"}), None if it is not registered."""
        _, found = self._visible(f"reading the catalog entry of node {node}", f"/v1/catalog/node/{node}", [])
        return found or None

    def catalog_register(self, registration: dict[str, Any]) -> None:
        """Register (or update) a node and its service in the catalog: one Raft write."""
        with self._translated(f"registering {registration.get('Node')} in the catalog"):
            self._api.http.put(consul.callback.CB.boolean(), "/v1/catalog/register",
                               headers=self._api.prepare_headers(), data=json.dumps(registration))

    def node_checks(self, node: str) -> list[dict[str, Any]]:
        """Every check of `node`; PermissionDenied if ACLs hid any of them."""
        _, found = self._visible(f"reading the health of node {node}", f"/v1/health/node/{node}", [])
        return found or []


ACL_FILTERED_HEADER = "X-Consul-Results-Filtered-By-ACLs"
