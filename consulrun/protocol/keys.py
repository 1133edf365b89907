"""Every KV key consulrun writes, named in one place and inside the strictest rule Consul has shipped.

Consul 1.21.5 (a patch release) refused, on its KV endpoints, any key outside
`^[a-zA-Z0-9,_./\\-?&=]+$` (hashicorp/consul#22822, #22835): `:`, `~`, spaces
and non-ASCII among them; later releases relaxed it (#22850). Keys written
here stay inside it, so a patch upgrade of Consul cannot lock us out of our
own state. Under `<prefix>/<job>/`:

  lock, slots/<n>, occurrence, trigger, pause     fixed names
  history/<time>                                  20261129T020000Z (ISO 8601 basic format, UTC)
  history/<time>.manual                           a manual run (`consulrun trigger`), by its start
  ended-pauses/<at>.<index>                       a filed pause, by its start and the pause key's index
  clock/<node>/<node>                             clock findings (clockskew.py), node names as `segment`s
  history/<run>,after,<parent>                    a chained run (chain.py), after <parent>'s run <run>
  after/<parent>/<run>                            a request for a chained run (chain.py)
  nodes/<node>/occurrence, nodes/<node>/history/  an each-node job's per-node records (eachnode.py)

Versions before this module wrote `history/2026-11-29T02:00:00Z`,
`history/<start>~manual` and `ended-pauses/<at>~<index>`. Those are still
read, ordered among the new ones by the time they name (not by the raw key:
`2026-11-29T02:30:00Z` sorts after `20261129T023000Z` byte for byte), and
pruned by age: a key outside the rule cannot be named in any request a strict
Consul accepts, so it is deleted with a `delete-tree` of the longest prefix
of it that is inside the rule (see `delete_ops`). No migration is needed.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any

SAFE_KEY = re.compile(r"^[a-zA-Z0-9,_./\-?&=]+$(?!\n)")

LOCK, OCCURRENCE, TRIGGER, PAUSE = "lock", "occurrence", "trigger", "pause"
SLOTS, HISTORY, EPISODES, CLOCK = "slots/", "history/", "ended-pauses/", "clock/"
AFTER, NODES = "after/", "nodes/"
CHAINED = ",after,"  # a chained run's key segment, `<parent run's segment>,after,<parent>`: no job name holds ','
CHAIN_SEPARATOR = "~after~"  # the same run's id in values and CONSULRUN_OCCURRENCE (chain.py)
MANUAL = ".manual"
LEGACY_MANUAL = "~manual"
LEGACY_EPISODE = "~"

_CANONICAL = re.compile(r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)Z$(?!\n)")  # calendar.occurrence_id, now_iso
_STAMP = re.compile(r"^(\d{4})(\d\d)(\d\d)T(\d\d)(\d\d)(\d\d)Z$(?!\n)")
_PLAIN = re.compile(r"[A-Za-z0-9,_.\-]")
_HEX = re.compile(r"[0-9A-F]{2}")
# A legacy time's hour, `2026-11-29T02`: what the longest safe prefix of an old history key looks like. No key
# written here begins so (stamps have no '-'), so a delete-tree of it can only reach old keys of that hour.
_LEGACY_HOUR = re.compile(r"^\d{4}-\d\d-\d\dT\d\d$(?!\n)")


def nameable(key: str) -> bool:
    """Whether a request may name `key` on a Consul that checks keys as 1.21.5 did."""
    return bool(SAFE_KEY.match(key))


def is_safe(key: str) -> bool:
    """Nameable, and no `..` (path traversal, which the later rules refuse): every key built here is, under a
    prefix and a job name that hold no `..` (the manifest's schema allows `a..b`; see the tests)."""
    return nameable(key) and ".." not in key


def job_base(prefix: str, job: str) -> str:
    return f"{prefix.strip('/')}/{job}"


def lock_key(base: str) -> str:
    return f"{base}/{LOCK}"


def slots_prefix(base: str) -> str:
    return f"{base}/{SLOTS}"


def slot_key(base: str, n: int) -> str:
    return f"{base}/{SLOTS}{n}"


def occurrence_key(base: str) -> str:
    return f"{base}/{OCCURRENCE}"


def trigger_key(base: str) -> str:
    return f"{base}/{TRIGGER}"


def pause_key(base: str) -> str:
    return f"{base}/{PAUSE}"


def history_prefix(base: str) -> str:
    return f"{base}/{HISTORY}"


def episodes_prefix(base: str) -> str:
    return f"{base}/{EPISODES}"


def clock_prefix(base: str) -> str:
    return f"{base}/{CLOCK}"


def clock_about_prefix(base: str, about: str) -> str:
    """Where the nodes record their findings about node `about`'s clock, one key each."""
    return f"{clock_prefix(base)}{segment(about)}/"


def clock_key(base: str, about: str, by: str) -> str:
    """Where node `by` records how far node `about`'s clock is ahead of its own."""
    return f"{clock_about_prefix(base, about)}{segment(by)}"


def history_key(base: str, occurrence: str, manual: bool = False) -> str:
    """`occurrence`'s history entry (a scheduled time), or with `manual` a manual run's, by its start."""
    return entry_key(history_prefix(base), occurrence, manual)


def chained_history_key(base: str, run: str) -> str:
    """A chained run's history entry, by its id `<parent run>~after~<parent>` (chain.py)."""
    return entry_key(history_prefix(base), run)


def entry_key(directory: str, run: str, manual: bool = False) -> str:
    """A history entry under `directory` (a job's `history/`, or an each-node job's `nodes/<node>/history/`)."""
    return f"{directory}{run_segment(run)}{MANUAL if manual else ''}"


def run_segment(run: str) -> str:
    """A run's id as a key segment: an occurrence as its `stamp`, a chained run's `<run>~after~<parent>` as
    `<run's segment>,after,<parent>` (a chain of chains nests: one `,after,<job>` per link)."""
    first, *parents = run.split(CHAIN_SEPARATOR)
    return CHAINED.join([stamp(first), *(segment(p) for p in parents)])


def run_of_segment(name: str) -> str:
    """The run id `run_segment` made `name` from (an old key's segment as it is). Iterative: a key anyone with
    KV write made of a thousand `,after,` parts is read in a linear pass, never a recursion that overflows."""
    first, *parents = name.split(CHAINED)
    return CHAIN_SEPARATOR.join([unstamp(first), *(unsegment(p) for p in parents)])


def after_prefix(base: str) -> str:
    """Where the requests for a chained job's runs wait, `after/<parent>/<run>` (chain.py)."""
    return f"{base}/{AFTER}"


def chain_request_key(base: str, parent: str, run: str) -> str:
    return f"{after_prefix(base)}{segment(parent)}/{run_segment(run)}"


def node_prefix(base: str, node: str) -> str:
    """An each-node job's keys of one node: `nodes/<node>/` (eachnode.py), the node name as a `segment`."""
    return f"{base}/{NODES}{segment(node)}/"


def episode_key(base: str, at: str, index: int | str) -> str:
    """A filed pause: its start (`at`, as the pause key holds it) and the pause key's ModifyIndex."""
    return f"{episodes_prefix(base)}{stamp(at)}.{index}"


def stamp(when: str) -> str:
    """A time as a key segment: `2026-11-29T02:00:00Z` -> `20261129T020000Z` (sorts as the time does);
    anything else (a time someone else wrote, say) as a `segment`."""
    match = _CANONICAL.match(when)
    return "{}{}{}T{}{}{}Z".format(*match.groups()) if match else segment(when)


def is_stamp(name: str) -> bool:
    """True if `name` is a time as `stamp` writes it (`20261129T020000Z`)."""
    return bool(_STAMP.match(name))


def unstamp(name: str) -> str:
    """The time a key segment names, as consulrun writes times in values: the inverse of `stamp`, and an old
    key's segment (`2026-11-29T02:00:00Z`) as it is."""
    match = _STAMP.match(name)
    return "{}-{}-{}T{}:{}:{}Z".format(*match.groups()) if match else unsegment(name)


def segment(text: str) -> str:
    """`text` as one key segment inside the rule, reversibly: a byte outside [A-Za-z0-9,_.-] (and `=`, the
    escape) as `=XX`; every `.` too when the text holds `..` or is `.`. A plain node name is itself."""
    if not text:
        return "="  # a lone escape: no text
    out = "".join(c if _PLAIN.match(c) else "".join(f"={b:02X}" for b in c.encode()) for c in text)
    return out.replace(".", "=2E") if out == "." or ".." in out else out


def unsegment(name: str) -> str:
    """The inverse of `segment` (text that holds no escape is itself)."""
    if "=" not in name:
        return name
    if name == "=":
        return ""
    raw, i = bytearray(), 0
    while i < len(name):
        if name[i] == "=" and _HEX.match(name, i + 1):
            raw += bytes.fromhex(name[i + 1:i + 3])
            i += 3
        else:
            raw += name[i].encode()
            i += 1
    return raw.decode("utf-8", "replace")


def is_manual(key: str) -> bool:
    """A manual run's history entry, in either form (not a chained run's after a job named `x.manual`)."""
    return (key.endswith(MANUAL) or key.endswith(LEGACY_MANUAL)) and not is_chained(key)


def is_chained(key: str) -> bool:
    """A chained run's history entry (chain.py)."""
    return CHAINED in key.rsplit("/", 1)[-1]


def history_order(key: str) -> tuple[str, int]:
    """Sort key of a history entry (a full key or the part after `history/`): the time it names, then the old
    form before the new one (an entry an old node wrote before a new one wrote the same name's)."""
    rest = key.rsplit("/", 1)[-1]
    for suffix in (MANUAL, LEGACY_MANUAL) if not is_chained(rest) else ():
        if rest.endswith(suffix):
            rest = rest[:-len(suffix)]
            break
    return run_of_segment(rest), 1 if SAFE_KEY.match(rest) else 0


def episode_order(key: str) -> tuple[str, int]:
    """Sort key of a filed pause (a full key or the part after `ended-pauses/`): by its start, then by the
    pause key's index (two pauses in one second)."""
    rest = key.rsplit("/", 1)[-1]
    at, _, index = rest.rpartition(LEGACY_EPISODE if LEGACY_EPISODE in rest else ".")
    return unstamp(at), int(index) if re.fullmatch(r"[0-9]{1,18}", index) else 0  # isdigit takes '²'; int does not


def _cover(key: str, directory: str) -> str | None:
    """The longest prefix of `key` (an old key under `directory`) inside the rule, if a delete-tree of it can
    reach only old keys: it names a legacy time's hour (`<directory>2026-11-29T02`)."""
    cut = next((i for i, c in enumerate(key) if not SAFE_KEY.match(c)), len(key))
    prefix = key[:cut]
    return prefix if prefix.startswith(directory) and _LEGACY_HOUR.match(prefix[len(directory):]) else None


def delete_ops(doomed: list[str], listed: list[str], directory: str,
               op: Any = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Operations that delete the keys `doomed` (of those `listed` under `directory`), and the ones they cannot.

    A key inside the rule is deleted by name (`op(key)`: a `delete` unless
    given). An old key outside it is deleted with a `delete-tree` of its
    legacy hour (`_cover`), and only when every listed key under that prefix
    is doomed too: the prefix reaches nothing that is kept. One that cannot
    be yet (its hour holds a key still kept) is returned, to go with the rest
    of its hour later; a key no release of consulrun wrote that way is never
    reached at all.
    """
    from consulrun.consul.client import kv_op

    op = op or (lambda key: kv_op("delete", key))
    doomed_set = set(doomed)
    ops: list[dict[str, Any]] = []
    left: list[str] = []
    covers: dict[str, bool] = {}
    for key in doomed:
        if nameable(key):
            ops.append(op(key))
            continue
        cover = _cover(key, directory)
        if cover is None:
            left.append(key)
            continue
        if cover not in covers:
            covers[cover] = all(k in doomed_set for k in listed if k.startswith(cover))
            if covers[cover]:
                ops.append(kv_op("delete-tree", cover))
        if not covers[cover]:
            left.append(key)
    return ops, left
