"""Driver behind scripts/mutation: run mutmut group by group in a scratch copy, then report every mutant.

mutmut 2 mutates files in place and runs a command per mutant, so the tests'
subprocesses (`python -m consulrun` against a real agent) run the mutant too;
mutmut 3 only learns which tests cover a function from calls inside the
pytest process, and would call most protocol mutants untested. Working in a
copy keeps this checkout untouched even when a run is cut short.
"""

from __future__ import annotations

import ast
import os
import shlex
import sqlite3
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "scripts" / "mutation.toml"
WORK = Path(os.environ.get("MUTATION_DIR", "/tmp/consulrun-mutation"))
BUDGET_S = int(os.environ.get("MUTATION_BUDGET", "3600"))
STATUS = {"ok_killed": "killed", "bad_survived": "survived", "bad_timeout": "timeout",
          "ok_suspicious": "suspicious", "untested": "not run (budget)", "skipped": "skipped"}


def copy_checkout(work: Path) -> None:
    """The checkout's files as they are now (committed or not), over a scratch copy; mutmut's cache stays."""
    work.mkdir(parents=True, exist_ok=True)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.split(b"\0")
    files = [f for f in files if f and (REPO / os.fsdecode(f)).is_file()]
    tar = subprocess.Popen(["tar", "--null", "-T", "-", "-cf", "-"], cwd=REPO, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE)
    untar = subprocess.Popen(["tar", "-xf", "-", "-C", str(work)], stdin=tar.stdout)
    assert tar.stdin is not None
    tar.stdin.write(b"\0".join(files) + b"\0")
    tar.stdin.close()
    if untar.wait() != 0 or tar.wait() != 0:
        sys.exit("mutation: copying the checkout failed")


def selected_lines(path: Path, names: list[str]) -> list[tuple[int, int]]:  
    """Line ranges of the named top-level functions/classes/assignments (or Class.method) in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: dict[str, tuple[int, int]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = (node.lineno, node.end_lineno or node.lineno)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found[f"{node.name}.{item.name}"] = (item.lineno, item.end_lineno or item.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = (node.lineno, node.end_lineno or node.lineno)
    missing = [n for n in names if n not in found]
    if missing:
        sys.exit(f"mutation: {path.name} has no {', '.join(missing)} (scripts/mutation.toml is stale)")
    return [found[n] for n in names] if names else [(1, len(path.read_text(encoding="utf-8").splitlines()))]


def patch_for(work: Path, mutate: dict[str, list[str]]) -> str:
    """A unified diff that 'adds' exactly the selected lines: mutmut's --use-patch-file then mutates only them."""
    out: list[str] = []
    for rel, names in mutate.items():
        lines = (work / rel).read_text(encoding="utf-8").splitlines()
        out += [f"diff --git {rel} {rel}", f"--- {rel}", f"+++ {rel}"]  # git form: one diff per file
        for first, last in selected_lines(work / rel, names):
            out.append(f"@@ -0,0 +{first},{last - first + 1} @@")
            out += ["+" + line for line in lines[first - 1:last]]
    return "\n".join(out) + "\n"


def run_group(name: str, group: dict) -> int:
    """One group in its own copy (WORK/<group>): its own mutmut cache, and a baseline time of its own tests."""
    work = WORK / name
    copy_checkout(work)
    mutate: dict[str, list[str]] = group["mutate"]
    patch = work / ".mutation.patch"
    patch.write_text(patch_for(work, mutate))
    runner = work / ".mutation-tests.sh"
    # mutmut counts only exit status 1 as "tests failed"; any failure (collection error, interrupted run) is one.
    runner.write_text("#!/bin/sh\nexport PYTHONDONTWRITEBYTECODE=1\n"
                      f"{shlex.quote(sys.executable)} -m pytest -x -q -p no:cacheprovider "
                      f"{' '.join(shlex.quote(t) for t in group['tests'])} >/dev/null 2>&1 || exit 1\n")
    runner.chmod(0o755)
    print(f"mutation: group {name}: mutating {', '.join(mutate)}; tests: {' '.join(group['tests'])}", flush=True)
    cmd = [str(Path(sys.executable).parent / "mutmut"), "run", "--paths-to-mutate", ",".join(mutate),
           "--runner", f"sh {runner.name}", "--use-patch-file", patch.name, "--simple-output", "--no-progress"]
    try:
        return subprocess.run(cmd, cwd=work, timeout=BUDGET_S).returncode
    except subprocess.TimeoutExpired:
        print(f"mutation: group {name} hit its budget of {BUDGET_S}s; rerun to go on where it stopped", flush=True)
        return -1


def report(groups: dict[str, dict]) -> None:
    """Counts per group, then every mutant that was not killed, as mutmut shows it."""
    summary = ["# scripts/mutation report", ""]
    details: list[str] = []
    mutmut = str(Path(sys.executable).parent / "mutmut")
    for name in groups:
        work = WORK / name
        if not (work / ".mutmut-cache").exists():
            summary.append(f"{name}: not run")
            continue
        db = sqlite3.connect(work / ".mutmut-cache")
        rows = db.execute("select SourceFile.filename, Line.line_number, Mutant.id, Mutant.status from Mutant "
                          "join Line on Mutant.line = Line.id join SourceFile on Line.sourcefile = SourceFile.id "
                          "order by SourceFile.filename, Line.line_number, Mutant.id").fetchall()
        db.close()
        counts: dict[str, int] = {}
        for _, _, _, status in rows:
            counts[STATUS.get(status, status)] = counts.get(STATUS.get(status, status), 0) + 1
        summary.append(f"{name}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
        for filename, line, mutant_id, status in rows:
            if status != "ok_killed":
                shown = subprocess.run([mutmut, "show", str(mutant_id)], cwd=work, capture_output=True,
                                       text=True).stdout
                details += [f"## {name} mutant {mutant_id}: {filename}:{line}: {STATUS.get(status, status)}",
                            shown.rstrip(), ""]
    out = WORK / "mutation-report.md"
    out.write_text("\n".join(summary + [""] + details) + "\n")
    print("\n".join(summary))
    print(f"mutation: every mutant not killed, with its diff: {out}")


def main(argv: list[str]) -> int:
    groups: dict[str, dict] = tomllib.loads(CONFIG.read_text())["groups"]
    unknown = [g for g in argv if g not in groups]
    if unknown:
        sys.exit(f"mutation: no group {', '.join(unknown)}; groups: {', '.join(groups)}")
    chosen = {g: groups[g] for g in (argv or groups)}
    for name, group in chosen.items():
        run_group(name, group)
    report(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
