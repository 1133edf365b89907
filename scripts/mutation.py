"""Driver behind scripts/mutation: mutmut's mutants, run group by group in a scratch copy, then a report.

The mutants are mutmut's own (its parso-based operators: numbers, strings,
comparisons, and/or, keywords, arguments, assignments...), listed and applied
through its library API. Running them is done here, one at a time, because:
- the protocol is tested through subprocesses (`python -m consulrun` against
  a real agent), so the mutant must be on disk; mutmut 3 only learns which
  tests cover a function from calls inside the pytest process and would call
  most protocol mutants untested;
- mutmut 2's own runner keeps its cache keyed by line text and, here, recorded
  a mutated line as the original halfway through a run, then stopped.
Results are kept per group (WORK/<group>/results.json), so a run cut short by
its budget goes on where it stopped; a changed line is a new mutant, a moved one is not.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

from mutmut import ALL, Context, list_mutations, mutate

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "scripts" / "mutation.toml"
WORK = Path(os.environ.get("MUTATION_DIR", "/tmp/consulrun-mutation"))
BUDGET_S = int(os.environ.get("MUTATION_BUDGET", "3600"))
COVERAGE = os.environ.get("MUTATION_COVERAGE", "1") != "0"  # 0: every mutant runs the group's whole test list


def copy_checkout(work: Path) -> None:
    """The checkout's files as they are now (committed or not), over a scratch copy; results.json stays."""
    work.mkdir(parents=True, exist_ok=True)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.split(b"\0")
    names = b"\0".join(f for f in files if f and (REPO / os.fsdecode(f)).is_file()) + b"\0"
    tar = subprocess.run(["tar", "--null", "-T", "-", "-cf", "-"], cwd=REPO, input=names, capture_output=True,
                         check=True)
    subprocess.run(["tar", "-xf", "-", "-C", str(work)], input=tar.stdout, check=True)


