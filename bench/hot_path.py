"""Benchmark: the cost of one timer tick, `consulrun run` against `consul lock`, side by side in one run.

Every timer tick starts the wrapper on every node and all but one skip, so
the skip path is paid (nodes - 1) times per occurrence. Measured per process
with wait4(2) (wall time, user+sys CPU of the process and its children, peak
resident memory), interleaved round by round in alternating order:

  loser          `consulrun run J -- true` with J held by another consulrun,
                 against `consul lock -timeout=10ms P true` with P held by another consul lock;
  loser, done    `consulrun run --schedule daily J -- true` once today's occurrence is recorded done;
  winner         `consulrun run J -- true` and `consul lock P true`, the lock free.

consulrun is started the way its units start it: the installed `consulrun`
script (next to this Python), not `python -m`.

With `--before DIR` (a checkout of an earlier commit, e.g. `git worktree add --detach DIR <commit>`), the
consulrun of DIR runs too, interleaved with the others, through the same Python and the same entry point.

With `--packaged PATH` (the .deb scripts/package builds, unpacked here with dpkg-deb, or an unpacked
/opt/consulrun/<release>), the package's consulrun runs too: its venv's python on its byte-compiled `bin/consulrun`,
which is what the kernel runs for the script's `#!/opt/consulrun/<release>/bin/python` line.

Usage: python bench/hot_path.py [--rounds N] [--nodes N] [--before DIR] [--packaged PATH]   (prints Markdown)
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.agents import consul_binary, start_dev_agent, wait_for  # noqa: E402


def measured(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, int]:
    """(wall s, CPU s, peak RSS MiB, exit status) of one run of `cmd`."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, proc.returncode


def label(tool: str) -> str:
    """The ratio's tag: "" for this checkout's consulrun, " before" / " packaged" for the others."""
    return tool.replace("consulrun", "", 1)


def packaged_command(path: Path) -> list[str]:
    """How the package's units start consulrun, for a .deb (unpacked into a temporary folder) or an /opt/consulrun."""
    if path.is_file():
        unpacked = Path(tempfile.mkdtemp(prefix="bench-deb-"))
        atexit.register(shutil.rmtree, unpacked, ignore_errors=True)
        subprocess.run(["dpkg-deb", "-x", str(path), str(unpacked)], check=True)
        # The package's venv, as dpkg unpacks it (postinst links it to /opt/consulrun/<version>-<release>).
        path = next(iter(sorted((unpacked / "usr" / "lib" / "consulrun" / "releases").glob("*"))), unpacked)
    python, script = path / "bin" / "python", path / "bin" / "consulrun"
    if not (os.access(python, os.X_OK) and script.is_file()):
        sys.exit(f"bench: {path} holds no bin/python and bin/consulrun (give the .deb or an /opt/consulrun/<release>)")
    if not re.fullmatch(r"#!/opt/consulrun/([^/]+/)?bin/python", script.read_text().splitlines()[0]):
        sys.exit(f"bench: {script} is not the packaged entry script")
    return [str(python), str(script)]


