"""Which nodes may run a job: the manifest's `nodes:` (node meta a node must have, globs its name must match).

A run (protocol/runner.py) checks its own node against it before anything else (the node's name
and meta come from the local agent, the same read that names the node for
the lock), and skips with one line and no write when it does not match. The
turns rank only the nodes that match (occurrence.py), so a node that never
runs the job never holds a turn for it.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from consulrun.records import record


@record
class Placement:
    meta: tuple[tuple[str, str], ...] = ()  # every pair must be in the node's meta
    names: tuple[str, ...] = ()  # if any: the node's name must match one of these globs

    def matches(self, name: str, meta: dict[str, str]) -> bool:
        return all(meta.get(key) == value for key, value in self.meta) and \
            (not self.names or any(fnmatchcase(name, glob) for glob in self.names))

    def needs_meta(self) -> bool:
        """Whether matching needs each node's meta (the catalog's), not only its name (the gossip's)."""
        return bool(self.meta)

    def describe(self) -> str:
        """`meta role=db, names web-* or db-*` for log lines and status."""
        parts = []
        if self.meta:
            parts.append("meta " + ", ".join(f"{key}={value}" for key, value in self.meta))
        if self.names:
            parts.append("names " + " or ".join(self.names))
        return "; ".join(parts)

    def argv(self) -> list[str]:
        """The `run` options that carry it (units/render.py writes them, commands/runargs.py reads them)."""
        return [*(a for key, value in self.meta for a in ("--node-meta", f"{key}={value}")),
                *(a for glob in self.names for a in ("--node-name", glob))]
