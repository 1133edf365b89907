"""Finding shell syntax in a command string that consulrun would otherwise pass on literally.

A `command:` string is split into words as a POSIX shell would, but nothing is
expanded: `a | b` would run `a` with the arguments `|` and `b`. Such a string is
an error unless the job says `shell: true`, so this scanner follows sh's
quoting rules (single quotes, double quotes, backslash) and reports the first
character a shell would have treated as syntax.
"""

from __future__ import annotations

import re
from typing import Any

_OPERATORS = set("|&;<>()`")
_GLOB = set("*?[")
_RESERVED = {"!", "{", "}", "if", "then", "else", "elif", "fi", "case", "esac", "for", "while", "until", "do", "done",
             "in"}
_ASSIGNMENT = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*=)")
_PARAMETER = re.compile(r"\$(?:[A-Za-z_{(]|[0-9@*#?$!-])")


def first_syntax(command: str) -> tuple[int, str] | None:
    """(index, what) of the first shell syntax outside quotes in `command`, or None.

    `what` describes it for a message: an operator, an expansion, a glob, a
    comment, a leading `~`.
    """
    assignment = _ASSIGNMENT.match(command)
    if assignment:
        return assignment.start(1), f"the variable assignment {assignment.group(1)!r}"
    first = command.split(None, 1)[0] if command.strip() else ""
    if first in _RESERVED:
        return command.index(first), f"the shell keyword {first!r}"
    quote = ""
    word_start = True
    i = 0
    while i < len(command):
        ch = command[i]
        if quote == "'":
            if ch == "'":
                quote = ""
        elif ch == "\\":
            if quote == '"' and command[i + 1:i + 2] in ("$", "`"):
                return i, "a backslash escape of '$' or '`' inside double quotes"  # shlex keeps that backslash
            i += 1  # the next character is literal
        elif quote == '"':
            if ch == '"':
                quote = ""
            elif ch == "`" or _PARAMETER.match(command, i):
                return i, _expansion(command, i)
        elif ch in "'\"":
            quote = ch
        elif ch == "`" or _PARAMETER.match(command, i):
            return i, _expansion(command, i)
        elif ch in _OPERATORS:
            op = command[i:i + 2] if command[i:i + 2] in ("&&", "||", ">>", "<<", ">&", "<&") else ch
            return i, f"the operator {op!r}"
        elif ch in _GLOB:
            return i, f"the wildcard {ch!r}"
        elif word_start and ch == "#":
            return i, "a '#' comment"
        elif word_start and ch == "~":
            return i, "a '~' home directory"
        word_start = ch in " \t\n" and not quote
        i += 1
    return None


def _expansion(command: str, i: int) -> str:
    if command[i] == "`":
        return "a `command` substitution"
    match = re.match(r"\$(?:\{[^}]*\}?|\(\(?|[A-Za-z_][A-Za-z0-9_]*|.)", command[i:])
    text = match.group(0) if match else "$"
    return f"the expansion {text!r}"


def command_problems(command: Any, shell: Any) -> list[tuple[str, str]]:
    """(job key, message) for a `shell: true` with an argv, or a command string with shell syntax and no `shell:`."""
    if shell is True and isinstance(command, list):
        return [("shell", "shell: true runs one command string with /bin/sh -c; write the command as a string, or "
                          "drop shell: and keep the list")]
    found = first_syntax(command) if shell is not True and isinstance(command, str) else None
    if found is None:
        return []
    index, what = found
    return [("command", f"has shell syntax ({what} at character {index + 1}) that would be passed on literally, not "
                        "interpreted; add 'shell: true' to run it with /bin/sh -c, or quote it")]
