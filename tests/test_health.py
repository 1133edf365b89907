"""Each job's health as a Consul health check, against a real Consul agent.

Runs set the check in their finish transaction (no extra Raft write); the
watchdog marks what only a clock sees (missed, overdue, paused) with
check-and-set, and writes nothing when nothing changed.
"""

from __future__ import annotations

import signal
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from consulrun.report import watchdog as health
from consulrun.consul.client import Client, ConsulConfig
from tests.harness.agents import Agent, wait_for
from tests.harness.healthchecks import checks, register
from tests.harness.holders import hold, iso, put
from tests.harness.runs import (
    cli,
    consulrun,
    finish,
    lock_entry,
    raft_applied as _raft_applied,
    write_manifest,
)

pytestmark = pytest.mark.consul

YEARLY = "*-01-01 00:00:00 UTC"


def watchdog(manifest: Path, *args: str) -> tuple[int, str, str]:
    return cli("watchdog", str(manifest), *args)


# --- What a run's finish writes -------------------------------------------------------------------------


def test_run_results_set_the_check_in_the_finish_transaction(catalog: Agent, tmp_path: Path) -> None:
    register(catalog)
    node = catalog.get("catalog/node/consulrun")
    assert node["Node"]["Meta"]["external-node"] == "true" and node["Node"]["Meta"]["external-probe"] == "false"
    assert "consulrun" in node["Services"]

    code, _, err = finish(consulrun("run", "--health-check", "--schedule", YEARLY, "green", "--", "true"))
    assert code == 0, err
    code, _, err = finish(consulrun("run", "--health-check", "--schedule", YEARLY, "red", "--", "sh", "-c", "exit 3"))
    assert code == 3, err
    found = checks(catalog)
    assert found["green"]["Status"] == "passing" and found["green"]["ServiceID"] == "consulrun"
    assert found["green"]["CheckID"] == "job:green"
    occurrence = catalog.get("kv/consulrun/green/occurrence?raw")["occurrence"]
    output = found["green"]["Output"]
    assert output.startswith(f"occurrence {occurrence} ran on dev1: exit status 0 after ") and "s (ended 20" in output
    assert found["red"]["Status"] == "critical" and "exit status 3" in found["red"]["Output"]
    assert "warning" not in err

    # No extra Raft write: a run with the check costs what a run without it costs.
    # The fewest of three tries each: the agent's own periodic writes may land in one window, not in all three.
    deltas: dict[str, list[int]] = {"plain": [], "checked": []}
    for n in range(3):
        for flag, job in (([], "plain"), (["--health-check"], "checked")):
            before = _raft_applied(catalog)
            assert finish(consulrun("run", *flag, "--schedule", YEARLY, f"{job}{n}", "--", "true"))[0] == 0
            deltas[job].append(_raft_applied(catalog) - before)
    assert min(deltas["checked"]) == min(deltas["plain"]) == 4, deltas
    # A node that finds the occurrence done still decides with reads only.
    skips = []
    for _ in range(3):
        before = _raft_applied(catalog)
        code, _, err = finish(consulrun("run", "--health-check", "--skip-exit-code", "42", "--schedule", YEARLY,
                                        "checked0", "--", "true"))
        assert code == 42 and "already ran on dev1" in err, err
        skips.append(_raft_applied(catalog) - before)
    assert min(skips) == 0, skips

    # A run without --schedule sets it too, from the result its lock's value keeps.
    code, _, err = finish(consulrun("run", "--health-check", "adhoc", "--", "sh", "-c", "exit 5"))
    assert code == 5, err
    assert checks(catalog)["adhoc"]["Status"] == "critical"
    assert checks(catalog)["adhoc"]["Output"].startswith("run started 20")

    # The watchdog agrees with what each run wrote: it rewrites none of them (only the "plain" runs get a check).
    written = {name: c["ModifyIndex"] for name, c in checks(catalog).items()}
    code, _, err = cli("watchdog", "--jobs", "{}")
    assert code == 0 and all(f"watchdog: check plain{n}: passing" in err for n in range(3)), err
    assert {name: c["ModifyIndex"] for name, c in checks(catalog).items() if not name.startswith("plain")} == written


