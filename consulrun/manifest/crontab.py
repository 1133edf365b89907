"""A crontab as a consulrun manifest: what `consulrun import-crontab` prints.

Each entry becomes a job whose schedule fires exactly when cron would (see
`cronfields`), and whose command runs as cron ran it: cron hands the line to
`$SHELL -c` (`/bin/sh` unless the crontab sets SHELL), so a line with shell
syntax becomes `shell: true`, and a plain one an argv. An unescaped `%` ends
the command and the rest, with each further `%` a newline, is its standard
input, as cron does. Environment lines apply to the entries after them, as in
cron; MAILTO has no equivalent until jobs can alert on failure, and is kept
as a comment. Lines that cannot be converted are reported with their number.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml

from consulrun.errors import ManifestError, UsageError
from consulrun.manifest import cronfields, cronnames, shellsyntax

_ENV = re.compile(r"\s*(?P<name>\"[^\"]*\"|'[^']*'|[^=\s]+)\s*=\s*(?P<value>.*?)\s*")
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")
_PLAIN_COMMAND = re.compile(r"[A-Za-z0-9_@%+=:,./ '\"-]+")
DEFAULT_SHELL = "/bin/sh"
_CRON_ONLY = {"SHELL", "MAILTO", "CRON_TZ", "MAILFROM", "CONTENT_TYPE", "CONTENT_TRANSFER_ENCODING", "RANDOM_DELAY"}


class CrontabError(ManifestError):
    """Lines of a crontab that have no manifest equivalent; the manifest of the rest is still printed."""

    def __init__(self, problems: list[str], manifest: str) -> None:
        self.manifest = manifest
        super().__init__(problems)


@dataclass
class _Job:
    line: int
    text: str
    data: dict[str, Any] = field(default_factory=dict)
    program: str = ""  # what the line runs, for its name
    name: str = ""


@dataclass
class _Crontab:
    """One crontab's converted lines."""

    source: str
    jobs: list[_Job]
    notes: list[str]
    problems: list[str]


def split_percent(command: str) -> tuple[str, str | None]:
    """(command, standard input or None), as cron reads an entry's `%` characters.

    In the command, `\\%` is a literal `%` and the first other `%` ends it. In
    the input, `\\%` is `%`, every other `%` a newline, other backslashes stay,
    and a final newline is added when the input does not end with one.
    """
    out, escaped = [], False
    for index, ch in enumerate(command):
        if escaped:
            if ch == "%":
                out[-1] = "%"
            else:
                out.append(ch)
            escaped = False
        elif ch == "\\":
            out.append(ch)
            escaped = True
        elif ch == "%":
            return "".join(out), _stdin(command[index + 1:])
        else:
            out.append(ch)
    return "".join(out), None


def _stdin(data: str) -> str:
    out, escaped = [], False
    for ch in data:
        if escaped:
            if ch != "%":
                out.append("\\")
        elif ch == "%":
            ch = "\n"
        escaped = ch == "\\" and not escaped
        if not escaped:
            out.append(ch)
    if escaped:
        out.append("\\")
    text = "".join(out)
    return text + "\n" if text and not text.endswith("\n") else text


def _command(text: str, shell: str) -> tuple[str | list[str], bool]:
    """The job's command and whether it needs `shell: true`, for what cron would run as `SHELL -c text`."""
    command, stdin = split_percent(text)
    if stdin is not None:
        command = f"printf '%s' {shlex.quote(stdin)} | {{\n{command}\n}}"
    if shell != DEFAULT_SHELL:
        return [shell, "-c", command], False
    # An argv only where sh and consulrun provably split alike: plain characters, quotes without anything special
    # inside; anything else runs with /bin/sh -c, as cron ran it.
    if stdin is None and _PLAIN_COMMAND.fullmatch(command) and shellsyntax.first_syntax(command) is None:
        try:
            if shlex.split(command):
                return command, False
        except ValueError:
            pass
    return command, True


