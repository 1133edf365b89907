"""Benchmark: validate and render a 10,000-job manifest with `consulrun generate`, against PyYAML's C loader.

Usage: python bench/generate_10k.py [--jobs N] [--repeat R] [--before DIR]   (prints a Markdown report)
--before DIR also times the consulrun in checkout DIR (e.g. a worktree of an earlier commit), interleaved.
The whole command is timed (interpreter start, YAML parse, schema validation,
calendar checks, rendering, writing 2N unit files), best and median of R runs,
interleaved with a process that only parses the same file with PyYAML's C
loader (interpreter start included in both); the ratio of the medians is the
figure the lean-hot-path issue asks for (goal: at most 3).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def manifest(jobs: int) -> str:
    schedules = ["daily", "*:0/5", "Mon..Fri 09:00", "*-*-* 02:30:00 Europe/Berlin", "hourly"]
    return yaml.safe_dump({
        "defaults": {"lock": {"ttl": "20s"}, "timer": {"randomized_delay": "10s"}},
        "jobs": {f"job-{n:05d}": {
            "description": f"Job number {n} at 100% with $VARS",
            "command": ["/usr/local/bin/task", "--id", str(n), "two words", "$HOME"],
            "schedule": schedules[n % len(schedules)],
            "environment": {"JOB_ID": str(n), "MODE": "batch mode"},
        } for n in range(jobs)}})


PARSE_ONLY = "import sys, yaml; yaml.load(open(sys.argv[1], encoding='utf-8'), Loader=yaml.CSafeLoader)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", type=Path, help="an earlier checkout to time beside this one")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    trees = {"consulrun generate": here, **({"the same, before (--before)": args.before.resolve()}
                                               if args.before else {})}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "jobs.yaml"
        path.write_text(manifest(args.jobs))
        parse: list[tuple[float, float]] = []
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for run in range(args.repeat):
            parse.append(timed([sys.executable, "-c", PARSE_ONLY, str(path)]))
            for name, tree in trees.items():
                out = Path(tmp) / f"units-{run}-{len(times[name])}-{tree.name}"
                times[name].append(timed([sys.executable, "-m", "consulrun", "generate", str(path), "-o", str(out),
                                          "--consulrun-path", "/usr/local/bin/consulrun"],
                                         cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}))
                assert len(list(out.iterdir())) == 2 * args.jobs
    print(f"| {args.jobs} jobs ({2 * args.jobs} unit files), {args.repeat} runs interleaved | wall best | wall median "
          "| CPU median | wall / parse | CPU / parse |")
    print("|---|---|---|---|---|---|")
    base_wall, base_cpu = (statistics.median(x[i] for x in parse) for i in (0, 1))
    for name, spent in {"PyYAML C loader, parse only": parse, **times}.items():
        wall, cpu = (statistics.median(x[i] for x in spent) for i in (0, 1))
        print(f"| {name} | {min(x[0] for x in spent):.2f} s | {wall:.2f} s | {cpu:.2f} s | {wall / base_wall:.2f} "
              f"| {cpu / base_cpu:.2f} |")


def timed(argv: list[str], **kwargs: object) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one run of `argv`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

if __name__ == "__main__":
    main()