def run_cut_off(agent: Agent, job: str, started: Path) -> tuple[int, str]:
    """A scheduled `--health-check` run of `job` whose session is destroyed while the job runs: (status, stderr)."""
    proc = consulrun("run", "--health-check", "--schedule", YEARLY, job, "--", "sh", "-c",
                     f"touch {started}; exec sleep 60")
    wait_for(started.exists, 20, "the job to start")
    agent.api("PUT", f"session/destroy/{lock_entry(agent, f'consulrun/{job}/lock')['Session']}")
    code, _, err = finish(proc)
    return code, err


def test_lost_and_stopped_runs_turn_the_check_critical(catalog: Agent, tmp_path: Path) -> None:
    register(catalog)
    started = tmp_path / "started"
    code, err = run_cut_off(catalog, "fenced", started)
    assert code == 75, err
    check = checks(catalog)["fenced"]
    assert check["Status"] == "critical" and " on dev1 was lost: " in check["Output"], check

    # Stopped by systemd (a timeout, `systemctl stop`): SIGTERM, forwarded to the job, which dies of it.
    started.unlink()
    stopped = consulrun("run", "--health-check", "--schedule", YEARLY, "slow", "--", "sh", "-c",
                        f"touch {started}; sleep 60")
    wait_for(started.exists, 20, "the job to start")
    stopped.send_signal(signal.SIGTERM)
    assert finish(stopped)[0] == 128 + signal.SIGTERM
    check = checks(catalog)["slow"]
    assert check["Status"] == "critical" and "exit status 143" in check["Output"], check
    written = {name: c["ModifyIndex"] for name, c in checks(catalog).items()}
    code, _, err = cli("watchdog", "--jobs", "{}")
    assert code == 0 and "watchdog: check" not in err, err  # a lost run's check, too, is what the watchdog says
    assert {name: c["ModifyIndex"] for name, c in checks(catalog).items()} == written


def test_an_unregistered_node_never_costs_the_result(catalog: Agent) -> None:
    """The check operation fails (no external node yet): the finish is applied without it, one warning line."""
    code, _, err = finish(consulrun("run", "--health-check", "--schedule", YEARLY, "early", "--", "true"))
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "health check" in line]
    assert len(warnings) == 1 and warnings[0].startswith("consulrun: early: the job's Consul health check was not "
                                                         "updated ("), err
    record = catalog.get("kv/consulrun/early/occurrence?raw")
    assert record["state"] == "done" and record["exit_status"] == 0
    assert "Session" not in lock_entry(catalog, "consulrun/early/lock")
    assert catalog.get("session/list") == []


def test_a_result_recorded_after_the_lock_was_lost_drops_a_refused_check_too(catalog: Agent, tmp_path: Path) -> None:
    """The session ends while the job runs and nobody takes the occurrence over: the finish is written outside
    the lock, and a check operation Consul refuses there (no external node yet) is dropped as it is under the
    lock, never taken for a takeover that leaves the occurrence "running"."""
    code, err = run_cut_off(catalog, "cutoff", tmp_path / "started")
    assert code == 75, err
    assert "the lock was no longer ours when the job ended; the result is recorded (lost)" in err, err
    assert "taken over meanwhile" not in err and "the job's Consul health check was not updated (" in err, err
    assert catalog.get("kv/consulrun/cutoff/occurrence?raw")["state"] == "lost"
    assert catalog.get("session/list") == []


