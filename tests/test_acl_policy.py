"""The policies `consulrun acl-policy` prints, each used exactly as printed, on a real agent with ACLs (default deny).

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
from tests.harness.acl import acl as _acl, token_file as _token_file
from tests.harness.agents import Agent, wait_for
from tests.harness.runs import consulrun, finish

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


def _node_commands(env: dict[str, str], tmp_path: Path, watchdog: Path | None, job: str = "acljob") -> object:
    """run (holding `job`'s lock), a second run that skips, reap and, given a manifest, the watchdog; returns the
    running holder."""
    started = tmp_path / f"started-{job}"
    holder = consulrun("run", "--schedule", SCHEDULE, job, "--", "sh", "-c", f"touch {started}; sleep 120", env=env)
    wait_for(started.exists, 30, "the job under the token")
    _ok(consulrun("run", "--schedule", SCHEDULE, "--skip-exit-code", "3", job, "--", "true", env=env), 3)
    _ok(consulrun("reap", job, env=env))
    if watchdog:
        _, err = _ok(consulrun("watchdog", str(watchdog), env=env))
        assert "registered the external node consulrun" in err, err
    return holder


def _operator_commands(env: dict[str, str], tmp_path: Path, manifest: Path, holder: object,
                       node_env: dict[str, str]) -> None:
    """status, the exporter, history, pause, resume, trigger and unlock, with acljob's lock held by `holder`; then
    logs and forget (what `acl-policy --operator` says it is for, beside them)."""
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
    # The run was made by hand, outside systemd: logs reads its record (no ACL denial) and says it has no journal.
    _, err = _ok(consulrun("logs", str(manifest), "acljob", env=env), 6)
    assert "ACL" not in err, err
    _ok(consulrun("forget", str(manifest), "acljob", "--yes", env=env))
    out, _ = _ok(consulrun("history", str(manifest), "acljob", env=env))
    assert "exit" not in out and "lost" not in out, out  # its records are gone


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
    from tests.harness.acl import RawListener

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
    # The default address is where the token goes with no manifest at all: a manifest naming it (as the example
    # does) chooses nothing, and `status MANIFEST` on a node works without --trust-manifest-consul.
    manifest.write_text(f"consul:\n  address: http://127.0.0.1:8500\n  token_file: {stolen}\n"
                        f'jobs:\n  j1: {{command: "true", schedule: daily}}\n')
    code, _, err = finish(consulrun("status", str(manifest), env=plain))
    assert code != 2 and "would receive the ACL token" not in err, err


# --- Least privilege per role ------------------------------------------------------------------------------------


def _rule(kind: str, name: str, policy: str) -> str:
    return f'{kind} "{name}" {{\n  policy = "{policy}"\n}}\n'


@pytest.mark.parametrize(("health", "service_read"), [(False, False), (True, False), (False, True)],
                         ids=["plain", "health-checks", "service-checks"])
def test_the_role_policies_are_exactly_the_documented_ones(tmp_path: Path, health: bool, service_read: bool) -> None:
    """Written out by hand: a rule added or widened fails the comparison."""
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(("health_checks: true\n" if health else "") + "kv_prefix: team/jobs\njobs:\n"
                        + ('  j: {command: "true", schedule: daily, lock: {checks: [web-ttl]}}\n' if service_read
                           else '  j: {command: "true", schedule: daily}\n'))
    service = _rule("service_prefix", "", "read") if service_read else ""
    catalog = ('# the jobs\' health checks: the external node "team-jobs" and its service\n'
               + _rule("node", "team-jobs", "write") + _rule("service", "team-jobs", "write")) if health else ""
    node = ('# consulrun: what node "web-1.dc" needs to run, skip, take over and reap jobs under "team/jobs/"\n'
            + _rule("key_prefix", "team/jobs/", "write")
            + "# sessions and the agent of this node only: no other node's, no other application's elsewhere\n"
            + _rule("session", "web-1.dc", "write") + _rule("agent", "web-1.dc", "read")
            + "# the members of the cluster (turns) and this node's checks\n" + _rule("node_prefix", "", "read")
            + service
            + ("# the watchdog judges every holder: it reads sessions on every node (it cannot create or destroy "
               "them)\n" + _rule("session_prefix", "", "read") if health else "") + catalog)
    operator = ("# consulrun: what an operator needs for status, history, logs, unlock, pause, resume, trigger, "
                'forget and the exporter under "team/jobs/"\n' + _rule("key_prefix", "team/jobs/", "write")
                + "# unlock destroys a holder's session on whichever node it is; status reads every holder's\n"
                + _rule("session_prefix", "", "write") + "# a holder's checks; trigger names the node it runs on\n"
                + _rule("node_prefix", "", "read") + _rule("agent_prefix", "", "read") + service + catalog)
    assert _printed(str(manifest), "--node", "web-1.dc") == node
    assert _printed(str(manifest), "--operator") == operator


@pytest.mark.parametrize(("args", "message"), [
    (["--node", 'x" {} key_prefix "'], "--node: node name 'x\" {} key_prefix \"' must be 1 to 128 letters"),
    (["--node", ""], "--node: node name '' must be"),
    (["--node", "n1", "--operator"], "--node and --operator are two roles: give one"),
], ids=["hcl-injection", "empty", "two-roles"])
def test_a_role_that_cannot_be_printed_is_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["acl-policy", *args])
    assert (result.exit_code, result.stdout) == (2, "") and result.stderr.count("\n") == 1, result.output
    assert message in result.stderr, result.stderr


def _elsewhere(agent: Agent, management: str) -> str:
    """Another application's session on another node (as Vault's HA lock on a Vault server), holding its lock."""
    assert _as(agent, management, "PUT", "catalog/register", {"Node": "vault1", "Address": "127.0.0.2"}).ok
    other = _as(agent, management, "PUT", "session/create",
                {"Name": "vault-ha-lock", "Node": "vault1", "NodeChecks": []}).json()["ID"]
    assert _as(agent, management, "PUT", f"kv/vault/ha/lock?acquire={other}", {"held": "vault1"}).json() is True
    return other


def _cannot_touch_elsewhere(agent: Agent, token: str, other: str, can_list: bool) -> None:
    """The node's token: no session on another node, no destroying another application's, no listing it (unless
    the watchdog's read is granted), no other key."""
    listed = _as(agent, token, "GET", "session/list")
    assert listed.ok and (other in {s["ID"] for s in listed.json()}) == can_list, listed.text
    assert _as(agent, token, "PUT", f"session/destroy/{other}").status_code == 403
    assert _as(agent, token, "PUT", "session/create", {"Name": "squat", "Node": "vault1",
                                                       "NodeChecks": []}).status_code == 403
    assert _as(agent, token, "PUT", "kv/vault/ha/lock?release=" + other, {}).status_code == 403
    assert _as(agent, token, "GET", "agent/self").ok  # its own agent; no other agent runs here to compare


def test_each_role_works_with_exactly_its_token_and_the_node_s_touches_nothing_elsewhere(
        acl_agent: tuple[Agent, str], tmp_path: Path) -> None:
    """A node's token (from `acl-policy --node NAME`) runs, skips and reaps, and with health checks runs the
    watchdog; it cannot list, destroy or make sessions elsewhere. The operator's token (`--operator`) does the
    rest. Before, the one printed policy (`session_prefix ""` write) let a node's token destroy the other
    application's session and make sessions on any node."""
    agent, management = acl_agent
    _real_node(agent, management)
    other = _elsewhere(agent, management)
    manifest = _manifest(tmp_path)
    plain = tmp_path / "plain.yaml"
    plain.write_text(f'jobs:\n  acljob: {{command: "true", schedule: "{SCHEDULE}"}}\n')
    base = {"CONSUL_HTTP_ADDR": agent.http_addr}
    node_plain = {**base, "CONSUL_HTTP_TOKEN_FILE": str(_token(agent, management, tmp_path, "node-plain",
                                                               _printed(str(plain), "--node", agent.name)))}
    node = {**base, "CONSUL_HTTP_TOKEN_FILE": str(_token(agent, management, tmp_path, "node",
                                                         _printed(str(manifest), "--node", agent.name)))}
    operator = {**base, "CONSUL_HTTP_TOKEN_FILE": str(_token(agent, management, tmp_path, "operator",
                                                             _printed(str(manifest), "--operator")))}
    for env, can_list in ((node_plain, False), (node, True)):
        _cannot_touch_elsewhere(agent, Path(env["CONSUL_HTTP_TOKEN_FILE"]).read_text().strip(), other, can_list)
    # What the reviewer found, still true of the one-token policy (why nodes get --node): it destroys a session
    # on another node, here a throwaway one.
    everything = _token(agent, management, tmp_path, "all", _printed(str(manifest))).read_text().strip()
    throwaway = _as(agent, management, "PUT", "session/create", {"Node": "vault1", "NodeChecks": []}).json()["ID"]
    assert _as(agent, everything, "PUT", f"session/destroy/{throwaway}").ok
    # A node's token made for another node cannot run here.
    elsewhere = {**base, "CONSUL_HTTP_TOKEN_FILE": str(_token(agent, management, tmp_path, "node-vault1",
                                                              _printed(str(plain), "--node", "vault1")))}
    code, _, err = finish(consulrun("run", "acljob", "--", "true", env=elsewhere))
    assert code == 77 and "Consul ACL denied it" in err, err

    plain_holder = _node_commands(node_plain, tmp_path, None, job="plainjob")
    plain_holder.terminate()  # type: ignore[attr-defined]
    assert finish(plain_holder)[0] == 143  # type: ignore[arg-type]
    holder = _node_commands(node, tmp_path, manifest)
    _operator_commands(operator, tmp_path, manifest, holder, node)
    assert _as(agent, management, "GET", f"session/info/{other}").json()[0]["Name"] == "vault-ha-lock"
    assert _as(agent, management, "GET", "kv/vault/ha/lock").json()[0]["Session"] == other
