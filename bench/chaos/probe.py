"""The cluster's own availability, measured beside the run: can each client's agent serve a consistent read?

A thread per client node asks its agent for a key with `?consistent` every
PERIOD_S (the read a wrapper's claim starts with: it needs a leader that can
reach a quorum) and writes a line to probes.log whenever the answer changes
between served and not served, with the reason. The checker (checker.py)
turns those lines into spans in which a node's agent could not serve it, so
an occurrence lost while no client could be served for longer than the
wrappers' start budget is told apart from one lost while a node could have
run it. The probe knows nothing of consulrun (urllib only): it is no
witness of its own.
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable

from bench.chaos.logs import AppendLog, read

PERIOD_S = 0.5
TIMEOUT_S = 2.0


class Prober:
    """Starts a probing thread per client (`name`, `http_addr`); `stop()` ends them with a last line each."""

    def __init__(self, clients: Iterable[Any], prefix: str, path: Path) -> None:
        self.clients = [(c.name, c.http_addr) for c in clients]
        self.key = f"{prefix}/_availability-probe"
        self.log = AppendLog(path)
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self._probe, args=client, name=f"probe-{client[0]}", daemon=True)
                        for client in self.clients]

    def start(self) -> "Prober":
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=TIMEOUT_S + 1)
        self.log.close()

    def _probe(self, node: str, addr: str) -> None:
        state: bool | None = None
        while not self.stop_event.is_set():
            began = time.monotonic()
            served, why = ask(addr, self.key)
            if served != state:
                self.log.emit("probe", node=node, served=served, why=why)
                state = served
            self.stop_event.wait(max(0.0, PERIOD_S - (time.monotonic() - began)))
        self.log.emit("probe-end", node=node)


def ask(addr: str, key: str) -> tuple[bool, str]:
    """(served, why): a consistent read answered 200 or 404 is served; anything else is not."""
    try:
        with urllib.request.urlopen(f"http://{addr}/v1/kv/{key}?consistent", timeout=TIMEOUT_S) as answer:
            return True, str(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code == 404, str(exc.code) + ("" if exc.code == 404 else f" {exc.read()[:120]!r}")
    except (OSError, http.client.HTTPException) as exc:
        return False, f"{type(exc).__name__}: {exc}"[:160]


def unserved_spans(path: Path, end_of_run: float) -> dict[str, list[tuple[float, float]]]:
    """Per node, the spans [first failed probe, next served probe] in which its agent could not serve it."""
    spans: dict[str, list[tuple[float, float]]] = {}
    since: dict[str, float] = {}
    for line in read(path):
        node = line.get("node", "")
        if line["ev"] == "probe" and not line["served"]:
            since.setdefault(node, line["t"])
        elif line["ev"] in ("probe", "probe-end") and node in since:
            spans.setdefault(node, []).append((since.pop(node), line["t"]))
    for node, t in since.items():
        spans.setdefault(node, []).append((t, end_of_run))
    return spans
