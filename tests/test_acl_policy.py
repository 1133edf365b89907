"""The policies `consulrun acl-policy` prints, each used exactly as printed, on a real agent with ACLs on (default deny).

The agent's node is set up as a real node is: a service with a check, and another application's session holding a
lock of its own, so a policy that works only on a bare dev agent fails here.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from consulrun.cli import main
from tests.harness.agents import Agent, wait_for
from tests.test_acl_tls import _acl, _token_file, acl_agent  # noqa: F401  (acl_agent is a fixture)
from tests.test_run import consulrun, finish

pytestmark = pytest.mark.consul
SCHEDULE = "*-01-01 00:00:00 UTC"


def _as(agent: Agent, token: str, method: str, path: str, body: dict | None = None) -> requests.Response:
    return requests.request(method, f"{agent.url}/v1/{path}", json=body, headers={"X-Consul-Token": token},
                            timeout=10)


def _real_node(agent: Agent, management: str) -> str:
    """A service with a TTL check on the agent's node, and another application's session holding its own lock
    (as Vault's HA lock would); returns that session's ID."""
    assert _as(agent, management, "PUT", "agent/service/register",
               {"Name": "web", "ID": "web", "Port": 8080, "Check": {"CheckID": "web-ttl", "TTL": "10m",
                                                                     "Status": "passing"}}).ok
    wait_for(lambda: any(c["CheckID"] == "web-ttl" for c in
                         _as(agent, management, "GET", f"health/node/{agent.name}").json()), 30, "the web check")
    other = _as(agent, management, "PUT", "session/create", {"Name": "vault-ha-lock", "Node": agent.name}).json()["ID"]
    assert _as(agent, management, "PUT", f"kv/vault/core/lock?acquire={other}", {"held": "vault"}).json() is True
    return other


def _token(agent: Agent, management: str, tmp_path: Path, name: str, rules: str) -> Path:
    """A token file for a token made from `rules`, exactly as printed."""
    _acl(agent, management, "PUT", "acl/policy", {"Name": name, "Rules": rules})
    secret = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": name}]})["SecretID"]
    return _token_file(tmp_path, f"{name}.token", secret)


def _printed(*args: str) -> str:
    result = CliRunner().invoke(main, ["acl-policy", *args])
    assert (result.exit_code, result.stderr) == (0, ""), result.output
    return result.stdout


def _manifest(tmp_path: Path) -> Path:
    path = tmp_path / "jobs.yaml"
    path.write_text(f'health_checks: true\njobs:\n  acljob: {{command: "true", schedule: "{SCHEDULE}"}}\n'
                    f'  trigjob: {{command: "true", schedule: "{SCHEDULE}"}}\n')
    return path


def _fake_systemctl(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    """A `systemctl` on PATH whose `start consulrun-trigjob.service` runs what that unit's ExecStart= runs, under
    the node's token (`env`): systemd stands in for nothing that talks to Consul."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "systemctl"
    exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
    script.write_text(f"#!/bin/sh\n{exports}exec {sys.executable} -m consulrun run --schedule '{SCHEDULE}' "
                      "trigjob -- true\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _ok(proc: object, *expected: int) -> tuple[str, str]:
    code, out, err = finish(proc)  # type: ignore[arg-type]
    assert code in (expected or (0,)), (code, out, err)
    return out, err


def _node_commands(env: dict[str, str], tmp_path: Path, manifest: Path) -> object:
    """run (holding acljob's lock), a second run that skips, reap and the watchdog; returns the running holder."""
    started = tmp_path / "started"
    holder = consulrun("run", "--schedule", SCHEDULE, "acljob", "--", "sh", "-c", f"touch {started}; sleep 120",
                       env=env)
    wait_for(started.exists, 30, "the job under the token")
    _ok(consulrun("run", "--schedule", SCHEDULE, "--skip-exit-code", "3", "acljob", "--", "true", env=env), 3)
    _ok(consulrun("reap", "acljob", env=env))
    _, err = _ok(consulrun("watchdog", str(manifest), env=env))
    assert "registered the external node consulrun" in err, err
    return holder


def _operator_commands(env: dict[str, str], tmp_path: Path, manifest: Path, holder: object,
                       node_env: dict[str, str]) -> None:
    """status, the exporter, history, pause, resume, trigger and unlock, with acljob's lock held by `holder`."""
    out, _ = _ok(consulrun("status", str(manifest), "acljob", env=env))
    assert "held" in out, out
    out, _ = _ok(consulrun("exporter", str(manifest), "--textfile", "-", env=env))
    assert "consulrun_exporter_consul_up 1.0" in out, out
    _ok(consulrun("history", str(manifest), "acljob", env=env))
    _ok(consulrun("pause", str(manifest), "trigjob", "--reason", "acl test", env=env))
    _ok(consulrun("resume", str(manifest), "trigjob", env=env))
    _ok(consulrun("run", "--schedule", SCHEDULE, "trigjob", "--", "true", env=node_env))  # the occurrence, done
    out, _ = _ok(consulrun("trigger", str(manifest), "trigjob", env={**env, **_fake_systemctl(tmp_path, node_env)}))
    assert "trigjob: manual run on" in out and "exit status 0" in out, out
    _ok(consulrun("unlock", str(manifest), "acljob", "--yes", "--force", env=env))
    assert finish(holder)[0] == 75  # type: ignore[arg-type]


def test_every_command_works_with_the_default_policy_on_a_node_with_checks_and_other_sessions(
        acl_agent: tuple[Agent, str], tmp_path: Path) -> None:
    """The default policy, one token for every command: before node health was read for the bound checks only,
    status, the exporter, unlock and the watchdog exited 77 here (the web check is hidden from the token)."""
    agent, management = acl_agent
    other = _real_node(agent, management)
    manifest = _manifest(tmp_path)
    env = {"CONSUL_HTTP_ADDR": agent.http_addr,
           "CONSUL_HTTP_TOKEN_FILE": str(_token(agent, management, tmp_path, "all", _printed(str(manifest))))}
    holder = _node_commands(env, tmp_path, manifest)
    _operator_commands(env, tmp_path, manifest, holder, env)
    # Nothing touched the other application's session or its lock.
    assert _as(agent, management, "GET", f"session/info/{other}").json()[0]["Name"] == "vault-ha-lock"
    assert _as(agent, management, "GET", "kv/vault/core/lock").json()[0]["Session"] == other


def test_a_bound_check_the_token_cannot_read_is_still_exit_77_never_taken_for_gone(acl_agent: tuple[Agent, str],
                                                                                   tmp_path: Path) -> None:
    """Only hidden checks that no session binds are ignored: a holder bound to a service check the token may not
    read (the default policy has no service read without bound checks in the manifest) is not judged blind."""
    agent, management = acl_agent
    _real_node(agent, management)
    session = _as(agent, management, "PUT", "session/create", {
        "Name": "consulrun:bound@" + agent.name, "Node": agent.name, "NodeChecks": ["serfHealth"],
        "ServiceChecks": [{"ID": "web-ttl"}]}).json()["ID"]
    assert _as(agent, management, "PUT", f"kv/consulrun/bound/lock?acquire={session}",
               {"node": agent.name, "pid": 1}).json() is True
    env = {"CONSUL_HTTP_ADDR": agent.http_addr,
           "CONSUL_HTTP_TOKEN_FILE": str(_token(agent, management, tmp_path, "all", _printed()))}
    code, out, err = finish(consulrun("status", "bound", env=env))
    assert code == 77 and out == "" and err.count("\n") == 1, (code, out, err)
    assert "the token cannot read the check(s) web-ttl bound to a session there" in err, err


# --- A manifest's consul: section and the operator's secrets ----------------------------------------------------


def test_a_manifest_does_not_choose_where_a_local_token_goes(tmp_path: Path) -> None:
    """`consul: {address, token_file}` in a manifest someone else wrote: before, `status MANIFEST` sent
    `X-Consul-Token: <that file's content>` to the manifest's address. Now nothing reaches that address unless the
    operator says so; an address the operator gave takes the token as before."""
    from tests.test_acl_tls import RawListener

    secret = "vault-token-abc123"
    stolen = tmp_path / "vault-token"
    stolen.write_text(secret + "\n")
    stolen.chmod(0o600)
    with RawListener() as raw:
        manifest = tmp_path / "jobs.yaml"
        manifest.write_text(f"consul:\n  address: http://127.0.0.1:{raw.port}\n  token_file: {stolen}\n"
                            f'jobs:\n  j1: {{command: "true", schedule: daily}}\n')
        plain = {k: v for k, v in os.environ.items() if not k.startswith("CONSUL_")}
        for command in (["status", str(manifest)], ["history", str(manifest), "j1"], ["unlock", str(manifest), "j1"]):
            code, out, err = finish(consulrun(*command, env=plain))
            assert code == 2 and out == "" and err.count("\n") == 1, (command, code, out, err)
            assert f"the manifest's consul.address 'http://127.0.0.1:{raw.port}' would receive the ACL token from " \
                   f"the file {stolen} the manifest names" in err and "--trust-manifest-consul" in err, err
            assert secret not in err
        # The operator's own token is not sent there either.
        code, _, err = finish(consulrun("status", str(manifest), env={**plain, "CONSUL_HTTP_TOKEN": "operator-token"}))
        assert code == 2 and "would receive the ACL token from CONSUL_HTTP_TOKEN" in err, err
        assert raw.received == []
        # Said so: the token goes where the manifest says (the listener answers nothing: exit 69).
        code, _, err = finish(consulrun("status", "--trust-manifest-consul", str(manifest), env=plain))
        assert code == 69, err
        wait_for(lambda: raw.received, 10, "the trusted request")
        assert f"X-Consul-Token: {secret}".encode() in raw.received[0]
        # The operator's address: the manifest's token file goes to the agent the operator named.
        raw.received.clear()
        code, _, err = finish(consulrun("status", str(manifest), env={
            **plain, "CONSUL_HTTP_ADDR": f"127.0.0.1:{raw.port}"}))
        assert code == 69, err
        wait_for(lambda: raw.received, 10, "the request to the operator's address")
        assert f"X-Consul-Token: {secret}".encode() in raw.received[0]
