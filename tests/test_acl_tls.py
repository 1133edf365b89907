"""ACLs (default deny, bootstrapped here) and TLS on the HTTP API, on real agents."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from consulrun.cli import main
from tests.harness.acl import (
    RawListener,
    acl as _acl,
    tls_material as _tls_material,
    token_file as _token_file,
)
from tests.harness.agents import Agent, free_port, start_dev_agent, wait_for
from tests.harness.runs import SKIP, consulrun, finish, lock_entry

pytestmark = pytest.mark.consul
REPO = Path(__file__).resolve().parents[1]


def _policy(prefix: str, service_read: bool, health_node: str | None = None) -> str:
    """The whole least-privilege policy, written out by hand: any rule added or widened fails the comparison."""
    return (f'# consulrun: what nodes need to run, take over and report jobs under "{prefix}"\n'
            '# (one token for every command on every node; least privilege per role: --node NAME, --operator)\n'
            f'key_prefix "{prefix}" {{\n  policy = "write"\n}}\n'
            'session_prefix "" {\n  policy = "write"\n}\n'
            'agent_prefix "" {\n  policy = "read"\n}\n'
            'node_prefix "" {\n  policy = "read"\n}\n'
            + ('service_prefix "" {\n  policy = "read"\n}\n' if service_read else "")
            + (f'# the jobs\' health checks: the external node "{health_node}" and its service\n'
               f'node "{health_node}" {{\n  policy = "write"\n}}\n'
               f'service "{health_node}" {{\n  policy = "write"\n}}\n' if health_node else ""))


@pytest.mark.parametrize(("args", "prefix", "service_read", "health_node"), [
    ([], "consulrun/", False, None),
    ([str(REPO / "examples" / "jobs.yaml")], "consulrun/", False, "consulrun"),
    ([str(REPO / "tests" / "golden" / "tls-and-checks" / "manifest.yaml")], "ops/cron/", True, None),
    ([str(REPO / "tests" / "golden" / "health" / "manifest.yaml")], "team/jobs/", False, "team-jobs"),
    (["--prefix", "team/jobs"], "team/jobs/", False, None),
], ids=["no-manifest", "example", "service-checks", "health-checks", "prefix"])
def test_acl_policy_is_exactly_the_documented_policy(args: list[str], prefix: str, service_read: bool,
                                                      health_node: str | None) -> None:
    result = CliRunner().invoke(main, ["acl-policy", *args])
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == _policy(prefix, service_read, health_node)


def test_health_check_rights_come_from_the_policy_and_their_lack_costs_no_result(acl_agent: tuple[Agent, str],
                                                                                 tmp_path: Path) -> None:
    """With the health rules, the watchdog registers the external node and a run sets its check; a token made
    from the policy without them (health_checks off when it was made) still runs and records its result."""
    agent, management = acl_agent
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text('health_checks: true\njobs:\n  acljob: {command: "true", schedule: "*-01-01 00:00:00 UTC"}\n')
    env = {"CONSUL_HTTP_ADDR": agent.http_addr}
    for name, args in (("with", [str(manifest)]), ("without", [])):
        rules = CliRunner().invoke(main, ["acl-policy", *args]).stdout
        _acl(agent, management, "PUT", "acl/policy", {"Name": name, "Rules": rules})
        secret = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": name}]})["SecretID"]
        env[name] = str(_token_file(tmp_path, name, secret))
    run = ["run", "--health-check", "--schedule", "*-01-01 00:00:00 UTC"]

    code, _, err = finish(consulrun(run[0], *run[1:], "weak", "--", "true",
                                    env={**env, "CONSUL_HTTP_TOKEN_FILE": env["without"]}))
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "health check" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "consulrun: weak: the job's Consul health check was not updated (Permission denied: ") and \
        "lacks permission 'service:write' on \"consulrun\"); the result is recorded without it" in warnings[0], err
    record = requests.get(f"{agent.url}/v1/kv/consulrun/weak/occurrence?raw", headers={"X-Consul-Token": management},
                          timeout=10).json()
    assert record["state"] == "done" and record["exit_status"] == 0
    code, _, err = finish(consulrun("watchdog", str(manifest), env={**env, "CONSUL_HTTP_TOKEN_FILE": env["without"]}))
    assert code == 77 and err.count("\n") == 1 and 'node "consulrun" and service "consulrun" write' in err, err

    strong = {**env, "CONSUL_HTTP_TOKEN_FILE": env["with"]}
    code, _, err = finish(consulrun("watchdog", str(manifest), env=strong))
    assert code == 0 and "registered the external node consulrun" in err, err
    code, _, err = finish(consulrun(*run, "acljob", "--", "true", env=strong))
    assert code == 0 and "health check" not in err, err
    found = requests.get(f"{agent.url}/v1/health/checks/consulrun", headers={"X-Consul-Token": management},
                         timeout=10).json()
    # The watchdog made a check for each job it saw (weak's from its record); the run then set acljob's.
    assert sorted((c["Name"], c["Status"]) for c in found) == [("acljob", "passing"), ("weak", "passing")]
    assert next(c for c in found if c["Name"] == "acljob")["Output"].startswith("occurrence 2026-01-01T00:00:00Z ran on")


@pytest.mark.parametrize("role", [[], ["--node", "acl1"]], ids=["one-token", "node"])
def test_acl_policy_token_runs_skips_takes_over_and_reports(acl_agent: tuple[Agent, str], tmp_path: Path,
                                                            role: list[str]) -> None:
    """The node's own policy too: a standby's takeover needs nothing beyond its own node's sessions (and status
    reads this node's holder with them; holders elsewhere need the operator's policy)."""
    agent, management = acl_agent
    rules = CliRunner().invoke(main, ["acl-policy", *role]).stdout
    _acl(agent, management, "PUT", "acl/policy", {"Name": "consulrun", "Rules": rules})
    secret = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": "consulrun"}]})["SecretID"]
    token_file = _token_file(tmp_path, "token", secret)
    env = {"CONSUL_HTTP_ADDR": agent.http_addr, "CONSUL_HTTP_TOKEN_FILE": str(token_file)}

    started = tmp_path / "started"
    args = ["run", "--schedule", "*-01-01 00:00:00 UTC", "--on-holder-loss", "retry", "--skip-exit-code", str(SKIP)]
    runner = consulrun(*args, "acljob", "--", "sh", "-c", f"touch {started}; sleep 120", env=env)
    wait_for(started.exists, 20, "the job under an ACL token")
    # The token appears in no process's command line.
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert secret.encode() not in cmdline.read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    code, out, err = finish(consulrun("status", env=env))
    assert code == 0, err
    assert "acljob" in out and "held" in out
    # A standby under the same token waits; the runner's session dies; the standby takes over.
    again = tmp_path / "again"
    standby = consulrun(*args, "acljob", "--", "touch", str(again), env=env)
    session = lock_entry(agent, "consulrun/acljob/lock?token=" + management)["Session"]
    _acl(agent, management, "PUT", f"session/destroy/{session}", {})
    code, _, err = finish(runner)
    assert code == 75, err
    code, _, err2 = finish(standby, timeout=120)
    assert code == 0 and again.exists(), err2
    assert secret not in err + err2
    code, _, _ = finish(consulrun(*args, "acljob", "--", "true", env=env))
    assert code == SKIP


def test_token_without_the_policy_is_refused_cleanly(acl_agent: tuple[Agent, str], tmp_path: Path) -> None:
    agent, management = acl_agent
    secret = _acl(agent, management, "PUT", "acl/token", {"Description": "no rights"})["SecretID"]
    marker = tmp_path / "ran"
    code, out, err = finish(consulrun("run", "denied", "--", "touch", str(marker), env={
        "CONSUL_HTTP_ADDR": agent.http_addr, "CONSUL_HTTP_TOKEN_FILE": str(_token_file(tmp_path, "weak", secret))}))
    assert code == 77
    assert out == "" and err.count("\n") == 1 and "Consul ACL denied it" in err
    assert secret not in err
    assert not marker.exists()


def test_world_readable_token_file_is_warned_about(acl_agent: tuple[Agent, str], tmp_path: Path) -> None:
    agent, management = acl_agent
    loose = _token_file(tmp_path, "loose", management)
    loose.chmod(0o644)
    code, _, err = finish(consulrun("run", "loose", "--", "true", env={
        "CONSUL_HTTP_ADDR": agent.http_addr, "CONSUL_HTTP_TOKEN_FILE": str(loose)}))
    assert code == 0, err
    assert f"Consul token file {loose} is readable by others; make it mode 0600" in err
    assert management not in err


def test_generated_units_reference_the_token_file_only(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["generate", str(REPO / "examples" / "jobs.yaml"), "-o", "-"])
    assert "LoadCredential=consul-token:/etc/consulrun/token" in result.stdout
    assert "CONSUL_HTTP_TOKEN=" not in result.stdout


# --- TLS ------------------------------------------------------------------------------------------------


@pytest.fixture
def tls_agent(consul_bin: str, tmp_path: Path) -> Iterator[tuple[Agent, int, dict[str, Path]]]:
    files = _tls_material(consul_bin, tmp_path / "tls")
    https = free_port()
    agent = start_dev_agent(consul_bin, tmp_path, name="tls1", extra_config={
        "ports": {"https": https},
        "tls": {"https": {"ca_file": str(files["ca"]), "cert_file": str(files["cert"]), "key_file": str(files["key"]),
                          "verify_incoming": True}}})
    try:
        yield agent, https, files
    finally:
        agent.stop()


def test_run_and_status_over_https_with_client_certificates(tls_agent, consul_bin: str, tmp_path: Path) -> None:
    agent, port, files = tls_agent
    env = {"CONSUL_HTTP_ADDR": f"https://127.0.0.1:{port}", "CONSUL_CACERT": str(files["ca"]),
           "CONSUL_CLIENT_CERT": str(files["client"]), "CONSUL_CLIENT_KEY": str(files["client_key"])}
    code, _, err = finish(consulrun("run", "tlsjob", "--", "true", env=env))
    assert code == 0, err
    assert "acquired consulrun/tlsjob/lock" in err
    code, out, err = finish(consulrun("status", env=env))
    assert code == 0 and "tlsjob" in out, err
    # The server certificate names server.dc1.consul; checking against that name works, another name fails.
    code, _, err = finish(consulrun("run", "tlsjob", "--", "true", env={**env, "CONSUL_TLS_SERVER_NAME": "server.dc1.consul"}))
    assert code == 0, err
    code, _, err = finish(consulrun("run", "tlsjob", "--", "true", env={**env, "CONSUL_TLS_SERVER_NAME": "wrong.example"}))
    assert code == 69 and "TLS failure" in err
    # A port on the name is dropped, as api.go's SetupTLSConfig drops it (before: "Hostname mismatch").
    code, _, err = finish(consulrun("run", "tlsjob", "--", "true",
                                    env={**env, "CONSUL_TLS_SERVER_NAME": f"server.dc1.consul:{port}"}))
    assert code == 0, err


def test_wrong_ca_fails_closed(tls_agent, consul_bin: str, tmp_path: Path) -> None:
    agent, port, files = tls_agent
    other = _tls_material(consul_bin, tmp_path / "other-ca")
    marker = tmp_path / "ran"
    code, out, err = finish(consulrun("run", "tlsjob", "--", "touch", str(marker), env={
        "CONSUL_HTTP_ADDR": f"https://127.0.0.1:{port}", "CONSUL_CACERT": str(other["ca"]),
        "CONSUL_CLIENT_CERT": str(files["client"]), "CONSUL_CLIENT_KEY": str(files["client_key"])}))
    assert code == 69
    assert err.count("\n") == 1 and "TLS failure talking to Consul" in err and "CERTIFICATE_VERIFY_FAILED" in err, err
    assert not marker.exists()
    code, _, err = finish(consulrun("run", "tlsjob", "--", "true", env={
        "CONSUL_HTTP_ADDR": f"https://127.0.0.1:{port}", "CONSUL_CACERT": str(files["ca"])}))
    assert code == 69, err  # verify_incoming: no client certificate, no service
    # TLS 1.3 rejects a missing client certificate after the handshake: the client reads the alert, or, if it was
    # still sending its request (a transaction's body), finds the connection closed.
    assert err.count("\n") == 1 and "TLS failure talking to Consul" in err and (
        "CERTIFICATE_REQUIRED" in err or "EOF occurred in violation of protocol" in err), err


def test_consul_http_ssl_and_ssl_verify_are_honoured(tls_agent, consul_bin: str, tmp_path: Path) -> None:
    agent, port, files = tls_agent
    certs = {"CONSUL_CLIENT_CERT": str(files["client"]), "CONSUL_CLIENT_KEY": str(files["client_key"])}
    bare = {"CONSUL_HTTP_ADDR": f"127.0.0.1:{port}", **certs}  # no scheme: CONSUL_HTTP_SSL decides
    code, _, err = finish(consulrun("run", "ssljob", "--", "true",
                                    env={**bare, "CONSUL_HTTP_SSL": "true", "CONSUL_CACERT": str(files["ca"])}))
    assert code == 0 and f"via https://127.0.0.1:{port}" not in err and "acquired consulrun/ssljob/lock" in err, err
    code, _, err = finish(consulrun("run", "ssljob", "--", "true", env={**bare, "CONSUL_CACERT": str(files["ca"])}))
    # Without it the same address is plain HTTP, which the HTTPS port answers with a 400.
    assert code == 70 and f"via http://127.0.0.1:{port}" in err and "HTTP request to an HTTPS server" in err, err
    # A CA that did not sign the agent's certificate: refused unless CONSUL_HTTP_SSL_VERIFY=false.
    other = _tls_material(consul_bin, tmp_path / "other-ca")
    wrong = {**bare, "CONSUL_HTTP_SSL": "1", "CONSUL_CACERT": str(other["ca"])}
    code, _, err = finish(consulrun("run", "ssljob", "--", "true", env={**wrong, "CONSUL_HTTP_SSL_VERIFY": "true"}))
    assert code == 69 and "TLS failure talking to Consul" in err and "CERTIFICATE_VERIFY_FAILED" in err, err
    code, _, err = finish(consulrun("run", "ssljob", "--", "true", env={**bare, "CONSUL_HTTP_SSL": "1",
                                                                       "CONSUL_HTTP_SSL_VERIFY": "false"}))
    assert code == 0 and "acquired consulrun/ssljob/lock" in err, err


def test_consul_http_token_is_honoured(acl_agent: tuple[Agent, str], tmp_path: Path) -> None:
    agent, management = acl_agent
    rules = CliRunner().invoke(main, ["acl-policy"]).stdout
    _acl(agent, management, "PUT", "acl/policy", {"Name": "consulrun", "Rules": rules})
    good = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": "consulrun"}]})["SecretID"]
    weak = _acl(agent, management, "PUT", "acl/token", {"Description": "no rights"})["SecretID"]
    marker = tmp_path / "ran"
    code, _, err = finish(consulrun("run", "envtoken", "--", "touch", str(marker),
                                    env={"CONSUL_HTTP_ADDR": agent.http_addr, "CONSUL_HTTP_TOKEN": good}))
    assert code == 0 and marker.exists() and "acquired consulrun/envtoken/lock" in err, err
    marker.unlink()
    code, _, err = finish(consulrun("run", "envtoken", "--", "touch", str(marker),
                                    env={"CONSUL_HTTP_ADDR": agent.http_addr, "CONSUL_HTTP_TOKEN": weak}))
    assert code == 77 and "Consul ACL denied it" in err and not marker.exists(), err
    assert good not in err and weak not in err


def test_a_token_that_cannot_read_every_node_does_not_take_turns_and_says_so(acl_agent: tuple[Agent, str],
                                                                            tmp_path: Path) -> None:
    """Consul drops the members a token may not read from /v1/agent/members without an error: a node that cannot
    see the whole order claims at once (as every node did before turns) and says why, once."""
    from tests.harness.faultproxy import FaultProxy

    agent, management = acl_agent
    full = CliRunner().invoke(main, ["acl-policy"]).stdout
    assert 'node_prefix "" {\n  policy = "read"\n}\n' in full
    for name, rules in (("full", full), ("blind", full.replace('node_prefix "" {\n  policy = "read"\n}\n', ""))):
        _acl(agent, management, "PUT", "acl/policy", {"Name": name, "Rules": rules})
        secret = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": name}]})["SecretID"]
        with FaultProxy(agent.http_addr) as proxy:
            blocks = proxy.fail("GET", "/occurrence?index=", "forward", times=100)
            env = {"CONSUL_HTTP_ADDR": proxy.address,
                   "CONSUL_HTTP_TOKEN_FILE": str(_token_file(tmp_path, name, secret))}
            code, _, err = finish(consulrun("run", "--schedule", "*-01-01 00:00:00 UTC", f"turns-{name}", "--",
                                            "true", env=env))
        assert code == 0, err
        assert ("cannot see every member of the cluster (its ACL token needs node:read on every node)" in err) \
            == (name == "blind"), err
        assert blocks.hits == [], blocks.hits  # no turn: no blocking read of the record


# --- The consul CLI's rules for connection settings (api/api.go), against a raw listener and the TLS agent -----


SECRET = "s3cr3t-token-value"


def test_consul_http_ssl_with_an_http_address_sends_tls_never_the_token_in_cleartext(tls_agent,
                                                                                      tmp_path: Path) -> None:
    """api.go: "Never revert to http if TLS was explicitly requested". Before, consulrun sent
    `X-Consul-Token: s3cr3t-token-value` in cleartext to http://... although CONSUL_HTTP_SSL=true."""
    with RawListener() as raw:
        code, out, err = finish(consulrun("status", env={
            "CONSUL_HTTP_ADDR": f"http://127.0.0.1:{raw.port}", "CONSUL_HTTP_SSL": "true",
            "CONSUL_HTTP_TOKEN": SECRET}))
        wait_for(lambda: raw.received, 10, "the client's first bytes")
    assert code == 69 and "TLS failure talking to Consul" in err and out == "", (code, out, err)
    assert all(SECRET.encode() not in data for data in raw.received), raw.received
    assert raw.received[0][:2] == b"\x16\x03", raw.received[0][:80]  # a TLS handshake record: the ClientHello
    # The real agent's HTTPS port under an http:// address: TLS, and the run works.
    agent, port, files = tls_agent
    code, _, err = finish(consulrun("run", "sslhttp", "--", "true", env={
        "CONSUL_HTTP_ADDR": f"http://127.0.0.1:{port}", "CONSUL_HTTP_SSL": "1", "CONSUL_CACERT": str(files["ca"]),
        "CONSUL_CLIENT_CERT": str(files["client"]), "CONSUL_CLIENT_KEY": str(files["client_key"])}))
    assert code == 0 and "acquired consulrun/sslhttp/lock" in err, err


