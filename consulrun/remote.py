"""The same install on other nodes, over the system's `ssh` (the user's config, keys and known_hosts).

The manifest travels on ssh's standard input to `consulrun install -` on each
node, so nothing but the manifest crosses (token files stay where they are:
units only name them). Nodes run in parallel; each one's install is the local,
all-or-nothing install.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class HostResult:
    host: str
    ok: bool
    summary: str
    output: str


def _summary(code: int, out: str, err: str) -> str:
    lines = [line for line in (err.strip().splitlines() + out.strip().splitlines()) if line.strip()]
    if code == 255 and not out:
        return "ssh failed: " + (lines[-1] if lines else "no answer")
    if code != 0:
        errors = [line for line in lines if line.startswith("Error:")]
        return f"exit {code}: " + (errors[0][len('Error: '):] if errors else (lines[-1] if lines else "no output"))
    return lines[-1] if lines else "ok"


def install_on(host: str, manifest_text: str, remote_argv: list[str], ssh_options: list[str],
               timeout_s: float) -> HostResult:
    cmd = ["ssh", "-o", "BatchMode=yes", *[part for opt in ssh_options for part in ("-o", opt)], host, "--",
           *remote_argv]
    try:
        result = subprocess.run(cmd, input=manifest_text, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return HostResult(host, False, f"timed out after {timeout_s:.0f}s", "")
    except OSError as exc:
        return HostResult(host, False, f"cannot run ssh: {exc.strerror}", "")
    return HostResult(host, result.returncode == 0, _summary(result.returncode, result.stdout, result.stderr),
                      result.stdout + result.stderr)


def install_all(hosts: list[str], manifest_text: str, remote_argv: list[str], ssh_options: list[str],
                parallel: int, timeout_s: float, progress: Callable[[HostResult, int, int], None]) -> list[HostResult]:
    """Install on every host; `progress` is called as each one finishes. Results keep the hosts' order."""
    results: dict[str, HostResult] = {}
    lock = threading.Lock()

    def one(host: str) -> None:
        result = install_on(host, manifest_text, remote_argv, ssh_options, timeout_s)
        with lock:
            results[host] = result
            progress(result, len(results), len(hosts))

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        list(pool.map(one, hosts))
    return [results[h] for h in hosts]
