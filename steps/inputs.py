"""What the user hands moeloop, read with one-line errors: files (bounded in size, UTF-8, YAML without a key given
twice or aliases that expand past a budget), storage locations (a local path, file:// or s3://bucket/key, one token
without credentials) and the folders commands write into."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from moeloop.steps.errors import MoeloopError

# Argo evaluates `{{...}}` wherever it finds it in a template, in any value it substitutes as well, and has no
# escape for it: a string that reaches a manifest may not hold one (workflows/README.md, "Security").
ARGO_EXPRESSION = "{{"
# scheme://userinfo@host: a user name, password or token in a URI.
URI_CREDENTIALS = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]*@")
QUOTES = "'\"`"
# Nodes that YAML aliases may add to a document by repeating what they refer to: a config or a manifest has a few,
# an alias bomb (nine lines of nine aliases each) billions, which pydantic or jsonschema would then walk.
MAX_ALIASED_NODES = 100_000


def check_text(value: str) -> None:
    """Text that reaches the rendered objects or a log: no Argo expression, no credentials in a URI (never echoed)."""
    if URI_CREDENTIALS.search(value):
        raise ValueError(
            "credentials in a URI are refused (the config reaches every rendered object, the run's config.yaml and"
            " the logs): give them through the environment (a Kubernetes Secret), IRSA or a profile"
        )
    if ARGO_EXPRESSION in value:
        raise ValueError(f"{value!r} holds '{{{{', which Argo would evaluate as an expression (it has no escape)")


def check_strings(data: Any, where: str = "") -> None:
    """check_text on every string of parsed YAML, keys included, an error naming the dotted path."""
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str):
                check_strings(key, f"{where or 'the top level'}: a key")
            check_strings(value, path)
    elif isinstance(data, list):
        for index, item in enumerate(data):
            check_strings(item, f"{where}.{index}")
    elif isinstance(data, str):
        try:
            check_text(data)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


def unsafe_character(value: str, one_token: bool) -> str | None:
    """The first control (or invisible format) character of value, or with one_token whitespace or quote too,
    described; None if none."""
    for character in value:
        spacing = character.isspace() or character in QUOTES
        if unicodedata.category(character) in ("Cc", "Cf") or (one_token and spacing):
            return f"{unicodedata.name(character, 'a control character')} ({character!r})"
    return None


def check_location_text(value: str, run: bool = False) -> None:
    """No location holds a control character, nor what check_text refuses. A run's location (the run URI, its root)
    is one token besides: no whitespace or quotes, as a newline and a quote in it once made YAML of their own in a
    manifest; it is every step's argument and the submit form's `run`."""
    check_text(value)
    found = unsafe_character(value, one_token=run)
    if found is not None:
        rule = "whitespace, quotes or control characters" if run else "control characters"
        raise ValueError(f"{value!r} holds {found}: a {'run' if run else 'storage'} location has no {rule}")


def check_location(value: str, what: str, run: bool = False) -> str:
    """A storage location (prompt file, checkpoint, run root with `run`): a local path, file://, or s3://bucket[/key].
    Other schemes would be read by whatever fsspec finds, and an s3:// without a bucket by nothing."""
    if not value.strip():
        raise ValueError(f"{what} is empty")
    check_location_text(value, run)
    if "://" not in value:
        return value
    scheme = value.split("://", 1)[0]
    if scheme not in ("s3", "file"):
        raise ValueError(f"unsupported URI scheme {scheme!r} in {value} (use a local path or s3://bucket/key)")
    if scheme == "s3" and not urlsplit(value).netloc:  # the bucket's name is checked where it is used (storage/s3.py)
        raise ValueError(f"{value} needs a bucket: s3://bucket/key")
    return value


def output_folder(path: Path, what: str) -> Path:
    """The folder a command writes into, made if missing: a path that is a file, or cannot be made, is one line."""
    if path.exists() and not path.is_dir():
        raise MoeloopError(f"{path}: not a folder; {what} names the folder to write into")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MoeloopError(f"{path}: cannot make the folder {what} names: {error.strerror or error}") from None
    return path


