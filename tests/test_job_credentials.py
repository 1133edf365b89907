"""The node's Consul token stays the wrapper's: not in a unit file, not in the job's environment unless asked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from tests.harness.acl import acl as _acl, token_file as _token_file
from tests.harness.agents import Agent
from tests.harness.runs import consulrun, finish

OK_JOB = "    command: [/bin/true]\n    schedule: daily\n"
_DUMP = ("import json, os, sys; "
         "json.dump({k: v for k, v in os.environ.items() if k.startswith('CONSUL_')}, open(sys.argv[1], 'w'))")


def _generate(tmp_path: Path, job: str) -> tuple[int, str]:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  a:\n" + OK_JOB + job)
    result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
    return result.exit_code, result.stderr.replace(str(manifest), "M")


@pytest.mark.parametrize(("setting", "where", "words"), [
    ("    environment: {CONSUL_HTTP_TOKEN: s3cr3t}\n", "M:5:19: jobs.a.environment.CONSUL_HTTP_TOKEN:",
     "CONSUL_HTTP_TOKEN is refused: unit files are world-readable"),
    ("    environment: {CONSUL_HTTP_TOKEN_FILE: /etc/t}\n", "M:5:19: jobs.a.environment.CONSUL_HTTP_TOKEN_FILE:",
     "CONSUL_HTTP_TOKEN_FILE is refused"),
    ("    environment: {CONSUL_HTTP_AUTH: 'ops:pw'}\n", "M:5:19: jobs.a.environment.CONSUL_HTTP_AUTH:",
     "CONSUL_HTTP_AUTH is refused: unit files are world-readable, and a credential never goes in one"),
    ("    service: {SetCredential: 'other:s3cr3t'}\n", "M:5:15: jobs.a.service.SetCredential:",
     "SetCredential= is refused: it writes the credential's value into the unit file, which every user can read"),
    ("    service: {PassEnvironment: 'LANG CONSUL_HTTP_TOKEN'}\n", "M:5:32: jobs.a.service.PassEnvironment:",
     "would hand the service manager's Consul credentials to the job"),
    ("    service: {PassEnvironment: 'CONSUL_HTTP_AUTH'}\n", "M:5:32: jobs.a.service.PassEnvironment:",
     "would hand the service manager's Consul credentials to the job"),
])
def test_a_secret_in_a_unit_setting_is_refused(tmp_path: Path, setting: str, where: str, words: str) -> None:
    code, stderr = _generate(tmp_path, setting)
    assert code == 2
    assert stderr.startswith(f"Error: {where} ") and words in stderr and len(stderr.splitlines()) == 1, stderr


def test_a_credential_loaded_from_a_file_is_still_accepted(tmp_path: Path) -> None:
    code, stderr = _generate(tmp_path, "    service: {LoadCredential: 'other:/etc/other-secret', "
                                       "SetCredentialEncrypted: 'other2:ZW5jcnlwdGVk'}\n")
    assert (code, stderr) == (0, "")


def test_pass_consul_token_reaches_the_unit_s_command_line(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    for flag, wanted in (("", False), ("    pass_consul_token: true\n", True)):
        manifest.write_text("jobs:\n  a:\n" + OK_JOB + flag)
        result = CliRunner().invoke(main, ["generate", str(manifest), "-o", "-", "--consulrun-path", "/x/consulrun"])
        assert result.exit_code == 0, result.stderr
        exec_start = next(line for line in result.stdout.splitlines() if line.startswith("ExecStart=/x/consulrun run"))
        assert (" --pass-consul-token " in exec_start) is wanted, exec_start


@pytest.mark.consul
def test_the_job_gets_no_consul_token_unless_it_asks(acl_agent: tuple[Agent, str],  # noqa: F811 - the fixture
                                                     tmp_path: Path) -> None:
    """The reviewer's `consulrun run j -- sh -c 'cat $CONSUL_HTTP_TOKEN_FILE'` printed the node token."""
    agent, management = acl_agent
    rules = CliRunner().invoke(main, ["acl-policy"]).stdout
    _acl(agent, management, "PUT", "acl/policy", {"Name": "consulrun", "Rules": rules})
    secret = _acl(agent, management, "PUT", "acl/token", {"Policies": [{"Name": "consulrun"}]})["SecretID"]
    token_file = _token_file(tmp_path, "token", secret)
    seen = tmp_path / "env.json"
    # HTTP basic auth's user:password (a proxy in front of the agent may ask for it) is a credential too.
    for env in ({"CONSUL_HTTP_TOKEN_FILE": str(token_file)}, {"CONSUL_HTTP_TOKEN": secret},
                {"CONSUL_HTTP_TOKEN": secret, "CONSUL_HTTP_AUTH": "ops:pw"}):
        env = {"CONSUL_HTTP_ADDR": agent.http_addr, **env}
        code, _, err = finish(consulrun("run", "tokjob", "--", sys.executable, "-c", _DUMP, str(seen), env=env))
        assert code == 0, err
        assert json.loads(seen.read_text()) == {"CONSUL_HTTP_ADDR": agent.http_addr}, env
        code, _, err = finish(consulrun("run", "--pass-consul-token", "tokjob", "--", sys.executable, "-c", _DUMP,
                                        str(seen), env=env))
        assert code == 0, err
        assert json.loads(seen.read_text()) == env