def _writes_bytecode() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--nodes", type=int, default=3, help="nodes per job for the CPU-per-minute table")
    parser.add_argument("--before", type=Path, help="an earlier checkout whose consulrun runs beside this one")
    parser.add_argument("--packaged", type=Path, help="a .deb or an unpacked /opt/consulrun to run beside this one")
    args = parser.parse_args()
    binary = consul_binary()
    script = str(Path(sys.executable).parent / "consulrun")
    if not os.access(script, os.X_OK):
        sys.exit(f"bench: {script} is missing; install consulrun into this Python first (scripts/test does)")
    agent = start_dev_agent(binary, Path(tempfile.mkdtemp(prefix="bench-hot-")), extra_config={"disable_coordinates": True})
    env = {**os.environ, "CONSUL_HTTP_ADDR": agent.http_addr}
    tools = ["consulrun", "consul lock"]
    others: dict[str, list[str]] = {}  # the other consulruns measured: name -> the command before `run ...`
    if args.packaged:
        others["consulrun packaged"] = packaged_command(args.packaged)
    # Byte-compile every tree that runs, this one too: with PYTHONDONTWRITEBYTECODE set (some shells set it), a
    # source newer than its .pyc is compiled again at every start, and that would be measured as the tick's cost.
    import importlib.util

    here = Path(importlib.util.find_spec("consulrun").origin).parent  # type: ignore[arg-type, union-attr]
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(here)], check=True, env=_writes_bytecode())
    if args.before:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(args.before / "consulrun")], check=True,
                       env=_writes_bytecode())
        # What its `consulrun` script would run, with the earlier tree first on the path: its entry point
        # (consulrun.entry since run is read without click), else click's command.
        entry = "entry" if (args.before / "consulrun" / "entry.py").exists() else "cli"
        others["consulrun before"] = ["env", f"PYTHONPATH={args.before}", sys.executable, "-P", "-c",  # -P: no cwd
                                      f"import sys; from consulrun.{entry} import main; sys.exit(main())"]
    tools += list(others)
    runs = {"loser": (["run", "held", "--", "true"], [binary, "lock", "-timeout=10ms", "held-lock", "true"]),
            "loser, occurrence done": (["run", "--schedule", "daily", "done", "--", "true"],
                                       [binary, "lock", "-timeout=10ms", "held-lock", "true"]),
            "winner": (["run", "free", "--", "true"], [binary, "lock", "free-lock", "true"])}
    cases = {case: ([script, *run], lock, *[[*prefix, *run] for prefix in others.values()])
             for case, (run, lock) in runs.items()}
    expected = {"loser": (0, 1), "loser, occurrence done": (0, 1), "winner": (0, 0)}
    holders = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for cmd in ([script, "run", "held", "--", "sleep", "3600"], [binary, "lock", "held-lock", "sleep 3600"])]
    results: dict[str, dict[str, list[tuple[float, float, float]]]] = {c: {t: [] for t in tools} for c in cases}
    try:
        wait_for(lambda: (agent.api("GET", "kv/consulrun/held/lock").json() or [{}])[0].get("Session"), 20, "consulrun holder")
        wait_for(lambda: (agent.api("GET", "kv/held-lock/.lock").json() or [{}])[0].get("Session"), 20, "consul lock holder")
        assert measured(cases["loser, occurrence done"][0], env)[3] == 0  # today's occurrence runs once, here
        for case, cmds in cases.items():  # warm the page cache once
            for cmd in cmds[:len(tools)]:
                measured(cmd, env)
        for round_no in range(args.rounds):
            for case, cmds in cases.items():
                order = list(zip(tools, cmds))
                if round_no % 2:
                    order.reverse()
                for name, cmd in order:
                    wall, cpu, rss, code = measured(cmd, env)
                    want = expected[case][1 if name == "consul lock" else 0]
                    assert code == want, (case, name, code)
                    results[case][name].append((wall, cpu, rss))
    finally:
        for holder in holders:
            holder.send_signal(signal.SIGTERM)
            holder.wait(timeout=30)
        agent.stop()

    load = os.getloadavg()[0]
    print(f"Rounds: {args.rounds} per case (interleaved, alternating order); one dev agent; Consul v1.16.3 built by "
          f"scripts/consul-binary; Python {sys.version.split()[0]}; load average at the end {load:.2f}\n")
    head = "| path | measure | " + " | ".join(f"{t}: median (min-max)" for t in tools) + " | ratio to consul lock |"
    print(head)
    print("|---" * (len(tools) + 3) + "|")
    medians: dict[tuple[str, str, str], float] = {}
    for case in cases:
        for index, (measure, unit, scale) in enumerate((("wall", "ms", 1000), ("CPU", "ms", 1000), ("peak RSS", "MiB", 1))):
            row = []
            for name in tools:
                values = [sample[index] * scale for sample in results[case][name]]
                medians[(case, name, measure)] = statistics.median(values)
                row.append(f"{statistics.median(values):.0f} {unit} ({min(values):.0f}-{max(values):.0f})")
            ratios = ", ".join(f"{medians[(case, t, measure)] / medians[(case, 'consul lock', measure)]:.2f}"
                               + label(t) for t in tools if t != "consul lock")
            print(f"| {case} | {measure} | " + " | ".join(row) + f" | {ratios} |")
    print(f"\nCPU-seconds per minute on one node, each job on {args.nodes} nodes (one wins, {args.nodes - 1} skip), "
          "from the CPU medians above:\n")
    print("| jobs per minute | " + " | ".join(tools) + " | ratio to consul lock |")
    print("|---" * (len(tools) + 2) + "|")
    for jobs in (10, 100, 1000):
        cost = {}
        for name in tools:
            win, lose = medians[("winner", name, "CPU")], medians[("loser", name, "CPU")]
            cost[name] = jobs * (win + (args.nodes - 1) * lose) / args.nodes / 1000
        ratios = ", ".join(f"{cost[t] / cost['consul lock']:.2f}" + label(t)
                           for t in tools if t != "consul lock")
        print(f"| {jobs} | " + " | ".join(f"{cost[t]:.1f} s" for t in tools) + f" | {ratios} |")

if __name__ == "__main__":
    main()
