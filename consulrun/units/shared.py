"""The watchdog's units, which every manifest with health checks in a folder shares.

One `<unit_prefix>-_watchdog.service`/`.timer` per unit prefix and folder
judges the jobs of every manifest that has a job list beside it
(`<unit_prefix>-_watchdog-<manifest>.jobs`, that manifest's own file); the
unit reads them all (`consulrun watchdog --jobs-glob`). Its header names no
manifest: any of them may rewrite it, none removes it while another's job
list is left, and the last one's removal takes it away. Manifests sharing it
must agree on what it runs with (kv_prefix, Consul settings, the consulrun it
calls), which each job list records on its `# Watchdog:` line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from consulrun.errors import UsageError

WATCHDOG_STEM = "-_watchdog"  # <unit_prefix>-_watchdog: the job name no manifest job can have
JOBS_SUFFIX = ".jobs"
SETTINGS_MARKER = "# Watchdog: "  # a job list's line with what the shared unit must run with


class SharedClash(UsageError):
    """Two manifests would share a watchdog unit that each needs to run otherwise (exit 2)."""


def watchdog_units(unit_prefix: str) -> tuple[str, str]:
    return f"{unit_prefix}{WATCHDOG_STEM}.service", f"{unit_prefix}{WATCHDOG_STEM}.timer"


def jobs_file_name(unit_prefix: str, manifest: str) -> str:
    """A manifest's own job list beside the shared watchdog unit."""
    return f"{unit_prefix}{WATCHDOG_STEM}-{manifest}{JOBS_SUFFIX}"


def jobs_glob(unit_prefix: str) -> str:
    """Every job list of `unit_prefix` (also an older consulrun's `<prefix>-_watchdog.jobs`)."""
    return f"{unit_prefix}{WATCHDOG_STEM}*{JOBS_SUFFIX}"


def is_shared_name(unit: str) -> bool:
    return unit.endswith((f"{WATCHDOG_STEM}.service", f"{WATCHDOG_STEM}.timer"))


def is_watchdog_file(unit: str) -> bool:
    return is_shared_name(unit) or (unit.endswith(JOBS_SUFFIX) and WATCHDOG_STEM in unit)


def _prefix(unit: str) -> str:
    return unit.partition(WATCHDOG_STEM)[0]


def settings_line(settings: dict[str, str | None]) -> str:
    return SETTINGS_MARKER + json.dumps(settings, sort_keys=True, separators=(",", ":"))


def read_settings(text: str) -> dict[str, str | None] | None:
    """A job list's `# Watchdog:` settings; None for an older consulrun's list, which has none."""
    for line in text.splitlines():
        if line.startswith(SETTINGS_MARKER):
            try:
                found = json.loads(line[len(SETTINGS_MARKER):])
            except ValueError:
                return None
            return found if isinstance(found, dict) else None
    return None


def _jobs_files(names: set[str], unit_prefix: str) -> set[str]:
    stem = f"{unit_prefix}{WATCHDOG_STEM}"
    return {n for n in names if n.startswith(stem) and n.endswith(JOBS_SUFFIX)}


def check_settings(units: dict[str, str], folder: Path, files: list[str],
                   leaving: set[str]) -> None:
    """Refuse (exit 2) a job list whose watchdog settings differ from another manifest's beside it;
    `leaving`: the files this install removes."""
    for mine in [n for n in units if n.endswith(JOBS_SUFFIX) and WATCHDOG_STEM in n]:
        wanted = read_settings(units[mine]) or {}
        for other in sorted(_jobs_files(set(files), _prefix(mine)) - leaving - {mine}):
            try:
                theirs = read_settings((folder / other).read_text(encoding="utf-8"))
            except OSError:
                continue
            if theirs is None:  # an older consulrun's list: it says nothing to compare
                continue
            differ = [k for k in sorted({*wanted, *theirs}) if wanted.get(k) != theirs.get(k)]
            if differ:
                key, unit = differ[0], watchdog_units(_prefix(mine))[0]
                raise SharedClash(
                    f"{folder / other}: that manifest's watchdog runs with {key} "
                    f"{_setting(theirs.get(key))}, this one's with {_setting(wanted.get(key))}; manifests "
                    f"of one unit_prefix share one watchdog unit ({unit}), so they must agree on it (give "
                    "this manifest the same setting, or another unit_prefix and another kv_prefix: the "
                    "watchdog's lock is the kv_prefix's); nothing changed")


def _setting(value: object) -> str:
    """A recorded watchdog setting as a line shows it: quoted, or `not set`."""
    return "not set" if value is None else repr(value)


def unused(units: dict[str, str], folder: Path, files: list[str], leaving: set[str]) -> list[str]:
    """The shared units to remove: those of a unit prefix left with no job list."""
    from consulrun.units.owner import is_shared

    names = set(files)
    out = []
    for unit in sorted(n for n in names if is_shared_name(n) and n not in units):
        lists = _jobs_files((names - leaving) | set(units), _prefix(unit))
        if not lists and is_shared(folder / unit):
            out.append(unit)
    return out


def listing(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:  # no folder (yet), or not one: nothing in it
        return []
