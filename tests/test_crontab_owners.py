"""`import-crontab`: whose jobs a crontab's lines become, and which files are node housekeeping.

A user crontab (`crontab -l`) names no user, so its jobs would run as root: it needs `--user`. A
cron file a Debian package owns is per-node housekeeping (e2scrub_all scrubs the node's own
filesystems): it is left to cron, or converted to `mode: each-node`, never to a `once` job.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from consulrun.cli import main
from consulrun.manifest.cronowner import package_owner
from consulrun.manifest.loader import parse_manifest
from tests.conftest import require_tool

CRONTAB = "0 2 * * * /usr/local/bin/report --daily\n"
E2SCRUB = ("30 3 * * 0 root test -e /run/systemd/system || SERVICE_MODE=1 "
           "/usr/lib/x86_64-linux-gnu/e2fsprogs/e2scrub_all_cron\n"
           "10 3 * * * root test -e /run/systemd/system || SERVICE_MODE=1 "
           "/sbin/e2scrub_all -A -r\n")
BACKUP = "0 1 * * * backup /usr/local/sbin/cluster-backup\n"


def invoke(*args: str, text: str = "") -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["import-crontab", *args], input=text)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


# --- item 3: a user crontab's jobs run as the user named, never as root by default ---------

def test_a_user_crontab_without_user_is_refused_with_one_line_and_nothing_printed() -> None:
    code, out, err = invoke("-", text=CRONTAB)
    assert (code, out) == (2, "")
    assert err == ("Error: <stdin>: a user crontab names no user, and its jobs would run as root: "
                   "give --user NAME (whose crontab it is), or --system if it has a user column\n")


def test_user_names_whom_a_user_crontab_s_jobs_run_as() -> None:
    code, out, err = invoke("--user", "alice", "-", text=CRONTAB)
    assert (code, err) == (0, "")
    assert yaml.safe_load(out)["jobs"] == {"report": {
        "command": "/usr/local/bin/report --daily", "schedule": "*-*-* 02:00:00", "user": "alice"}}
    assert parse_manifest(out, "<converted>").jobs[0].user == "alice"


def test_a_system_file_keeps_its_user_column_and_needs_no_user(tmp_path: Path) -> None:
    system = tmp_path / "backup"
    system.write_text(BACKUP)
    code, out, err = invoke("--system", str(system))
    assert (code, err) == (0, "")
    assert yaml.safe_load(out)["jobs"]["backup"]["user"] == "backup"


def test_a_copy_of_a_cron_d_file_given_by_a_relative_path_keeps_its_user_column(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`etc/cron.d/billing` beside a user crontab: the copy is a system file by where it lies, so its user
    column is its user, not the first word of its command (a new user got a job named `root` running
    `root /usr/local/sbin/...` as alice)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "etc" / "cron.d").mkdir(parents=True)
    (tmp_path / "etc" / "cron.d" / "billing").write_text(BACKUP)
    (tmp_path / "mine").write_text(CRONTAB)
    monkeypatch.setenv("PATH", str(tmp_path))  # no dpkg-query: no file is a package's
    code, out, err = invoke("--user", "alice", "mine", "etc/cron.d/billing")
    assert code == 0, err
    jobs = yaml.safe_load(out)["jobs"]
    assert jobs["billing"]["user"] == "backup" and jobs["billing"]["command"] == "/usr/local/sbin/cluster-backup", jobs
    assert jobs["report"]["user"] == "alice", jobs


@pytest.mark.parametrize("args, message", [
    (["--user", "root;x", "-"], "Error: --user 'root;x' is not a user name\n"),
    (["--user", "alice", "--system", "-"],
     "Error: --user is for a user crontab; a system crontab names each line's user\n"),
])
def test_a_user_that_cannot_apply_is_refused(args: list[str], message: str) -> None:
    assert invoke(*args, text=BACKUP) == (2, "", message)


# --- item 4: a package's cron file is per-node housekeeping, not a once-per-cluster job ----

@pytest.fixture
def fake_dpkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A dpkg-query on PATH that says e2fsprogs owns any file named e2scrub_all, as Debian's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "dpkg-query"
    script.write_text('#!/bin/sh\n[ "$1" = -S ] || exit 2\ncase "$2" in\n'
                      '  */e2scrub_all) echo "e2fsprogs: $2" ;;\n'
                      '  *) echo "dpkg-query: no path found matching pattern $2" >&2; exit 1 ;;\n'
                      'esac\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cron_d = tmp_path / "cron.d"
    cron_d.mkdir()
    (cron_d / "e2scrub_all").write_text(E2SCRUB)
    (cron_d / "backup").write_text(BACKUP)
    return cron_d


def test_a_package_s_cron_file_is_left_to_cron_with_one_line(fake_dpkg: Path) -> None:
    code, out, err = invoke("--system", str(fake_dpkg / "e2scrub_all"), str(fake_dpkg / "backup"))
    assert code == 0
    assert err == (f"warning: {fake_dpkg / 'e2scrub_all'}: left out: package e2fsprogs owns it, "
                   "so it is this node's own housekeeping, which cron keeps running on every node "
                   "(--package-files each-node converts it to mode: each-node)\n")
    assert yaml.safe_load(out)["jobs"] == {"backup": {
        "command": "/usr/local/sbin/cluster-backup", "schedule": "*-*-* 01:00:00",
        "user": "backup"}}
    assert f"# {fake_dpkg / 'e2scrub_all'}: left out: package e2fsprogs owns it" in out


def test_package_files_each_node_makes_a_package_s_file_every_node_jobs(fake_dpkg: Path) -> None:
    code, out, err = invoke("--system", "--package-files", "each-node",
                            str(fake_dpkg / "e2scrub_all"), str(fake_dpkg / "backup"))
    assert (code, err) == (0, "")
    modes = {job.name: job.mode for job in parse_manifest(out, "<converted>").jobs}
    assert modes == {"e2scrub_all-e2scrub_all_cron": "each-node", "e2scrub_all": "each-node",
                     "backup": "once"}


def test_only_package_files_print_no_manifest(fake_dpkg: Path) -> None:
    code, out, err = invoke("--system", str(fake_dpkg / "e2scrub_all"))
    assert (code, out) == (0, "")
    assert err.count("\n") == 1 and "left out: package e2fsprogs" in err


def test_without_dpkg_no_file_is_a_package_s(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "e2scrub_all").write_text(E2SCRUB)
    assert package_owner(str(tmp_path / "e2scrub_all")) is None
    assert package_owner("-") is None


def test_the_real_dpkg_query_is_read_as_it_answers(tmp_path: Path) -> None:
    """The parsing, against dpkg itself: /usr/bin/dpkg is dpkg's own file, a fresh file nobody's."""
    require_tool("dpkg-query")
    assert package_owner("/usr/bin/dpkg") == "dpkg"
    mine = tmp_path / "mine"
    mine.write_text(BACKUP)
    assert package_owner(str(mine)) is None
