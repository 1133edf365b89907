"""The command line as a new user meets it: where options go, addresses, durations, stdin, prefixes, output errors."""

from __future__ import annotations

import base64

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from consulrun.cli import main
from tests.harness.agents import Agent, free_port, start_dev_agent

REPO = Path(__file__).resolve().parents[1]
MANIFEST = "jobs:\n  tick:\n    command: [/bin/true]\n    schedule: daily\n"


def invoke(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), input=stdin, env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "jobs.yaml"
    path.write_text(MANIFEST)
    return path


# --- run: options go before JOB ----------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["myjob", "--ttl", "10s", "--", "true"], ["myjob", "-h"], ["myjob", "--wait=5s", "true"]])
def test_option_after_job_is_refused_not_run_as_the_command(args: list[str]) -> None:
    code, out, err = invoke("run", *args, env={"CONSUL_HTTP_ADDR": f"127.0.0.1:{free_port()}"})
    assert code == 2
    assert err.startswith(f"Error: options go before JOB: {args[1].split('=')[0]!r}") or \
        err.startswith(f"Error: options go before JOB: {args[1]!r}"), err
    assert "cannot start" not in err and out == ""


# --- addresses -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("address, why", [("127.0.0.1:99999", "port must be a number from 1 to 65535"),
                                          (":abc", "is not [http[s]://]host[:port]"),
                                          ("127.0.0.1:0", "port must be a number from 1 to 65535"),
                                          ("::1", "in brackets"), ("ftp://h", "scheme must be")])
def test_bad_address_is_a_usage_error_not_port_8500(address: str, why: str) -> None:
    for args, env in ((["--http-addr", address], {}), ([], {"CONSUL_HTTP_ADDR": address})):
        code, _, err = invoke("run", *args, "job", "--", "true", env=env)
        assert code == 2, err
        assert err.startswith(f"Error: Consul address {address!r}") and why in err and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def ipv6_agent(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """A dev agent serving HTTP on 127.0.0.1, [::1] and a unix socket."""
    work = tmp_path_factory.mktemp("addr")
    sock = work / "http.sock"
    agent = start_dev_agent(consul_bin, work, "addr1",
                            extra_config={"addresses": {"http": f"127.0.0.1 ::1 unix://{sock}"}})
    agent.extra["socket"] = sock
    yield agent
    agent.stop()


@pytest.mark.consul
def test_ipv6_literal_address_reaches_the_agent(ipv6_agent: Agent, tmp_path: Path) -> None:
    port = ipv6_agent.extra["ports"]["http"]
    marker = tmp_path / "ran"
    code, _, err = invoke("run", "--http-addr", f"http://[::1]:{port}", "v6job", "--", "touch", str(marker))
    assert code == 0, err
    assert marker.exists()
    held = requests.get(f"http://[::1]:{port}/v1/kv/consulrun/v6job/lock", timeout=10).json()[0]
    assert held.get("Session") is None  # released after the run


@pytest.mark.consul
def test_unix_socket_address_reaches_the_agent(ipv6_agent: Agent, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code, _, err = invoke("run", "--http-addr", f"unix://{ipv6_agent.extra['socket']}", "unixjob", "--", "touch",
                          str(marker))
    assert code == 0, err
    assert marker.exists()
    port = ipv6_agent.extra["ports"]["http"]
    held = requests.get(f"http://127.0.0.1:{port}/v1/kv/consulrun/unixjob/lock", timeout=10).json()[0]
    assert held.get("Session") is None and '"exit_status": 0' in base64.b64decode(held["Value"]).decode()


@pytest.mark.consul
def test_unix_socket_client_talks_to_the_agent(ipv6_agent: Agent) -> None:
    """The Client sends every call to the socket a unix:///path address names; a missing socket is one clear line."""
    from consulrun.consul.client import Client, ConsulConfig, decoded, kv_op
    from consulrun.errors import ConsulUnavailable

    config = ConsulConfig.from_env({}, address=f"unix://{ipv6_agent.extra['socket']}")
    assert config.endpoint(allow_unix=True) == ("http", "localhost", 80)
    assert config.socket_path == str(ipv6_agent.extra["socket"])
    client = Client(config)
    assert client.address == f"unix://{ipv6_agent.extra['socket']}"
    session = client.session_create(name="unix-probe", ttl_ms=10_000, lock_delay_ms=0, node_checks=[],
                                    service_checks=[])
    assert client.txn([kv_op("lock", "consulrun-unix/probe", {"x": 1}, Session=session)]) is not None
    index, entry = client.kv_get("consulrun-unix/probe")
    assert decoded(entry) == {"x": 1} and entry["Session"] == session and index > 0
    client.session_destroy(session)
    missing = Client(ConsulConfig.from_env({}, address=f"unix://{ipv6_agent.extra['socket']}.gone"))
    with pytest.raises(ConsulUnavailable, match=r"Consul agent not reachable: .*http\.sock\.gone: no such file"):
        missing.kv_get("consulrun-unix/probe")


# --- durations -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, message", [("abc", "--ttl: 'abc' is not a duration"),
                                            ("5s", "--ttl: 5s is out of range: must be 10s to 24h"),
                                            ("2 days", "--ttl: 48h is out of range: must be 10s to 24h")])