def test_a_dead_runner_marked_abandoned_drops_a_refused_check_too(catalog: Agent, tmp_path: Path) -> None:
    """skip: a node finds the occurrence's runner dead and records it abandoned; a check operation Consul refuses
    there (no external node yet) is dropped, as on every other write of a result, never a write retried for ever."""
    import json

    occurrence = f"{datetime.now(timezone.utc).year}-01-01T00:00:00Z"
    dead = {"occurrence": occurrence, "state": "running", "node": "gone",
            "session": "5b8f2f83-0000-4000-8000-000000000002", "started": occurrence,
            "takeover": False, "attempt": 1, "earlier": []}
    catalog.api("PUT", "kv/consulrun/deadhc/occurrence", data=json.dumps(dead))
    ran = tmp_path / "ran"
    code, _, err = finish(consulrun("run", "--health-check", "--schedule", YEARLY, "--skip-exit-code", "42", "deadhc",
                                    "--", "touch", str(ran)), timeout=30)
    assert code == 42 and not ran.exists(), err
    assert f"occurrence {occurrence} was abandoned by gone; recorded" in err, err
    assert "the job's Consul health check was not updated (" in err, err
    assert catalog.get("kv/consulrun/deadhc/occurrence?raw")["state"] == "abandoned"
    assert catalog.get("session/list") == []


# --- The watchdog -------------------------------------------------------------------------------------------


def test_watchdog_marks_missed_overdue_and_paused_and_otherwise_writes_nothing(catalog: Agent, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path, """
  fine: {command: "true", schedule: "*-01-01 00:00:00 UTC"}
  missed: {command: "true", schedule: "minutely"}
  overdue: {command: "true", schedule: "*-01-01 00:00:00 UTC", timeout: 1m}
  paused: {command: "true", schedule: "minutely"}
  never: {command: "true", schedule: "minutely"}
""", "health_checks: true\n")
    now = datetime.now(timezone.utc)
    register(catalog)
    assert finish(consulrun("run", "--health-check", "--schedule", YEARLY, "fine", "--", "true"))[0] == 0
    put(catalog, "consulrun/missed/occurrence", {"occurrence": iso(now - timedelta(hours=1)), "state": "done",
                                                 "node": "dev1", "exit_status": 0, "started": iso(now - timedelta(hours=1)),
                                                 "ended": iso(now - timedelta(hours=1))})
    started = now - timedelta(minutes=10)
    sid = hold(catalog, "overdue", started=iso(started))
    put(catalog, "consulrun/overdue/occurrence", {"occurrence": "2026-01-01T00:00:00Z", "state": "running",
                                                  "node": "dev1", "session": sid, "started": iso(started)})
    assert finish(consulrun("pause", str(manifest), "paused", "--reason", "migration"))[0] == 0  # never run yet
    fine_index = checks(catalog)["fine"]["ModifyIndex"]

    code, _, err = watchdog(manifest, "--grace", "1s")
    assert code == 0, err
    found = checks(catalog)
    # As its run left it, not rewritten: the watchdog derives the same output from the same record.
    assert found["fine"]["Status"] == "passing" and found["fine"]["ModifyIndex"] == fine_index
    assert found["missed"]["Status"] == "critical" and found["missed"]["Output"].startswith("missed: occurrence ")
    assert found["overdue"]["Status"] == "critical"
    assert found["overdue"]["Output"].startswith("overdue: occurrence 2026-01-01T00:00:00Z has run longer than")
    assert found["paused"]["Status"] == "warning" and found["paused"]["Output"].startswith("paused by ")
    assert "migration" in found["paused"]["Output"] and "missed" not in found["paused"]["Output"]
    assert found["never"]["Status"] == "passing" and found["never"]["Output"] == "never run"

    # Nothing changed: the watchdog reads, and writes nothing (the run's own check included).
    passes = []
    for _ in range(3):
        before = _raft_applied(catalog)
        code, _, err = watchdog(manifest, "--grace", "1s")
        assert code == 0 and "watchdog: check" not in err, err
        passes.append(_raft_applied(catalog) - before)
    assert min(passes) == 0, passes

    # Resumed: the pause line goes; the next run's result replaces the missed verdict, and the watchdog agrees.
    assert finish(consulrun("resume", "paused"))[0] == 0
    assert finish(consulrun("run", "--health-check", "--schedule", "minutely", "missed", "--", "true"))[0] == 0
    assert checks(catalog)["missed"]["Status"] == "passing"
    code, _, err = watchdog(manifest, "--grace", "1s")
    assert code == 0, err
    found = checks(catalog)
    assert found["missed"]["Status"] == "passing" and "missed:" not in found["missed"]["Output"]
    assert "paused" not in found["paused"]["Output"]


