"""YAML to plain data, remembering where every key and value came from.

PyYAML's own loaders forget positions and silently keep the last of two equal
keys; a manifest error must name file, line and column, and a duplicated key
is an error, so the node tree is walked here instead.
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

    def where(self, path: Path, *, key: bool = False) -> tuple[int, int]:
        """Position of `path`, or of its nearest located ancestor."""
        table = self.keys if key else self.values
        while path not in table and path:
            path = path[:-1]
        mark = table.get(path, self.values.get(()))
        return _pos(mark) if mark is not None else (1, 1)


def _pos(mark: yaml.Mark) -> tuple[int, int]:
    return (mark.line + 1, mark.column + 1)


_STR = "tag:yaml.org,2002:str"


class _Walker:
    def __init__(self, loader: yaml.SafeLoader | yaml.CSafeLoader, out: Located) -> None:
        self.loader = loader
        self.out = out

    def walk(self, node: yaml.Node, path: Path) -> Any:
        self.out.values[path] = node.start_mark
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.walk(item, path + (i,)) for i, item in enumerate(node.value)]
        return self._scalar(node)

    def _scalar(self, node: yaml.Node) -> Any:
        # A plain string is its node's text (SafeConstructor.construct_yaml_str); most scalars in a manifest are
        # strings, and going around the constructor's machinery for them halves the walk's time on 10,000 jobs.
        if node.tag == _STR and isinstance(node, yaml.ScalarNode):
            return node.value
        return self.loader.construct_object(node, deep=True)

    def _mapping(self, node: yaml.MappingNode, path: Path) -> dict[Any, Any]:
        seen: dict[Any, tuple[int, int]] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self._scalar(key_node)
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
            key = self._scalar(key_node)
            self.out.keys[path + (key,)] = key_node.start_mark
            result[key] = self.walk(value_node, path + (key,))
        return result


# libyaml's parser (when PyYAML was built with it) is an order of magnitude faster and keeps marks.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load(text: str) -> Located:
    """Parse one YAML document; syntax errors raise `yaml.YAMLError` with a mark."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        out = Located(data=None)
        if node is not None:
            out.data = _Walker(loader, out).walk(node, ())
        return out
    finally:
        loader.dispose()