def test_bad_ttl_reads_the_same_whether_malformed_or_out_of_range(value: str, message: str) -> None:
    code, out, err = invoke("run", "--ttl", value, "job", "--", "true")
    assert (code, out) == (2, "")
    assert err.startswith(f"Error: {message}") and err.count("\n") == 1, err


def test_lock_delay_bounds_in_the_one_duration_style() -> None:
    code, _, err = invoke("run", "--lock-delay", "90s", "job", "--", "true")
    assert (code, err) == (2, "Error: --lock-delay: 1m30s is out of range: must be 5s to 1m\n")


@pytest.mark.consul
def test_systemd_duration_forms_on_the_command_line(consul: Agent, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code, _, err = invoke("run", "--ttl", "10 min", "--lock-delay", "15 sec", "--wait", "1h 30min", "durjob", "--",
                          "touch", str(marker))
    assert code == 0, err
    assert marker.exists()


# --- stdin and prefixes ----------------------------------------------------------------------------------------

def test_generate_reads_the_manifest_from_stdin() -> None:
    code, out, err = invoke("generate", "-", "-o", "-", "--consulrun-path", "/x/consulrun", stdin=MANIFEST)
    assert code == 0, err
    assert "# --- consulrun-tick.timer\n" in out


def test_acl_policy_reads_stdin_too() -> None:
    code, out, _ = invoke("acl-policy", "-", stdin="kv_prefix: ops/cron\n" + MANIFEST)
    assert code == 0 and 'key_prefix "ops/cron/"' in out


@pytest.mark.parametrize("prefix", ["", "/lead", "a//b", "a b", "x/", "a/../b", "a/./b", "..", "ops/."])
def test_prefix_is_checked_like_the_manifests_kv_prefix(prefix: str, tmp_path: Path) -> None:
    """`.` and `..` segments too: Consul stores `a/../b` as written, but its HTTP router answers 301 to reading it."""
    rule = "must be KV path segments of letters, digits, '_', '.', '-' separated by '/', none of them '.', and no '..' anywhere (Consul refuses it in a key)"
    for command in (["acl-policy", "--prefix", prefix], ["run", "--prefix", prefix, "job", "--", "true"]):
        code, out, err = invoke(*command)
        assert (code, out) == (2, ""), (command, out)
        assert err == f"Error: --prefix: {prefix!r} {rule}\n"
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(f"kv_prefix: '{prefix}'\n" + MANIFEST)
    code, _, err = invoke("acl-policy", str(manifest))
    assert code == 2 and (rule in err or "must not be empty" in err)


def test_missing_token_file_reads_without_errno_text(tmp_path: Path) -> None:
    code, _, err = invoke("run", "--token-file", str(tmp_path / "nope"), "job", "--", "true",
                          env={"CONSUL_HTTP_ADDR": f"127.0.0.1:{free_port()}"})
    assert (code, err) == (2, f"Error: Consul token file {tmp_path / 'nope'}: no such file\n")


def test_missing_templates_folder_is_one_line(manifest: Path, tmp_path: Path) -> None:
    code, _, err = invoke("generate", str(manifest), "-o", "-", "--templates", str(tmp_path / "nope"))
    assert (code, err) == (2, f"Error: --templates: {tmp_path / 'nope'}: no such file\n")


# --- output that cannot be written -----------------------------------------------------------------------------

def _cli(*args: str, stdout: int, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "consulrun", *args], stdout=stdout, stderr=subprocess.PIPE,
                          input=stdin, text=True, env=env, timeout=60)


