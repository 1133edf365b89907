"""The quickstarts run exactly as written, against a real agent, and print what they show.

docs/getting-started.md and README.md's quickstart mark their blocks for tests/harness/pagerun.py. What
differs from a reader's shell, and is said on the page: `consul` is the suite's build (scripts/consul-binary),
`consul agent -dev` gets free loopback ports in place of the defaults, and CONSUL_HTTP_ADDR names that HTTP
port for every command (the `consul` CLI and consulrun both read it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.harness.agents import free_port
from tests.harness.pagerun import blocks, matches, run_page

REPO = Path(__file__).resolve().parents[1]
PAGES = {"getting-started": REPO / "docs" / "getting-started.md", "readme": REPO / "README.md"}


def _page(name: str) -> str:
    text = PAGES[name].read_text()
    if name == "readme":
        text = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return text


@pytest.mark.consul
@pytest.mark.parametrize("name", sorted(PAGES))
def test_quickstart_runs_as_written(name: str, consul_bin: str, tmp_path: Path) -> None:
    page = _page(name)
    assert sum(1 for block in blocks(page) if "consul agent -dev" in block.script) == 1, "one block starts the agent"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "consul").symlink_to(consul_bin)
    http = free_port()
    ports = (f"-http-port={http} -dns-port=-1 -grpc-port=-1 -grpc-tls-port=-1 -serf-lan-port={free_port()} "
             f"-serf-wan-port={free_port()} -server-port={free_port()}")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("CONSUL_", "CONSULRUN_"))}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}", CONSUL_HTTP_ADDR=f"127.0.0.1:{http}")
    work = tmp_path / "work"
    work.mkdir()
    problems = run_page(page, work, env, rewrite=lambda script: script.replace("consul agent -dev",
                                                                                f"consul agent -dev {ports}"))
    assert not problems, "\n\n".join(problems)


def test_output_matching_rules() -> None:
    """The placeholder rules the pages rely on, and that they are no wildcard for everything."""
    assert matches("a <pid> b\n", "a 123 b\n")
    assert not matches("a <pid> b\n", "a  b\n")
    assert matches("x\n...\ny\n", "x\ny\n") and matches("x\n...\ny\n", "x\n1\n2\ny\n")
    assert matches("JOB  STATE\n", "JOB     STATE\n") and not matches("JOB  STATE\n", "JOBSTATE\n")
    assert not matches("exit 0\n", "exit 1\n") and not matches("one\n", "one\ntwo\n")
    assert matches("==> units/a <==\n", "==> units/a <==\n") and not matches("==> <==\n", "==> x <==\n")