def test_a_run_finishing_while_the_watchdog_judges_wins(catalog: Agent, tmp_path: Path) -> None:
    """The watchdog reads the checks, a run finishes, the watchdog's check-and-set fails; it judges again."""
    manifest = write_manifest(tmp_path, '  racer: {command: "true", schedule: "minutely", timeout: 1m}\n',
                              "health_checks: true\n")
    register(catalog)
    now = datetime.now(timezone.utc)
    put(catalog, "consulrun/racer/occurrence", {"occurrence": iso(now - timedelta(hours=2)), "state": "done",
                                                "node": "dev1", "exit_status": 0})
    finished: list[bool] = []

    class RunFinishesMeanwhile(Client):
        def node_checks(self, node: str) -> list[dict[str, Any]]:
            seen = super().node_checks(node)
            if not finished:  # after the watchdog's first look at the checks, a run records its result
                finished.append(True)
                assert finish(consulrun("run", "--health-check", "--schedule", "minutely", "racer", "--", "true"))[0] == 0
            return seen

    from consulrun.manifest.loader import load_manifest

    client = RunFinishesMeanwhile(ConsulConfig(address=catalog.http_addr))
    report = health.watchdog(client, "consulrun", health.Watched.from_manifest(load_manifest(manifest)), grace_s=1)
    assert report.changed == []  # its "missed" verdict was older than the run, and judging again found nothing
    assert checks(catalog)["racer"]["Status"] == "passing"


def test_watchdog_runs_under_its_own_lock_as_its_unit_runs_it(catalog: Agent, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path, '  job1: {command: "true", schedule: "minutely"}\n', "health_checks: true\n")
    from consulrun.manifest.loader import load_manifest
    from consulrun.units.owner import identity
    from consulrun.units.render import watchdog_job, watchdog_jobs_name, watchdog_jobs_text
    from consulrun.units.shared import jobs_glob

    loaded = load_manifest(manifest)
    job = watchdog_job(loaded, "consulrun")
    ident = identity(loaded, tmp_path)
    jobs_file = tmp_path / watchdog_jobs_name(loaded, ident)  # the unit finds it as %Y/<glob>: beside the unit
    jobs_file.write_text(watchdog_jobs_text(loaded, ident, "consulrun"))
    assert job.command[-1] == "--jobs-glob"
    argv = ["run", "--schedule", job.schedules[0], "--history", "1", job.name, "--",
            sys.executable, "-m", "consulrun", *job.command[1:], str(tmp_path / jobs_glob(loaded.unit_prefix))]
    code, _, err = finish(consulrun(*argv))
    assert code == 0, err
    assert checks(catalog)["job1"]["Output"] == "never run"
    code, _, err = finish(consulrun(*argv))
    assert code == 0 and "skipped: occurrence" in err, err  # once per minute, on one node
    code, out, _ = cli("status", "--json")
    assert "_watchdog" not in out  # consulrun's own lock is not a job