def _commands(manifest: Path) -> list[list[str]]:
    helps = [["--help"], ["--version"]] + [[name, "--help"] for name in sorted(main.commands)]
    return helps + [["generate", str(manifest), "-o", "-"], ["acl-policy"], ["generate", "-", "-o", "-"]]


def test_full_disk_exits_74_with_one_line_for_every_command(manifest: Path) -> None:
    with open("/dev/full", "w") as full:
        for args in _commands(manifest):
            result = _cli(*args, stdout=full.fileno(), stdin=MANIFEST)
            assert result.returncode == 74, (args, result.stderr)
            assert result.stderr == "Error: writing output failed: no space left on device\n", (args, result.stderr)


def test_closed_pipe_exits_74_quietly_for_every_command(manifest: Path) -> None:
    for args in _commands(manifest):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before anything is written, as with `| head -0`
        try:
            result = _cli(*args, stdout=write_end, stdin=MANIFEST)
        finally:
            os.close(write_end)
        assert (result.returncode, result.stderr) == (74, ""), args


# --- documentation a sysadmin expects ----------------------------------------------------------------------------

README = (REPO / "README.md").read_text()
COMMANDS_PAGE = (REPO / "docs" / "commands" / "index.md").read_text()  # where shell completion is documented
VENV_BIN = str(Path(sys.prefix) / "bin")


@pytest.mark.parametrize("shell, registered", [("bash", "complete -o nosort -F _consulrun_completion consulrun"),
                                                ("zsh", "compdef _consulrun_completion consulrun"),
                                                ("fish", "complete --no-files --command consulrun")])
def test_readme_completion_line_enables_completion(shell: str, registered: str) -> None:
    lines = [line.split("#")[0].strip() for line in COMMANDS_PAGE.splitlines() if "_CONSULRUN_COMPLETE=" in line
             and f"{shell}_source" in line]
    assert len(lines) == 1, f"docs/commands/index.md must give one line for {shell}"
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    command = lines[0].replace(" | source", "").replace('eval "$(', "").rstrip(')"')
    script = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env, timeout=60)
    assert script.returncode == 0 and registered in script.stdout, script.stderr
    if shell == "bash":  # and bash really takes it: the function is registered for consulrun
        shown = subprocess.run(["bash", "-c", f"{lines[0]}\ncomplete -p consulrun"], capture_output=True, text=True,
                               env=env, timeout=60)
        assert shown.stdout.strip() == registered, shown.stderr


