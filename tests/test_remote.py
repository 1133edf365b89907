"""`consulrun install --host`: what reaches ssh and the node's shell, against a real sshd on loopback.

The sshd runs on this machine (a random loopback port, its own host key and
authorized_keys), so the node's shell really parses the remote command. The
installs are dry runs into a temporary unit folder: nothing touches the
machine's systemd.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from consulrun.units.remote import host_problem, remote_command, ssh_argv
from tests.harness.agents import free_port
from tests.harness.sshd import MANIFEST, Sshd, install_here as _install

CONSULRUN = str(Path(sys.prefix) / "bin" / "consulrun")


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "jobs.yaml"
    path.write_text(MANIFEST)
    return path


# --- what may be a host -----------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["node1", "root@node1", "10.0.0.5", "admin@10.0.0.5", "::1", "[fe80::1]",
                                  "web-01.dc1.example.com", "ops_user@db_2"])
def test_good_hosts(host: str) -> None:
    assert host_problem(host) is None


@pytest.mark.parametrize("host", ["-oProxyCommand=touch /tmp/x", "-v", "node1;id", "node 1", "a@b@c", "$(id)",
                                  "node1\n", "`id`", "host|x", "@host", ""])
def test_bad_hosts(host: str) -> None:
    assert host_problem(host) is not None


def test_option_looking_host_is_refused_before_ssh_runs(manifest: Path, tmp_path: Path) -> None:
    """`--host '-oProxyCommand=touch X'` used to run that command on this machine through ssh."""
    marker = tmp_path / "pwned"
    code, out, err = _install(str(manifest), "--host", f"-oProxyCommand=touch {marker}", "--dry-run")
    assert code == 2, err
    assert err.startswith("Error: --host: host '-oProxyCommand=touch") and "ssh would read it as an option" in err
    assert not marker.exists()


def test_hosts_file_is_untrusted_input(manifest: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hosts = tmp_path / "hosts"
    hosts.write_text(f"# nodes\nnode1\n\n-oProxyCommand=touch {marker}  # not a node\n")
    code, _, err = _install(str(manifest), "--hosts-file", str(hosts), "--dry-run")
    assert code == 2
    assert err.startswith(f"Error: {hosts}:4: host '-oProxyCommand=touch")
    assert not marker.exists()


def test_missing_hosts_file_is_one_line(manifest: Path, tmp_path: Path) -> None:
    code, _, err = _install(str(manifest), "--hosts-file", str(tmp_path / "nope"))
    assert (code, err) == (2, f"Error: --hosts-file: {tmp_path / 'nope'}: no such file\n")


def test_ssh_gets_the_host_after_double_dash_and_one_quoted_command() -> None:
    argv = ssh_argv("node1", ["/opt/consul run/consulrun", "install", "-", "--unit-dir", "/x;rm -rf /"], ["Port=22"])
    assert argv[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "Port=22"]
    assert argv[5:7] == ["--", "node1"] and len(argv) == 8
    assert argv[7] == "'/opt/consul run/consulrun' install - --unit-dir '/x;rm -rf /'"
    assert remote_command(["a b", "$HOME", "it's"]) == "'a b' '$HOME' 'it'\"'\"'s'"


@pytest.mark.parametrize("bundle, why", [("not json", "is not a JSON bundle"),
                                         ('{"manifest": "x"}', "needs a 'manifest' text and a 'templates' mapping"),
                                         ('{"manifest": "x", "templates": {"../evil.j2": "x"}}', "'../evil.j2'"),
                                         ('{"manifest": "x", "templates": {"timer.j2": 5}}', "'timer.j2'")])
def test_a_bad_bundle_is_refused(bundle: str, why: str, tmp_path: Path) -> None:
    code, _, err = _install("-", "--stdin-bundle", "--dry-run", "--unit-dir", str(tmp_path), stdin=bundle)
    assert code == 2 and err.startswith("Error: --stdin-bundle: ") and why in err, err
    assert not (tmp_path.parent / "evil.j2").exists()


def test_templates_folder_without_templates_is_refused(manifest: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _install(str(manifest), "--host", "node1", "--templates", str(empty))
    assert (code, err) == (2, f"Error: --templates: {empty}: holds no *.j2 template\n")


# --- over a real ssh ----------------------------------------------------------------------------------------

def test_remote_arguments_are_quoted_for_the_nodes_shell(sshd: Sshd, manifest: Path, tmp_path: Path) -> None:
    """A --unit-dir with a space and a `;` reaches the node's consulrun as one word; no shell runs the rest."""
    marker = tmp_path / "pwned"
    unit_dir = tmp_path / f"units dir;touch {marker}"
    code, out, err = _install(str(manifest), "--host", "root@127.0.0.1", "--dry-run", "--unit-dir", str(unit_dir),
                              "--consulrun-path", CONSULRUN, *sshd.options())
    assert code == 0, out + err
    assert not marker.exists()
    assert "+++ b/consulrun-tick.timer" in out  # the node planned against the folder as named