def _never_fires(specs: list[str]) -> bool:
    from consulrun.manifest import calendar

    return calendar.following(specs, datetime(2000, 1, 1, tzinfo=timezone.utc)) is None


def convert(text: str, source: str, system: bool = False, user: str | None = None) -> str:
    """The manifest for crontab `text`; raise `CrontabError` (with that manifest) if any line is left out.

    `system`: the /etc/crontab and /etc/cron.d format, with a user column
    between the time fields and the command. `user`: whom a user crontab's jobs run as.
    """
    return convert_all([(text, source, system)], user=user)


def convert_all(crontabs: list[tuple[str, str, bool]], user: str | None = None,
                packages: dict[str, str] | None = None, each_node_packaged: bool = False) -> str:
    """One manifest for several crontabs, as (text, source, system) each; job names are unique
    across them all.

    A user crontab has no user column: its jobs run as `user`, and without one the conversion is
    refused (its jobs would run as root). `packages` names the package owning a source (see
    `cronowner`): such a file's jobs are per-node housekeeping, left out (the caller says so,
    `packaged_note`), or with `each_node_packaged` written as `mode: each-node` jobs.
    """
    _check_user(crontabs, user)
    packages = packages or {}
    taken: set[str] = set()
    parts, left_out = [], []
    for text, source, system in crontabs:
        if source in packages and not each_node_packaged:
            left_out.append(packaged_note(source, packages[source]))
            continue
        part = _read(text, source, system, None if system else user)
        if source in packages:
            for job in part.jobs:
                job.data["mode"] = "each-node"
            part.notes.append(f"package {packages[source]} owns it: its jobs run on every node "
                              "(mode: each-node)")
        names = cronnames.names([job.program for job in part.jobs], cronnames.file_name(source) if system else "",
                                taken)
        for job, name in zip(part.jobs, names):
            job.name = name
        parts.append(part)
    manifest = _render(parts, left_out)
    _self_check(manifest, ", ".join(part.source for part in parts))
    problems = [problem for part in parts for problem in part.problems]
    if problems:
        raise CrontabError(problems, manifest)
    return manifest


def packaged_note(source: str, package: str) -> str:
    """The one line for a package's cron file left out of the manifest."""
    return (f"{_printable(source)}: left out: package {package} owns it, so it is this node's own "
            "housekeeping, which cron keeps running on every node (--package-files each-node "
            "converts it to mode: each-node)")


def _check_user(crontabs: list[tuple[str, str, bool]], user: str | None) -> None:
    """Refuse a user crontab without the user it belongs to, and a --user no crontab takes."""
    user_crontabs = [source for _, source, system in crontabs if not system]
    if user is not None and not _USER.fullmatch(user):
        raise UsageError(f"--user {user!r} is not a user name")
    if user_crontabs and user is None:
        raise UsageError(f"{_printable(user_crontabs[0])}: a user crontab names no user, and its "
                         "jobs would run as root: give --user NAME (whose crontab it is), or "
                         "--system if it has a user column")
    if user is not None and not user_crontabs:
        raise UsageError("--user is for a user crontab; a system crontab names each line's user")


# An address list as cron hands MAILTO to sendmail: addresses separated by commas, none of them an option.
_MAILTO = re.compile(r"[A-Za-z0-9._+=@][A-Za-z0-9._+=@-]*(\s*,\s*[A-Za-z0-9._+=@][A-Za-z0-9._+=@-]*)*")
# What a converted MAILTO runs on failure: a mail to the address with the run's journal lines (the handler's standard
# input). The address is the script's $1, so no quoting of it can go wrong.
_MAIL_SCRIPT = ("{ printf 'To: %s\\nSubject: %s failed on %s (%s, exit status %s)\\n\\n' \"$1\" \"$CONSULRUN_JOB\" "
                "\"$CONSULRUN_NODE\" \"$CONSULRUN_RESULT\" \"$CONSULRUN_EXIT_STATUS\"; cat; } "
                "| /usr/sbin/sendmail -i -- \"$1\"")


