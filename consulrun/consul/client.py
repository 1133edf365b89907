"""The one module that talks to Consul: configuration, the client, and error translation.

Settings come from the same variables the `consul` CLI reads, with the same
meaning; every failure becomes one of consulrun's errors, so callers never see
a socket, TLS or HTTP exception. The transport is `transport`, one kept-alive
connection per thread: every timer tick on every node starts `consulrun run`,
and importing `requests` and py-consul, or even `http.client`, cost more than
the whole exchange with the agent (docs/development.md, Dependencies). `ssl` is imported
only when the address is https.

Why this module is long: it is one method per Consul endpoint the tools use (KV, sessions,
transactions, health, catalog, agent), all answering in the same few error kinds; split by endpoint, the
error translation every method shares would be imported by each piece anyway.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from consulrun.consul import transport
from consulrun.consul.values import decode
from consulrun.errors import ConsulProtocolError, ConsulUnavailable, PermissionDenied, UsageError, os_reason
from consulrun.records import record

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    import ssl
    from typing import Any

    from consulrun.consul.settings import ConsulSettings


class SessionInvalid(ConsulProtocolError):
    """Consul no longer knows the session a write named (it expired or was destroyed): make a new one."""


class _ChecksRefused(Exception):
    """Consul refused a transaction for its health-check operations only (not its KV operations)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


_GO_BOOLS = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True,
             "0": False, "f": False, "F": False, "FALSE": False, "false": False, "False": False}


def _go_bool(env: dict[str, str], name: str) -> bool | None:
    """A boolean variable as the consul CLI reads it (Go's strconv.ParseBool); None if unset or empty.

    Where the CLI only warns about another value and goes on (for
    CONSUL_HTTP_SSL_VERIFY=yes it then skips verifying the agent's
    certificate), this refuses it: a setting about TLS is never guessed.
    """
    value = env.get(name)
    if value is None or value == "":
        return None
    if value not in _GO_BOOLS:
        raise UsageError(f"{name}={value[:40]!r} is not a boolean as the consul CLI reads one "
                         "(1, t, true, TRUE, True or 0, f, false, FALSE, False)")
    return _GO_BOOLS[value]


DEFAULT_PORT = 8500  # the agent's HTTP port, as the consul CLI assumes it


@record
class ConsulConfig:
    """Where and how to reach the local agent."""

    address: str = "127.0.0.1:8500"
    token: str | None = None
    token_file: str | None = None
    ssl: bool | None = None
    ssl_verify: bool = True
    ca_file: str | None = None
    ca_path: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    tls_server_name: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> "ConsulConfig":
        """Read CONSUL_HTTP_* / CONSUL_CACERT / CONSUL_CAPATH / CONSUL_CLIENT_* like the consul CLI (api/api.go's
        defaultConfig); `overrides` win when not None."""
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {
            "address": env.get("CONSUL_HTTP_ADDR") or "127.0.0.1:8500",
            "token": env.get("CONSUL_HTTP_TOKEN") or None,
            "token_file": env.get("CONSUL_HTTP_TOKEN_FILE") or None,
            "ssl": _go_bool(env, "CONSUL_HTTP_SSL"),
            "ssl_verify": _go_bool(env, "CONSUL_HTTP_SSL_VERIFY") is not False,
            "ca_file": env.get("CONSUL_CACERT") or None,
            "ca_path": env.get("CONSUL_CAPATH") or None,
            "client_cert": env.get("CONSUL_CLIENT_CERT") or None,
            "client_key": env.get("CONSUL_CLIENT_KEY") or None,
            "tls_server_name": env.get("CONSUL_TLS_SERVER_NAME") or None,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def endpoint(self, allow_unix: bool = False) -> tuple[str, str, int]:
        """(scheme, host, port), an IPv6 host in brackets; with CONSUL_HTTP_SSL true the scheme is https even where
        the address says http:// (as the consul CLI: never plain HTTP once TLS was asked for).

        A unix socket address gives ("http", "localhost", 80) only to a caller
        that says it sends its requests to `socket_path` itself (the Client does).
        """
        from consulrun.consul.address import AddressError, parse_address

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
        from consulrun.consul.address import AddressError, parse_address

        try:
            return parse_address(self.address, self.ssl).socket_path
        except AddressError:
            return None

    def resolved_token(self, label: str | None = None) -> str | None:
        """The ACL token to send: the token file's (--token-file, CONSUL_HTTP_TOKEN_FILE) if it holds one, else
        CONSUL_HTTP_TOKEN; None if neither. The file wins, as in the consul CLI (api.go: "If the TokenFile is set,
        always use that, even if a Token is configured").

        A token that cannot travel in an HTTP header (a line break, a control
        or non-ASCII character) is refused without being shown: it is a secret
        and error lines end up in the journal.
        """
        from_file = _token_from_file(self.token_file, label) if self.token_file else None
        if from_file:
            return from_file
        if self.token:
            return _sendable(self.token, "the Consul token in CONSUL_HTTP_TOKEN")
        return None


def _token_from_file(path: str, label: str | None) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            if os.fstat(handle.fileno()).st_mode & 0o077:
                logging.getLogger("consulrun").warning(
                    "%sConsul token file %s is readable by others; make it mode 0600", f"{label}: " if label else "",
                    path)
            token = handle.read().strip() or None
    except (OSError, UnicodeDecodeError) as exc:
        reason = os_reason(exc) if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"Consul token file {path}: {reason}") from None
    return _sendable(token, f"Consul token file {path}") if token else None


