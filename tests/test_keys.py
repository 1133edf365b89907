"""KV key names (consulrun/protocol/keys.py): inside Consul 1.21.5's rule, ordered as the times they name, the old
forms still read; and nothing in consulrun builds a key by hand that could leave the rule."""

from __future__ import annotations

import ast
import random
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from consulrun.manifest import calendar
from consulrun.manifest.schema import SCHEMA, kv_prefix_problem
from consulrun.protocol import keys
from consulrun.protocol.occurrence import Ledger
from consulrun.protocol.pause import _filing_ops
from tests.harness.faultproxy import KV_KEY_RULE

PACKAGE = Path(__file__).resolve().parents[1] / "consulrun"
BASE = "ops/cron/nightly"


def consul_takes(key: str) -> bool:
    """Consul 1.21.5's own rule, as the fault proxy holds it (not keys.SAFE_KEY, which is under test)."""
    return re.fullmatch(KV_KEY_RULE, key) is not None


def times(n: int, seed: int = 30) -> list[str]:
    rng = random.Random(seed)
    start = datetime(1999, 12, 31, 23, 59, 59, tzinfo=timezone.utc)
    return [calendar.occurrence_id(start + timedelta(seconds=rng.randrange(0, 40 * 365 * 86400))) for _ in range(n)]


def test_the_rule_is_consuls() -> None:
    assert keys.SAFE_KEY.pattern.startswith(KV_KEY_RULE[:-1])
    for key in ("a/b", "a,b", "a_b", "a.b", "a-b", "a?b", "a&b", "a=b", "A9"):
        assert keys.is_safe(key) and consul_takes(key), key
    for key in ("a:b", "a~b", "a b", "é", "a\n", "a%b", "a+b", "a*b", ""):
        assert not keys.is_safe(key) and not consul_takes(key), key
    assert not keys.is_safe("a/../b") and consul_takes("a/../b")  # path traversal: refused by the later rule


def test_every_key_the_module_names_is_inside_the_rule() -> None:
    occ = "2026-11-29T02:00:00Z"
    named = [keys.lock_key(BASE), keys.slot_key(BASE, 3), keys.occurrence_key(BASE), keys.trigger_key(BASE),
             keys.pause_key(BASE), keys.history_key(BASE, occ), keys.history_key(BASE, occ, manual=True),
             keys.episode_key(BASE, occ, 1234), keys.episode_key(BASE, "soon: when it's done ~", 7),
             keys.clock_key(BASE, "node 1", "nöde~2"), keys.history_prefix(BASE), keys.episodes_prefix(BASE),
             keys.clock_prefix(BASE), keys.slots_prefix(BASE)]
    assert all(consul_takes(k) and keys.is_safe(k) for k in named), [k for k in named if not consul_takes(k)]
    assert keys.history_key(BASE, occ) == f"{BASE}/history/20261129T020000Z"
    assert keys.history_key(BASE, occ, manual=True) == f"{BASE}/history/20261129T020000Z.manual"
    assert keys.episode_key(BASE, occ, 1234) == f"{BASE}/ended-pauses/20261129T020000Z.1234"
    assert keys.clock_key(BASE, "node1", "node-2.dc") == f"{BASE}/clock/node1/node-2.dc"  # as before: plain names


def test_stamps_sort_as_the_times_do_and_read_back() -> None:
    found = times(2000)
    assert sorted(found) == [keys.unstamp(s) for s in sorted(keys.stamp(t) for t in found)]
    assert all(keys.unstamp(keys.stamp(t)) == t and consul_takes(keys.stamp(t)) for t in found)
    assert keys.unstamp("2026-11-29T02:00:00Z") == "2026-11-29T02:00:00Z"  # an old key's name is its time


def test_segments_are_reversible_and_inside_the_rule() -> None:
    rng = random.Random(7)
    alphabet = "aZ9,_.-/?&=:~ %+*\n\t\u00e9\u2603."
    texts = ["", ".", "..", "...", "a..b", "=", "==", "=41", "node1"] + \
        ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))) for _ in range(3000)]
    seen: dict[str, str] = {}
    for text in texts:
        name = keys.segment(text)
        assert consul_takes(name) and keys.is_safe(name) and "/" not in name, (text, name)
        assert keys.unsegment(name) == text, (text, name)
        assert seen.setdefault(name, text) == text  # two texts never share a segment
    assert keys.segment("node-1.example_2") == "node-1.example_2"


def test_mixed_histories_order_by_the_time_each_names() -> None:
    found = times(300, seed=5)
    old = {f"{BASE}/history/{t}": t for t in found[:150]}  # written before the upgrade
    old.update({f"{BASE}/history/{t}~manual": t for t in found[150:170]})
    new = {keys.history_key(BASE, t): t for t in found[170:280]}
    new.update({keys.history_key(BASE, t, manual=True): t for t in found[280:]})
    mixed = {**old, **new}
    ordered = sorted(mixed, key=keys.history_order)
    assert [mixed[k] for k in ordered] == sorted(mixed.values())
    assert sorted(mixed) != ordered  # byte order would not do: `2026-...:30:00Z` sorts after `2026...T..3000Z`
    assert {k for k in mixed if keys.is_manual(k)} == {k for k in mixed if k.endswith(("~manual", ".manual"))}
    assert keys.episode_order(f"{BASE}/ended-pauses/2026-11-29T02:00:00Z~12") == ("2026-11-29T02:00:00Z", 12)
    assert keys.episode_order(keys.episode_key(BASE, "2026-11-29T02:00:00Z", 12)) == ("2026-11-29T02:00:00Z", 12)
    assert keys.episode_order(keys.episode_key(BASE, "a.b ~ c", 3)) == ("a.b ~ c", 3)


