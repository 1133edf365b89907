"""Append-only JSON-lines logs timed by the host clock: the history (oracle) and the nemesis log.

One line is one write() on an O_APPEND descriptor, so lines from the runner's
threads and from every node's jobs never interleave or overwrite each other.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator


class AppendLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> float:
        now = time.time()
        os.write(self.fd, (json.dumps({"t": round(now, 4), "ev": event, **fields}) + "\n").encode())
        return now

    def close(self) -> None:
        os.close(self.fd)


def read(path: Path) -> Iterator[dict[str, Any]]:
    """Every complete line; a torn last line (a run killed mid-write) is ignored."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                yield json.loads(line)
            except ValueError:
                continue