def test_consul_capath_is_honoured_after_consul_cacert(tls_agent, consul_bin: str, tmp_path: Path) -> None:
    """CONSUL_CAPATH: every file of a folder (sub-folders too) as CA certificates; CONSUL_CACERT wins over it;
    a file that holds no certificate is refused naming it. Before, CONSUL_CAPATH was ignored."""
    agent, port, files = tls_agent
    other = _tls_material(consul_bin, tmp_path / "other-ca")
    env = {"CONSUL_HTTP_ADDR": f"https://127.0.0.1:{port}", "CONSUL_CLIENT_CERT": str(files["client"]),
           "CONSUL_CLIENT_KEY": str(files["client_key"])}
    good, wrong, junk = tmp_path / "good", tmp_path / "wrong", tmp_path / "junk"
    (good / "nested").mkdir(parents=True)
    (good / "nested" / "ca.pem").write_bytes(files["ca"].read_bytes())  # not a hashed name: no c_rehash needed
    (good / "other.pem").write_bytes(other["ca"].read_bytes())
    wrong.mkdir()
    (wrong / "ca.pem").write_bytes(other["ca"].read_bytes())
    junk.mkdir()
    (junk / "ca.pem").write_bytes(files["ca"].read_bytes())
    (junk / "README").write_text("not a certificate\n")
    code, _, err = finish(consulrun("run", "capath", "--", "true", env={**env, "CONSUL_CAPATH": str(good)}))
    assert code == 0 and "acquired consulrun/capath/lock" in err, err
    code, _, err = finish(consulrun("run", "capath", "--", "true", env={**env, "CONSUL_CAPATH": str(wrong)}))
    assert code == 69 and "CERTIFICATE_VERIFY_FAILED" in err, err
    code, _, err = finish(consulrun("run", "capath", "--", "true", env={**env, "CONSUL_CAPATH": str(wrong),
                                                                         "CONSUL_CACERT": str(files["ca"])}))
    assert code == 0, err  # CONSUL_CACERT first, as go-rootcerts has it
    code, _, err = finish(consulrun("run", "capath", "--", "true", env={**env, "CONSUL_CAPATH": str(junk)}))
    assert code == 2 and err.count("\n") == 1 and f"{junk / 'README'} holds no PEM certificate" in err, err
    code, _, err = finish(consulrun("status", "--ca-path", str(good), env=env))
    assert code in (0, 6), err  # the option says the same as the variable (6: nothing under the prefix yet)