def selected_lines(path: Path, names: list[str]) -> set[int]:
    """1-based line numbers of the named top-level functions/classes/assignments (or Class.method); all if none."""
    source = path.read_text(encoding="utf-8")
    if not names:
        return set(range(1, len(source.splitlines()) + 1))
    found: dict[str, tuple[int, int]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = (node.lineno, node.end_lineno or node.lineno)
            for item in node.body if isinstance(node, ast.ClassDef) else []:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{item.name}"] = (item.lineno, item.end_lineno or item.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    found[target.id] = (node.lineno, node.end_lineno or node.lineno)
    missing = [n for n in names if n not in found]
    if missing:
        sys.exit(f"mutation: {path.name} has no {', '.join(missing)} (scripts/mutation.toml is stale)")
    return {line for n in names for line in range(found[n][0], found[n][1] + 1)}


LOG_CALLS = {"debug", "info", "warning", "error", "exception", "say_waiting"}


def log_lines(source: str) -> set[int]:
    """Lines of calls that only say something: `log.<level>(...)`, `<x>.say_waiting(...)`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_CALLS:
            found.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return found


def mutants_of(work: Path, rel: str, names: list[str], logged: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(key, mutated source, one-line diff) for each of mutmut's mutants on the selected lines of `rel`.

    Mutants on a logging call's lines are left out (their keys go to `logged`, when given).
    """
    source = (work / rel).read_text(encoding="utf-8")
    lines = selected_lines(work / rel, names)
    quiet = log_lines(source)
    out = []
    for mid in list_mutations(Context(source=source, filename=rel, mutation_id=ALL)):
        if mid.line_number + 1 not in lines:
            continue
        if mid.line_number + 1 in quiet:
            if logged is not None:
                logged.append(f"{rel}:{mid.line_number + 1}:{mid.index}")
            continue
        mutated, count = mutate(Context(source=source, filename=rel, mutation_id=mid))
        if not count:
            continue
        diff = "".join(difflib.unified_diff(source.splitlines(keepends=True), mutated.splitlines(keepends=True),
                                            f"a/{rel}", f"b/{rel}", n=0))
        out.append((mutant_key(rel, source, mid.line_number, mid.index), mutated, diff))
    return out


def mutant_key(rel: str, source: str, line_index: int, index: int) -> str:
    """`file:line:index:identity`; the identity (the line's text, and which of the file's lines with that text it
    is) is what results are matched on, so lines added or removed elsewhere do not make a mutant new."""
    lines = source.splitlines()
    text = lines[line_index].strip()
    nth = sum(1 for earlier in lines[:line_index] if earlier.strip() == text)
    identity = hashlib.sha1(f"{text}\n{nth}".encode()).hexdigest()[:12]
    return f"{rel}:{line_index + 1}:{index}:{identity}"


def identity(key: str) -> str:
    """What stays the same when a mutant's line moves: file, index on the line, the line's identity."""
    parts = key.split(":")
    return f"{parts[0]}:{parts[2]}:{parts[3]}" if len(parts) == 4 else key  # results.json holds identities already


def run_tests(work: Path, tests: list[str], timeout_s: float) -> tuple[str, float, str]:
    """(survived | killed | timeout, seconds, the test that failed first or "")."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # a stale .pyc must never hide a mutant
    started = time.monotonic()
    out = work / ".mutation-pytest.out"
    # Its own session, so a mutant that hangs can be stopped with everything it started (agents, wrappers, jobs).
    with out.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *tests],
                                cwd=work, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            proc.wait()
            return "timeout", time.monotonic() - started, ""
    _kill_session(proc.pid)  # whatever a finished run left behind (a mutant may leave a wrapper running)
    took = time.monotonic() - started
    if code == 0:
        return "survived", took, ""
    failed = [line.split()[1] for line in out.read_text(errors="replace").splitlines()
              if line.startswith(("FAILED ", "ERROR ")) and len(line.split()) > 1]
    return "killed", took, (failed[0] if failed else "")


def run_mutant(work: Path, tests: list[str], timeout_s: float) -> tuple[str, float, str]:
    """run_tests, with a kill confirmed: the test that failed must fail again, alone, against the same mutant.

    On this 2-core machine a timing-sensitive test can fail once under load; a kill it does not repeat is a
    flake, and the mutant's tests run once more from the start (that second answer stands).
    """
    status, took, failed = run_tests(work, tests, timeout_s)
    if status != "killed" or not failed:
        return status, took, failed
    again, more, _ = run_tests(work, [failed], timeout_s)
    if again != "survived":
        return status, took + more, failed
    status, last, failed = run_tests(work, tests, timeout_s)
    return status, took + more + last, failed


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (the test run's own session: nothing else is in it)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of /proc/PID/stat: the session id
            try:
                os.kill(int(stat.parent.name), 9)
            except OSError:
                pass


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Held by one process at a time: shards of a group share its directory, results and coverage map."""
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# Every Python process of the venv starts coverage when COVERAGE_PROCESS_START names a config (coverage's own
# subprocess hook): the wrappers the tests start run consulrun, not the pytest process.
COVERAGE_PTH = ("import os; os.environ.get('COVERAGE_PROCESS_START') and "
                "__import__('coverage').process_startup()\n")


def coverage_by_test(home: Path, work: Path, tests: list[str]) -> dict[str, set[str]] | None:
    """Test id -> the `file:line`s of consulrun/ it runs, in pytest and in every process it starts; None if the
    group's arguments are not all test ids (then every mutant runs them all).

    Kept in WORK/<group>/coverage-by-test.json for as long as the code and the tests are the same.
    """
    if not all("::" in test for test in tests):
        return None
    digest = hashlib.sha1("\n".join(tests).encode())
    for path in sorted([*(work / "consulrun").glob("*.py"), *(work / "tests").rglob("*.py")]):
        digest.update(path.read_bytes())
    cache = home / "coverage-by-test.json"
    with _exclusive(home / "coverage-by-test.lock"):  # shards: the first builds the map, the others wait
        return _coverage_map(cache, digest.hexdigest(), work, tests)


def _coverage_map(cache: Path, digest: str, work: Path, tests: list[str]) -> dict[str, set[str]]:
    import coverage

    if cache.exists():
        stored = json.loads(cache.read_text())
        if stored.get("digest") == digest:
            return {test: set(lines) for test, lines in stored["tests"].items()}
    (Path(sysconfig.get_paths()["purelib"]) / "consulrun_mutation_coverage.pth").write_text(COVERAGE_PTH)
    found: dict[str, set[str]] = {}
    for number, test in enumerate(tests):
        where = work / ".coverage-runs" / str(number)
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        (where / "rc").write_text(f"[run]\nparallel = true\ndata_file = {where}/.coverage\nsource = {work}/consulrun\n"
                                  "sigterm = true\n")
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "COVERAGE_PROCESS_START": str(where / "rc")}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=work, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, timeout=900)
        cov = coverage.Coverage(data_file=str(where / ".coverage"))
        cov.combine([str(where)], keep=False)
        data = cov.get_data()
        found[test] = {f"{Path(f).relative_to(work)}:{n}" for f in data.measured_files() for n in data.lines(f) or []}
        print(f"  coverage {len(found[test]):5} lines  {test}" + ("" if proc.returncode == 0 else " (FAILED)"),
              flush=True)
    cache.write_text(json.dumps({"digest": digest, "tests": {t: sorted(v) for t, v in found.items()}}))
    return found


