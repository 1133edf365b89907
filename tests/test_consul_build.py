"""The Consul we test against is built from the MPL-2.0 release and nothing from a BUSL-1.1 release."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import require_tool

MODULE = Path(__file__).resolve().parents[1] / "scripts" / "consul"
# What consul v1.16.3's own go.mod requires of its submodules (all MPL-2.0 tags).
EXPECTED = {
    "github.com/hashicorp/consul": "v1.16.3",
    "github.com/hashicorp/consul/api": "v1.25.1",
    "github.com/hashicorp/consul/envoyextensions": "v0.4.1",
    "github.com/hashicorp/consul/proto-public": "v0.4.1",
    "github.com/hashicorp/consul/sdk": "v0.14.1",
    "github.com/hashicorp/consul/troubleshoot": "v0.3.1",
}


def test_module_graph_pins_the_mpl_release(consul_bin: str) -> None:
    # consul_bin first: building it fills the module cache that `go list` reads.
    result = subprocess.run([require_tool("go"), "list", "-m", "-e", "-f", "{{.Path}} {{.Version}}", "all"], cwd=MODULE,
                            capture_output=True, text=True, env=None)
    assert result.returncode == 0, result.stderr
    versions = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    consul = {path: version for path, version in versions.items()
              if path == "github.com/hashicorp/consul" or path.startswith("github.com/hashicorp/consul/")}
    assert consul == EXPECTED


def test_go_mod_keeps_consuls_excludes() -> None:
    text = (MODULE / "go.mod").read_text()
    assert "github.com/hashicorp/go-msgpack v1.1.5" in text and "github.com/hashicorp/go-msgpack v1.1.6" in text
    assert "\ngo 1.20\n" in text  # the GODEBUG defaults consul v1.16.3 was tested with