def test_two_prefixes_with_one_node_name_are_refused_not_fought_over(catalog: Agent, tmp_path: Path) -> None:
    """`a/b` and `a-b` both name the node `a-b`: the second watchdog refuses instead of taking the node over."""
    register(catalog, "team/jobs")
    manifest = write_manifest(tmp_path, '  job1: {command: "true", schedule: "minutely"}\n', "health_checks: true\n")
    code, _, err = watchdog(manifest, "--prefix", "team-jobs")
    assert code == 2
    assert err.strip().splitlines()[-1].endswith(
        "the Consul catalog node team-jobs holds the health checks of prefix 'team/jobs', not 'team-jobs'; two "
        "prefixes that give one node name (they differ only in case, or in '/' against '-') cannot both have "
        "health checks")
    assert catalog.get("catalog/node/team-jobs")["Node"]["Meta"]["consulrun-prefix"] == "team/jobs"
    assert catalog.get("health/node/team-jobs") == []  # nothing judged or written under the other prefix


def test_reap_frees_a_killed_watchdogs_lock(catalog: Agent, tmp_path: Path) -> None:
    """The watchdog unit's ExecStopPost= reaps `_watchdog` like any job's lock (it used to be refused as a name)."""
    started = tmp_path / "started"
    holder = consulrun("run", "--schedule", "*-*-* *:*:00", "--history", "1", "_watchdog", "--",
                       "sh", "-c", f"touch {started}; exec sleep 300")
    wait_for(started.exists, 20, "the watchdog's stand-in to start")
    holder.kill()  # as systemd does after TimeoutStartSec= or the OOM killer: no release
    holder.wait(timeout=10)
    assert lock_entry(catalog, "consulrun/_watchdog/lock").get("Session")
    code, _, err = cli("reap", "--concurrency", "1", "_watchdog")
    assert code == 0, err
    assert "Session" not in lock_entry(catalog, "consulrun/_watchdog/lock")


def test_jobs_differing_only_in_case_have_two_checks(catalog: Agent, tmp_path: Path) -> None:
    """Consul compares check IDs ignoring case; job names are case-sensitive, so capitals are encoded in the ID."""
    register(catalog)
    assert finish(consulrun("run", "--health-check", "--schedule", YEARLY, "Backup", "--", "true"))[0] == 0
    assert finish(consulrun("run", "--health-check", "--schedule", YEARLY, "backup", "--", "false"))[0] == 1
    found = checks(catalog)
    assert (found["Backup"]["Status"], found["backup"]["Status"]) == ("passing", "critical")
    assert {found["Backup"]["CheckID"], found["backup"]["CheckID"]} == {"job:^backup", "job:backup"}
    manifest = write_manifest(tmp_path, '  Backup: {command: "true", schedule: "yearly"}\n'
                                        '  backup: {command: "true", schedule: "yearly"}\n', "health_checks: true\n")
    code, _, err = watchdog(manifest)
    assert code == 0, err  # nothing to fight over: each check is its own job's


def test_a_real_agents_node_is_never_taken_over(catalog: Agent, tmp_path: Path) -> None:
    """A prefix that names an agent's node: the watchdog refuses instead of re-registering that node as external."""
    agent_node = catalog.get("agent/self")["Config"]["NodeName"]
    before = catalog.get(f"catalog/node/{agent_node}")["Node"]
    manifest = write_manifest(tmp_path, '  job1: {command: "true", schedule: "minutely"}\n', "health_checks: true\n")
    code, _, err = watchdog(manifest, "--prefix", agent_node)
    assert code == 2
    assert f"the Consul catalog already has a node {agent_node} that is not consulrun's external node" in err
    after = catalog.get(f"catalog/node/{agent_node}")["Node"]
    assert (after["Address"], after["Meta"]) == (before["Address"], before["Meta"])


@pytest.mark.parametrize("schedules", [["nonsense x"], []])
def test_a_bad_job_list_is_one_line_and_exit_2(schedules: list[str]) -> None:
    jobs = '{"a": {"schedules": %s, "accuracy_ms": 1, "randomized_delay_ms": 0, "timeout_ms": null}}' % (
        str(schedules).replace("'", '"'))
    code, _, err = cli("watchdog", "--jobs", jobs)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("Error: --jobs: job a: ")
