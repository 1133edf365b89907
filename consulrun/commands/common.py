"""What several commands share: reading a manifest or standard input, `[MANIFEST] [JOB]...` arguments, JSON output."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from consulrun.commands.runargs import WATCHDOG_JOB
from consulrun.errors import UsageError, os_reason
from consulrun.manifest.schema import name_problem

if TYPE_CHECKING:
    from consulrun.manifest.loader import Manifest


def job_problem(job: str) -> str | None:
    """Why `job` is not a job name, or None; the watchdog's own lock (`_watchdog`) is one to run, reap, unlock."""
    return None if job == WATCHDOG_JOB else name_problem(job)


def default_consulrun_path() -> str:
    """The consulrun being run now, so units call the same installation."""
    invoked = Path(sys.argv[0])
    if invoked.name == "consulrun" and invoked.exists():
        return str(invoked.absolute())
    beside = Path(sys.executable).parent / "consulrun"
    if beside.exists():
        return str(beside)
    found = shutil.which("consulrun")
    return os.path.abspath(found) if found else "/usr/local/bin/consulrun"


def read_manifest(manifest: Path) -> tuple["Manifest", str]:
    """Load and validate MANIFEST, or standard input for `-`; also return its text (sent on by `install --host`)."""
    from consulrun.manifest.loader import parse_manifest  # imported here: `run` should not pay for the validator

    text, source = read_text(manifest)
    return parse_manifest(text, source), text


def interruptible() -> None:
    """Ctrl-C (SIGINT) ends a long-running command even when its parent started it with SIGINT ignored
    (a background job of a non-interactive shell): asked for interactively, it must stop when asked to."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)


def manifest_and_jobs(targets: tuple[str, ...]) -> tuple[Manifest | None, tuple[str, ...]]:
    """Split `[MANIFEST] [JOB]...`: the first argument is a manifest if it has a '/' or ends in .yaml/.yml/.json."""
    from consulrun.manifest.loader import load_manifest

    loaded = None
    if targets and ("/" in targets[0] or targets[0].endswith((".yaml", ".yml", ".json"))):
        loaded, targets = load_manifest(Path(targets[0])), targets[1:]
    for job in targets:
        problem = job_problem(job)
        if problem:
            raise UsageError(problem)
    return loaded, targets


def to_json(data: object, compact: bool) -> str:
    import json

    return json.dumps(data, sort_keys=True, separators=(",", ":")) if compact else json.dumps(data, indent=2, sort_keys=True)


def read_text(path: Path) -> tuple[str, str]:
    """The text of PATH, or of standard input for `-`, and the name messages give it."""
    if str(path) == "-":
        return sys.stdin.read(), "<stdin>"
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except OSError as exc:
        raise UsageError(f"{path}: {os_reason(exc)}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start})") from None