def _sendable(token: str, where: str) -> str:
    if all(0x21 <= ord(ch) <= 0x7E for ch in token):
        return token
    raise UsageError(f"{where}: the token holds a space, a line break or a character outside printable ASCII, "
                     "which an HTTP header cannot carry (the token is not shown)")


def readable(value: dict[str, Any]) -> str:
    """JSON as stored in KV: indented, keys sorted, so it reads well in the Consul UI's editor."""
    return json.dumps(value, sort_keys=True, indent=2) + "\n"


def decoded(entry: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON object a KV entry holds (the inverse of `readable`); {} if absent or empty.

    Anything else is MalformedValue (exit 65) naming the key: every reader of
    KV values comes through here, and `values` is the one place that says what
    a value may be.
    """
    return decode(entry)


def kv_op(verb: str, key: str, value: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """One KV operation of a Consul transaction, its value as readable JSON."""
    op: dict[str, Any] = {"Verb": verb, "Key": key, **extra}
    if value is not None:
        op["Value"] = base64.b64encode(readable(value).encode()).decode()
    return {"KV": op}


class ConsulAnswer(Exception):
    """An HTTP status that is not success: `code` and the body Consul sent, for `translated` to judge."""

    def __init__(self, code: int, body: str) -> None:
        super().__init__(f"{code} {body.strip()}")
        self.code = code
        self.body = body.strip()


@contextmanager
def translated(what: str, read_only: bool = False) -> Iterator[None]:
    """Turn transport and API failures into consulrun errors naming `what` was being done. No answer in time
    is transient only for a read (`read_only`): a write the agent still holds may be applied after the caller
    has looked and given up, so retrying it could meet its own claim as someone else's."""
    try:
        yield
    except OSError as exc:
        if _tls_failure(exc):
            raise ConsulUnavailable(f"{what}: TLS failure talking to Consul: {_short(exc)}") from None
        if isinstance(exc, TimeoutError):  # an agent holds a request while the servers elect: a read may retry
            raise ConsulUnavailable(f"{what}: Consul agent did not answer in time", transient=read_only) from None
        raise ConsulUnavailable(f"{what}: Consul agent not reachable: {_reason(exc)}",
                                not_listening=_not_listening(exc)) from None
    except ConsulAnswer as exc:
        if exc.code == 403:
            raise PermissionDenied(f"{what}: Consul ACL denied it: {_short(ValueError(exc.body))}") from None
        text = _short(exc)
        if exc.code >= 500 or "No cluster leader" in text or "rpc error" in text:
            raise ConsulUnavailable(f"{what}: Consul cannot serve the request: {text}",
                                    transient=_election(text)) from None
        raise ConsulProtocolError(f"{what}: unexpected answer from Consul: {text}") from None
    except ValueError as exc:  # a body that is not the JSON Consul promises
        raise ConsulProtocolError(f"{what}: unexpected answer from Consul: {_short(exc)}") from None
    except (KeyError, IndexError, TypeError, AttributeError) as exc:  # JSON, but not of the shape Consul promises
        raise ConsulProtocolError(f"{what}: unexpected answer from Consul: {type(exc).__name__}: {_short(exc)}") from None


# What servers answer while they elect a leader or a new leader catches up, and what a client agent answers
# while it has lost every server (a one-server cluster restarting: "No known Consul servers" until serf sees
# one again), and what an agent that has just started answers until the servers have its node in the catalog
# ("Missing node registration": a session needs the node's registration), and what they answer for a node that
# has just come back (a partition healed, an agent restarted) until its serfHealth passes again; worth retrying
# for a while. Anything else (a bound check of the job's in critical state, an unknown session) is an answer,
# not an outage.
SERF_CRITICAL = "Check 'serfHealth' is in critical state"
_ELECTION_SIGNS = ("No cluster leader", "leadership lost", "not leader", "rpc error getting client",
                   "failed to get conn", "connection refused", "i/o timeout", "EOF", "raft is already shutdown",
                   "Missing check 'serfHealth' registration", "Raft leader not found", "context deadline exceeded",
                   "No known Consul servers", "Missing node registration", SERF_CRITICAL)


def _check_hint(why: str) -> str:
    """What Consul's refusal of a health-check write means here, and what cures it. The prefix's external
    node is registered by the watchdog's first run: until then Consul knows no node to hold the check. Any
    other refusal is the token's: the policy for the manifest has the rules."""
    if "Missing node registration" in why:
        return (" (the prefix's health-check node is not registered yet; the watchdog registers it on its "
                "first run: consulrun-_watchdog.timer, once a minute on one node, or `consulrun watchdog` by "
                "hand)")
    return " (a token without the rules for it: `consulrun acl-policy MANIFEST --node NODE` prints them)"


def _not_listening(exc: OSError) -> bool:
    """Whether nothing listens at the agent's address (refused; a unix socket not created): what an agent still
    starting answers, and one that is down; the caller judges which (at start: whether the system has just
    booted). A timeout, a TLS failure or an unreachable host is neither."""
    return exc.errno in (errno.ECONNREFUSED, errno.ENOENT)


def _election(text: str) -> bool:
    return any(sign in text for sign in _ELECTION_SIGNS)


def _tls_failure(exc: BaseException) -> bool:
    """Whether `exc` is ssl's; ssl is imported only by an https client, so without it nothing can be."""
    ssl = sys.modules.get("ssl")
    return ssl is not None and isinstance(exc, ssl.SSLError)


def _reason(exc: BaseException) -> str:
    """The cause of a connection failure in a few words ("connection refused"), not Python's `[Errno 111] ...`."""
    if isinstance(exc, OSError) and (exc.strerror or exc.errno):
        where = f"{exc.filename}: " if exc.filename else ""
        return where + os_reason(exc)
    return _short(exc) or type(exc).__name__


def _short(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    return text if len(text) < 300 else text[:297] + "..."


def _tls_context(config: ConsulConfig) -> ssl.SSLContext:
    """The agent's certificate checked, unless CONSUL_HTTP_SSL_VERIFY=false, against CONSUL_CACERT, else every
    certificate under CONSUL_CAPATH, else the system's CAs: go-rootcerts' order, which the consul CLI uses."""
    import ssl

    if bool(config.client_cert) != bool(config.client_key):  # api.go: "both client cert and client key must be ..."
        raise UsageError("Consul TLS: give both a client certificate and its key (CONSUL_CLIENT_CERT and "
                         "CONSUL_CLIENT_KEY), or neither")
    try:
        from_path = config.ssl_verify and not config.ca_file and config.ca_path
        context = ssl.create_default_context(cafile=config.ca_file if config.ssl_verify else None,
                                             cadata=_ca_path_pem(config.ca_path) if from_path else None)
        if not config.ssl_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if config.client_cert:
            context.load_cert_chain(config.client_cert, config.client_key)
    except (OSError, ssl.SSLError) as exc:
        files = ", ".join(f for f in (config.ca_file, config.ca_path, config.client_cert, config.client_key) if f)
        reason = _short(exc) if isinstance(exc, ssl.SSLError) else os_reason(exc)
        raise UsageError(f"Consul TLS files ({files}): {reason}") from None
    return context


def _server_name(config: ConsulConfig) -> str | None:
    """CONSUL_TLS_SERVER_NAME without a port if it has one (`server.dc1.consul:8501`), as api.go's
    SetupTLSConfig strips it; an IPv6 literal loses its brackets with the port, as net.SplitHostPort has it."""
    name = config.tls_server_name
    if name and name.rfind(":") > name.rfind("]"):
        name = name[:name.rfind(":")]
        name = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    return name or None


def _ca_path_pem(path: str) -> str:
    """Every file under CONSUL_CAPATH, walked as go-rootcerts walks it: sub-folders too, and any file name (OpenSSL's
    own capath reads only c_rehash's hashed names). Each must hold a PEM certificate, or it is refused by name."""
    if not os.path.isdir(path):
        raise UsageError(f"Consul CA path {path}: not a directory")
    texts = []
    for folder, subfolders, names in os.walk(path, onerror=_raise):
        subfolders.sort()
        for name in sorted(names):
            where = os.path.join(folder, name)
            try:
                with open(where, encoding="ascii", errors="replace") as handle:
                    text = handle.read()
            except OSError as exc:
                raise UsageError(f"Consul CA path {path}: {where}: {os_reason(exc)}") from None
            if "-----BEGIN CERTIFICATE-----" not in text:
                raise UsageError(f"Consul CA path {path}: {where} holds no PEM certificate")
            texts.append(text)
    if not texts:
        raise UsageError(f"Consul CA path {path}: no certificate in it")
    return "\n".join(texts)


def _raise(exc: OSError) -> None:
    raise UsageError(f"Consul CA path {exc.filename}: {os_reason(exc)}")


Response = tuple[int, dict[str, str], str]  # headers with lower-case names


_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")


def _quoted(text: str, safe: str = "") -> str:
    """`text` percent-encoded as UTF-8 for a URL, as urllib.parse.quote does (whose import every run would pay)."""
    keep = _UNRESERVED.union(safe.encode("ascii"))
    return "".join(chr(b) if b in keep else f"%{b:02X}" for b in text.encode("utf-8"))


def _blocking(index: int, wait_s: float | None) -> tuple[list[tuple[str, Any]], float]:
    """A blocking read's parameters from `index`, and the longest it may wait (None: Consul's own 5 minutes)."""
    wait = 300.0 if wait_s is None else wait_s
    return [("index", index), ("wait", f"{max(1, int(wait * 1000))}ms")], wait


class Client:
    """The handful of Consul calls consulrun makes, each with a bounded timeout."""

    def __init__(self, config: ConsulConfig, timeout: float = 10.0, label: str | None = None) -> None:
        """`label` (a job name) starts every line this client logs."""
        scheme, host, port = config.endpoint(allow_unix=True)
        self._config = config
        self._scheme, self._host, self._port = scheme, host.strip("[]"), port
        self._host_header = f"{host}:{port}"  # an IPv6 host keeps its brackets here
        self._socket_path = config.socket_path
        self._timeout = timeout
        self._context: ssl.SSLContext | None = None
        self._local = threading.local()  # one connection per thread: the watcher's blocking reads beside the main's
        self._token = config.resolved_token(label)
        self.address = f"unix://{self._socket_path}" if self._socket_path else f"{scheme}://{host}:{port}"
        self.label = label
        self._ends_at: float | None = None  # time.monotonic() past which no request waits (see `end_by`)

    def end_by(self, seconds: float) -> None:
        """No request from now on waits past `seconds` from now (a stopping wrapper's TimeoutStopSec=): one
        that would is cut short, as an agent not answering in time is."""
        self._ends_at = time.monotonic() + seconds

    def _translated(self, what: str, read_only: bool = False) -> Any:
        return translated(f"{what} via {self.address}", read_only)

    def _connection(self, timeout: float) -> transport.Connection:
        conn: transport.Connection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            # The agent may have closed an idle connection; reading that now beats failing a write on it later.
            # poll(2), not select(2): a descriptor may be numbered 1024 or more.
            idle = select.poll()
            idle.register(conn.sock, select.POLLIN)
            if idle.poll(0):
                conn.close()
            else:
                return conn
        if self._socket_path:
            conn = transport.Connection(transport.connect_unix(self._socket_path, timeout), "localhost")
        else:
            if self._scheme == "https" and self._context is None:
                self._context = _tls_context(self._config)
            sock = transport.connect_tcp(self._host, self._port, timeout)
            try:
                if self._context is not None:
                    sock = self._context.wrap_socket(sock, server_hostname=_server_name(self._config) or self._host)
            except BaseException:
                sock.close()
                raise
            conn = transport.Connection(sock, self._host_header)
        self._local.conn = conn
        return conn

    def _call(self, method: str, path: str, params: list[tuple[str, Any]] | None = None, body: str | bytes | None = None,
              *, wait_s: float | None = None, allow_404: bool = True) -> Response:
        """One request; (status, headers, body text). A status other than 2xx (and 404 if allowed) raises ConsulAnswer.

        A blocking read (`wait_s`) may take its wait plus Consul's jitter of up
        to a sixteenth of it before answering; the timeout allows for that.
        """
        url = _quoted(path, "/:")
        if params:
            url += "?" + "&".join(f"{_quoted(str(k))}={_quoted(str(v))}" for k, v in params)
        headers = {"X-Consul-Token": self._token} if self._token else {}
        if isinstance(body, str):
            body = body.encode("utf-8")
        timeout = self._timeout + (wait_s + wait_s / 16 if wait_s is not None else 0)
        if self._ends_at is not None:
            timeout = min(timeout, self._ends_at - time.monotonic())
            if timeout <= 0:
                raise TimeoutError("no time left for it")
        conn = self._connection(timeout)
        try:
            code, fields, content = conn.request(method, url, body, headers, timeout)
        except BaseException:
            conn.close()
            self._local.conn = None
            raise
        text = content.decode("utf-8", "replace")
        if not (200 <= code < 300 or (code == 404 and allow_404)):
            raise ConsulAnswer(code, text)
        return code, fields, text

    def _json(self, method: str, path: str, params: list[tuple[str, Any]] | None = None, body: str | None = None,
              **kwargs: Any) -> tuple[int, Any]:
        """(X-Consul-Index, the decoded JSON body; None for a 404)."""
        code, headers, text = self._call(method, path, params, body, **kwargs)
        return int(headers.get("x-consul-index") or 0), (None if code == 404 else json.loads(text))

    def node_name(self) -> str:
        return self.node_identity()[0]

    def node_identity(self) -> tuple[str, dict[str, str]]:
        """The local agent's node name and node meta: one read the agent answers itself."""
        with self._translated("reading the local agent's node name", read_only=True):
            answer = self._json("GET", "/v1/agent/self")[1]
            return answer["Config"]["NodeName"], {str(k): str(v) for k, v in (answer.get("Meta") or {}).items()}

    def node_metas(self) -> tuple[dict[str, dict[str, str]], bool]:
        """Every catalog node's meta by node name (a stale read: any server answers, no leader needed), and whether
        the token's ACLs hid some nodes."""
        with self._translated("listing the catalog's nodes", read_only=True):
            code, headers, text = self._call("GET", "/v1/catalog/nodes", [("stale", "")])
            return ({n["Node"]: {str(k): str(v) for k, v in (n.get("Meta") or {}).items()} for n in json.loads(text)},
                    _acl_filtered(headers))

    def failing_nodes(self) -> set[str]:
        """The nodes whose serfHealth check is critical (their agent is gone or unreachable), by a stale read."""
        with self._translated("listing the critical checks", read_only=True):
            checks = self._json("GET", "/v1/health/state/critical", [("stale", "")])[1] or []
            return {c["Node"] for c in checks if c.get("CheckID") == "serfHealth"}

    def alive_members(self) -> tuple[list[tuple[str, bool]], bool]:
        """The members the local agent's gossip sees alive, as (name, is a server), and whether the ACL token hid
        some (Consul drops them from the list silently): the agent's own view, answered without a server or Raft."""
        with self._translated("listing the cluster's members", read_only=True):
            code, headers, text = self._call("GET", "/v1/agent/members")
            members = json.loads(text) if code != 404 else []
            return ([(m["Name"], (m.get("Tags") or {}).get("role") == "consul") for m in members
                     if m.get("Status") == 1], _acl_filtered(headers))

    def check_kinds(self) -> dict[str, str]:
        """Check ID -> service ID ('' for node checks) of the local agent's checks."""
        with self._translated("listing the local agent's checks", read_only=True):
            return {cid: c.get("ServiceID", "") for cid, c in self._json("GET", "/v1/agent/checks")[1].items()}

    def kv_get(self, key: str, *, index: int | None = None, wait_s: float | None = None,
               consistent: bool = False, recurse: bool = False) -> tuple[int, Any]:
        params, blocking = _blocking(index, wait_s) if index is not None else ([], None)
        if recurse:
            params.append(("recurse", "1"))
        if consistent:
            params.append(("consistent", "1"))
        with self._translated(f"reading {key}", read_only=True):
            idx, entries = self._json("GET", f"/v1/kv/{key}", params, wait_s=blocking)
            if entries is not None and not (isinstance(entries, list) and all(
                    isinstance(e, dict) and isinstance(e.get("Key"), str) for e in entries)):
                raise ValueError(f"not a list of KV entries: {_short(ValueError(json.dumps(entries)))}")
            for entry in entries or []:
                if entry.get("Value") is not None:
                    entry["Value"] = base64.b64decode(entry["Value"])
            return idx, (entries if recurse else (entries[0] if entries else None))

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
                "%sthe job's Consul health check was not updated (%s); the result is recorded without it%s",
                f"{self.label}: " if self.label else "", refused.why, _check_hint(refused.why))
            return self._txn([op for op in ops if "Check" not in op])

    def _txn(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        with self._translated("applying a transaction"):
            try:
                _, _, text = self._call("PUT", "/v1/txn", body=json.dumps(ops))
            except ConsulAnswer as answer:
                if answer.code != 409:
                    raise
                found = json.loads(answer.body or "{}").get("Errors") or []
                if found and all("Check" in ops[int(e.get("OpIndex") or 0)] for e in found
                                 if int(e.get("OpIndex") or 0) < len(ops)):
                    raise _ChecksRefused("; ".join(e.get("What") or "" for e in found)) from None
                errors = [e.get("What") or "" for e in found]
                if any("invalid session" in what for what in errors):
                    raise SessionInvalid("Consul no longer knows the session: " + errors[0]) from None
                if any("Permission denied" in what or "ACL not found" in what for what in errors):
                    raise ConsulAnswer(403, "; ".join(errors)) from None
                return None
            return json.loads(text).get("Results") or []

    def read_trees(self, prefixes: list[str], consistent: bool = False) -> dict[str, dict[str, Any]]:
        """Every key under each of `prefixes`, read in one read-only transaction (no Raft write): one snapshot."""
        ops = [{"KV": {"Verb": "get-tree", "Key": prefix}} for prefix in prefixes]
        with self._translated("reading " + ", ".join(prefixes), read_only=True):
            _, found = self._json("PUT", "/v1/txn", [("consistent", "")] if consistent else None, json.dumps(ops))
            entries = [r["KV"] for r in found.get("Results") or [] if r.get("KV")]
            for entry in entries:
                if entry.get("Value") is not None:
                    entry["Value"] = base64.b64decode(entry["Value"])
            return {e["Key"]: e for e in entries}

    def session_create(self, *, name: str, ttl_ms: int, lock_delay_ms: int,
                       node_checks: list[str], service_checks: list[str]) -> str:
        body: dict[str, Any] = {"Name": name, "TTL": f"{ttl_ms // 1000}s", "LockDelay": f"{lock_delay_ms}ms",
                                "Behavior": "release", "NodeChecks": node_checks}
        if service_checks:
            body["ServiceChecks"] = [{"ID": cid} for cid in service_checks]
        with self._translated("creating a session"):
            return self._json("PUT", "/v1/session/create", body=json.dumps(body), allow_404=False)[1]["ID"]

    def session_renew(self, session: str) -> bool:
        """True if the session still exists after renewal."""
        with self._translated("renewing the session"):
            code, _, _ = self._call("PUT", f"/v1/session/renew/{session}")
            return code != 404

    def session_destroy(self, session: str) -> None:
        with self._translated("destroying the session"):
            self._call("PUT", f"/v1/session/destroy/{session}", allow_404=False)

    def session_info(self, session: str) -> dict[str, Any] | None:
        with self._translated("reading a session", read_only=True):
            found = self._json("GET", f"/v1/session/info/{session}")[1]
            return found[0] if found else None

    def session_destroy_checked(self, session: str) -> bool:
        """Destroy a session; False if it did not exist."""
        if self.session_info(session) is None:
            return False
        self.session_destroy(session)
        return True

    # --- Reads for status/unlock/history that refuse to be blind -------------------------------------------
    # Consul filters list, session and health answers by ACLs silently, except for one header; these reads
    # turn that header into PermissionDenied, so a hidden key, session or check is never taken for absent.

    def _visible(self, what: str, path: str, params: list[tuple[str, Any]],
                 wait_s: float | None = None) -> tuple[int, Any]:
        with self._translated(what, read_only=True):
            code, headers, text = self._call("GET", path, params, wait_s=wait_s)
            if _acl_filtered(headers):
                raise ConsulAnswer(403, f"the token cannot read all of it ({ACL_FILTERED_HEADER})")
            return int(headers.get("x-consul-index") or 0), (None if code == 404 else json.loads(text))

    def kv_tree(self, prefix: str, *, index: int | None = None, wait_s: float | None = None) -> tuple[int, list[dict[str, Any]]]:
        """Every entry under `prefix` (values decoded to text); PermissionDenied if ACLs hid any of them."""
        params, blocking = _blocking(index, wait_s or None) if index else ([], None)
        idx, entries = self._visible(f"reading {prefix}", f"/v1/kv/{prefix}", [*params, ("recurse", "1")], blocking)
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
            self._call("PUT", "/v1/catalog/register", body=json.dumps(registration), allow_404=False)

    def node_checks(self, node: str) -> list[dict[str, Any]]:
        """Every check of `node`; PermissionDenied if ACLs hid any of them."""
        _, found = self._visible(f"reading the health of node {node}", f"/v1/health/node/{node}", [])
        return found or []

    def node_health(self, node: str) -> tuple[list[dict[str, Any]], bool]:
        """The checks of `node` the token may read, and whether ACLs hid others.

        Consul hides the checks of services the token may not read; a caller
        that needs only some checks (those bound to a session) judges whether
        what is hidden matters, with `hidden_checks_refused`.
        """
        what = f"reading the health of node {node}"
        with self._translated(what, read_only=True):
            code, headers, text = self._call("GET", f"/v1/health/node/{node}")
            return (json.loads(text) if code != 404 else None) or [], _acl_filtered(headers)

    def hidden_checks_refused(self, node: str, missing: list[str]) -> PermissionDenied:
        """The error for checks a session is bound to that ACLs hid (they are never taken for gone)."""
        return PermissionDenied(f"reading the health of node {node} via {self.address}: Consul ACL denied it: the "
                                f"token cannot read the check(s) {', '.join(missing)} bound to a session there "
                                f"({ACL_FILTERED_HEADER})")


ACL_FILTERED_HEADER = "X-Consul-Results-Filtered-By-ACLs"
# The environment variables that carry a Consul credential (the consul CLI's names: an ACL token, a file holding
# one, HTTP basic auth's user:password). consulrun keeps them from a job's environment and out of unit files.
# Here, not in settings.py: `run` imports this module anyway, and dataclasses would cost its skip path.
CREDENTIAL_VARIABLES = frozenset({"CONSUL_HTTP_TOKEN", "CONSUL_HTTP_TOKEN_FILE", "CONSUL_HTTP_AUTH"})


def _acl_filtered(headers: dict[str, str]) -> bool:
    """Consul's one sign that the token's ACLs left something out of a list it answered with 200."""
    return headers.get(ACL_FILTERED_HEADER.lower(), "").lower() == "true"


# The manifest's `consul:` keys and the variables the generated units set from them.
MANIFEST_CONSUL_ENV = {"address": "CONSUL_HTTP_ADDR", "token_file": "CONSUL_HTTP_TOKEN_FILE", "ca_file": "CONSUL_CACERT",
                       "cert_file": "CONSUL_CLIENT_CERT", "key_file": "CONSUL_CLIENT_KEY",
                       "tls_server_name": "CONSUL_TLS_SERVER_NAME"}


def manifest_consul_env(settings: "ConsulSettings | None") -> dict[str, str]:
    """The CONSUL_* variables a manifest's `consul:` settings stand for, as the units get them."""
    if settings is None:
        return {}
    return {var: str(getattr(settings, key)) for key, var in MANIFEST_CONSUL_ENV.items() if getattr(settings, key)}


def consul_config(kwargs: dict[str, Any], manifest_consul: "ConsulSettings | None" = None) -> "ConsulConfig":
    """Build the config from the options (which already fell back to the environment) and the rest of the env.

    A manifest's `consul:` settings come below both: a command pointed at a
    manifest reaches Consul as that manifest's units do, unless the operator's
    environment or options say otherwise. A token (the operator's, or the
    file the manifest names) is never sent to an address only the manifest
    chose unless the operator says so (`trust_manifest_consul`): whoever
    wrote the manifest would otherwise choose where a local secret goes.
    """
    trusted = bool(kwargs.pop("trust_manifest_consul", False))
    operator = {k: v for k, v in os.environ.items() if v}
    manifest = manifest_consul_env(manifest_consul)
    if operator.get("CONSUL_HTTP_TOKEN") or kwargs.get("token_file"):
        manifest.pop("CONSUL_HTTP_TOKEN_FILE", None)  # the operator's token, not the file the manifest names
    env = {**manifest, **operator}
    address_by_manifest = kwargs.get("http_addr") is None and "CONSUL_HTTP_ADDR" in manifest
    config = ConsulConfig.from_env(
        env, address=kwargs.pop("http_addr"), token_file=kwargs.pop("token_file"), ca_file=kwargs.pop("ca_file"),
        ca_path=kwargs.pop("ca_path"),
        client_cert=kwargs.pop("client_cert"), client_key=kwargs.pop("client_key"),
        tls_server_name=kwargs.pop("tls_server_name"))
    config.endpoint(allow_unix=True)  # a bad address is a usage error now, before anything else happens
    # The default address is where the token goes without any manifest: naming it chooses nothing.
    chose = address_by_manifest and config.endpoint(allow_unix=True) != ("http", "127.0.0.1", DEFAULT_PORT)
    if chose and not trusted and (config.token or config.token_file):
        source = (f"the file {config.token_file}" + (" the manifest names" if config.token_file ==
                                                     manifest.get("CONSUL_HTTP_TOKEN_FILE") else "")
                  if config.token_file else "CONSUL_HTTP_TOKEN")
        raise UsageError(f"the manifest's consul.address {config.address!r} would receive the ACL token from "
                         f"{source}: a manifest does not choose where a local secret goes; give the address "
                         "yourself (--http-addr or CONSUL_HTTP_ADDR) or pass --trust-manifest-consul")
    return config
