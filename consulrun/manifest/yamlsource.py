"""YAML to plain data, remembering where every key and value came from.

PyYAML's own loaders forget positions and silently keep the last of two equal
keys; a manifest error must name file, line and column, and a duplicated key
is an error, so the node tree is walked here instead.

The walk has limits, because aliases make a small text a large (or endless)
value: an alias inside the node it names is refused, and so is a document
whose aliases would expand it by more than `ALIAS_EXPANSION` values beyond
the ones it writes out (a 1 KB "billion laughs" reached 1.77 GB before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

Path = tuple[Any, ...]


@dataclass
class Located:
    """Parsed data plus where each value and mapping key starts (`where` gives 1-based line and column)."""

    data: Any
    values: dict[Path, yaml.Mark] = field(default_factory=dict)  # marks, turned into positions only when asked
    keys: dict[Path, yaml.Mark] = field(default_factory=dict)
    problems: list[tuple[tuple[int, int], str]] = field(default_factory=list)
    integral_floats: list[Path] = field(default_factory=list)  # values such as 1.0, which JSON Schema calls integers

    def where(self, path: Path, *, key: bool = False) -> tuple[int, int]:
        """Position of `path`, or of its nearest located ancestor."""
        table = self.keys if key else self.values
        while path not in table and path:
            path = path[:-1]
        mark = table.get(path, self.values.get(()))
        return _pos(mark) if mark is not None else (1, 1)


def _pos(mark: yaml.Mark) -> tuple[int, int]:
    return (mark.line + 1, mark.column + 1)


def explain(exc: yaml.MarkedYAMLError, text: str) -> str:
    """PyYAML's problem, said so that a new user sees the mistake behind the two that are nearly always one: a
    tab (YAML indents with spaces only) and an unquoted value holding `: `."""
    problem = str(exc.problem or exc)
    mark = exc.problem_mark
    lines = text.splitlines()
    line = lines[mark.line] if mark is not None and mark.line < len(lines) else ""
    indent = line[:len(line) - len(line.lstrip(" \t"))]
    if mark is not None and "cannot start any token" in problem and \
            ("\t" in line[mark.column:mark.column + 1] or "\t" in indent):
        return "a tab character: YAML indents with spaces only; replace the tab with spaces"
    if "mapping values are not allowed" in problem:
        key, colon, value = line.strip().partition(": ")
        example = f" ({key}: '{value.replace(chr(39), chr(39) * 2)}')" if colon and value and len(line) < 200 else ""
        return f"{problem}: a value holding ': ' must be quoted{example}"
    return problem


_STR = "tag:yaml.org,2002:str"
ALIAS_EXPANSION = 100_000  # values reached again through aliases, beyond as many as the document writes out
MAX_DEPTH = 64  # a manifest is six levels deep; the walk recurses, and Python's stack is not a limit to meet


class LimitError(Exception):
    """A document beyond the walk's limits; `mark` is where it was found."""

    def __init__(self, mark: yaml.Mark, message: str) -> None:
        super().__init__(message)
        self.mark = mark
        self.message = message

    def position(self) -> tuple[int, int]:
        return _pos(self.mark)


class _Walker:
    def __init__(self, loader: yaml.SafeLoader | yaml.CSafeLoader, out: Located) -> None:
        self.loader = loader
        self.out = out
        self.seen: set[int] = set()  # nodes walked (an alias gives the same node object again)
        self.repeats = 0
        self.open: set[int] = set()  # the collections the walk is inside
        self.alias_at: yaml.Mark | None = None  # where the walk went into a node it had walked before

    def walk(self, node: yaml.Node, path: Path, where: yaml.Mark | None = None) -> Any:
        """`where`: the mark of what refers to `node` (its key), for messages about an alias, whose own mark
        the composer does not keep."""
        self.out.values[path] = node.start_mark
        outermost_alias = False
        if id(node) in self.seen:
            self.repeats += 1
            if self.alias_at is None:
                self.alias_at, outermost_alias = where or node.start_mark, True
            if self.repeats > ALIAS_EXPANSION + len(self.seen):
                raise LimitError(self.alias_at, f"aliases expand the document past {ALIAS_EXPANSION:,} repeated "
                                                "values (an alias bomb?); write the values out or use defaults:")
        else:
            self.seen.add(id(node))
        try:
            return self._node(node, path, where)
        finally:
            if outermost_alias:
                self.alias_at = None

    def _node(self, node: yaml.Node, path: Path, where: yaml.Mark | None) -> Any:
        if isinstance(node, yaml.ScalarNode):
            value = self._scalar(node)
            if isinstance(value, float) and value.is_integer():
                self.out.integral_floats.append(path)
            return value
        if id(node) in self.open:
            raise LimitError(where or node.start_mark,
                             "an alias refers to a node that contains it (a recursive anchor), an endless value")
        if len(path) > MAX_DEPTH:
            raise LimitError(node.start_mark, f"nested deeper than {MAX_DEPTH} levels")
        self.open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, path)
            return [self.walk(item, path + (i,), where=node.start_mark) for i, item in enumerate(node.value)]
        finally:
            self.open.discard(id(node))

    def _scalar(self, node: yaml.Node) -> Any:
        # A plain string is its node's text (SafeConstructor.construct_yaml_str); most scalars in a manifest are
        # strings, and going around the constructor's machinery for them halves the walk's time on 10,000 jobs.
        if node.tag == _STR and isinstance(node, yaml.ScalarNode):
            return node.value
        return self.loader.construct_object(node, deep=True)

    def _key(self, node: yaml.ScalarNode) -> Any:
        # YAML 1.1 reads a plain `on:`, `yes:` or `off:` key as a boolean; no manifest key is one, and `after:`'s
        # `on:` must stay the word it is (as GitHub Actions had to learn).
        if node.tag == "tag:yaml.org,2002:bool" and not node.style:  # plain (libyaml says "", PyYAML None)
            return node.value
        return self._scalar(node)

    def _mapping(self, node: yaml.MappingNode, path: Path) -> dict[Any, Any]:
        seen: dict[Any, tuple[int, int]] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self._key(key_node)
            if key in seen:
                first = seen[key]
                self.out.problems.append(
                    (_pos(key_node.start_mark),
                     f"duplicate key {key!r} (first defined at line {first[0]}); YAML would silently keep the last"))
            seen[key] = _pos(key_node.start_mark)
        self.loader.flatten_mapping(node)
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.out.problems.append((_pos(key_node.start_mark), "mapping keys must be plain scalars"))
                continue
            key = self._key(key_node)
            self.out.keys[path + (key,)] = key_node.start_mark
            result[key] = self.walk(value_node, path + (key,), where=key_node.start_mark)
        return result


# libyaml's parser (when PyYAML was built with it) is an order of magnitude faster and keeps marks.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load(text: str) -> Located:
    """Parse one YAML document; syntax errors raise `yaml.YAMLError` with a mark, a document past the walk's
    limits `LimitError`."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        out = Located(data=None)
        if node is not None:
            out.data = _Walker(loader, out).walk(node, ())
        return out
    finally:
        loader.dispose()
