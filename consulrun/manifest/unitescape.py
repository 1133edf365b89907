"""The one place manifest values are turned into unit-file text.

systemd reads a unit-file value in up to three layers, and which apply depends
on the setting (systemd.service(5), systemd.exec(5), systemd.unit(5)):

* specifiers: `%` starts one in every setting the templates write, so `%`
  becomes `%%`; a few settings a job may add (`CPUQuota=50%`) resolve no
  specifiers, and there `%` is written as it is;
* variable expansion: only command lines expand `$VAR`, so `$` becomes `$$`
  there and stays as it is in `Environment=`;
* word splitting with quotes and C escapes: command lines and `Environment=`.

Settings without word splitting (`Description=`, paths) cannot carry a
newline or other control characters at all; those are rejected, never mangled.
"""

from __future__ import annotations

import enum
import functools
import re

_SAFE_WORD = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r",
              "\a": "\\a", "\b": "\\b", "\f": "\\f", "\v": "\\v"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Context(enum.Enum):
    EXEC_ARG = "exec"  # one word of ExecStart=
    ENV_ASSIGNMENT = "env"  # one NAME=value word of Environment=
    PLAIN = "plain"  # the whole value of a setting without word splitting
    NO_SPECIFIERS = "literal"  # like PLAIN, for a setting systemd reads without resolving `%` specifiers

    __hash__ = object.__hash__  # members are singletons; Enum's own hash is Python code, paid on every cached escape


class UnrepresentableError(ValueError):
    """The value cannot be written so that systemd reads it back unchanged."""


def _quote(word: str) -> str:
    out = []
    for ch in word:
        if ch in _C_ESCAPES:
            out.append(_C_ESCAPES[ch])
        elif _CONTROL.match(ch):
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


@functools.lru_cache(maxsize=4096)  # pure; a big manifest repeats paths, prefixes, addresses
def escape(value: str, context: Context) -> str:
    """Return `value` as unit-file text that systemd reads back as exactly `value`."""
    if "\x00" in value:
        raise UnrepresentableError("contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UnrepresentableError("is not valid Unicode text") from None
    if context in (Context.PLAIN, Context.NO_SPECIFIERS):
        if _CONTROL.search(value):
            raise UnrepresentableError("contains a newline or another control character")
        if value != value.strip():
            raise UnrepresentableError("has leading or trailing whitespace")
        if value.endswith("\\"):
            raise UnrepresentableError("ends with a backslash, which systemd reads as a line continuation")
        return value if context is Context.NO_SPECIFIERS else value.replace("%", "%%")
    text = value if _SAFE_WORD.fullmatch(value) else _quote(value)
    text = text.replace("%", "%%")
    if context is Context.EXEC_ARG:
        text = text.replace("$", "$$")
    return text


def exec_line(argv: list[str]) -> str:
    """Join a command's arguments into one `ExecStart=` value."""
    return " ".join([escape(arg, Context.EXEC_ARG) for arg in argv])