def test_tls_settings_the_consul_cli_refuses_or_would_guess_are_refused_before_any_connection(tmp_path: Path) -> None:
    """A boolean Go's ParseBool does not take (the consul CLI then warns and, for CONSUL_HTTP_SSL_VERIFY, skips
    verification), and a client certificate without its key (api.go refuses it): exit 2, nothing sent."""
    cert = tmp_path / "cert.pem"
    cert.write_text("unused\n")
    with RawListener() as raw:
        base = {"CONSUL_HTTP_ADDR": f"127.0.0.1:{raw.port}", "CONSUL_HTTP_TOKEN": SECRET}
        for extra, message in (({"CONSUL_HTTP_SSL": "yes"}, "CONSUL_HTTP_SSL='yes' is not a boolean"),
                               ({"CONSUL_HTTP_SSL": "1", "CONSUL_HTTP_SSL_VERIFY": "no"},
                                "CONSUL_HTTP_SSL_VERIFY='no' is not a boolean"),
                               ({"CONSUL_HTTP_SSL": "1", "CONSUL_CLIENT_CERT": str(cert)},
                                "give both a client certificate and its key")):
            code, out, err = finish(consulrun("run", "refused", "--", "true", env={**base, **extra}))
            assert code == 2 and err.count("\n") == 1 and message in err and SECRET not in err, (extra, err)
    assert raw.received == []


