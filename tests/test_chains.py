"""Job chains (`after:`): the manifest's refusals, the units, and the protocol on a real dev agent."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import threading
from datetime import datetime, timezone
import time
from pathlib import Path

import pytest
import requests

from consulrun.protocol.keys import stamp
from consulrun.errors import ManifestError
from consulrun.manifest.loader import parse_manifest
from tests.harness.agents import Agent, Cluster, wait_for
from tests.harness.runs import consulrun, finish, kv_json

YEARLY = "*-01-01 00:00:00 UTC"  # an occurrence that is always in the past and long before the next


def _messages(text: str) -> str:
    with pytest.raises(ManifestError) as caught:
        parse_manifest(text, "m.yaml")
    return "\n".join(caught.value.problems)


def _put(consul: Agent, key: str, value: str) -> None:
    consul.api("PUT", f"kv/{key}", data=value.encode())


JOBS = "jobs:\n  a:\n    command: /bin/true\n    schedule: daily\n"


@pytest.mark.parametrize(("after", "where", "said"), [
    ("[zz]", "m.yaml:7:13: jobs.b.after[0]", "unknown job 'zz'"),
    ("[aa]", "m.yaml:7:13: jobs.b.after[0]", "unknown job 'aa' (did you mean 'a'?)"),
    ("[b]", "m.yaml:7:13: jobs.b.after[0]", "job 'b' cannot run after itself"),
    ("[a, {job: a, on: failure}]", "m.yaml:7:22: jobs.b.after[1].job", "names job 'a' twice"),
    ("[{job: a, on: never}]", "m.yaml:7:13: jobs.b.after[0]",
     "{'job': 'a', 'on': 'never'} must be a job name or a mapping"),
])
def test_after_refuses_unknown_self_and_twice_with_file_line_and_field(after: str, where: str, said: str) -> None:
    text = JOBS + f"  b:\n    command: /bin/true\n    after: {after}\n"
    message = _messages(text)
    assert f"{where}: {said}" in message, message


def test_a_cycle_is_refused_at_the_entry_that_closes_it_with_the_loop_spelled_out() -> None:
    text = JOBS + ("  b:\n    command: /bin/true\n    after: [c]\n"
                   "  c:\n    command: /bin/true\n    after:\n      - job: d\n        on: always\n"
                   "  d:\n    command: /bin/true\n    after: [b, a]\n")
    message = _messages(text)
    loop = "m.yaml:15:13: jobs.d.after[0]: a cycle: 'b' runs after 'c' runs after 'd' runs after 'b'"
    assert loop in message, message
    assert message.count("a cycle") == 1, message


def test_a_job_needs_a_schedule_or_after_and_a_chain_needs_one_holder() -> None:
    assert "jobs.b: missing required key 'schedule'" in _messages(JOBS + "  b:\n    command: /bin/true\n")
    text = JOBS + "  b:\n    command: /bin/true\n    after: [a]\n    lock: {concurrency: 2}\n"
    assert "jobs.b.after[0]: it runs with lock.concurrency above 1" in _messages(text)
    many = JOBS + "".join(f"  c{i}:\n    command: /bin/true\n    after: [a]\n" for i in range(33))
    assert "jobs.c32.after[0]: job 'a' has more than 32 jobs after it" in _messages(many)  # one txn holds them
    parse_manifest(JOBS + "".join(f"  c{i}:\n    command: /bin/true\n    after: [a]\n" for i in range(32)), "m.yaml")


def test_after_takes_names_and_mappings_and_on_is_a_word_not_yaml_s_boolean() -> None:
    text = JOBS + ("  b:\n    command: /bin/true\n    after: [a]\n"
                   "  c:\n    command: /bin/true\n    schedule: weekly\n"
                   "    after:\n      - job: b\n        on: failure\n"
                   "      - {job: a, on: always}\n")
    manifest = parse_manifest(text, "m.yaml")
    jobs = {job.name: job for job in manifest.jobs}
    assert jobs["b"].after == (("a", "success"),) and jobs["b"].schedules == ()
    assert jobs["c"].after == (("b", "failure"), ("a", "always")) and jobs["c"].schedules == ("weekly",)


def test_units_join_parent_and_child_and_an_after_only_job_has_a_watcher_and_no_timer() -> None:
    from consulrun.units.render import render

    text = JOBS + ("  b:\n    command: /bin/true\n    after: [{job: a, on: always}]\n    nodes: {names: [n1]}\n"
                   "  c:\n    command: /bin/true\n    schedule: weekly\n    after: [b]\n")
    units = render(parse_manifest(text, "m.yaml"), "/usr/bin/consulrun")
    assert "consulrun-b.timer" not in units and "consulrun-c.timer" in units
    assert " --then b:always " in units["consulrun-a.service"]
    assert " --after a --then c:success " in units["consulrun-b.service"]
    watcher = units["consulrun-after@b.service"]
    assert "ExecStart=/usr/bin/consulrun chain-watch --prefix consulrun --unit consulrun-b.service --node-name n1 b" \
        in watcher and "Restart=always" in watcher and "WantedBy=multi-user.target" in watcher
    assert "consulrun-after@a.service" not in units and "consulrun-after@c.service" in units


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return finish(consulrun("run", *args, env=env))


def _parent(tmp: Path, status: int = 0, *extra: str) -> tuple[int, str, str]:
    return _run("--schedule", YEARLY, *extra, "--then", "child:success", "--then", "onfail:failure", "parent", "--",
                "sh", "-c", f"echo parent >> {tmp}/parent; exit {status}")


def _child(tmp: Path, name: str = "child", *extra: str) -> tuple[int, str, str]:
    env_line = "$CONSULRUN_PARENT_JOB $CONSULRUN_PARENT_OCCURRENCE $CONSULRUN_PARENT_STATE " \
               "$CONSULRUN_PARENT_EXIT_STATUS $CONSULRUN_OCCURRENCE"
    return _run("--after", "parent", *extra, name, "--", "sh", "-c", f'echo "{env_line}" >> {tmp}/{name}')


@pytest.mark.consul
def test_a_parent_s_end_is_a_request_written_with_its_result_and_the_child_runs_once_for_it(
        consul: Agent, tmp_path: Path) -> None:
    from datetime import datetime, timezone

    occ = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"
    code, _, err = _child(tmp_path)
    assert code == 0 and "no run after parent is pending" in err, err  # nothing asked: a skip, nothing written
    code, _, err = _parent(tmp_path)
    assert code == 0, err
    request = kv_json(consul, f"consulrun/child/after/parent/{stamp(occ)}")
    assert request and request["parent"] == "parent" and request["run"] == occ, request
    assert request["state"] == "done" and request["exit_status"] == 0 and request["node"] == "dev1", request
    assert kv_json(consul, f"consulrun/onfail/after/parent/{stamp(occ)}") is None  # on: failure, and it succeeded
    # The request and the parent's result came in one transaction: the same index.
    record = consul.get("kv/consulrun/parent/history/" + stamp(occ))
    req_entry = consul.get(f"kv/consulrun/child/after/parent/{stamp(occ)}")
    assert record[0]["ModifyIndex"] == req_entry[0]["ModifyIndex"], (record, req_entry)

    code, _, err = _child(tmp_path)
    assert code == 0, err
    # The journal line names the parent's run (it said "parent's None" once the request's field became `run`).
    assert f"acquired consulrun/child/lock for the run after parent's {occ} (node dev1," in err, err
    assert (tmp_path / "child").read_text() == f"parent {occ} done 0 {occ}~after~parent\n"
    assert kv_json(consul, f"consulrun/child/after/parent/{stamp(occ)}") is None  # consumed
    entry = kv_json(consul, f"consulrun/child/history/{stamp(occ)},after,parent")
    assert entry and entry["state"] == "done" and entry["exit_status"] == 0, entry
    assert entry["after"] == {"job": "parent", "run": occ, "state": "done", "exit_status": 0, "node": "dev1",
                              "ended": request["ended"]}, entry
    code, _, err = _child(tmp_path)  # once: nothing more is pending
    assert code == 0 and "no run after parent is pending" in err, err
    assert (tmp_path / "child").read_text().count("\n") == 1

    # Written again (a forged or re-recorded request): its history entry keeps the run to one.
    _put(consul, f"consulrun/child/after/parent/{stamp(occ)}", base64.b64decode(req_entry[0]["Value"]).decode())
    code, _, err = _child(tmp_path)
    assert code == 0 and "has run already" in err, err
    assert (tmp_path / "child").read_text().count("\n") == 1
    assert kv_json(consul, f"consulrun/child/after/parent/{stamp(occ)}") is None  # the spent request removed

    code, out, err = finish(consulrun("history", "--prefix", "consulrun", "child"))
    assert code == 0 and f"after parent {occ} (exit 0)" in out, (out, err)
    code, out, err = finish(consulrun("status", "--prefix", "consulrun", "child"))
    row = next((line for line in out.splitlines() if line.startswith("child ")), "")
    assert f"{occ}~after~parent" in row and "exit 0 in" in row and "on dev1" in row, (out, err)
    (tmp_path / "m.yaml").write_text(JOBS.replace("a:", "parent:") + "  child:\n    command: /bin/true\n"
                                     "    after: [parent]\n")
    code, out, err = finish(consulrun("status", str(tmp_path / "m.yaml")))  # the manifest's child has no schedule
    row = next((line for line in out.splitlines() if line.startswith("child ")), "")
    assert f"{occ}~after~parent" in row and row.rstrip().endswith("-"), (out, err)  # no NEXT: nothing it is due by


@pytest.mark.consul
def test_a_child_s_skips_make_no_raft_writes(consul: Agent, tmp_path: Path) -> None:
    """Started with nothing pending, or with the job running: reads only, no session, no write (the least of
    three tries: the agent's own writes may land in one window, not in all)."""

    def skip_writes(said: str) -> int:
        deltas = []
        for _ in range(3):
            before = requests_index(consul)
            code, _, err = _child(tmp_path)
            assert code == 0 and said in err, err
            deltas.append(requests_index(consul) - before)
        return min(deltas)

    assert skip_writes("no run after parent is pending") == 0
    assert _parent(tmp_path)[0] == 0
    started, go = tmp_path / "started", tmp_path / "go"
    holder = consulrun("run", "--schedule", YEARLY, "child", "--", "sh", "-c",
                       f"touch {started}; while [ ! -e {go} ]; do sleep 0.1; done")
    try:
        wait_for(started.exists, 20, "the child's own occurrence to run")
        assert skip_writes("is pending, but the job is running") == 0
    finally:
        go.touch()
        finish(holder)


@pytest.mark.consul
def test_on_failure_follows_a_failed_final_attempt_and_not_the_retried_ones(consul: Agent, tmp_path: Path) -> None:
    from datetime import datetime, timezone

    occ = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"
    code, _, err = _parent(tmp_path, 3, "--attempts", "2", "--retry-backoff", "0s")
    assert code == 3, err
    assert (tmp_path / "parent").read_text() == "parent\nparent\n"
    assert kv_json(consul, f"consulrun/child/after/parent/{stamp(occ)}") is None  # on: success
    request = kv_json(consul, f"consulrun/onfail/after/parent/{stamp(occ)}")
    assert request and request["exit_status"] == 3, request
    code, _, err = _child(tmp_path, "onfail")
    assert code == 0, err
    assert (tmp_path / "onfail").read_text() == f"parent {occ} done 3 {occ}~after~parent\n"


@pytest.mark.consul
def test_a_chained_run_past_the_child_s_start_deadline_is_recorded_missed_and_a_paused_one_skipped(
        consul: Agent, tmp_path: Path) -> None:
    import json

    def request(occ: str, ended: str) -> None:
        _put(consul, f"consulrun/child/after/parent/{stamp(occ)}", json.dumps(
            {"parent": "parent", "run": occ, "state": "done", "exit_status": 0, "node": "x", "ended": ended}))

    request("2020-01-01T00:00:00Z", "2020-01-01T00:00:05Z")
    code, _, err = _child(tmp_path, "child", "--start-deadline", "1h")
    assert code == 0 and "recorded it missed" in err, err
    entry = kv_json(consul, "consulrun/child/history/20200101T000000Z,after,parent")
    assert entry and entry["state"] == "missed" and "start_deadline" in entry["reason"], entry
    assert not (tmp_path / "child").exists()
    assert finish(consulrun("pause", "--prefix", "consulrun", "child"))[0] == 0
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    request("2026-01-01T00:00:00Z", now)
    code, _, err = _child(tmp_path)
    assert code == 0 and "recorded it skipped" in err, err
    assert not (tmp_path / "child").exists()
    assert kv_json(consul, "consulrun/child/after/parent/20260101T000000Z") is None


@pytest.mark.consul
def test_a_chained_run_keeps_to_the_child_s_placement(consul: Agent, tmp_path: Path) -> None:
    """On a node the child may not run on, neither its run nor its watcher takes the request."""
    from datetime import datetime, timezone

    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.manifest.placement import Placement
    from consulrun.protocol.chainwatch import _may_run_here

    occ = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"
    assert _parent(tmp_path)[0] == 0
    code, _, err = _child(tmp_path, "child", "--node-name", "elsewhere")
    assert code == 0 and "is not one the job runs on" in err, err
    assert kv_json(consul, f"consulrun/child/after/parent/{stamp(occ)}") is not None and not (tmp_path / "child").exists()
    client = Client(ConsulConfig.from_env({}, address=consul.http_addr))
    assert not _may_run_here(client, Placement(names=("elsewhere",)))
    assert _may_run_here(client, Placement(names=("dev*",)))
    assert _child(tmp_path, "child", "--node-name", "dev*")[0] == 0 and (tmp_path / "child").exists()


@pytest.mark.consul
def test_chained_runs_keep_the_history_to_its_size(consul: Agent, tmp_path: Path) -> None:
    import json

    for occ in ("2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z"):
        _put(consul, f"consulrun/child/after/parent/{stamp(occ)}", json.dumps(
            {"parent": "parent", "run": occ, "state": "done", "exit_status": 0, "node": "x", "ended": occ}))
        code, _, err = _child(tmp_path, "child", "--history", "2")
        assert code == 0, err
    keys = consul.get("kv/consulrun/child/history/", params={"keys": ""})
    assert keys == ["consulrun/child/history/20260102T000000Z,after,parent",
                    "consulrun/child/history/20260103T000000Z,after,parent"], keys


@pytest.mark.consul
def test_the_watcher_starts_the_unit_for_a_request_and_writes_nothing_while_idle(consul: Agent,
                                                                                 tmp_path: Path) -> None:
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.protocol.chainwatch import watch

    started: list[str] = []

    def start_unit(unit: str) -> subprocess.CompletedProcess[str]:
        started.append(unit)
        code, out, err = _child(tmp_path)
        return subprocess.CompletedProcess([unit], code, out, err)

    stop = threading.Event()
    client = Client(ConsulConfig.from_env({}, address=consul.http_addr))
    before = our_tables_index(consul)
    thread = threading.Thread(target=watch, args=(client, "consulrun/child", "consulrun-child.service", start_unit),
                              kwargs={"stop": stop.is_set}, daemon=True)
    thread.start()
    try:
        time.sleep(2)  # idle: the watcher blocks on its read (a wall-clock wait only to give it the chance to write)
        assert our_tables_index(consul) == before, "the idle watcher wrote"
        assert started == []
        code, _, err = _parent(tmp_path)
        assert code == 0, err
        wait_for(lambda: (tmp_path / "child").exists(), 30, "the chained run")
        assert started == ["consulrun-child.service"]
    finally:
        stop.set()
        _put(consul, "consulrun/child/after/wake", "x")  # ends the blocking read
        thread.join(timeout=30)


@pytest.mark.consul
def test_a_chain_of_chains_runs_its_last_job_once(consul: Agent, tmp_path: Path) -> None:
    """a -> b -> c: b's run is itself a parent, whose run id is `<occurrence>~after~a`, no time; its request
    and c's record of it must be read as well-formed (a new user found c never ran, the request refused)."""
    occ = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"
    assert _run("--schedule", YEARLY, "--then", "b:success", "a", "--", "true")[0] == 0
    code, _, err = _run("--after", "a", "--then", "c:always", "b", "--", "true")
    assert code == 0, err
    code, _, err = _run("--after", "b", "c", "--", "sh", "-c",
                        f'echo "$CONSULRUN_PARENT_OCCURRENCE $CONSULRUN_OCCURRENCE" > {tmp_path}/c')
    assert code == 0 and "ignoring" not in err, err
    assert (tmp_path / "c").read_text() == f"{occ}~after~a {occ}~after~a~after~b\n"
    code, out, err = finish(consulrun("history", "--prefix", "consulrun", "c"))
    assert code == 0 and f"after b {occ}~after~a (exit 0)" in out, (out, err)
    assert _run("--after", "b", "c", "--", "true")[2].count("no run after b is pending") == 1  # once


@pytest.mark.consul
def test_the_watcher_starts_nothing_for_a_malformed_request(consul: Agent, tmp_path: Path) -> None:
    """Anyone with KV write can put a key under after/: the watcher says so and waits, rather than starting
    the unit for it over and over (each start would skip: a new user saw it loop)."""
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.protocol.chainwatch import watch

    started: list[str] = []

    def start_unit(unit: str) -> subprocess.CompletedProcess[str]:
        started.append(unit)
        code, out, err = _child(tmp_path)
        return subprocess.CompletedProcess([unit], code, out, err)

    _put(consul, "consulrun/child/after/parent/20200101T000000Z", '{"parent": "someone else"}')
    stop = threading.Event()
    client = Client(ConsulConfig.from_env({}, address=consul.http_addr))
    thread = threading.Thread(target=watch, args=(client, "consulrun/child", "consulrun-child.service", start_unit),
                              kwargs={"stop": stop.is_set}, daemon=True)
    thread.start()
    try:
        time.sleep(3)  # given the chance (it would start the unit at once, and again after 2 s)
        assert started == []
        code, _, err = _parent(tmp_path)  # a well-formed request: the watcher is alive and starts the unit
        assert code == 0, err
        wait_for(lambda: (tmp_path / "child").exists(), 30, "the chained run")
        assert started == ["consulrun-child.service"]
    finally:
        stop.set()
        _put(consul, "consulrun/child/after/wake", "x")
        thread.join(timeout=30)


@pytest.mark.consul
def test_a_parent_run_found_dead_by_the_next_occurrence_asks_for_its_failure_children(consul: Agent,
                                                                                       tmp_path: Path) -> None:
    """Red team: under skip, a run whose runner died is closed as abandoned by the next occurrence's claim; that
    close asked for no chained run, so `on: failure`/`always` children never ran for it."""
    import json

    this = datetime.now(timezone.utc).year
    assert _run("--schedule", YEARLY, "parent", "--", "true")[0] == 0
    record = kv_json(consul, "consulrun/parent/occurrence")
    # As a runner that died mid-run last year left it: running, its session long gone.
    _put(consul, "consulrun/parent/occurrence", json.dumps({**record, "occurrence": f"{this - 1}-01-01T00:00:00Z",
                                                             "state": "running", "ended": None, "exit_status": None,
                                                             "session": "00000000-0000-0000-0000-000000000000"}))
    code, _, err = _run("--schedule", YEARLY, "--then", "onfail:failure", "--then", "ok:success", "parent", "--",
                        "true")
    assert code == 0, err
    last = f"{this - 1}-01-01T00:00:00Z"
    assert kv_json(consul, f"consulrun/parent/history/{stamp(last)}")["state"] == "abandoned"
    asked = kv_json(consul, f"consulrun/onfail/after/parent/{stamp(last)}")
    assert asked and asked["state"] == "abandoned", asked
    assert kv_json(consul, f"consulrun/ok/after/parent/{stamp(last)}") is None
    assert kv_json(consul, f"consulrun/ok/after/parent/{stamp(f'{this}-01-01T00:00:00Z')}") is not None  # this year's


@pytest.mark.consul
def test_a_late_result_over_an_abandoned_guess_asks_for_no_second_end(consul: Agent, tmp_path: Path) -> None:
    """Red team: another node recorded the run abandoned (its session gone; under skip that is final, and asked
    for the failure children), then the runner's own late result landed over it and asked for the success
    children too: one parent run, both ends. The first recorded end is the one the children get."""
    import requests

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    thens = ["--then", "ok:success", "--then", "onfail:failure"]
    parent = consulrun("run", "--schedule", YEARLY, *thens, "parent", "--", "true",
                       env={"CONSULRUN_TEST_HOOK_DIR": str(hooks), "CONSULRUN_TEST_PAUSE": "releasing"})
    wait_for(lambda: (hooks / "releasing").exists(), 60, "the parent between its job's end and its result")
    session = consul.get("kv/consulrun/parent/lock")[0]["Session"]
    requests.put(f"{consul.url}/v1/session/destroy/{session}", timeout=10)
    code, _, err = _run("--schedule", YEARLY, *thens, "parent", "--", "true")  # another node's timer: it finds it dead
    assert code == 0, err
    occ = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"
    assert kv_json(consul, f"consulrun/onfail/after/parent/{stamp(occ)}") is not None
    (hooks / "releasing.go").touch()
    code, _, err = finish(parent)
    assert code == 0 and "the result is recorded (exit status 0)" in err, err
    assert kv_json(consul, f"consulrun/parent/history/{stamp(occ)}")["state"] == "done"  # what really happened
    assert kv_json(consul, f"consulrun/ok/after/parent/{stamp(occ)}") is None  # but no second end


@pytest.mark.consul
def test_a_chained_run_stopped_before_its_job_started_gives_its_request_back(consul: Agent, tmp_path: Path) -> None:
    """Red team: a stop between the claim and the fork recorded the chained run lost, used up the parent's end
    and asked for the child's own failure children; now the request goes back and a node runs it."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    assert _run("--schedule", YEARLY, "--then", "child:success", "parent", "--", "true")[0] == 0
    child = consulrun("run", "--after", "parent", "--then", "grand:failure", "child", "--", "touch",
                      str(tmp_path / "ran"), env={"CONSULRUN_TEST_HOOK_DIR": str(hooks), "CONSULRUN_TEST_PAUSE": "acquired"})
    wait_for(lambda: (hooks / "acquired").exists(), 60, "the child holding the lock, its job not started")
    child.send_signal(signal.SIGTERM)  # systemctl stop, a shutdown, right after the claim
    code, _, err = finish(child)
    assert code == 143 and not (tmp_path / "ran").exists(), err
    occ = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"
    assert kv_json(consul, f"consulrun/child/after/parent/{stamp(occ)}") is not None  # given back
    assert kv_json(consul, f"consulrun/child/history/{stamp(occ)},after,parent") is None
    code, _, err = _run("--after", "parent", "--then", "grand:failure", "child", "--", "touch", str(tmp_path / "ran"))
    assert code == 0 and (tmp_path / "ran").exists(), err
    assert kv_json(consul, f"consulrun/grand/after/child/{stamp(occ)},after,parent") is None  # it succeeded


@pytest.mark.consul
def test_a_request_left_while_no_node_watched_runs_when_a_watcher_comes_back(consul: Agent, tmp_path: Path) -> None:
    """Every node with the child was down when the parent ended: the request waits; the first watcher that
    starts runs it. A request from a job the child no longer runs after is removed, not run."""
    import json

    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.protocol.chainwatch import watch

    assert _parent(tmp_path)[0] == 0  # nobody watches
    _put(consul, "consulrun/child/after/gone/20260101T000000Z", json.dumps(
        {"parent": "gone", "run": "2026-01-01T00:00:00Z", "state": "done", "exit_status": 0, "node": "x",
         "ended": "2026-01-01T00:00:01Z"}))

    def start_unit(unit: str) -> subprocess.CompletedProcess[str]:
        code, out, err = _child(tmp_path)
        return subprocess.CompletedProcess([unit], code, out, err)

    stop = threading.Event()
    thread = threading.Thread(target=watch, daemon=True, kwargs={"stop": stop.is_set},
                              args=(Client(ConsulConfig.from_env({}, address=consul.http_addr)), "consulrun/child",
                                    "consulrun-child.service", start_unit))
    thread.start()
    try:
        wait_for(lambda: (tmp_path / "child").exists() and requests_pending(consul) == 0, 60,
                 "the waiting request to run and the unwanted one to go")
        assert (tmp_path / "child").read_text().count("\n") == 1
    finally:
        stop.set()
        _put(consul, "consulrun/child/after/wake", "x")
        thread.join(timeout=30)


def requests_pending(consul: Agent) -> int:
    import requests

    response = requests.get(f"{consul.url}/v1/kv/consulrun/child/after/?keys", timeout=10)
    return 0 if response.status_code == 404 else len(response.json())


def our_tables_index(consul: Agent) -> tuple[int, int]:
    """The indexes of the KV keys under consulrun/ and of the session table: a write by a watcher (a key, a
    session) moves one of them; the agent's own catalog syncs, which move Raft's applied index at any moment
    (the idle test failed on them under load), do not."""
    kv = requests.get(f"{consul.url}/v1/kv/consulrun/", params={"keys": "true"}, timeout=10)  # 404: none
    sessions = consul.api("GET", "session/list")
    return int(kv.headers["X-Consul-Index"]), int(sessions.headers["X-Consul-Index"])


def requests_index(consul: Agent) -> int:
    """Raft's applied index as the dev agent reports it: it grows with every write."""
    return int(consul.get("agent/self")["Stats"]["raft"]["applied_index"])


@pytest.mark.cluster
def test_the_parent_s_node_dies_right_after_finishing_and_the_child_runs_once_elsewhere(cluster: Cluster,
                                                                                       tmp_path: Path) -> None:
    """A runs on node2, whose agent is killed the moment A's wrapper exits; B is installed on node1 and node3,
    each with its watcher: the request A's result wrote survives node2, both watchers see it and start B, and
    B runs once, on one of them."""
    from consulrun.consul.client import Client, ConsulConfig
    from consulrun.protocol.chainwatch import watch

    node1 = cluster.server
    node2, node3 = cluster.clients
    env = {"CONSUL_HTTP_ADDR": "127.0.0.1:8500"}
    ran = tmp_path / "ran"
    calls: list[str] = []
    in_flight = [0]

    def starter(agent: Agent):  # noqa: ANN202 - what systemctl start of B's unit does on that node
        def start_unit(unit: str) -> subprocess.CompletedProcess[str]:
            calls.append(agent.name)
            in_flight[0] += 1
            try:
                code, out, err = finish(consulrun("run", "--after", "a", "b", "--", "sh", "-c",
                                                  f'echo "$CONSULRUN_PARENT_OCCURRENCE {agent.name}" >> {ran}',
                                                  env=env, netns=agent.netns), timeout=120)
            finally:
                in_flight[0] -= 1
            return subprocess.CompletedProcess([unit], code, out, err)
        return start_unit

    stop = threading.Event()
    watchers = [threading.Thread(target=watch, daemon=True, kwargs={"stop": stop.is_set}, args=(
        Client(ConsulConfig.from_env({}, address=agent.http_addr)), "consulrun/b", "consulrun-b.service",
        starter(agent))) for agent in (node1, node3)]
    for thread in watchers:
        thread.start()
    try:
        code, _, err = finish(consulrun("run", "--schedule", YEARLY, "--then", "b:success", "a", "--", "true",
                                        env=env, netns=node2.netns), timeout=120)
        node2.kill()  # right after A's result is recorded: nothing more comes from node2
        assert code == 0, err
        from datetime import datetime, timezone

        occ = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"
        wait_for(lambda: (kv_json(node1, f"consulrun/b/history/{stamp(occ)},after,a") or {})
                 .get("state") == "done", 90, "B's run after A")
        wait_for(lambda: in_flight[0] == 0 and kv_json(node1, f"consulrun/b/after/a/{stamp(occ)}") is None, 60,
                 "the watchers' starts to end")
        lines = ran.read_text().splitlines()
        assert len(lines) == 1 and lines[0].split()[0] == occ and lines[0].split()[1] in ("node1", "node3"), lines
        entry = kv_json(node1, f"consulrun/b/history/{stamp(occ)},after,a")
        assert entry["after"]["node"] == "node2" and entry["node"] == lines[0].split()[1], entry
    finally:
        stop.set()
        for agent in (node1, node3):
            try:
                agent.api("PUT", "kv/consulrun/b/after/wake", data=b"x")  # ends the blocking reads
            except Exception:  # noqa: BLE001 - a teardown nicety
                pass
        for thread in watchers:
            thread.join(timeout=30)


@pytest.mark.systemd
def test_real_timers_run_the_parent_and_the_watcher_unit_runs_the_child_once_for_each(systemd_container,  # noqa: ANN001
                                                                                      consul_bin: str,
                                                                                      tmp_path: Path) -> None:
    """A booted systemd: `feed` on a 3 s timer, `report` with only `after: [feed]` (no timer; its
    consulrun-after@report.service installed, enabled and started). Every feed occurrence that ended is
    followed by one report run for it, through report's own unit, and by no other."""
    import base64
    import json

    from tests.harness.nodes import CONSULRUN, manifest, start_agent, stop_agent_in

    ctr = systemd_container
    agent = start_agent(ctr, consul_bin, "chainnode", ["-dev", "-client", "127.0.0.1", "-bind", "127.0.0.1"],
                        tmp_path / "consul.log")
    log = ctr.shared / "chain-log"
    try:
        jobs = {"feed": {"command": ["sh", "-c", "echo feed $CONSULRUN_OCCURRENCE >> /shared/chain-log"],
                         "schedule": "*:*:0/3"},
                "report": {"command": ["sh", "-c", "echo report $CONSULRUN_PARENT_JOB $CONSULRUN_PARENT_OCCURRENCE "
                                                   "$INVOCATION_ID >> /shared/chain-log"], "after": ["feed"]}}
        (ctr.shared / "chain.yaml").write_text(manifest(jobs))
        ctr.exec(CONSULRUN, "install", "/shared/chain.yaml")
        assert ctr.systemctl("is-active", "consulrun-after@report.service", check=False).stdout.strip() == "active"
        assert ctr.systemctl("cat", "consulrun-report.timer", check=False).returncode != 0  # no timer for it
        wait_for(lambda: log.exists() and log.read_text().count("report feed") >= 2, 60, "two chained runs")
        ctr.systemctl("stop", "consulrun-feed.timer")
        wait_for(lambda: ctr.ended("consulrun-feed.service"), 30, "the last feed run to end")

        def settled() -> bool:
            pending = ctr.exec(consul_bin, "kv", "get", "-recurse", "consulrun/report/after/", check=False).stdout
            return not pending.strip() and ctr.ended("consulrun-report.service")

        wait_for(settled, 60, "every request to be consumed")
        lines = [line.split() for line in log.read_text().splitlines()]
        fed = [line[1] for line in lines if line[0] == "feed"]
        reported = [line[2] for line in lines if line[0] == "report"]
        assert sorted(reported) == sorted(fed) and len(set(reported)) == len(reported), lines
        assert all(len(line) == 4 for line in lines if line[0] == "report"), lines  # run by systemd: INVOCATION_ID
        exported = json.loads(ctr.exec(consul_bin, "kv", "export", "consulrun/report/history/").stdout)
        entries = [json.loads(base64.b64decode(e["value"])) for e in exported]
        assert sorted(e["after"]["run"] for e in entries) == sorted(fed), entries
        assert all(e["state"] == "done" and e["after"]["job"] == "feed" for e in entries), entries
    finally:
        ctr.systemctl("stop", "consulrun-feed.timer", "consulrun-after@report.service", "consulrun-feed.service",
                      "consulrun-report.service", check=False)
        stop_agent_in(ctr, consul_bin, agent)


@pytest.mark.consul
def test_the_not_started_mark_is_never_recorded(consul: Agent, tmp_path: Path) -> None:
    """The runner marks a stop before the fork for its own finish; a plain run's lock value records the outcome,
    without that mark."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    plain = consulrun("run", "plainstop", "--", "true", env={"CONSULRUN_TEST_HOOK_DIR": str(hooks),
                                                              "CONSULRUN_TEST_PAUSE": "acquired"})
    wait_for(lambda: (hooks / "acquired").exists(), 60, "the run holding the lock, its job not started")
    plain.send_signal(signal.SIGTERM)
    code, _, err = finish(plain)
    assert code == 143, err
    last = kv_json(consul, "consulrun/plainstop/lock")["last"]
    assert "before the job started" in last["lost"] and "_not_started" not in last, last


def test_a_chained_job_with_retries_validates_and_generates(tmp_path: Path) -> None:
    """A chained job has no schedule of its own: the checks of how much room a schedule leaves for retries and
    takeovers have nothing to measure, and said nothing; they crashed with a traceback (a new user found it)."""
    from tests.harness.runs import cli

    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n"
                        "  parent: {command: [sh, -c, 'echo parent'], schedule: '*:0/2'}\n"
                        "  child: {command: [sh, -c, 'exit 1'], after: [parent], retries: {attempts: 3, backoff: 5s},"
                        " on_holder_loss: retry}\n")
    code, out, err = cli("validate", str(manifest))
    assert code == 0 and "valid: 2 jobs" in out, (out, err)
    code, out, err = cli("generate", str(manifest), "-o", "-")
    assert code == 0 and "consulrun-child.service" in out, err
