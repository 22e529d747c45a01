"""Small helpers of every check: the shapes of parsed YAML, tolerant access to it (anything unexpected was already
a schema error), locations as text, one-line messages."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

YamlMap = dict[str, Any]  # a parsed YAML mapping: a document, spec, template, task, ...
Finding = tuple[str, str]  # (path, message) before source and document are attached
TemplateIndex = Mapping[tuple[bool, str], frozenset[str]]  # (cluster scope, name) -> template names

_PLAIN_KEY = re.compile(r"[A-Za-z_][-\w]*")


def dict_items(value: object) -> Iterator[tuple[int, YamlMap]]:
    """(index, item) for the dict items of a list; anything else was already a schema error."""
    for i, item in list_items(value):
        if isinstance(item, dict):
            yield i, item


def list_items(value: object) -> Iterator[tuple[int, Any]]:
    return enumerate(value) if isinstance(value, list) else iter(())


def names_of(items: object) -> frozenset[str]:
    """The string `name` fields of a list of dicts."""
    if not isinstance(items, list):
        return frozenset()
    return frozenset(item["name"] for item in items if isinstance(item, dict) and isinstance(item.get("name"), str))


def listing(names: Iterable[str], limit: int = 12) -> str:
    ordered = sorted(names)
    if not ordered:
        return "none"
    more = f", ... ({len(ordered) - limit} more)" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more


def child_path(path: str, key: object) -> str:
    text = str(key)
    if _PLAIN_KEY.fullmatch(text):
        return f"{path}.{text}" if path else text
    return f"{path}[{text!r}]"


def format_path(parts: Iterable[str | int], path: str = "") -> str:
    for part in parts:
        path = f"{path}[{part}]" if isinstance(part, int) else child_path(path, part)
    return path


def one_line(text: str) -> str:
    return " ".join(text.split())