def test_man_pages_are_built_from_the_help_by_the_documented_command(tmp_path: Path) -> None:
    documented = [line for line in README.splitlines() if "python -m consulrun.manpage" in line]
    assert documented, "README must say how to build the man pages"
    result = subprocess.run([sys.executable, "-m", "consulrun.manpage", str(tmp_path)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert result.returncode == 0, result.stderr
    names = {"consulrun.1"} | {f"consulrun-{name}.1" for name in main.commands}
    assert {p.name for p in tmp_path.iterdir()} == names
    for page in sorted(tmp_path.iterdir()):
        shown = subprocess.run(["man", "--warnings", "-l", str(page)], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "MANWIDTH": "100"})
        assert (shown.returncode, shown.stderr) == (0, ""), page
    main_page = subprocess.run(["man", "-l", str(tmp_path / "consulrun.1")], capture_output=True, text=True,
                               env={**os.environ, "MANWIDTH": "100"}).stdout
    assert "EXIT STATUS" in main_page and "74  writing output failed" in main_page
    run_page = (tmp_path / "consulrun-run.1").read_text()
    assert r"\-\-ttl" in run_page and "EXIT STATUS" in run_page


def test_units_documentation_points_at_our_man_pages(tmp_path: Path) -> None:
    import re

    from consulrun.manifest.loader import parse_manifest
    from consulrun.units.render import render

    units = render(parse_manifest(MANIFEST, "jobs.yaml"), "/x/consulrun")
    refs = {ref for text in units.values() for line in text.splitlines() if line.startswith("Documentation=")
            for ref in line.split("=", 1)[1].split()}
    assert refs == {"man:consulrun(1)", "man:consulrun-run(1)"}
    pages = {re.fullmatch(r"man:(.+)\(1\)", ref).group(1) for ref in refs}  # type: ignore[union-attr]
    assert all(name == "consulrun" or name.split("-", 1)[1] in main.commands for name in pages)


def test_readme_first_command_shows_units_with_their_file_names(tmp_path: Path) -> None:
    """What it shows after installing (test_package runs the whole line on a fresh copy): names between units."""
    first = README.split("```sh\n", 1)[1].split("```", 1)[0].strip()
    shown = first[first.index(".venv/bin/consulrun "):]
    consulrun = Path(VENV_BIN) / "consulrun"
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    result = subprocess.run(["bash", "-c", shown.replace(".venv/bin/consulrun", str(consulrun), 1)],
                            capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    names = [line for line in result.stdout.splitlines() if line.startswith("==> ")]
    assert names == [f"==> units/{n} <==" for n in ("consulrun-_watchdog-jobs.jobs", "consulrun-_watchdog.service",
                                                   "consulrun-_watchdog.timer",
                                                   "consulrun-billing-report.service", "consulrun-billing-report.timer",
                                                   "consulrun-cache-warm.service", "consulrun-cache-warm.timer",
                                                   "consulrun-onfailure@billing-report.service",
                                                   "consulrun-onfailure@cache-warm.service")]
    # As README says: the units call this venv's consulrun, by absolute path, unless --consulrun-path is given.
    execs = [line for line in result.stdout.splitlines() if line.startswith("ExecStart=")]
    assert execs and all(line.startswith((f"ExecStart={consulrun} run ", f"ExecStart={consulrun} on-failure "))
                         for line in execs)
    assert "the consulrun of this venv" in README.replace("\n", " ")


def test_consulrun_path_that_cannot_run_is_one_line(manifest: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "consulrun"
    bogus.write_bytes(b"\x7fELF not really")
    bogus.chmod(0o755)
    code, _, err = invoke("install", str(manifest), "--dry-run", "--unit-dir", str(tmp_path / "units"),
                          "--consulrun-path", str(bogus))
    assert (code, err) == (2, f"Error: {bogus}: the consulrun the units would call cannot be run: exec format error\n")


@pytest.mark.parametrize("command", [["generate", "-o", "-"], ["install", "--dry-run", "--host", "node1"]])
def test_consulrun_path_must_be_absolute(command: list[str], manifest: Path) -> None:
    code, _, err = invoke(command[0], str(manifest), *command[1:], "--consulrun-path", "bin/consulrun")
    assert (code, err) == (2, "Error: --consulrun-path: 'bin/consulrun' must be an absolute path without control "
                              "characters\n")


def test_a_dry_run_into_an_image_shows_systemctl_with_its_root(manifest: Path, tmp_path: Path) -> None:
    """`install --root R --dry-run` printed `systemctl enable ...`: without --root, the command that would touch
    the running system, not the image."""
    image = tmp_path / "image"
    (image / "usr" / "bin").mkdir(parents=True)
    (image / "usr" / "bin" / "consulrun").write_text("#!/bin/sh\n")
    (image / "usr" / "bin" / "consulrun").chmod(0o755)
    code, out, err = invoke("install", str(manifest), "--root", str(image), "--dry-run", "--consulrun-path",
                            "/usr/bin/consulrun")
    assert code == 0, err
    runs = [line for line in out.splitlines() if line.startswith("would run: ")]
    assert runs and all(line.startswith(f"would run: systemctl --root={image} enable ") for line in runs), out
    assert not (image / "etc").exists()


def test_a_consulrun_missing_from_the_image_is_named_inside_it(manifest: Path, tmp_path: Path) -> None:
    """With --root the units run the image's consulrun; the error said "or pass --consulrun-path" even when it
    was passed, and did not say the path is looked up inside the root."""
    image = tmp_path / "image"
    image.mkdir()
    code, out, err = invoke("install", str(manifest), "--root", str(image), "--dry-run", "--consulrun-path",
                            "/usr/bin/consulrun")
    assert (code, out) == (2, "")
    assert err == (f"Error: {image}/usr/bin/consulrun: no executable consulrun at /usr/bin/consulrun inside {image}, "
                   "where the units run it: install consulrun into that root\n")
    code, out, err = invoke("install", str(manifest), "--root", str(image), "--dry-run")  # the one running now
    assert code == 2 and err.endswith(", or pass --consulrun-path with its path inside the root\n"), err
    code, out, err = invoke("install", str(manifest), "--dry-run", "--consulrun-path", "/nonexistent/consulrun")
    assert err == ("Error: /nonexistent/consulrun: the consulrun the units would call does not exist or is not "
                   "executable (install consulrun there)\n"), err


def test_a_dry_run_uninstall_of_a_name_with_no_units_says_so(tmp_path: Path) -> None:
    """A typo in `uninstall --name` must not read as success: 'up to date' is what install says."""
    code, out, err = invoke("uninstall", "--name", "mine", "--root", str(tmp_path), "--dry-run")
    assert code == 0, err
    assert out.strip() == f"nothing to remove: no unit of manifest 'mine' in {tmp_path}/etc/systemd/system", out
    # Without --root neither: no `would run: systemctl daemon-reload` before "nothing to remove".
    code, out, err = invoke("uninstall", "--name", "mine", "--unit-dir", str(tmp_path / "units"), "--dry-run")
    assert (code, out) == (0, f"nothing to remove: no unit of manifest 'mine' in {tmp_path / 'units'}\n"), out


def test_install_asks_the_agent_the_units_will_call_not_this_shell_s(tmp_path: Path) -> None:
    """A new user's CONSUL_HTTP_ADDR=127.0.0.1:18500 made install probe 18500 and stay silent, while the units
    (which never see that variable) would call 127.0.0.1:8500."""
    from consulrun.units.install import agent_warnings

    silent = free_port()
    shell = {"CONSUL_HTTP_ADDR": f"127.0.0.1:{silent}"}
    with pytest.MonkeyPatch.context() as env:
        for name, value in shell.items():
            env.setenv(name, value)
        warned = agent_warnings(f"127.0.0.1:{silent}")  # the manifest names it: the units call it too
        assert warned == [f"no Consul agent answers at http://127.0.0.1:{silent} (connection refused); the units "
                          "are installed anyway and their runs fail closed until it does"], warned
        warned = agent_warnings(None)
        assert warned[0] == (f"CONSUL_HTTP_ADDR=127.0.0.1:{silent} here does not reach the units: they call the "
                             "agent at 127.0.0.1:8500 (set consul.address in the manifest to change that)"), warned


def test_the_connection_parameters_are_the_connection_options() -> None:
    """units_consul_config names every connection option (a new one would otherwise reach Consul unset)."""
    import click

    from consulrun.commands.options import CONSUL_PARAMETERS, agent_options

    command = click.command()(agent_options(lambda **_: None))
    assert tuple(p.name for p in command.params) == CONSUL_PARAMETERS
