"""Safe YAML reading that refuses a mapping key given twice, and alias bombs.

YAML says the keys of a mapping are unique; PyYAML keeps the last value and
says nothing, so a second ``train:`` section silently replaced the first
(``epochs`` dropped). :class:`UniqueKeyLoader` is ``yaml.SafeLoader`` (no
Python objects, no code) whose ``construct_mapping`` refuses a repeated key,
naming it by its dotted path (``train.epochs``, ``datasets[0].name``) and
both lines. Merge keys (``<<: *base``) still work: a key given beside a merge
overrides the merged one, as YAML intends. A document whose aliases expand
to more than a million values, or into themselves, is refused before it is
built.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

_MERGE_TAG = "tag:yaml.org,2002:merge"


class RefusedError(yaml.YAMLError):
    """Valid YAML that a config must not be: a repeated key, an alias bomb, a recursive alias."""


class DuplicateKeyError(RefusedError):
    """A mapping key given twice; the message names the key's dotted path and both lines."""


def _key_text(node: Node) -> str:
    return str(node.value) if isinstance(node, ScalarNode) else "?"


def _node_paths(root: Node) -> dict[int, str]:
    """``id(mapping node)`` -> its dotted path in the document (``""`` for the top)."""
    found: dict[int, str] = {}
    stack: list[tuple[Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in found:  # an alias: named where its anchor is
            continue
        found[id(node)] = path
        if isinstance(node, MappingNode):
            for key, value in node.value:
                if key.tag != _MERGE_TAG:
                    stack.append((value, f"{path}.{_key_text(key)}" if path else _key_text(key)))
        elif isinstance(node, SequenceNode):
            stack += [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
    return found


#: More values than this once aliases are expanded is an alias bomb ("billion laughs"): a few lines
#: that any later json.dumps or digest of the config would expand into gigabytes.
MAX_EXPANDED_VALUES = 1_000_000


def _expanded_size(root: Node) -> int:
    """How many values the document holds with every alias expanded (each node counted once per use)."""
    size: dict[int, int] = {}
    visiting: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        kids = [n for pair in node.value for n in pair] if isinstance(node, MappingNode) else \
            node.value if isinstance(node, SequenceNode) else []
        if children_done:
            size[id(node)] = 1 + sum(size[id(k)] for k in kids)
            visiting.discard(id(node))
        elif id(node) not in size:
            if id(node) in visiting:
                line = node.start_mark.line + 1
                raise RefusedError(f"the value at line {line} contains itself through an alias (*name)")
            visiting.add(id(node))
            stack.append((node, True))
            stack += [(k, False) for k in kids if id(k) not in size]
    return size[id(root)]


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises :class:`RefusedError` on a repeated key or an alias bomb."""

    _paths: dict[int, str] = {}

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        if (n := _expanded_size(node)) > MAX_EXPANDED_VALUES:
            raise RefusedError(
                f"the document expands to {n} values through its aliases (*name), more than "
                f"{MAX_EXPANDED_VALUES}: an alias bomb, not a config"
            )
        self._paths = _node_paths(node)
        return self.construct_document(node)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}  # key -> line of its first appearance
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    parent = self._paths.get(id(node), "")
                    name = f"{parent}.{key}" if parent else str(key)
                    raise DuplicateKeyError(
                        f"duplicate key {name!r} at line {line} (first at line {seen[key]}): YAML keeps only "
                        "the last value; remove one or merge them"
                    )
                seen[key] = line
            except TypeError:  # an unhashable key: SafeLoader's own error below names it
                break
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """Parse YAML ``text`` safely; raises ``yaml.YAMLError`` (:class:`RefusedError` for what a config must not be)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
