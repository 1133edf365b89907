"""README's ACL step and the exit-77 line give the policy the manifest needs (acl-policy MANIFEST).

A user followed README's `consulrun acl-policy --node a1` (no manifest) for a manifest with
`health_checks: true`: the watchdog exited 77, every run logged that its check was not updated,
and neither the README nor the error said that the manifest's own policy was the one to give.
On a real agent with ACLs on (default deny): the old step fails as it did, its messages name the
command, and the command README now gives makes both work.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from consulrun.cli import main
from tests.harness.agents import Agent, start_dev_agent, wait_for

pytestmark = pytest.mark.consul
REPO = Path(__file__).resolve().parents[1]
HINT = "`consulrun acl-policy MANIFEST --node NODE`"
MANIFEST = ('health_checks: true\njobs:\n'
            '  report: {command: "true", schedule: "*-01-01 00:00:00 UTC"}\n')


@pytest.fixture
def acl_agent(consul_bin: str, tmp_path: Path) -> Iterator[tuple[Agent, str]]:
    agent = start_dev_agent(consul_bin, tmp_path, name="a1", extra_config={
        "acl": {"enabled": True, "default_policy": "deny", "down_policy": "deny"}})
    try:
        def bootstrap() -> str:
            return requests.put(f"{agent.url}/v1/acl/bootstrap", timeout=10).json()["SecretID"]
        management = wait_for(bootstrap, 30, "ACL bootstrap")
        yield agent, management
    finally:
        agent.stop()


def token_file(agent: Agent, management: str, tmp_path: Path, name: str, rules: str) -> str:
    """A root-only file holding a token whose one policy is `rules`."""
    headers = {"X-Consul-Token": management}
    requests.put(f"{agent.url}/v1/acl/policy", json={"Name": name, "Rules": rules}, headers=headers,
                 timeout=10).raise_for_status()
    token = requests.put(f"{agent.url}/v1/acl/token", json={"Policies": [{"Name": name}]},
                         headers=headers, timeout=10)
    token.raise_for_status()
    path = tmp_path / f"{name}.token"
    path.write_text(token.json()["SecretID"] + "\n")
    path.chmod(0o600)
    return str(path)


def consulrun(agent: Agent, token: str, *args: str) -> tuple[int, str]:
    env = {**os.environ, "CONSUL_HTTP_ADDR": agent.http_addr, "CONSUL_HTTP_TOKEN_FILE": token,
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "consulrun", *args], env=env, capture_output=True,
                          text=True, timeout=120)
    return done.returncode, done.stderr


def policy(*args: str) -> str:
    result = CliRunner().invoke(main, ["acl-policy", *args])
    assert result.exit_code == 0, result.stderr
    return result.stdout


def test_the_77_line_and_the_check_warning_name_the_manifest_s_policy(
        acl_agent: tuple[Agent, str], tmp_path: Path) -> None:
    agent, management = acl_agent
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(MANIFEST)
    bare = token_file(agent, management, tmp_path, "bare", policy("--node", "a1"))
    code, err = consulrun(agent, bare, "watchdog", str(manifest))
    assert code == 77 and err.count("\n") == 1, err
    assert err.startswith("Error: ") and HINT in err and "with the manifest" in err, err
    run = ["run", "--health-check", "--schedule", "*-01-01 00:00:00 UTC", "report", "--", "true"]
    code, err = consulrun(agent, bare, *run)
    warnings = [line for line in err.splitlines() if "health check was not updated" in line]
    assert code == 0 and len(warnings) == 1 and HINT in warnings[0], err

    # What the hint says to do, with the manifest, makes the watchdog and the run's check work.
    whole = token_file(agent, management, tmp_path, "whole", policy(str(manifest), "--node", "a1"))
    code, err = consulrun(agent, whole, "watchdog", str(manifest))
    assert code == 0, err
    code, err = consulrun(agent, whole, *run)
    assert code == 0 and "health check" not in err, err


def test_readme_s_acl_step_gives_the_manifest() -> None:
    readme = REPO / "README.md"
    text = readme.read_text().replace("\n   ", " ")
    commands = re.findall(r"`(consulrun acl-policy[^`]*)`", text)
    assert commands, "README's ACL step"
    for command in commands:
        words = command.split()[2:]
        assert words and words[0].endswith((".yaml", ".yml")), command
