"""The main paths through a Consul that refuses keys as 1.21.5 did: nothing refused is ever sent, and the keys an
older consulrun wrote (`history/<time with ':'>`, `~manual`, `ended-pauses/<at>~<index>`) are still read,
ordered, counted and pruned.

A real dev agent behind the fault proxy in its strict-keys mode (tests/harness/faultproxy.py): every /v1/kv/
path and every KV operation of a transaction is held to `^[a-zA-Z0-9,_./\\-?&=]+$`, refused with Consul's own
400 otherwise. The old keys are seeded straight into the agent, as an older consulrun (or an older Consul that
took them) left them. Each test ends by asserting the proxy refused nothing.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import requests

from consulrun.consul.client import Client, ConsulConfig
from consulrun.protocol import keys as kvkeys
from tests.harness.agents import Agent
from tests.harness.faultproxy import KV_KEY_REFUSED, FaultProxy
from tests.harness.healthchecks import checks, register
from tests.harness.holders import iso
from tests.harness.metrics import samples
from tests.harness.runs import SKIP, cli, consulrun, finish, kv_json, write_manifest

pytestmark = pytest.mark.consul

YEARLY = "*-01-01 00:00:00 UTC"
THIS = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"


@pytest.fixture
def strict(consul: Agent) -> Iterator[FaultProxy]:
    with FaultProxy(consul.http_addr, strict_keys=True) as proxy:
        yield proxy


def via(proxy: FaultProxy) -> dict[str, str]:
    return {"CONSUL_HTTP_ADDR": proxy.address}


def seed(agent: Agent, key: str, value: dict[str, Any]) -> None:
    """Write `key` straight into the agent (v1.16.3 takes any key), as an older consulrun did."""
    assert agent.api("PUT", f"kv/{key}", data=json.dumps(value)).json() is True


def listed(agent: Agent, prefix: str) -> list[str]:
    found = requests.get(f"{agent.url}/v1/kv/{prefix}", params={"keys": "true"}, timeout=10)
    return [] if found.status_code == 404 else found.json()


def done(occurrence: str, **more: Any) -> dict[str, Any]:
    return {"occurrence": occurrence, "state": "done", "exit_status": 0, "node": "dev1", "attempt": 1,
            "started": occurrence, "ended": occurrence, "schedule": [YEARLY], **more}


def sent_ops(proxy: FaultProxy, verb: str) -> list[str]:
    """The keys of every transaction operation `verb` that went through."""
    out = []
    for request in proxy.requests:
        head, _, body = request.partition("\n")
        if head.startswith("PUT /v1/txn") and body:
            out += [op["KV"]["Key"] for op in json.loads(body) if (op.get("KV") or {}).get("Verb") == verb]
    return out


def test_the_proxy_refuses_what_consul_1_21_5_refused(consul: Agent, strict: FaultProxy) -> None:
    """The harness itself: a key with ':' or '~' in a path or a transaction is answered 400 and never forwarded."""
    url = f"http://{strict.address}/v1"
    answer = requests.put(f"{url}/kv/probe/a:b", data="{}", timeout=10)
    assert (answer.status_code, answer.content) == (400, KV_KEY_REFUSED)
    answer = requests.put(f"{url}/txn", json=[{"KV": {"Verb": "set", "Key": "probe/x~manual", "Value": "e30="}}],
                          timeout=10)
    assert (answer.status_code, answer.content) == (400, KV_KEY_REFUSED)
    assert requests.get(f"{url}/kv/probe/a%20b", timeout=10).status_code == 400
    assert listed(consul, "probe/") == []  # nothing refused reached the agent
    assert requests.put(f"{url}/kv/probe/a,b.c_d-e", data="{}", timeout=10).json() is True
    assert requests.get(f"{url}/kv/probe/", params={"recurse": "1"}, timeout=10).status_code == 200
    assert len(strict.refusals) == 3


def test_scheduled_manual_and_takeover_runs_read_and_prune_old_keys_and_write_only_safe_ones(
        consul: Agent, strict: FaultProxy, tmp_path: Path) -> None:
    base = "consulrun/legacy"
    for year in (2020, 2021, 2022):
        seed(consul, f"{base}/history/{year}-01-01T00:00:00Z", done(f"{year}-01-01T00:00:00Z"))
    seed(consul, f"{base}/history/2022-06-01T12:00:00Z~manual",
         {"manual": True, "state": "done", "exit_status": 0, "node": "dev1", "started": "2022-06-01T12:00:00Z",
          "ended": "2022-06-01T12:00:05Z", "requested_by": "op@old"})
    seed(consul, f"{base}/occurrence", done("2022-01-01T00:00:00Z"))

    # A scheduled run: claim, result, history, prune (--history 3: of 2020, 2021, 2022 and this one, 2020 goes).
    code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--history", "3", "legacy", "--", "true",
                                    env=via(strict)))
    assert code == 0, err
    assert sent_ops(strict, "delete-tree") == [f"{base}/history/2020-01-01T00"]
    assert sorted(listed(consul, f"{base}/history/")) == sorted([
        f"{base}/history/2021-01-01T00:00:00Z", f"{base}/history/2022-01-01T00:00:00Z",
        f"{base}/history/2022-06-01T12:00:00Z~manual", kvkeys.history_key(base, THIS)])

    # A manual run (`consulrun trigger`, the unit started by running what its ExecStart= runs), a second later at
    # least: times are recorded to the second, and history orders runs by their start.
    time.sleep(1.1)
    from consulrun.protocol.trigger import trigger

    def start_unit(unit: str) -> subprocess.CompletedProcess[str]:
        code, out, err = finish(consulrun("run", "--schedule", YEARLY, "legacy", "--", "true", env=via(strict)))
        return subprocess.CompletedProcess([unit], code, out, err)

    client = Client(ConsulConfig.from_env({}, address=strict.address))
    outcome = trigger(client, base, "consulrun-legacy.service", wait_s=0, start_unit=start_unit)
    assert outcome.unit_status == 0 and outcome.record and outcome.record["state"] == "done", outcome
    manual_key = kvkeys.history_key(base, outcome.record["started"], manual=True)
    assert manual_key in listed(consul, f"{base}/history/")

    # `history` and `status` see both forms, newest first by time, the old manual run among them.
    code, out, err = cli("history", "legacy", "--json", env=via(strict))
    assert code == 0, err
    rows = json.loads(out)["runs"]
    assert [(r["occurrence"], r["manual"]) for r in rows] == [
        (None, True), (THIS, False), (None, True), ("2022-01-01T00:00:00Z", False), ("2021-01-01T00:00:00Z", False)]
    assert rows[2]["started"] == "2022-06-01T12:00:00Z"
    code, out, err = cli("status", "legacy", "--json", env=via(strict))
    assert code == 0, err

    # The exporter counts every run the history holds, old keys and new.
    prom = tmp_path / "textfile" / "consulrun.prom"
    prom.parent.mkdir()
    code, _, err = finish(consulrun("exporter", "--textfile", str(prom), env=via(strict)))
    assert code == 0, err
    got = samples(prom.read_text())
    assert got[("consulrun_job_runs_total", (("job_name", "legacy"), ("outcome", "success")))] == 5

    # A takeover: this occurrence's record "running" under a session that is gone; retry runs it again, and a
    # failed first attempt is retried (retries.py's own writes).
    record = kv_json(consul, f"{base}/occurrence")
    gone = "00000000-0000-0000-0000-000000000000"
    seed(consul, f"{base}/occurrence", {**record, "state": "running", "session": gone})
    marker = tmp_path / "failed-once"
    code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--history", "3", "--on-holder-loss", "retry",
                                    "--attempts", "2", "--retry-backoff", "0s", "legacy", "--", "sh", "-c",
                                    f"test -e {marker} || {{ touch {marker}; exit 1; }}", env=via(strict)))
    assert code == 0, err
    final = kv_json(consul, kvkeys.history_key(base, THIS))
    assert (final["state"], final["attempt"]) == ("done", 3), final
    assert [(e["state"], e.get("takeover"), e.get("exit_status")) for e in final["earlier"]] == [
        ("abandoned", False, 0), ("done", True, 1)], final["earlier"]
    assert strict.refusals == []
    old = {f"{base}/history/2021-01-01T00:00:00Z", f"{base}/history/2022-01-01T00:00:00Z",
           f"{base}/history/2022-06-01T12:00:00Z~manual"}
    assert [k for k in listed(consul, f"{base}/") if not kvkeys.is_safe(k)] == sorted(old)


def test_a_job_whose_old_history_outlives_the_limit_loses_it_hour_by_hour(consul: Agent, strict: FaultProxy) -> None:
    """Old entries of one hour go together, once every one of them is due; until then they count, as before."""
    base = "consulrun/hourly"
    for minute in (0, 20, 40):
        seed(consul, f"{base}/history/2020-01-01T05:{minute:02d}:00Z", done(f"2020-01-01T05:{minute:02d}:00Z"))
    seed(consul, f"{base}/history/2020-01-01T06:00:00Z", done("2020-01-01T06:00:00Z"))
    code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--history", "3", "hourly", "--", "true",
                                    env=via(strict)))
    assert code == 0, err
    # Due: 05:00 and 05:20 (the newest three are 05:40, 06:00 and this one): 05:40 holds its hour back.
    assert len(listed(consul, f"{base}/history/")) == 5 and sent_ops(strict, "delete-tree") == []
    seed(consul, f"{base}/history/2021-01-01T00:00:00Z", done("2021-01-01T00:00:00Z"))
    requests.delete(f"{consul.url}/v1/kv/{base}/occurrence", timeout=10)  # as if a later occurrence were due
    code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--history", "3", "hourly", "--", "true",
                                    env=via(strict)))
    assert code == 0, err
    assert sent_ops(strict, "delete-tree") == [f"{base}/history/2020-01-01T05"]
    assert sorted(listed(consul, f"{base}/history/")) == sorted([
        f"{base}/history/2020-01-01T06:00:00Z", f"{base}/history/2021-01-01T00:00:00Z", kvkeys.history_key(base, THIS)])
    assert strict.refusals == []


def test_pause_resume_and_skips_file_and_prune_episodes_of_both_forms(consul: Agent, strict: FaultProxy) -> None:
    base = "consulrun/paused"
    for day in range(1, 21):  # as many as are kept, each filed by an older consulrun
        seed(consul, f"{base}/ended-pauses/2022-01-{day:02d}T00:00:00Z~{day}",
             {"by": "a@h", "at": f"2022-01-{day:02d}T00:00:00Z", "ended": f"2022-01-{day:02d}T00:10:00Z"})
    seed(consul, f"{base}/history/2022-01-01T00:00:00Z", done("2022-01-01T00:00:00Z"))
    env = via(strict)
    assert finish(consulrun("pause", "paused", "--reason", "upgrade", env=env))[0] == 0
    code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "paused", "--", "true",
                                    env=env))
    assert code == SKIP and "paused by" in err, err
    code, _, err = finish(consulrun("resume", "paused", env=env))
    assert code == 0, err
    episodes = listed(consul, f"{base}/ended-pauses/")
    assert len(episodes) == 20 and f"{base}/ended-pauses/2022-01-01T00:00:00Z~1" not in episodes, episodes
    new = [k for k in episodes if kvkeys.is_safe(k)]
    assert len(new) == 1 and kvkeys.episode_order(new[0])[0].startswith(str(datetime.now(timezone.utc).year)), new
    assert sent_ops(strict, "delete-tree") == [f"{base}/ended-pauses/2022-01-01T00"]
    code, out, err = cli("history", "paused", "--json", env=env)
    assert code == 0, err
    assert [r["occurrence"] for r in json.loads(out)["runs"]] == ["2022-01-01T00:00:00Z"]
    assert strict.refusals == []


def test_missed_records_and_clock_findings_are_written_with_safe_keys(consul: Agent, strict: FaultProxy) -> None:
    env = via(strict)
    # Missed: this year's occurrence is months past a 1s start deadline.
    code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--start-deadline", "1s", "--skip-exit-code",
                                    str(SKIP), "late", "--", "true", env=env))
    assert code == SKIP and "start_deadline" in err, err
    assert kv_json(consul, kvkeys.history_key("consulrun/late", THIS))["state"] == "missed"
    # A record whose start lies two minutes in this node's future: the skip records a finding about its writer.
    ahead = datetime.now(timezone.utc) + timedelta(minutes=2)
    seed(consul, "consulrun/skewed/occurrence", done(THIS, node="fast node~1", started=iso(ahead), ended=iso(ahead)))
    code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "skewed", "--", "true",
                                    env=env))
    assert code == SKIP and "ahead" in err, err
    code, out, err = cli("status", "skewed", "--json", env=env)
    assert "skew" in out, (out, err)
    seed(consul, "consulrun/skewed/occurrence", done(THIS, node="fast1", started=iso(ahead), ended=iso(ahead)))
    finish(consulrun("run", "--schedule", YEARLY, "--skip-exit-code", str(SKIP), "skewed", "--", "true", env=env))
    assert listed(consul, "consulrun/skewed/clock/") == ["consulrun/skewed/clock/fast1/dev1"]
    assert strict.refusals == []


def test_forget_deletes_old_keys_too(consul: Agent, strict: FaultProxy) -> None:
    base = "consulrun/gone"
    seed(consul, f"{base}/history/2021-01-01T00:00:00Z", done("2021-01-01T00:00:00Z"))
    seed(consul, f"{base}/history/2021-01-01T00:30:00Z~manual", {"manual": True, "started": "2021-01-01T00:30:00Z"})
    seed(consul, f"{base}/ended-pauses/2021-02-01T00:00:00Z~3", {"by": "a@h", "at": "2021-02-01T00:00:00Z"})
    assert finish(consulrun("run", "--schedule", YEARLY, "gone", "--", "true", env=via(strict)))[0] == 0
    before = listed(consul, f"{base}/")
    code, out, err = finish(consulrun("forget", "gone", "--yes", env=via(strict)))
    assert code == 0, err
    assert out == f"gone: forgotten ({len(before)} key(s))\n"
    assert listed(consul, f"{base}/") == []
    assert strict.refusals == []


def test_status_and_the_watchdog_judge_a_job_of_old_keys(catalog: Agent, tmp_path: Path) -> None:  # noqa: F811
    """A job last run by an older consulrun: status and the watchdog read its old keys through a strict Consul."""
    manifest = write_manifest(tmp_path, f'  old: {{command: "true", schedule: "{YEARLY}"}}\n', "health_checks: true\n")
    register(catalog)
    seed(catalog, "consulrun/old/history/2025-01-01T00:00:00Z", done("2025-01-01T00:00:00Z"))
    seed(catalog, "consulrun/old/occurrence", done(THIS))
    seed(catalog, f"consulrun/old/history/{THIS}", done(THIS))
    with FaultProxy(catalog.http_addr, strict_keys=True) as strict:
        code, out, err = cli("status", str(manifest), "--json", env=via(strict))
        assert code == 0, (out, err)
        code, _, err = cli("watchdog", str(manifest), "--grace", "1s", env=via(strict))
        assert code == 0, err
        assert checks(catalog)["old"]["Status"] == "passing"
        code, out, err = cli("history", "old", env=via(strict))
        assert code == 0 and THIS in out and "2025-01-01T00:00:00Z" in out, (out, err)
        assert strict.refusals == []
    assert strict.requests  # the requests did go through the proxy


def test_more_slots_than_one_are_named_safely(consul: Agent, strict: FaultProxy) -> None:
    code, _, err = finish(consulrun("run", "--concurrency", "2", "slotted", "--", "true", env=via(strict)))
    assert code == 0, err
    assert all(kvkeys.is_safe(k) for k in listed(consul, "consulrun/slotted/"))
    assert strict.refusals == []


def test_a_key_consul_refuses_is_a_plain_error_not_a_retry(consul: Agent, strict: FaultProxy) -> None:
    """What a refusal looks like to consulrun, should one ever slip through: one line, not 'Consul unavailable'."""
    client = Client(ConsulConfig.from_env({}, address=strict.address))
    from consulrun.errors import ConsulProtocolError

    with pytest.raises(ConsulProtocolError, match="invalid key name"):
        client.kv_get("consulrun/x/history/2026-01-01T00:00:00Z")
    assert len(strict.refusals) == 1
    with FaultProxy(consul.http_addr, strict_keys=True, refused_status=500) as as_500:  # as #22835's UI showed it
        from consulrun.errors import ConsulUnavailable

        with pytest.raises(ConsulUnavailable, match="invalid key name") as raised:
            Client(ConsulConfig.from_env({}, address=as_500.address)).kv_get("consulrun/x/a b")
        assert not raised.value.transient  # not an election: no retrying for minutes


def test_chains_and_each_node_runs_write_only_safe_keys(consul: Agent, strict: FaultProxy, tmp_path: Path) -> None:
    """The keys issue 29 added: a chain's request and the chained run's history entry (`after/<parent>/<run>`,
    `history/<run>,after,<parent>`), an each-node job's per-node record and history (`nodes/<node>/...`)."""
    code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--then", "kid:always", "mom", "--", "true",
                                    env=via(strict)))
    assert code == 0, err
    assert listed(consul, "consulrun/kid/after/") == [kvkeys.chain_request_key("consulrun/kid", "mom", THIS)]
    code, _, err = finish(consulrun("run", "--then", "grandkid:always", "--after", "mom", "kid", "--",
                                    "sh", "-c", f"echo $CONSULRUN_OCCURRENCE > {tmp_path}/kid", env=via(strict)))
    assert code == 0, err
    run = f"{THIS}~after~mom"
    assert (tmp_path / "kid").read_text() == run + "\n"  # the id in values is as before: only keys changed
    assert listed(consul, "consulrun/kid/history/") == [kvkeys.chained_history_key("consulrun/kid", run)]
    # A chain of chains nests: the grandchild's request names the child's run.
    assert listed(consul, "consulrun/grandkid/after/") == [kvkeys.chain_request_key("consulrun/grandkid", "kid", run)]
    assert kvkeys.run_of_segment(listed(consul, "consulrun/grandkid/after/")[0].rsplit("/", 1)[1]) == run
    code, out, err = cli("history", "kid", "--json", env=via(strict))
    assert code == 0 and json.loads(out)["runs"][0]["occurrence"] == run, (out, err)

    code, _, err = finish(consulrun("run", "--each-node", "--schedule", YEARLY, "rolling", "--", "true",
                                    env=via(strict)))
    assert code == 0, err
    written = listed(consul, "consulrun/rolling/")
    assert kvkeys.node_prefix("consulrun/rolling", "dev1") + "occurrence" in written, written
    assert kvkeys.entry_key(kvkeys.node_prefix("consulrun/rolling", "dev1") + "history/", THIS) in written, written
    code, out, err = cli("status", "rolling", "--json", env=via(strict))
    assert code == 0 and json.loads(out)["jobs"][0]["nodes"][0]["node"] == "dev1", (out, err)
    assert all(kvkeys.is_safe(k) for k in [*written, *listed(consul, "consulrun/kid/"),
                                           *listed(consul, "consulrun/grandkid/"), *listed(consul, "consulrun/mom/")])
    assert strict.refusals == []


def test_a_hostile_history_key_neither_crashes_the_finish_nor_repeats_the_run(consul: Agent, tmp_path: Path) -> None:
    """Red team, session 11: `history/x,after,p,after,p,...` (1,200 parts) made every finish of a `retry` job
    crash in its pruning, the result unrecorded, so the next run took the occurrence over and ran it again."""
    seed(consul, "consulrun/deep/history/x" + ",after,p" * 1200, {"junk": True})
    ran = tmp_path / "ran"
    for _ in range(2):
        code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--on-holder-loss", "retry", "deep", "--",
                                        "sh", "-c", f"echo x >> {ran}"))
        assert code == 0 and "Traceback" not in err, err
    assert ran.read_text() == "x\n"  # once: the second run found the occurrence done
    assert kv_json(consul, "consulrun/deep/occurrence")["state"] == "done"
