"""Immutable records declared like dataclasses, built on `collections.namedtuple`.

Every timer tick on every node starts `consulrun run`, and importing
`dataclasses` (with the `inspect`, `ast` and `dis` it pulls in) and building
the run path's nine record classes cost about 12 ms of CPU: a fifth of a
skipping run (bench/RESULTS.md). A namedtuple is built in a fraction of that
and is what a frozen dataclass is here: fields by keyword or position, with
defaults; read-only attributes; equality and repr by value.
"""

from __future__ import annotations

from collections import namedtuple

_NOT_COPIED = ("__dict__", "__weakref__", "__annotations__")


def record(cls: type) -> type:
    """`cls` as an immutable record of its annotated fields, in order; a class attribute is its field's default.

    Methods, properties and class methods come along; the fields with
    defaults must come last, as in a dataclass.
    """
    fields = list(cls.__dict__.get("__annotations__", {}))
    defaults = [cls.__dict__[name] for name in fields if name in cls.__dict__]
    if any(name in cls.__dict__ for name in fields[:len(fields) - len(defaults)]):
        raise TypeError(f"{cls.__name__}: a field without a default follows one with a default")
    base = namedtuple(cls.__name__, fields, defaults=defaults)  # type: ignore[misc]
    body = {k: v for k, v in cls.__dict__.items() if k not in fields and k not in _NOT_COPIED}
    return type(cls.__name__, (base,), {**body, "__slots__": ()})
