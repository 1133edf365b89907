"""The compiled schema check (fastjsonschema) and jsonschema give the same verdict on every document.

`manifest.validate` trusts the compiled check's "conforms" and asks jsonschema
only for the messages of a document that does not: a document the compiled
check passed but jsonschema would refuse would slip through unreported. These
tests hold the two to one verdict on the committed manifests and on documents
generated around the schema (right and wrong types, unknown keys, bounds).
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consulrun.manifest.schema import SCHEMA, conforms

ROOT = Path(__file__).resolve().parents[1]

_anything = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                         | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
_duration = st.sampled_from(["15s", "1m", "0s", "10", 15, "1h 30min", "-1s", "", "5 parsecs", True, 2.5, "15s\n"])
_names = st.sampled_from(["backup", "job-1", "a_b.c", "Bad Name", "", "x" * 70, "ünï", "-lead", "ok@node", "backup\n"])
_lock = st.fixed_dictionaries({}, optional={
    "ttl": _duration, "lock_delay": _duration, "wait": _duration, "checks": st.lists(st.text(max_size=6), max_size=3)
    | _anything, "concurrency": st.integers(-1, 1002) | _anything, "skip_exit_code": st.integers(-1, 256),
    "bogus": _anything})
_timer = st.fixed_dictionaries({}, optional={
    "accuracy": _duration, "randomized_delay": _duration, "persistent": st.booleans() | _anything, "other": _anything})
_job = st.fixed_dictionaries({}, optional={
    "description": st.text(max_size=10) | _anything,
    "command": st.lists(st.text(max_size=8), max_size=3) | st.text(max_size=12) | _anything,
    "shell": st.booleans() | _anything,
    "schedule": st.sampled_from(["daily", "*:0/5", "Mon 02:00"]) | st.lists(st.text(max_size=6), max_size=2)
    | _anything,
    "user": _names | _anything, "group": _names, "working_directory": st.sampled_from(["/srv", "relative", ""]),
    "environment": st.dictionaries(st.sampled_from(["A", "B_2", "1X", "a b", "A\n"]), st.text(max_size=5) | _anything,
                                   max_size=2),
    "environment_file": st.sampled_from(["/etc/x", "rel", "-/etc/y", "/etc/x\n"]),
    "timeout": _duration, "lock": _lock | _anything, "timer": _timer,
    "service": st.dictionaries(st.sampled_from(["Nice", "CPUQuota", "nice", ""]), _anything, max_size=2),
    "on_holder_loss": st.sampled_from(["retry", "skip", "other"]) | _anything,
    "history": st.integers(-1, 10_001) | _anything,
    "on_failure": st.text(max_size=8) | st.lists(st.text(max_size=5), max_size=2) | _anything,
    "ping_url": st.sampled_from(["https://hc.example/ping/x", "ftp://x", "notaurl", "https://hc.example/x\n"])
    | _anything,
    "unknown": _anything})
_document = st.fixed_dictionaries({}, optional={
    "unit_prefix": _names | _anything,
    "kv_prefix": st.sampled_from(["consulrun", "a/b", "/lead", "", "a/b\n"]) | _anything,
    "consul": st.dictionaries(st.sampled_from(["address", "token_file", "ca_file", "nope"]),
                              st.text(max_size=8) | _anything, max_size=2),
    "defaults": st.fixed_dictionaries({}, optional={"lock": _lock, "timer": _timer, "history": st.integers(0, 3),
                                                    "bogus": _anything}),
    "jobs": st.dictionaries(_names, _job | _anything, max_size=3) | _anything,
    "extra": _anything})


def _agree(document: object) -> None:
    before = copy.deepcopy(document)
    errors = list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(document))
    assert conforms(document) == (not errors), (document, [e.message for e in errors])
    assert document == before, "the compiled check changed the document (defaults filled in?)"


def test_committed_manifests_agree() -> None:
    paths = [*ROOT.glob("examples/*.yaml"), *ROOT.glob("tests/golden/*/manifest.yaml")]
    assert len(paths) >= 4
    for path in paths:
        document = yaml.safe_load(path.read_text())
        _agree(document)
        assert conforms(document), path


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_document)
def test_generated_documents_agree(document: dict) -> None:
    _agree(document)


def test_a_final_newline_gets_one_verdict() -> None:
    """fastjsonschema reads `$` as the true end and jsonschema (Python's re) also before a final newline: with a
    bare `$`, `unit_prefix: "ops\\n"` failed the compiled check and then passed jsonschema's, unreported."""
    for document in ({"unit_prefix": "ops\n", "jobs": {"a": {"command": "x", "schedule": "daily"}}},
                     {"jobs": {"abc\n": {"command": "x", "schedule": "daily"}}},
                     {"jobs": {"a": {"command": "x", "schedule": "daily", "environment": {"FOO\n": "bar"}}}}):
        _agree(document)
        assert not conforms(document)