def test_dry_run_shows_each_hosts_diff_once_per_host(sshd: Sshd, manifest: Path, tmp_path: Path) -> None:
    hosts = ["root@127.0.0.1", "root@localhost", "root@127.0.0.1"]
    code, out, err = _install(str(manifest), *[a for h in hosts for a in ("--host", h)], "--dry-run",
                              "--unit-dir", str(tmp_path / "units"), "--consulrun-path", CONSULRUN, *sshd.options())
    assert code == 0, out + err
    assert "warning: root@127.0.0.1 is listed more than once; installing there once" in err
    assert err.count("[1/2]") == 1 and err.count("[2/2]") == 1
    for host in ("root@127.0.0.1", "root@localhost"):
        section = out.split(f"==> {host} <==\n", 1)[1]
        assert section.startswith("--- a/consulrun-tick.service\n+++ b/consulrun-tick.service\n"), out
        assert "would run: systemctl enable --now consulrun-tick.timer" in section.split("==>")[0]
    table = out[out.index("HOST "):].splitlines()
    assert [row.split()[0] for row in table] == ["HOST", "root@127.0.0.1", "root@localhost"]


def test_remote_warnings_reach_the_user(sshd: Sshd, tmp_path: Path) -> None:
    silent = free_port()
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(f"consul: {{address: '127.0.0.1:{silent}'}}\n" + MANIFEST)
    code, out, err = _install(str(manifest), "--host", "root@127.0.0.1", "--dry-run", "--unit-dir",
                              str(tmp_path / "units"), "--consulrun-path", CONSULRUN, *sshd.options())
    assert code == 0, out + err
    assert f"warning: root@127.0.0.1: no Consul agent answers at http://127.0.0.1:{silent} (connection refused)" in err


def test_override_templates_travel_to_the_nodes(sshd: Sshd, manifest: Path, tmp_path: Path) -> None:
    """`--templates` with `--host` used to be dropped: the nodes rendered the shipped templates."""
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "timer.j2").write_text("{{ header }}\n[Timer]\nOnCalendar={{ job.schedules[0] | unit_value }}\n"
                                        "# overridden for {{ job.name }}\n[Install]\nWantedBy=timers.target\n")
    code, out, err = _install(str(manifest), "--host", "root@127.0.0.1", "--dry-run", "--templates", str(templates),
                              "--unit-dir", str(tmp_path / "units"), "--consulrun-path", CONSULRUN, *sshd.options())
    assert code == 0, out + err
    assert "+# overridden for tick\n" in out
    assert "+Type=oneshot\n" in out  # the service template is still the shipped one


def test_root_is_passed_to_the_nodes(sshd: Sshd, manifest: Path, tmp_path: Path) -> None:
    """`--root` with `--host` used to be ignored: the nodes installed into their live /etc/systemd/system."""
    image = tmp_path / "image"
    in_image = image / CONSULRUN.lstrip("/")  # the consulrun the units will call, inside the image
    in_image.parent.mkdir(parents=True)
    in_image.write_text("#!/bin/sh\n")
    in_image.chmod(0o755)
    code, out, err = _install(str(manifest), "--host", "root@127.0.0.1", "--dry-run", "--root", str(image),
                              "--consulrun-path", CONSULRUN, *sshd.options())
    assert code == 0, out + err
    assert f"would run: systemctl --root={image} enable consulrun-tick.timer\n" in out  # offline: enabled, not started
    assert not (image / "etc").exists()  # a dry run