def mail_on_failure(mailto: str) -> list[str]:
    """The `on_failure:` a MAILTO line becomes: mail `mailto` the journal lines, through sendmail as cron does."""
    return ["/bin/sh", "-c", _MAIL_SCRIPT, "mailto", mailto]


def _read(text: str, source: str, system: bool, user: str | None = None) -> _Crontab:
    env: dict[str, str] = {}
    shell, zone, mailto = DEFAULT_SHELL, None, None
    part = _Crontab(source, [], [], [])
    notes, problems = part.notes, part.problems
    for number, raw in enumerate(text.split("\n"), start=1):  # cron's lines end at a newline and nothing else
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{_printable(source)}:{number}"
        env_match = _ENV.fullmatch(raw)
        if env_match and not line.startswith("@") and not line[0].isdigit() and not line.startswith("*"):
            name = env_match.group("name").strip("'\"")
            value = env_match.group("value")
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if name == "SHELL":
                shell = value
            elif name == "CRON_TZ":
                try:
                    ZoneInfo(value)
                    zone = value
                except (ZoneInfoNotFoundError, ValueError):
                    problems.append(f"{where}: CRON_TZ={value!r} is not a time zone; entries after it cannot be "
                                    "converted")
                    zone = "invalid"
            elif name == "MAILTO" and not value:
                mailto = None
                notes.append(f"line {number}: {line} -- cron sends no mail for the lines after it; neither do their "
                             "jobs")
            elif name == "MAILTO" and _MAILTO.fullmatch(value):
                mailto = value
                notes.append(f"line {number}: {line} -- the jobs after it mail {value} their last journal lines "
                             "when a run fails (on_failure); cron mailed any output, of a run that succeeded too, "
                             "which consulrun leaves in the journal")
            elif name == "MAILTO":
                mailto = None
                problems.append(f"{where}: MAILTO={value!r} is not a list of mail addresses; the jobs after it get "
                                "no on_failure")
            elif name in _CRON_ONLY:
                notes.append(f"line {number}: {line} -- cron's own setting, not converted")
            elif not _VARIABLE.fullmatch(name):
                problems.append(f"{where}: {name!r} is not an environment variable name a unit can set")
            else:
                env[name] = value
            continue
        try:
            job = _entry(raw, number, system, env, shell, zone, user)
        except cronfields.CronError as exc:
            problems.append(f"{where}: cannot convert {line!r}: {exc}")
            continue
        if mailto:
            job.data["on_failure"] = mail_on_failure(mailto)
        problem = _job_problem(job)
        if problem:
            problems.append(f"{where}: cannot convert {line!r}: {problem}")
            continue
        part.jobs.append(job)
    return part


def _entry(raw: str, number: int, system: bool, env: dict[str, str], shell: str, zone: str | None,
           crontab_user: str | None) -> _Job:
    line = raw.strip()
    count = (1 if line.startswith("@") else 5) + (1 if system else 0)
    parts = line.split(None, count)
    if len(parts) <= count:
        wanted = ("a macro" if line.startswith("@") else "5 time fields") + (", a user" if system else "")
        raise cronfields.CronError(f"expected {wanted} and a command, got only {len(parts)} word(s)")
    fields = " ".join(parts[:1] if line.startswith("@") else parts[:5])
    if zone == "invalid":
        raise cronfields.CronError("CRON_TZ before it is not a time zone")
    specs = cronfields.to_oncalendar(fields, zone)
    if _never_fires(specs):
        raise cronfields.CronError(f"{fields!r} never fires (no such date)")
    user = parts[count - 1] if system else crontab_user
    if system and not _USER.fullmatch(user or ""):
        raise cronfields.CronError(f"{user!r} is not a user name (is this a user crontab? leave out --system)")
    command, needs_shell = _command(parts[count].rstrip(), shell)
    data: dict[str, Any] = {"command": command}
    if needs_shell:
        data["shell"] = True
    data["schedule"] = specs[0] if len(specs) == 1 else specs
    if user:
        data["user"] = user
    if env:
        data["environment"] = dict(env)
    return _Job(number, line, data, program=cronnames.program(split_percent(parts[count])[0]))


