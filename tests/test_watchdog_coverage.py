"""Which jobs a node's watchdog judges: every job of every manifest installed beside it,
whatever `nodes:` puts on the node, with one watchdog unit for all of them (against a real
Consul agent for the verdicts)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.manifest.loader import load_manifest
from consulrun.units.install import install_local
from tests.harness.agents import Agent
from tests.harness.runs import fake_root

CONSULRUN = shutil.which("consulrun", path=str(Path(sys.executable).parent)) or "/usr/bin/true"
HOURLY = "*-*-* *:00:00"


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def catalog(consul: Agent) -> Iterator[Agent]:
    """The shared agent; the external nodes a test registers are removed afterwards (wipe()
    keeps the catalog)."""
    yield consul
    for node in consul.get("catalog/nodes"):
        if (node.get("Meta") or {}).get("external-node") == "true":
            consul.api("PUT", "catalog/deregister", json={"Node": node["Node"]})


def missed_long_ago(agent: Agent, job: str) -> None:
    """`job` last ran three hours ago: every hourly occurrence since was missed."""
    old = (datetime.now(timezone.utc) - timedelta(hours=3)).strftime("%Y-%m-%dT%H:00:00Z")
    record = {"occurrence": old, "state": "done", "node": "n1", "exit_status": 0,
              "started": old, "ended": old}
    agent.api("PUT", f"kv/consulrun/{job}/occurrence", data=json.dumps(record)).raise_for_status()


def check(agent: Agent, job: str) -> tuple[str, str] | None:
    found = {c["Name"]: (c["Status"], c["Output"]) for c in agent.get("health/node/consulrun")}
    return found.get(job)


def jobs_file_in(diff: str) -> str:
    """The text `install --dry-run` would write to the watchdog's job list, from its diff."""
    part = re.split(r"\+\+\+ b/\S+\.jobs\n", diff, maxsplit=1)[1]
    lines = []
    for line in part.splitlines()[1:]:  # after the hunk header
        if not line.startswith("+"):
            break
        lines.append(line[1:] + "\n")
    return "".join(lines)


def dry_run_on(manifest: Path, folder: Path, node: str, role: str) -> str:
    """What `install --dry-run` on Consul node `node` (meta role=`role`) would change: its diff."""
    report = install_local(load_manifest(manifest), root=None, unit_dir=folder, dry_run=True,
                           start=False, templates=None, consulrun_path=CONSULRUN,
                           node=(node, {"role": role}))
    return "".join(report.diff)


def test_every_nodes_watchdog_judges_a_placed_job_alike(catalog: Agent, tmp_path: Path) -> None:
    """A job placed on db nodes is judged on a web node too: its missed occurrence is critical
    whichever node's watchdog runs the minute (it was `passing` from a node it is not on)."""
    manifest = tmp_path / "placed.yaml"
    manifest.write_text(
        f"health_checks: true\njobs:\n"
        f"  backup: {{command: ['true'], schedule: '{HOURLY}', nodes: {{meta: {{role: db}}}}}}\n"
        f"  anywhere: {{command: ['true'], schedule: '{HOURLY}'}}\n")
    lists = {}
    for node, role in (("db1", "db"), ("web1", "web")):
        diff = dry_run_on(manifest, tmp_path / node, node, role)
        assert ("consulrun-backup.service" in diff) == (role == "db")  # its units: db nodes only
        lists[node] = tmp_path / node / "consulrun-_watchdog-placed.jobs"
        lists[node].parent.mkdir()
        lists[node].write_text(jobs_file_in(diff))
    missed_long_ago(catalog, "backup")
    for node in ("db1", "web1", "db1"):  # each node's watchdog in turn runs a minute's occurrence
        code, _, err = invoke("watchdog", "--jobs-file", str(lists[node]), "--grace", "1s")
        assert code == 0, err
        status, output = check(catalog, "backup") or ("", "")
        assert status == "critical" and output.startswith("missed: occurrence "), \
            (node, status, output)
    assert lists["db1"].read_text() == lists["web1"].read_text()


def two_manifests(tmp_path: Path, b_top: str = "") -> tuple[Path, Path]:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    job = f"{{command: 'true', schedule: '{HOURLY}'}}"
    a.write_text(f"health_checks: true\njobs:\n  alpha: {job}\n")
    b.write_text(f"health_checks: true\n{b_top}jobs:\n  beta: {job}\n")
    return a, b


def watchdog_argv(unit: Path) -> list[str]:
    """The `consulrun watchdog` arguments of the watchdog unit's ExecStart=, `%Y` made the
    unit's folder."""
    line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    words = line.split(" -- ", 1)[1].split()
    return [w.replace("%Y", str(unit.parent)) for w in words[1:]]


def test_one_watchdog_unit_judges_every_manifests_jobs(catalog: Agent, tmp_path: Path) -> None:
    a, b = two_manifests(tmp_path)
    units = tmp_path / "units"
    for manifest in (a, b):
        code, _, err = invoke("generate", str(manifest), "-o", str(units), "--consulrun-path",
                              CONSULRUN)
        assert code == 0, err
    assert sorted(p.name for p in units.glob("*_watchdog*")) == [
        "consulrun-_watchdog-a.jobs", "consulrun-_watchdog-b.jobs",
        "consulrun-_watchdog.service", "consulrun-_watchdog.timer"]
    missed_long_ago(catalog, "alpha")
    missed_long_ago(catalog, "beta")
    code, _, err = invoke(*watchdog_argv(units / "consulrun-_watchdog.service"), "--grace", "1s")
    assert code == 0, err
    for job in ("alpha", "beta"):
        status, output = check(catalog, job) or ("", "")
        assert status == "critical" and output.startswith("missed: occurrence "), \
            (job, status, output)


