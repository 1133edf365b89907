"""`consulrun logs`: a run's journal lines found by the history's invocation id, read here or over ssh, in a
booted systemd container with a Consul agent (and an sshd) of its own."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from consulrun.report.logs import choose, split_occurrence
from consulrun.report.status import NoState
from tests.harness.nodes import CONSULRUN, agent_node, install, manifest
from tests.harness.nspawn import Container

pytestmark = [pytest.mark.systemd, pytest.mark.consul]

JOB = {"command": ["sh", "-c", "echo out of $CONSULRUN_OCCURRENCE; echo to stderr >&2"],
       "schedule": "*-*-* 00:00:00"}  # today's midnight is the occurrence; the timer never fires in the test
SSH = [a for opt in ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "IdentityFile=/shared/id_ed25519",
                     "ConnectTimeout=5", "LogLevel=ERROR") for a in ("--ssh-option", opt)]


@pytest.fixture(scope="module")
def node(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """One booted node whose agent is `solo`, the job installed (timer not started) and run once by systemd, and
    an sshd that lets root in with /shared/id_ed25519."""
    with agent_node(consul_bin, tmp_path_factory.mktemp("logs"), "10.213.88.0/24", "l") as ctr:
        assert install(ctr, manifest({"echoer": JOB}), "--no-start").returncode == 0
        ctr.systemctl("start", "consulrun-echoer.service")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ctr.shared / "id_ed25519")],
                       check=True)
        ctr.exec("sh", "-c", "install -d -m 700 /root/.ssh && cp /shared/id_ed25519.pub /root/.ssh/authorized_keys")
        ctr.systemctl("start", "ssh.service")
        yield ctr


def logs(ctr: Container, *args: str) -> subprocess.CompletedProcess[str]:
    # Over ssh a login may wait for the container's logind (pam_systemd) on a loaded machine: a long bound.
    return ctr.exec(CONSULRUN, "logs", *args, check=False, timeout=180)


def test_the_newest_run_s_lines_from_this_host_s_journal(node: Container) -> None:
    found = logs(node, "echoer", "-o", "cat")
    assert found.returncode == 0, found.stderr
    occurrence = found.stdout.split("out of ", 1)[1].split()[0]
    assert occurrence.endswith("T00:00:00Z"), found.stdout
    assert "to stderr" in found.stdout  # the job's stderr too
    assert "consulrun: echoer: acquired" in found.stdout  # and the wrapper's own lines: the whole run
    # By its occurrence, in journalctl's default mode: the same run, each line with its time, host and tag.
    named = logs(node, "echoer", occurrence)
    assert named.returncode == 0, named
    line = next(line for line in named.stdout.splitlines() if line.endswith("out of " + occurrence))
    assert line.startswith("20") and " consulrun[" in line, line


def test_over_ssh_the_same_lines(node: Container) -> None:
    here = logs(node, "echoer", "-o", "cat")
    there = logs(node, "echoer", "-o", "cat", "--host", "root@127.0.0.1", *SSH)
    assert there.returncode == 0, there.stderr
    assert there.stdout == here.stdout and "out of " in there.stdout


def test_no_such_run_is_exit_6_with_what_there_is(node: Container) -> None:
    found = logs(node, "echoer", "2020-01-01T00:00:00Z")
    assert found.returncode == 6 and "no run of occurrence 2020-01-01T00:00:00Z in the history (it has " in \
        found.stderr, found
    found = logs(node, "echoer", "--attempt", "2")
    assert found.returncode == 6 and "has no attempt 2 (it has 1)" in found.stderr, found
    found = logs(node, "echoe")
    assert found.returncode == 6 and "did you mean 'echoer'" in found.stderr, found


def test_a_run_systemd_did_not_start_says_where_its_output_went(node: Container) -> None:
    assert node.exec(CONSULRUN, "run", "by-hand", "--", "true", check=False).returncode == 0
    found = logs(node, "by-hand")
    assert found.returncode == 6, found
    assert "was not started by systemd (no invocation id was recorded): its output went to whoever ran it" in \
        found.stderr, found


def test_an_unreachable_host_is_an_error_naming_it(node: Container) -> None:
    found = logs(node, "echoer", "--host", "root@127.0.0.1", "--ssh-option", "Port=1", *SSH)  # nothing listens
    assert found.returncode == 1, found
    assert "Error: ssh reading the journal on root@127.0.0.1 exited with status 255" in found.stderr, found


def _row(occurrence: str | None, attempt: int, state: str = "done") -> dict:
    return {"occurrence": occurrence, "attempt": attempt, "state": state, "started": "2026-12-01T00:00:01Z"}


def test_choose_takes_the_last_attempt_of_the_newest_occurrence_unless_told() -> None:
    rows = [_row("2026-12-02T00:00:00Z", 0, "skipped"), _row("2026-12-01T00:00:00Z", 2),
            _row("2026-12-01T00:00:00Z", 1, "lost"), _row("2026-11-30T00:00:00Z", 1)]
    assert choose(rows, "j", None, None) is rows[1]  # a skipped occurrence ran nothing to show
    assert choose(rows, "j", None, 1) is rows[2]
    assert choose(rows, "j", "2026-11-30T00:00:00Z", None) is rows[3]
    manual = [_row(None, 1), _row(None, 1)]
    assert choose(manual, "j", None, None) is manual[0]
    with pytest.raises(NoState, match="no run in the history"):
        choose(rows[:1], "j", None, None)


def test_the_occurrence_is_taken_as_history_or_as_the_consul_ui_writes_it() -> None:
    """The UI shows the history key (`20261201T020000Z`); given that, `logs` took it for a second job name and
    failed with a usage error."""
    assert split_occurrence(("j", "2026-12-01T02:00:00Z")) == (("j",), "2026-12-01T02:00:00Z")
    assert split_occurrence(("m.yaml", "j", "20261201T020000Z")) == (("m.yaml", "j"), "2026-12-01T02:00:00Z")
    assert split_occurrence(("m.yaml", "j")) == (("m.yaml", "j"), None)
    assert split_occurrence(("20261201T020000Z",)) == (("20261201T020000Z",), None)  # alone it is the JOB
