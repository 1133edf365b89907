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
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import consul
import consul.callback
import requests
import requests.adapters

from consulrun.errors import ConsulProtocolError, ConsulUnavailable, PermissionDenied, UsageError


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

    def endpoint(self) -> tuple[str, str, int]:
        """(scheme, host, port); CONSUL_HTTP_SSL decides the scheme when the address has none."""
        text = self.address if "://" in self.address else f"//{self.address}"
        parts = urllib.parse.urlsplit(text)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or (parts.scheme not in ("", "http", "https")):
            raise UsageError(f"Consul address {self.address!r} is not [http[s]://]host[:port]")
        scheme = parts.scheme or ("https" if self.ssl else "http")
        return scheme, parts.hostname, port or (8501 if scheme == "https" else 8500)

    def resolved_token(self) -> str | None:
        if self.token:
            return self.token
        if self.token_file:
            try:
                with open(self.token_file, encoding="utf-8") as handle:
                    if os.fstat(handle.fileno()).st_mode & 0o077:
                        logging.getLogger("consulrun").warning(
                            "Consul token file %s is readable by others; make it mode 0600", self.token_file)
                    return handle.read().strip() or None
            except OSError as exc:
                raise UsageError(f"cannot read Consul token file {self.token_file}: {exc.strerror}") from None
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
            raise ConsulUnavailable(f"{what}: Consul cannot serve the request: {text}") from None
        raise ConsulProtocolError(f"{what}: unexpected answer from Consul: {text}") from None
    except ValueError as exc:  # a body that is not the JSON Consul promises
        raise ConsulProtocolError(f"{what}: unexpected answer from Consul: {exc}") from None
    except (KeyError, IndexError, TypeError, AttributeError) as exc:  # JSON, but not of the shape Consul promises
        raise ConsulProtocolError(f"{what}: unexpected answer from Consul: {type(exc).__name__}: {_short(exc)}") from None


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


class Client:
    """The handful of Consul calls consulrun makes, each with a bounded timeout."""

    def __init__(self, config: ConsulConfig, timeout: float = 10.0) -> None:
        scheme, host, port = config.endpoint()
        verify: bool | str = config.ca_file or config.ssl_verify
        cert = (config.client_cert, config.client_key) if config.client_cert and config.client_key else config.client_cert
        self._api = consul.Consul(host=host, port=port, scheme=scheme, verify=verify, cert=cert,
                                  connections_timeout=timeout)
        # py-consul lets CONSUL_HTTP_TOKEN override an explicit token; ours is resolved already.
        self._api.token = config.resolved_token()
        if scheme == "https" and config.tls_server_name:
            self._api.http.session.mount("https://", _ServerNameAdapter(config.tls_server_name))
        self.address = f"{scheme}://{host}:{port}"

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

    def txn(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Apply `ops` atomically; the results, or None if Consul rolled the transaction back."""

        def answer(response: Any) -> list[dict[str, Any]] | None:
            if response.code == 409:
                return None
            consul.callback.CB._status(response)  # noqa: SLF001 - py-consul's own status mapping
            return json.loads(response.body).get("Results") or []

        # py-consul's txn.put sends no ACL token; the raw call with our headers does.
        with self._translated("applying a transaction"):
            return self._api.http.put(answer, "/v1/txn", headers=self._api.prepare_headers(), data=json.dumps(ops))

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