def test_installs_share_the_watchdog_and_the_last_removal_takes_it(tmp_path: Path) -> None:
    a, b = two_manifests(tmp_path)
    root, inside = fake_root(tmp_path)
    unit_dir = root / "etc" / "systemd" / "system"
    for manifest in (a, b):
        code, out, err = invoke("install", str(manifest), "--root", str(root),
                                "--consulrun-path", inside)
        assert code == 0, err  # was exit 2: consulrun-_watchdog.jobs belongs to manifest 'a'
    assert sorted(p.name for p in unit_dir.glob("*_watchdog*")) == [
        "consulrun-_watchdog-a.jobs", "consulrun-_watchdog-b.jobs",
        "consulrun-_watchdog.service", "consulrun-_watchdog.timer"]
    timer_link = unit_dir / "timers.target.wants" / "consulrun-_watchdog.timer"
    assert timer_link.is_symlink()
    code, out, err = invoke("uninstall", str(a), "--root", str(root))
    assert code == 0, err
    assert "removed: consulrun-_watchdog-a.jobs, consulrun-alpha.service, consulrun-alpha.timer\n" \
        in out
    assert sorted(p.name for p in unit_dir.glob("*_watchdog*")) == [
        "consulrun-_watchdog-b.jobs", "consulrun-_watchdog.service", "consulrun-_watchdog.timer"]
    assert timer_link.is_symlink()
    b.write_text(b.read_text().replace("health_checks: true", "health_checks: false"))
    code, out, err = invoke("install", str(b), "--root", str(root), "--consulrun-path", inside)
    assert code == 0, err
    assert ("removed: consulrun-_watchdog-b.jobs, consulrun-_watchdog.service, "
            "consulrun-_watchdog.timer\n") in out
    assert list(unit_dir.glob("*_watchdog*")) == [] and not timer_link.is_symlink()


def test_manifests_that_need_the_watchdog_run_otherwise_are_refused(tmp_path: Path) -> None:
    a, b = two_manifests(tmp_path, b_top="kv_prefix: team/b\n")
    units = tmp_path / "units"
    assert invoke("generate", str(a), "-o", str(units), "--consulrun-path", CONSULRUN)[0] == 0
    before = {p.name: p.read_bytes() for p in units.iterdir()}
    code, out, err = invoke("generate", str(b), "-o", str(units), "--consulrun-path", CONSULRUN)
    assert (code, out) == (2, "")
    assert re.fullmatch(
        r"Error: \S+/consulrun-_watchdog-a\.jobs: that manifest's watchdog runs with kv_prefix "
        r"'consulrun', this one's with 'team/b'; manifests of one unit_prefix share one "
        r"watchdog unit \(consulrun-_watchdog\.service\), so they must agree on it \(give this "
        r"manifest the same setting, or another unit_prefix and another kv_prefix: the watchdog's lock is "
        r"the kv_prefix's\); nothing changed\n", err), err
    assert {p.name: p.read_bytes() for p in units.iterdir()} == before
    b.write_text("unit_prefix: teamb\n" + b.read_text())  # the fix the line gives
    assert invoke("generate", str(b), "-o", str(units), "--consulrun-path", CONSULRUN)[0] == 0
    assert (units / "teamb-_watchdog.service").exists()  # a watchdog of its own


def as_older_consulrun_wrote(units: Path, name: str) -> None:
    """The watchdog files as the previous version wrote them: one list, units owned by `name`."""
    (units / f"consulrun-_watchdog-{name}.jobs").rename(units / "consulrun-_watchdog.jobs")
    for path in units.iterdir():
        lines = path.read_text().splitlines(keepends=True)
        lines = [f"# Manifest: {name}\n" if x.startswith("# Shared: ") else
                 x.replace("--jobs-glob %Y/consulrun-_watchdog*.jobs",
                           "--jobs-file %Y/consulrun-_watchdog.jobs")
                 for x in lines if not x.startswith(("# Manifest file: ", "# Watchdog: "))]
        path.write_text("".join(lines))


def test_an_older_consulruns_watchdog_becomes_the_shared_one(tmp_path: Path) -> None:
    a, b = two_manifests(tmp_path)
    units = tmp_path / "units"
    assert invoke("generate", str(a), "-o", str(units), "--consulrun-path", CONSULRUN)[0] == 0
    as_older_consulrun_wrote(units, "a")
    code, out, err = invoke("generate", str(b), "-o", str(units), "--consulrun-path", CONSULRUN)
    assert code == 0, err
    service = (units / "consulrun-_watchdog.service").read_text()
    assert "# Shared: " in service and "--jobs-glob %Y/consulrun-_watchdog*.jobs" in service
    # a's old list is still read (the pattern matches it) until a is installed again
    assert sorted(p.name for p in units.glob("consulrun-_watchdog*.jobs")) == [
        "consulrun-_watchdog-b.jobs", "consulrun-_watchdog.jobs"]
    code, out, err = invoke("generate", str(a), "-o", str(units), "--consulrun-path", CONSULRUN)
    assert code == 0, err
    assert f"removed {units / 'consulrun-_watchdog.jobs'}" in out.splitlines()
    assert sorted(p.name for p in units.glob("consulrun-_watchdog*.jobs")) == [
        "consulrun-_watchdog-a.jobs", "consulrun-_watchdog-b.jobs"]
