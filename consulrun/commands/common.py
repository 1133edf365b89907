"""What several commands share: reading a manifest or standard input, `[MANIFEST] [JOB]...` arguments, JSON output."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from consulrun.commands.runargs import WATCHDOG_JOB
from consulrun.errors import ConsulrunError, UsageError, os_reason
from consulrun.manifest.schema import name_problem

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    from consulrun.consul.client import Client
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


def confirm(question: str) -> None:
    """Ask QUESTION on standard input (prompt on stderr); refuse with nothing changed on "no", and on no answer
    at all (closed standard input, e.g. a cron job or `< /dev/null`), which click would report only as "Aborted!"."""
    import click

    try:
        answer = click.confirm(question, err=True)
    except click.Abort:
        click.echo("", err=True)
        raise ConsulrunError("no answer on standard input; nothing changed (--yes answers yes)") from None
    if not answer:
        raise ConsulrunError("not confirmed; nothing changed")


def interruptible() -> None:
    """Ctrl-C (SIGINT) ends a long-running command even when its parent started it with SIGINT ignored
    (a background job of a non-interactive shell): asked for interactively, it must stop when asked to."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)


def _is_manifest(word: str) -> bool:
    return "/" in word or word.endswith((".yaml", ".yml", ".json"))


def manifest_and_jobs(targets: tuple[str, ...]) -> tuple[Manifest | None, tuple[str, ...]]:
    """Split `[MANIFEST] [JOB]...`: the first argument is a manifest if it has a '/' or ends in .yaml/.yml/.json."""
    from consulrun.manifest.loader import load_manifest

    loaded = None
    if targets and _is_manifest(targets[0]):
        loaded, targets = load_manifest(Path(targets[0])), targets[1:]
    for job in targets:
        problem = job_problem(job)
        if problem:
            raise UsageError(problem)
    return loaded, targets


def complete_jobs(many: bool) -> Callable[..., list[Any]]:
    """Shell completion of `[MANIFEST] JOB` (`many`: `[MANIFEST] [JOB]...`): the first word as a
    file, then the job names of the manifest given (`pause jobs.yaml <TAB>`). Nothing from
    Consul: a completion must not wait on the network."""
    def complete(ctx: Any, param: Any, incomplete: str) -> list[Any]:
        from click.shell_completion import CompletionItem

        from consulrun.manifest.loader import load_manifest

        given = tuple(ctx.params.get(param.name) or ())
        if not given:
            return [CompletionItem(incomplete, type="file")]
        if not _is_manifest(given[0]) or (len(given) > 1 and not many):
            return []
        try:
            names = [job.name for job in load_manifest(Path(given[0])).jobs]
        except (ConsulrunError, OSError):
            return []
        return [CompletionItem(name) for name in names
                if name.startswith(incomplete) and name not in given[1:]]
    return complete


def did_you_mean(names: Iterable[str], known: Iterable[str]) -> str:
    """` (did you mean 'db-backup'?)` for the names that are close to a known job name, else ''."""
    import difflib

    names, known = list(names), sorted(set(known))
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            hints.append(f"{close[0]!r}" + (f" for {name!r}" if len(names) > 1 else ""))
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def consul_jobs(client: Client, kv_prefix: str) -> set[str]:
    """The jobs that have any state under `kv_prefix` in Consul (77 if ACLs hide some)."""
    from consulrun.report.status import read_prefix

    return set(read_prefix(client, kv_prefix.strip("/") + "/")[1])


def check_jobs(jobs: Iterable[str], loaded: Manifest | None, client: Client | None, kv_prefix: str,
               manifest_helps: bool = True) -> None:
    """Refuse (exit 6, with a "did you mean") a JOB that is not one: not in the manifest when one is given, else
    with no state under the prefix in Consul; so a typo pauses (or resumes, triggers, forgets) no phantom."""
    from consulrun.report.status import NoState

    jobs = list(jobs)
    if loaded is not None:
        known, where = {job.name for job in loaded.jobs}, f"in {loaded.source}"
    else:
        assert client is not None, "without a manifest the jobs are Consul's"
        known, where = consul_jobs(client, kv_prefix), f"with state under {kv_prefix.strip('/')}/ in Consul"
    unknown = list(dict.fromkeys(job for job in jobs if job not in known and job != WATCHDOG_JOB))
    if unknown:
        raise NoState(f"no such job {where}: {', '.join(unknown)}{did_you_mean(unknown, known)}"
                      + ("" if loaded or not manifest_helps else " (a job that has never run: give its MANIFEST)"))


def with_suggestion(exc: Exception, jobs: Iterable[str], loaded: Manifest | None, client: Client,
                    kv_prefix: str) -> Exception:
    """`exc` (a NoState for JOBs with no state) with a "did you mean" from the manifest's and Consul's jobs."""
    from consulrun.errors import ConsulrunError
    from consulrun.report.status import NoState

    if not isinstance(exc, NoState) or not jobs:
        return exc
    known = {job.name for job in loaded.jobs} if loaded else set()
    try:
        known |= consul_jobs(client, kv_prefix)
    except ConsulrunError:
        pass  # the suggestion is a courtesy: the error it adds to stands either way
    hint = did_you_mean([job for job in jobs if job not in known], known)
    return NoState(exc.format_message() + hint, exc.index) if hint else exc


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