def decode_text(data: bytes, source: str) -> str:
    """UTF-8 text, or a one-line error naming the line of the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise MoeloopError(
            f"{source}: not UTF-8 text (byte 0x{data[error.start]:02x} on line {line}): is it the right file?"
        ) from None


def read_limited(
    location: str | Path,
    what: str,
    limit: int,
    open_file: Callable[[Any, str], Any] = open,
    describe: Callable[[BaseException, str], Exception | None] | None = None,
) -> bytes:
    """A file's bytes, at most `limit`: a missing, unreadable or oversized one is a one-line error. open_file opens
    location for binary reads (default: a local file); describe turns its own failures into one line."""
    try:
        with open_file(location, "rb") as file:
            data = file.read(limit + 1)
    except FileNotFoundError:
        raise MoeloopError(f"{what} not found: {location}") from None
    except IsADirectoryError:
        raise MoeloopError(f"{what} is a directory, not a file: {location}") from None
    except Exception as error:
        described = describe(error, str(location)) if describe is not None else None
        if described is not None:
            raise described from None
        if isinstance(error, OSError) and error.strerror:
            raise MoeloopError(f"cannot read {what} {location}: {error.strerror}") from None
        raise
    if len(data) > limit:
        raise MoeloopError(f"{what} {location} is larger than {limit} bytes: is it the right file?")
    return data


class NotYaml(MoeloopError):
    """Text that is no YAML moeloop reads; `reason` says why in one line, without the source."""

    def __init__(self, source: str, reason: str):
        super().__init__(f"{source}: {reason}")
        self.reason = reason


class _StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser: faster, nesting bounded
    """Safe YAML that refuses a key given twice in one mapping (PyYAML would silently keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                continue  # the base class refuses what cannot be a key
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


class AliasRefused(yaml.YAMLError):
    """YAML whose aliases moeloop refuses to expand."""


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def check_aliases(root: yaml.Node) -> None:
    """Refuse a document whose aliases add more than MAX_ALIASED_NODES nodes, or refer to the node holding them,
    before anything is built from it: each node's size, the nodes it stands for once every alias is expanded, is
    counted once, bottom up (aliases share the node they name)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    pending: list[tuple[yaml.Node, bool]] = [(root, False)]
    while pending:
        node, children_done = pending.pop()
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
            # A subtree's nodes are all counted by now, so this bounds what the whole document's aliases add.
            if sizes[id(node)] - len(sizes) > MAX_ALIASED_NODES:
                raise AliasRefused(f"its aliases expand it by more than {MAX_ALIASED_NODES} nodes")
        elif id(node) in open_nodes:
            raise AliasRefused("an alias refers to a node that holds it")
        elif id(node) not in sizes:
            open_nodes.add(id(node))
            pending.append((node, True))
            pending.extend((child, False) for child in _children(node))


def _construct(loader: yaml.BaseLoader, node: yaml.Node | None) -> Any:
    if node is None:
        return None
    check_aliases(node)
    return loader.construct_document(node)


def _read_yaml(data: bytes | str, source: str, read: Callable[[yaml.BaseLoader], Any]) -> Any:
    loader = _StrictLoader(decode_text(data, source) if isinstance(data, bytes) else data)
    try:
        return read(loader)
    except AliasRefused as error:
        raise NotYaml(source, f"refused YAML: {error}") from None
    except (yaml.YAMLError, ValueError) as error:  # ValueError: a scalar no value has, e.g. a date 2024-02-30
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise NotYaml(source, f"not valid YAML ({problem}{where})") from None
    except RecursionError:
        raise NotYaml(source, "not valid YAML (nested too deeply)") from None
    finally:
        loader.dispose()


def load_yaml(data: bytes | str, source: str) -> Any:
    """One YAML (or JSON) document: not UTF-8, not YAML, a key given twice or an alias bomb is one line naming
    source."""
    return _read_yaml(data, source, lambda loader: _construct(loader, loader.get_single_node()))


def load_yaml_documents(data: bytes | str, source: str) -> list[Any]:
    """Every document of a YAML stream, read as load_yaml reads one."""

    def every(loader: yaml.BaseLoader) -> list[Any]:
        documents = []
        while loader.check_node():
            documents.append(_construct(loader, loader.get_node()))
        return documents

    return _read_yaml(data, source, every)