def entries(*names: str) -> list[dict]:
    return [{"Key": name, "ModifyIndex": n + 1} for n, name in enumerate(names)]


def deletes(ops: list[dict]) -> list[tuple[str, str]]:
    return [(op["KV"]["Verb"], op["KV"]["Key"]) for op in ops]


def test_pruning_deletes_old_keys_by_their_hour_once_all_of_it_is_due() -> None:
    ledger = Ledger(None, BASE, history_size=2)  # type: ignore[arg-type] - prune_ops reads no Consul
    h = f"{BASE}/history/"
    listed = entries(f"{h}2025-01-01T00:00:00Z", f"{h}2025-01-01T00:30:00Z", f"{h}2025-01-01T01:00:00Z",
                     f"{h}2025-01-01T01:30:00Z", keys.history_key(BASE, "2025-01-01T02:00:00Z"))
    keep = keys.history_key(BASE, "2025-01-01T03:00:00Z")
    ops = deletes(ledger.prune_ops(listed, keep))
    # The newest two are 02:00 and 03:00: hours 00 and 01 are due whole, each one delete-tree of its prefix
    # (which no new key can begin with).
    assert ops == [("delete-tree", f"{h}2025-01-01T00"), ("delete-tree", f"{h}2025-01-01T01")], ops
    assert all(consul_takes(key) for _, key in ops)
    ledger = Ledger(None, BASE, history_size=3)  # type: ignore[arg-type]
    ops = deletes(ledger.prune_ops(listed, keep))
    assert ops == [("delete-tree", f"{h}2025-01-01T00")], ops  # 01:30 is kept, so 01:00 waits for its hour
    manual_in_hour = entries(*(e["Key"] for e in listed), f"{h}2025-01-01T00:10:00Z~manual",
                             f"{h}2025-01-01T05:00:00Z~manual")
    ops = deletes(ledger.prune_ops(manual_in_hour, keep))
    assert ops == [], ops  # hour 00 holds a manual run still among the newest three: nothing of it goes yet


def test_pruning_new_keys_and_the_old_key_of_the_entry_written() -> None:
    ledger = Ledger(None, BASE, history_size=2)  # type: ignore[arg-type]
    h = f"{BASE}/history/"
    listed = entries(keys.history_key(BASE, "2025-01-01T00:00:00Z"), keys.history_key(BASE, "2025-01-02T00:00:00Z"),
                     f"{h}2025-01-03T00:00:00Z", keys.history_key(BASE, "2025-01-03T12:00:00Z", manual=True))
    keep = keys.history_key(BASE, "2025-01-03T00:00:00Z")  # an old node recorded this occurrence lost; now done
    ops = deletes(ledger.prune_ops(listed, keep))
    assert ops == [("delete", keys.history_key(BASE, "2025-01-01T00:00:00Z")),
                   ("delete-tree", f"{h}2025-01-03T00")], ops


def test_a_job_whose_name_holds_two_dots_is_pruned_by_name() -> None:
    base = "consulrun/a..b"
    ledger = Ledger(None, base, history_size=1)  # type: ignore[arg-type]
    listed = entries(keys.history_key(base, "2025-01-01T00:00:00Z"), f"{base}/history/2024-01-01T00:00:00Z")
    ops = deletes(ledger.prune_ops(listed, keys.history_key(base, "2026-01-01T00:00:00Z")))
    assert ops == [("delete-tree", f"{base}/history/2024-01-01T00"),
                   ("delete", keys.history_key(base, "2025-01-01T00:00:00Z"))], ops


def test_a_key_no_release_wrote_is_never_reached_by_a_prefix() -> None:
    h = f"{BASE}/history/"
    odd = [f"{h}2026~manual", f"{h}x y", f"{h}:"]
    ops, left = keys.delete_ops(odd, odd + [keys.history_key(BASE, "2026-01-01T00:00:00Z")], h)
    assert ops == [] and left == odd


def test_filing_a_pause_prunes_old_episodes_by_their_hour() -> None:
    e = f"{BASE}/ended-pauses/"
    filed = [f"{e}2025-01-{d:02d}T00:00:00Z~{d}" for d in range(1, 21)]
    entry = {"Key": keys.pause_key(BASE), "ModifyIndex": 99,
             "Value": b'{"by": "a@h", "at": "2026-01-01T00:00:00Z"}'}
    ops = deletes(_filing_ops(BASE, entry, filed, datetime(2026, 1, 2, tzinfo=timezone.utc)))
    assert ops == [("check-index", keys.pause_key(BASE)), ("set", keys.episode_key(BASE, "2026-01-01T00:00:00Z", 99)),
                   ("delete-tree", f"{e}2025-01-01T00")], ops
    assert all(consul_takes(key) for _, key in ops)


