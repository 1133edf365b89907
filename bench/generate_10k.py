"""Benchmark: validate and render a 10,000-job manifest with `consulrun generate`.

Usage: python bench/generate_10k.py [--jobs N] [--repeat R]   (prints a Markdown report)
The whole command is timed (interpreter start, YAML parse, schema validation,
calendar checks, rendering, writing 2N unit files), best and median of R runs.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "jobs.yaml"
        path.write_text(manifest(args.jobs))
        times = []
        for run in range(args.repeat):
            out = Path(tmp) / f"units-{run}"
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "consulrun", "generate", str(path), "-o", str(out),
                            "--consulrun-path", "/usr/local/bin/consulrun"], check=True, stdout=subprocess.DEVNULL)
            times.append(time.perf_counter() - start)
            assert len(list(out.iterdir())) == 2 * args.jobs
    print(f"{args.jobs} jobs ({2 * args.jobs} unit files), {args.repeat} runs: best {min(times):.2f} s, "
          f"median {statistics.median(times):.2f} s, {args.jobs / min(times):.0f} jobs/s")


if __name__ == "__main__":
    main()
