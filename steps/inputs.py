"""What the user hands moeloop, read with one-line errors: files (bounded in size, UTF-8, YAML without a key given
twice) and storage locations (a local path, file:// or s3://bucket/key)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from moeloop.steps.errors import MoeloopError


def check_location(value: str, what: str) -> str:
    """A storage location (prompt file, checkpoint, run root): a local path, file://, or s3://bucket[/key].
    Other schemes would be read by whatever fsspec finds, and an s3:// without a bucket by nothing."""
    if not value.strip():
        raise ValueError(f"{what} is empty")
    if "://" not in value:
        return value
    scheme = value.split("://", 1)[0]
    if scheme not in ("s3", "file"):
        raise ValueError(f"unsupported URI scheme {scheme!r} in {value} (use a local path or s3://bucket/key)")
    if scheme == "s3" and not urlsplit(value).netloc:  # the bucket's name is checked where it is used (storage/s3.py)
        raise ValueError(f"{value} needs a bucket: s3://bucket/key")
    return value


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


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML would silently keep the last)."""

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


def load_yaml(data: bytes, source: str) -> Any:
    """YAML (or JSON) from bytes: not UTF-8, not YAML, or a key given twice is one line naming source."""
    text = decode_text(data, source)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise MoeloopError(f"{source}: not valid YAML ({problem}{where})") from None
