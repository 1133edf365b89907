"""The docs say what the code does: the site builds strictly, every command and manifest key has its page or row.

The quickstart pages are run against a real agent in tests/test_quickstart.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CONFIG = DOCS / "mkdocs" / "mkdocs.yml"
README = (REPO / "README.md").read_text()


def test_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """A broken link or anchor, or a page missing from the nav, is a warning, and --strict makes it a failure."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG),
                             "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for page in ("getting-started", "manifest", "guarantees", "commands/run", "operations/troubleshooting",
                 "benchmarks", "chaos", "mutation", "alerts"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_site_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The strict build is a real check: the same config with one broken link fails."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(DOCS), str(docs)], check=True)
    (docs / "benchmarks.md").unlink()  # a link to ../bench/RESULTS.md, which the copy does not have
    (docs / "benchmarks.md").write_text((REPO / "bench" / "RESULTS.md").read_text())
    page = docs / "guarantees.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                             str(docs / "mkdocs" / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "no-such-page.md" in result.stderr, result.stderr


def test_command_pages_hold_the_current_help() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONSUL_", "COLUMNS"))}
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "command_docs.py"), "--check"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_command_has_a_page_in_the_nav() -> None:
    from consulrun.cli import main

    nav = CONFIG.read_text()
    for name in main.commands:
        assert f"commands/{name}.md" in nav, name
        page = (DOCS / "commands" / f"{name}.md").read_text()
        assert "To be written" not in page, f"docs/commands/{name}.md has no prose yet"


# --- the manifest reference against the schema ----------------------------------------------------------------

SCHEMA = json.loads((REPO / "consulrun" / "manifest" / "manifest.schema.json").read_text())
# Documented once, as lock.X, timer.X, service.X, retries.X, whether in a job or defaults.
SECTIONS = {"lock", "timer", "service", "retries"}


def _resolve(node: dict) -> dict:
    while "$ref" in node:
        target: object = SCHEMA
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]  # type: ignore[index]
        node = target  # type: ignore[assignment]
    return node


def _keys(node: dict, path: str, out: set[str]) -> set[str]:
    node = _resolve(node)
    for name, sub in node.get("properties", {}).items():
        out.add(path + name)
        ref = sub.get("$ref", "")
        if ref.startswith("#/$defs/") and ref.split("/")[-1] in SECTIONS:
            _keys(sub, ref.split("/")[-1] + ".", out)
        else:
            _keys(sub, path + name + ".", out)
    if node.get("patternProperties") or isinstance(node.get("additionalProperties"), dict):
        # Free-form maps (a job's environment, the node meta it asks for) have one row, not a row per name.
        if node.get("type") == "object" and not path.endswith(("environment.", "nodes.meta.")):
            child = "<name>" if path == "jobs." else "<Setting>"
            out.add(path + child)
            sub = next(iter(node.get("patternProperties", {}).values()), node.get("additionalProperties"))
            if path == "jobs.":
                _keys(sub, path + child + ".", out)
    return out


def _documented() -> set[str]:
    page = (DOCS / "manifest.md").read_text()
    table = page.split("## Keys\n", 1)[1].split("\n## ", 1)[0]
    keys: set[str] = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            keys.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return keys


def test_manifest_reference_has_a_row_for_every_key_and_none_other() -> None:
    schema = _keys(SCHEMA, "", set())
    assert {"jobs.<name>.command", "lock.ttl", "timer.<Setting>", "service.<Setting>", "defaults.ping_url"} <= schema
    documented = _documented()
    assert not schema - documented, f"docs/manifest.md has no row for: {sorted(schema - documented)}"
    unknown = sorted(documented - schema)
    assert not unknown, f"docs/manifest.md names keys the schema does not have: {unknown}"


# --- README -----------------------------------------------------------------------------------------------------

def test_readme_is_short_and_its_test_command_is_what_ci_runs() -> None:
    assert len(README.splitlines()) <= 250
    blocks = re.findall(r"```sh\n(.*?)```", README, flags=re.S)
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", " "))]
    assert blocks[1].strip() == "scripts/test" and "scripts/test" in ci, (blocks[1], ci)


def test_readme_sections_come_in_the_order_a_user_works() -> None:
    headings = re.findall(r"^## (.+)$", README, flags=re.M)
    order = ["What it is", "Install", "Quickstart", "On a cluster", "Documentation"]
    assert [h for h in headings if h in order] == order, headings


def test_manifests_shown_in_the_reference_are_valid(tmp_path: Path) -> None:
    """The complete manifest and the examples of docs/manifest.md load as written (validate: writes nothing)."""
    shown = re.findall(r"```yaml\n(.*?)```", (DOCS / "manifest.md").read_text(), flags=re.S)
    manifests = [text for text in shown if "jobs:" in text]
    assert len(manifests) >= 2
    for number, text in enumerate(manifests):
        path = tmp_path / f"shown{number}.yaml"
        path.write_text(text)
        result = subprocess.run([sys.executable, "-m", "consulrun", "validate", str(path)], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, (text, result.stderr)