def test_the_token_file_wins_over_consul_http_token_as_in_the_consul_cli(acl_agent: tuple[Agent, str],
                                                                          tmp_path: Path) -> None:
    """api.go: "If the TokenFile is set, always use that, even if a Token is configured" (an empty file leaves
    the token). Before, CONSUL_HTTP_TOKEN won over CONSUL_HTTP_TOKEN_FILE."""
    agent, management = acl_agent
    rules = CliRunner().invoke(main, ["acl-policy"]).stdout
    _acl(agent, management, "PUT", "acl/policy", {"Name": "consulrun", "Rules": rules})
    good = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": "consulrun"}]})["SecretID"]
    weak = _acl(agent, management, "PUT", "acl/token", {"Description": "no rights"})["SecretID"]
    env = {"CONSUL_HTTP_ADDR": agent.http_addr}
    code, _, err = finish(consulrun("run", "tokenfile", "--", "true", env={
        **env, "CONSUL_HTTP_TOKEN": weak, "CONSUL_HTTP_TOKEN_FILE": str(_token_file(tmp_path, "good", good))}))
    assert code == 0 and "acquired consulrun/tokenfile/lock" in err, err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    code, _, err = finish(consulrun("run", "tokenfile", "--", "true", env={
        **env, "CONSUL_HTTP_TOKEN": good, "CONSUL_HTTP_TOKEN_FILE": str(empty)}))
    assert code == 0, err
    code, _, err = finish(consulrun("run", "tokenfile", "--", "true", env={
        **env, "CONSUL_HTTP_TOKEN": good, "CONSUL_HTTP_TOKEN_FILE": str(_token_file(tmp_path, "weak", weak))}))
    assert code == 77 and "Consul ACL denied it" in err, err
