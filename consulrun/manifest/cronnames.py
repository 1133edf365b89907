"""Job names for converted crontab lines: after what a line runs, past the guards packages put before it.

Debian's cron.d files start their lines with guards (`test -x X && X`,
`[ -x X ] && X`, `if [ ... ]; then X; fi`, `command -v X >/dev/null && X`):
named after the first shell word, their jobs were `test`, `test-2`, `if` and
`command`, and two files both gave `test`. The program a line runs is the
first word of the first simple command that is not such a guard, with
wrappers (`nice -n 10 X`, `env A=1 X`) and assignments looked through. A
/etc/cron.d file is named after itself, as its package named it.
"""

from __future__ import annotations

import posixpath
import re
import shlex

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.DOTALL)
_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}"}
# Commands that decide whether, where or when the job runs, not what it is.
_GUARDS = {"test", "[", "[[", "command", "which", "type", "hash", "exit", "true", "false", ":", "cd", "sleep", "echo",
           "printf", "logger", "read", "set", "export", "umask", "ulimit", "trap", "wait"}
# Commands that run the next word: their options (and a number, such as timeout's duration) come first.
_WRAPPERS = {"nice", "ionice", "nohup", "exec", "env", "timeout", "chronic", "setsid", "stdbuf", "time", "chrt"}
_OPTION_OR_NUMBER = re.compile(r"-.*|[0-9][0-9.]*[smhd]?", re.DOTALL)


def _commands(command: str) -> list[list[str]]:
    """The simple commands of a shell line, as lists of words, in order."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: words as whitespace splits them
        tokens = command.split()
    out: list[list[str]] = [[]]
    for token in tokens:
        if token and set(token) <= set("();<>|&") and set(token) & set(";|&"):
            out.append([])  # `&&`, `||`, `;`, `|`, `&` (and `)|`): a new simple command
        elif token in ("(", ")", "((", "))") or (not out[-1] and token in _KEYWORDS):
            continue
        else:
            out[-1].append(token)
    return [words for words in out if words]


def _program(words: list[str]) -> str | None:
    """The program of one simple command, looking through assignments and wrappers."""
    index = 0
    while index < len(words):
        word = words[index]
        if _ASSIGNMENT.fullmatch(word):
            index += 1
        elif posixpath.basename(word) in _WRAPPERS:
            index += 1
            while index < len(words) and (_OPTION_OR_NUMBER.fullmatch(words[index])
                                          or _ASSIGNMENT.fullmatch(words[index])):
                index += 1
        else:
            return posixpath.basename(word)
    return None


def program(command: str) -> str:
    """What a crontab command runs, for its job's name (`test -x /usr/bin/x && x --all` -> `x`); '' if nothing."""
    programs = [p for p in map(_program, _commands(command)) if p]
    return next((p for p in programs if p not in _GUARDS), programs[0] if programs else "")


def clean(text: str) -> str:
    """`text` as job-name material: letters, digits, '_', '.', '-', starting with a letter or digit."""
    base = _NAME_CHARS.sub("-", text).strip("-._")[:56]
    return base if base and base[0].isalnum() else ("job-" + base if base else "")


def unique(base: str, taken: set[str]) -> str:
    """`base`, or `base-2`, `base-3`... whichever is not taken yet; the name returned is taken from then on."""
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    taken.add(name)
    return name


def file_name(source: str) -> str:
    """The name a system crontab file gives its jobs (`/etc/cron.d/sysstat` -> `sysstat`), or '' for /etc/crontab
    and standard input, whose lines are named after their programs."""
    base = posixpath.basename(source)
    return "" if base in ("crontab", "-", "<stdin>") else clean(base)


def names(programs: list[str], source_name: str, taken: set[str]) -> list[str]:
    """Names for one file's jobs, in order, unique across `taken` (shared by every file converted together).

    A system file's one job is named after the file; several jobs are `<file>-<program>`, or `<file>` where the
    program is the file's name. Elsewhere a job is named after its program.
    """
    out = []
    for prog in programs:
        prog = clean(prog)
        if source_name:
            base = source_name if len(programs) == 1 or prog in ("", source_name) else f"{source_name}-{prog}"
        else:
            base = prog or "job"
        out.append(unique(clean(base)[:64] or "job", taken))
    return out
