"""Who goes first for an occurrence nobody has claimed yet: the nodes take turns.

Every node's timer fires within the same second or so; a node that reads the
occurrence record before the winner's claim lands would make a session and
destroy it for nothing (two Raft writes each). So each occurrence orders the
members the local agent's gossip sees alive: rendezvous hashing of the job and
the occurrence over their node names, the same order on every node of a kind
and its own per occurrence, so runs spread evenly and a node that leaves moves
only its own share. Each node puts the members of its own kind first (a
server, the servers; a client, the clients): a job that runs on servers only,
or on clients only, gets one order; one that runs on both gets two, so at most
two nodes claim at once. The first goes at once; the one in place k (from 0)
leaves the occurrence to those before it for k steps, at most
RANK_STEPS_AT_MOST, on a blocking read of the record that ends as soon as a
claim lands (occurrence.py). A step outlasts a timer's 1 s AccuracySec=
window plus a wrapper's start, so the second never races a first that fired
last. A turn is also at most a tenth of the time left before the next
occurrence: a run started late must not run into it.
"""

from __future__ import annotations

RANK_STEP_S = 2.0
RANK_STEPS_AT_MOST = 3
TURN_MAX_S = RANK_STEP_S * RANK_STEPS_AT_MOST


def turn_at_most_s(interval_s: float | None) -> float:
    """The longest a node's turn delays a run when the next occurrence is `interval_s` away (None: never)."""
    return TURN_MAX_S if interval_s is None else max(0.0, min(TURN_MAX_S, interval_s / 10))


def order(key: str, members: list[tuple[str, bool]], server: bool = False) -> list[str]:
    """The turns for `key` among `members` ((name, is a server)), as a node of kind `server` sees them: its own
    kind first, each kind by rendezvous hash."""
    import hashlib  # here: a run that finds its occurrence settled never ranks, and hashlib loads OpenSSL

    def score(name: str) -> bytes:
        return hashlib.blake2b(f"{key}\n{name}".encode(), digest_size=8).digest()

    return [name for _, _, name in sorted({(kind != server, score(name), name) for name, kind in members})]


def wait_s(place: int, time_left_s: float | None) -> float:
    """How long the node in `place` (0 goes first) leaves the occurrence to those before it."""
    return min(min(place, RANK_STEPS_AT_MOST) * RANK_STEP_S, turn_at_most_s(time_left_s))