def statement_lines(source: str) -> dict[int, range]:
    """Line -> the lines of the innermost statement holding it: a mutant on a continuation line of a call counts
    as covered when any line of its statement ran (coverage may name only the statement's first line)."""
    spans: dict[int, range] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt):
            span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            for line in span:
                if line not in spans or len(span) < len(spans[line]):
                    spans[line] = span
    return spans


def covering(key: str, tests: list[str], by_test: dict[str, set[str]] | None, spans: dict[str, dict[int, range]]) -> list[str]:
    """The tests (in the group's order) that run the mutated statement; all of them without coverage data."""
    if by_test is None:
        return tests
    rel, line = key.split(":")[0], int(key.split(":")[1])
    lines = [f"{rel}:{n}" for n in spans[rel].get(line, range(line, line + 1))]
    # A test that recorded nothing (its processes SIGKILLed before saving, e.g. the kill -9 test) may run anything.
    return [test for test in tests if not by_test[test] or any(n in by_test[test] for n in lines)]


def tests_of(group: dict, subsets: dict[str, list[str]]) -> list[str]:
    """The group's pytest arguments, each `@name` replaced by the list [subsets.name]."""
    return [arg for item in group["tests"] for arg in (subsets[item[1:]] if item.startswith("@") else [item])]


def shard() -> tuple[int, int]:
    """MUTATION_SHARD=k/n: this process runs the k-th of every n mutants left (1/1, all of them, by default)."""
    text = os.environ.get("MUTATION_SHARD", "1/1")
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        sys.exit(f"mutation: MUTATION_SHARD={text!r} is not k/n with 1 <= k <= n")
    return int(k), int(n)


def save_results(path: Path, mine: dict) -> None:
    """Write this process's results into the group's results.json, keeping what other shards wrote meanwhile."""
    with _exclusive(path.with_suffix(".lock")):
        stored = json.loads(path.read_text()) if path.exists() else {}
        merged = {identity(key): value for key, value in stored.items()}
        merged.update(mine)
        scratch = path.with_suffix(f".{os.getpid()}")
        scratch.write_text(json.dumps(merged, indent=1, sort_keys=True))
        scratch.replace(path)