def _render(parts: list[_Crontab], left_out: list[str]) -> str:
    """The manifest text, each job under a comment quoting its crontab line; '' when no job converted.

    A crontab line may hold anything but a newline, and YAML ends a line at more than a newline (`\\r`,
    U+0085, U+2028, U+2029): left in a comment, such a character turned the rest of the line into manifest
    (a root job hidden in a comment). So comments show such characters escaped, and values holding them
    are double-quoted with every non-ASCII character escaped; what loads back is exactly the jobs converted.
    """
    if not any(part.jobs for part in parts):
        return ""
    several = len(parts) > 1
    sources = ", ".join(_printable(part.source) for part in parts)
    out = [f"# Converted by `consulrun import-crontab` from {sources}. Each job fires exactly when cron would;",
           "# consulrun runs each occurrence on one node only."]
    out += [f"# not converted: {_printable(p)}" for part in parts for p in part.problems]
    out += [f"# {line}" for line in left_out]
    out += [f"# {_printable(part.source) + ' ' if several else ''}{_printable(n)}"
            for part in parts for n in part.notes]
    out.append("jobs:")
    for part in parts:
        for job in part.jobs:
            out.append(f"  # {_printable(part.source) + ' ' if several else ''}line {job.line}: {_printable(job.text)}")
            body = yaml.dump({job.name: job.data}, Dumper=_Dumper, sort_keys=False,
                             allow_unicode=not _has_unsafe(job.data), width=100, default_flow_style=False)
            out += ["  " + row if row else row for row in body.rstrip("\n").split("\n")]
    return "\n".join(out) + "\n"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (a command with its standard input) as literal blocks, the way they would be typed."""


# What must never reach the output as itself: control characters (Cc), line and paragraph separators (Zl, Zp), format
# characters (Cf: bidirectional overrides, zero-width, BOM), surrogates, private-use and unassigned code points.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def _unsafe(ch: str) -> bool:
    return ch != "\n" and unicodedata.category(ch) in _UNSAFE_CATEGORIES


def _has_unsafe(data: Any) -> bool:
    if isinstance(data, str):
        return any(map(_unsafe, data))
    if isinstance(data, dict):
        return any(_has_unsafe(k) or _has_unsafe(v) for k, v in data.items())
    if isinstance(data, list):
        return any(map(_has_unsafe, data))
    return False


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    if _has_unsafe(data):  # double quotes are the one style in which YAML escapes them
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style='"')
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_Dumper.add_representer(str, _str)


def _printable(text: str) -> str:
    """Text for a YAML comment: every character that could end the comment, make the stream invalid or mislead a
    terminal, escaped as Python writes it (U+2028 as \\u2028)."""
    return "".join(ascii(ch)[1:-1] if ch == "\n" or _unsafe(ch) else ch for ch in text)


def _job_problem(job: _Job) -> str | None:
    """Why the job would not load as a manifest (a value a unit file cannot hold), or None."""
    from consulrun.errors import ManifestError
    from consulrun.manifest.loader import parse_manifest

    try:
        parse_manifest(yaml.safe_dump({"jobs": {"j": job.data}}), "-")
    except ManifestError as exc:
        return exc.problems[0].split(": ", 2)[-1]
    return None


def _self_check(manifest: str, source: str) -> None:
    """What import-crontab prints must load as a manifest; a value that cannot (a NUL) is a one-line error."""
    from consulrun.errors import ManifestError
    from consulrun.manifest.loader import parse_manifest

    if manifest:
        try:
            parse_manifest(manifest, "<converted>")
        except ManifestError as exc:
            raise UsageError(f"{source}: the converted manifest would not load: {exc.problems[0]}") from None