# --- The manifest's names ------------------------------------------------------------------------------------

def schema_pattern(*path: str) -> str:
    node = SCHEMA
    for part in path:
        node = node[part]
    return node["pattern"]


def test_job_names_and_kv_prefixes_the_schema_allows_are_inside_the_rule() -> None:
    """Every one-character name, and many random ones over a wide alphabet: what the schema takes, Consul takes."""
    patterns = [schema_pattern("$defs", "name"), schema_pattern("properties", "kv_prefix")]
    rng = random.Random(11)
    alphabet = [chr(c) for c in range(32, 127)] + ["\u00e9", "\n", "\t", "\u2603"]
    candidates = alphabet + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 10))) for _ in range(20000)]
    candidates += ["a/b", "a//b", "a/./b", "a/../b", "a..b", "..", ".", "a/b/", "/a"]
    taken = 0
    for text in candidates:
        if kv_prefix_problem(text) is None:
            taken += 1
            key = keys.history_key(keys.job_base(text, "j"), "2026-01-01T00:00:00Z")
            assert consul_takes(text) and consul_takes(key) and keys.is_safe(key), text  # no '..' either
            assert "/../" not in f"/{text}/" and "/./" not in f"/{text}/", text
        for pattern in patterns:
            if re.search(pattern, text):
                assert consul_takes(text), (pattern, text)
    assert taken > 100  # the sample did reach the schema's accepted space


def test_job_names_the_loader_takes_are_inside_the_rule(tmp_path: Path) -> None:
    from consulrun.errors import ConsulrunError
    from consulrun.manifest.loader import load_manifest

    for name in ["backup", "Backup_2.x-y", "a..b", "a:b", "a~b", "a b", "é", "_x", "-x"]:
        path = tmp_path / "jobs.yaml"
        path.write_text(f'jobs:\n  "{name}": {{command: "true", schedule: daily}}\n')
        try:
            load_manifest(path)
        except ConsulrunError:
            continue
        key = keys.history_key(keys.job_base("consulrun", name), "2026-01-01T00:00:00Z")
        assert consul_takes(key) and keys.is_safe(key), name


# --- Nobody builds a key by hand ---------------------------------------------------------------------------------

KEY_DIRECTORIES = ("history/", "ended-pauses/", "clock/", "slots/", "after/", "nodes/")


def _hand_built_keys(path: Path) -> list[str]:
    """f-strings that build a KV key by hand outside keys.py: one that begins with a value and goes on with a
    `/`-path holding a key directory, a `~`, or a `:` (the old keys' characters), or any text holding `~manual`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "~manual" in node.value \
                and "\n" not in node.value:
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")
        if not isinstance(node, ast.JoinedStr) or not node.values or not isinstance(node.values[0], ast.FormattedValue):
            continue
        text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        if not text.startswith("{}/"):
            continue
        if any(d in text for d in KEY_DIRECTORIES) or re.search(r"\{\}[~:]|[~:]\{\}", text):
            found.append(f"{path.name}:{node.lineno}: f{text!r}")
    return found


def test_no_key_is_built_by_hand_outside_the_keys_module() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "keys.py" or path.parent.name != "protocol"
             for hit in _hand_built_keys(path)]
    assert found == []


@pytest.mark.parametrize("source", [
    'key = f"{base}/history/{occ}"',
    'key = f"{base}/ended-pauses/{at}~{index}"',
    'key = f"{prefix}{started}~manual"',
    'ok = key.endswith("~manual")',
    'key = f"{base}/clock/{node}/{me}"',
])
def test_the_hand_built_key_check_can_fail(tmp_path: Path, source: str) -> None:
    path = tmp_path / "mod.py"
    path.write_text(source + "\n")
    assert _hand_built_keys(path), source


def test_hostile_key_names_are_read_in_one_pass_and_never_crash_a_reader() -> None:
    """Red team: a key of 1,200 `,after,` parts overflowed the recursive reader (a RecursionError in the finish,
    so a `retry` job ran one occurrence three times); an index of '²' passed isdigit() and crashed int()."""
    deep = "consulrun/parent/history/x" + ",after,p" * 1200
    assert keys.history_order(deep)[0].count("~after~") == 1200
    assert keys.run_of_segment(keys.run_segment("2026-01-01T00:00:00Z" + "~after~p" * 1200)).count("~after~") == 1200
    assert keys.episode_order("consulrun/j/ended-pauses/20261129T020000Z.\u00b2") == ("2026-11-29T02:00:00Z", 0)
    # A chained run after a job named `x.manual` is a chained run, not a manual one, and is ordered by its time.
    chained = keys.chained_history_key("consulrun/c", "2026-01-01T00:00:00Z~after~x.manual")
    assert not keys.is_manual(chained) and keys.history_order(chained)[0] == "2026-01-01T00:00:00Z~after~x.manual"