def run_group(name: str, group: dict, deadline: float, again: bool = False) -> None:
    home = WORK / name  # results.json and the coverage map, shared by the shards
    home.mkdir(parents=True, exist_ok=True)
    with _exclusive(home / "copy.lock"):  # shards starting together must not untar over each other
        copy_checkout(home)
    k, n = shard()
    work = home if n == 1 else WORK / f"{name}-shard{k}of{n}"  # each shard mutates its own copy
    if work != home:
        copy_checkout(work)
        os.environ["CONSULRUN_TEST_NET_PREFIX"] = f"10.{220 + k}."  # and its cluster tests get their own subnets
    results_path = home / "results.json"
    kept = REPO / "docs" / "mutation-results" / f"{name}.json"  # the last run's results, committed: a fresh
    with _exclusive(results_path.with_suffix(".lock")):           # machine goes on where it stopped
        if not results_path.exists() and kept.exists():
            results_path.write_text(kept.read_text())
    results: dict = json.loads(results_path.read_text()) if results_path.exists() else {}
    survivors = {identity(key) for key, value in results.items() if value["status"] == "survived"}
    if again:  # tests were added for the survivors: run those mutants again, against the checkout as it is now
        results = {key: value for key, value in results.items() if value["status"] != "survived"}
    results = {identity(key): value for key, value in results.items()}
    mutants = [m for rel, names in group["mutate"].items() for m in mutants_of(work, rel, names)]
    todo = [m for m in mutants if identity(m[0]) not in results]
    if again:  # the survivors first, then (budget allowing) the mutants not run yet
        todo.sort(key=lambda m: identity(m[0]) not in survivors)
    todo = todo[k - 1::n]
    print(f"mutation: {name}: {len(mutants)} mutants, {len(todo)} to run"
          + (f" (shard {k} of {n})" if n > 1 else "") + f"; {len(group['tests'])} test arguments", flush=True)
    if not todo:
        return
    for _attempt in range(3):  # a loaded machine can fail a timing-sensitive test once; three times is a real failure
        status, baseline, _ = run_tests(work, group["tests"], timeout_s=1800)
        if status == "survived":
            break
    else:
        sys.exit(f"mutation: {name}: the tests fail without any mutant ({status}); fix that first")
    timeout_s = max(3 * baseline, baseline + 60)  # a mutant that hangs a test is caught, not waited for
    originals = {rel: (work / rel).read_text(encoding="utf-8") for rel in group["mutate"]}
    by_test = coverage_by_test(home, work, group["tests"]) if COVERAGE else None
    spans = {rel: statement_lines(text) for rel, text in originals.items()}
    mine: dict = {}
    try:
        for key, mutated, diff in todo:
            if time.monotonic() > deadline:
                print(f"mutation: {name}: budget spent; rerun to go on", flush=True)
                break
            rel = key.split(":", 1)[0]
            tests = covering(key, group["tests"], by_test, spans)
            if not tests:  # no test of the group runs this statement: nothing to learn by running them
                mine[identity(key)] = {"status": "survived", "seconds": 0, "diff": diff, "at": key,
                                       "tests": "none runs this line"}
                save_results(results_path, mine)
                print(f"  {'survived':8} {key.rsplit(':', 1)[0]} (no test runs it)", flush=True)
                continue
            (work / rel).write_text(mutated, encoding="utf-8")
            try:
                status, took, failed = run_mutant(work, tests, timeout_s)
            finally:
                (work / rel).write_text(originals[rel], encoding="utf-8")
            mine[identity(key)] = {"status": status, "seconds": round(took, 1), "diff": diff, "at": key,
                                   "tests": f"{len(tests)} of {len(group['tests'])}",
                                   **({"killed by": failed} if failed else {})}
            save_results(results_path, mine)
            print(f"  {status:8} {key.rsplit(':', 1)[0]} ({took:.0f}s) {failed}", flush=True)
    finally:
        for rel, text in originals.items():
            (work / rel).write_text(text, encoding="utf-8")


def report(groups: dict[str, dict]) -> None:
    """Counts per group, then every mutant that was not killed, with its diff."""
    summary, details = ["# scripts/mutation report", ""], []
    for name, group in groups.items():
        work = WORK / name
        if not work.exists():
            summary.append(f"{name}: not run")
            continue
        logged: list[str] = []
        current = {identity(m[0]): m[0] for rel, names in group["mutate"].items()
                   for m in mutants_of(work, rel, names, logged)}
        path = work / "results.json"
        stored = {identity(k): v for k, v in (json.loads(path.read_text()) if path.exists() else {}).items()}
        results = {current[k]: v for k, v in stored.items() if k in current}  # keyed by where the mutant is now
        counts: dict[str, int] = {}
        for value in results.values():
            counts[value["status"]] = counts.get(value["status"], 0) + 1
        counts["not run yet"] = len(current) - len(results)
        summary.append(f"{name}: {len(current)} mutants: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
                       + f"; {len(logged)} on log lines, not run")
        for key in sorted(results, key=lambda k: (k.split(":")[0], int(k.split(":")[1]), int(k.split(":")[2]))):
            if results[key]["status"] == "survived":
                details += [f"## {name}: {key.rsplit(':', 1)[0]}", "```diff", results[key]["diff"].rstrip(), "```", ""]
    out = WORK / "mutation-report.md"
    out.write_text("\n".join(summary + [""] + details) + "\n")
    print("\n".join(summary))
    print(f"mutation: every surviving mutant, with its diff: {out}")


def main(argv: list[str]) -> int:
    config = tomllib.loads(CONFIG.read_text())
    groups: dict[str, dict] = config["groups"]
    for group in groups.values():
        group["tests"] = tests_of(group, config.get("subsets", {}))
    again = argv[:1] == ["--again"]
    if again:
        argv = argv[1:]
    if argv[:1] == ["--report"]:
        report({g: groups[g] for g in (argv[1:] or groups)})
        return 0
    unknown = [g for g in argv if g not in groups]
    if unknown:
        sys.exit(f"mutation: no group {', '.join(unknown)}; groups: {', '.join(groups)}")
    chosen = {g: groups[g] for g in (argv or groups)}
    for name, group in chosen.items():
        run_group(name, group, time.monotonic() + BUDGET_S, again)
    report(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
