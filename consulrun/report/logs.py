"""Where a run's output is: the run's row in the history (node, host, systemd invocation id) and the journal
command that prints it, on this host or over ssh.

The output is not copied into Consul: every KV reader (every node's token)
could read it there, and the journal already keeps it under the retention
the operator chose. A run the timer started carries the invocation id
systemd gave it (`INVOCATION_ID`), which journald attaches to every line the
run wrote; `journalctl _SYSTEMD_INVOCATION_ID=...` prints exactly that run.

Which host that is, is asked of Consul, not of the record (anyone with KV
write may rewrite its `host` to `ops@attacker.example`): the run's session's
Node while the session lives, else the node the record names, and either must
be a node the Consul catalog knows; ssh is given that node's catalog address.
What comes back over ssh is shown escaped, line by line (`printable`).
"""

from __future__ import annotations

from consulrun.consul.values import printable
from consulrun.report.status import NoState

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import IO, Any

    from consulrun.consul.client import Client

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def split_occurrence(targets: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """[MANIFEST] JOB [OCCURRENCE]: the targets before the occurrence, and the occurrence as `history` writes it.
    The last of two or more is an occurrence if it has a ':' (no job name has one) or is written as its history
    key names it in the Consul UI (`20261201T020000Z`)."""
    from consulrun.protocol import keys

    last = targets[-1] if len(targets) > 1 else ""
    if ":" in last or keys.is_stamp(last):
        return targets[:-1], keys.unstamp(last)
    return targets, None


def choose(rows: list[dict[str, Any]], job: str, occurrence: str | None, attempt: int | None) -> dict[str, Any]:
    """The run asked for among `rows` (newest first): OCCURRENCE's last attempt, or attempt N of it; without
    OCCURRENCE, the newest run (attempt N of the newest occurrence). NoState (exit 6) if there is none."""
    ran = [row for row in rows if row["state"] != "skipped"]
    if occurrence is not None:
        ran = [row for row in ran if row["occurrence"] == occurrence]
        if not ran:
            known = ", ".join(dict.fromkeys(str(r["occurrence"]) for r in rows if r["occurrence"]))
            raise NoState(f"{job}: no run of occurrence {printable(occurrence)} in the history"
                          + (f" (it has {known})" if known else ""))
    elif ran:
        newest = ran[0]["occurrence"]
        ran = [row for row in ran if row["occurrence"] == newest] if newest else ran[:1]
    if not ran:
        raise NoState(f"{job}: no run in the history")
    if attempt is None:
        return max(ran, key=lambda row: row["attempt"] or 0)
    for row in ran:
        if row["attempt"] == attempt:
            return row
    have = ", ".join(str(row["attempt"]) for row in sorted(ran, key=lambda row: row["attempt"] or 0))
    raise NoState(f"{job}: occurrence {printable(ran[0]['occurrence'])} has no attempt {attempt} (it has {have})")


def described(row: dict[str, Any]) -> str:
    """'occurrence 2026-12-01T02:00:00Z attempt 2' or 'manual run started 2026-...' for messages."""
    if row["occurrence"]:
        return f"occurrence {printable(row['occurrence'])} attempt {row['attempt'] or 1}"
    return f"manual run started {printable(row['started'])}"


def journal_argv(job: str, row: dict[str, Any], output: str = "short-iso") -> list[str]:
    """`journalctl` printing the run's lines (consulrun's own and the job's) in journalctl's `output` mode;
    NoState if the run was not one systemd started (its output went to whoever started it)."""
    invocation = row.get("invocation_id")
    if not invocation:
        raise NoState(f"{job}: the {described(row)} on {printable(row.get('node') or '?')} was not started by "
                      "systemd (no invocation id was recorded): its output went to whoever ran it")
    return ["journalctl", "--no-pager", "--quiet", f"--output={output}", f"_SYSTEMD_INVOCATION_ID={invocation}"]


def run_node(client: Client, job: str, row: dict[str, Any]) -> tuple[str, str]:
    """(node, address) of the catalog node that ran `row`: its session's Node while that session
    lives (only Consul can say it), else the node the record names; UsageError if the catalog does
    not know that node (or it is consulrun's own external node, which no host stands behind). The
    record's `host` is never used."""
    import re
    from urllib.parse import quote

    from consulrun.errors import UsageError

    node = row.get("node")
    session = row.get("session")
    shaped = isinstance(session, str) and re.fullmatch(_UUID, session)  # else no session to ask
    info = client.session_visible(session) if shaped else None
    if info and info.get("Node"):
        node = info["Node"]
    found = client.catalog_node(quote(node, safe="")) if isinstance(node, str) and node else None
    entry = (found or {}).get("Node") or {}
    external = (entry.get("Meta") or {}).get("external-node") == "true"
    if entry.get("Node") != node or external or not entry.get("Address"):
        raise UsageError(f"{job}: the {described(row)} names node {printable(node or '?')}, which "
                         "is not a node of the Consul catalog: logs reaches only those; give the "
                         "host to read the journal on with --host")
    return node, str(entry["Address"])


def is_local(client: Client, node: str) -> bool:
    """Whether `node` is the local agent's (by the agent's name; the host's if ACLs hide it)."""
    import socket

    from consulrun.errors import PermissionDenied

    try:
        return node == client.node_name()
    except PermissionDenied:
        return node == socket.gethostname()


def _escaped(source: IO[bytes], sink: IO[bytes]) -> int:
    """Copy `source` to `sink` line by line, each line's control characters escaped (`printable`):
    bytes from a remote host never reach the terminal raw. Returns the bytes read."""
    read = 0
    for raw in iter(source.readline, b""):
        read += len(raw)
        line = raw[:-1] if raw.endswith(b"\n") else raw
        text = printable(line.decode("utf-8", "backslashreplace"))
        sink.write(text.encode() + (b"\n" if raw.endswith(b"\n") else b""))
        sink.flush()
    return read


def stream(argv: list[str], where: str, job: str, row: dict[str, Any],
           remote: bool = False) -> None:
    """Run `argv` (journalctl, or ssh running it), its output to ours: this host's journalctl's
    straight (it shows a line with control characters as `[N blob data]` unless asked otherwise), a
    `remote` one's stdout and stderr escaped line by line; NoState if it printed nothing, an error
    if it failed (its own message is on stderr already)."""
    import subprocess
    import sys
    import threading

    from consulrun.errors import ConsulrunError, os_reason

    wrote = 0
    try:
        with subprocess.Popen(argv, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE if remote else None) as proc:
            assert proc.stdout is not None
            if remote:
                said = threading.Thread(target=_escaped, args=(proc.stderr, sys.stderr.buffer),
                                        daemon=True)
                said.start()
                wrote = _escaped(proc.stdout, sys.stdout.buffer)
                said.join()
            else:
                read = proc.stdout.read1
                for chunk in iter(lambda: read(65536), b""):
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
                    wrote += len(chunk)
    except OSError as exc:
        raise ConsulrunError(f"{argv[0]}: {os_reason(exc)}") from None
    if proc.returncode:
        raise ConsulrunError(f"{' '.join(argv[:1])} reading the journal {where} exited with status {proc.returncode}")
    if not wrote:
        raise NoState(f"{job}: the journal {where} has no line of the {described(row)} (invocation "
                      f"{row['invocation_id']}): journald has rotated it out, or keeps no journal across boots "
                      "(Storage=volatile)")
