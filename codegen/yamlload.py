"""YAML loading that remembers where every value came from.

Mappings load as `LocDict` and sequences as `LocList`; both carry the 1-based line
of each key / item so every schema error can name `variants.yaml:LINE`. Duplicate
keys are an error (plain PyYAML silently keeps the last one).
"""
from __future__ import annotations

import re
from typing import Any

import yaml


class LocDict(dict):
    """A mapping with `line` (its own) and `key_lines[key]` (each key's line)."""

    line: int
    key_lines: dict[str, int]


class LocList(list):
    """A sequence with `line` (its own) and `item_lines[i]`."""

    line: int
    item_lines: list[int]


class DuplicateKeyError(yaml.MarkedYAMLError):
    pass


class _Loader(yaml.SafeLoader):
    pass


# YAML 1.1 reads `off`, `on`, `yes`, `no` as booleans; `off` is an index symbol here.
# Only `true` and `false` are booleans in variants.yaml.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|false)$"),
                              list("tf"))


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LocDict:
    loader.flatten_mapping(node)
    out = LocDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise DuplicateKeyError(
                None, None,
                f"duplicate key '{key}' (first defined on line {out.key_lines[key]})",
                key_node.start_mark)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> LocList:
    out = LocList(loader.construct_object(child, deep=True) for child in node.value)
    out.line = node.start_mark.line + 1
    out.item_lines = [child.start_mark.line + 1 for child in node.value]
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def load(text: str) -> Any:
    """Parse YAML text into LocDict / LocList / scalars; raises yaml.YAMLError."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
