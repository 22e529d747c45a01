"""The COMMIT manifest: its format, and the part digests it names each object by (README.md in this folder).

An object's digest is blake3_of_parts: the BLAKE3 of the concatenated BLAKE3 digests of its parts of part_size
bytes (the last one shorter; one empty part for an empty object). Both backends compute it the same way; on S3
the parts are also the multipart upload's, so each part is hashed by the thread that moves it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import socket
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import blake3

from moeloop.steps.errors import MoeloopError

COMMIT = "COMMIT"
# The COMMIT's "format"; the first (no "format", a whole-object "sha256" per file) is refused by name.
MANIFEST_FORMAT = 2
DIGEST = re.compile(r"^[0-9a-f]{64}$")
MIN_PART_SIZE = 1 << 20  # in a COMMIT: smaller parts would have a reader send a request per few bytes
# Parts of 8 MiB: well above S3's 5 MiB minimum, and 10,000 of them (S3's maximum) cover 80 GB per object.
PART_SIZE = 8 << 20
MAX_PARTS = 10_000
TEMPORARY = ".tmp-"  # in the name of a local write in progress; never part of a committed name


def temporary_name(path: str | Path) -> str:
    """The temporary a local write of path goes through: beside it, named for its writer (host and pid), so that a
    later writer of path can tell a leftover of one that died."""
    return f"{path}{TEMPORARY}{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}"


def remove_dead_temporaries(path: str | Path) -> None:
    """Remove the temporaries that writers of path left when they died (SIGKILL, a lost node): those of this host
    whose process is gone, and those of a moeloop from before temporaries named their writer. A live writer's,
    racing this one, stays; as do other hosts' (their processes cannot be seen from here)."""
    for leftover in glob.glob(f"{glob.escape(str(path))}{TEMPORARY}*"):
        writer = leftover[len(str(path)) + len(TEMPORARY) :].rpartition(".")[0]  # host.pid, less the uuid
        host, _, pid = writer.rpartition(".")
        if not writer or (host == socket.gethostname() and pid.isdigit() and not process_alive(int(pid))):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass  # another writer of path removed it first


def process_alive(pid: int) -> bool:
    """Whether a process of this host has that pid (a signal-0 probe)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def part_digest(data: bytes | memoryview) -> bytes:
    """The digest of one part: BLAKE3, cryptographic like sha256 and about five times cheaper on these cores,
    which is what lets a verified read keep up with raw boto3 when the cores are busy (benchmarks/storage.md)."""
    return blake3.blake3(data).digest()


def part_size(size: int) -> int:
    return max(PART_SIZE, -(-size // MAX_PARTS))


def part_offsets(size: int, step: int) -> range:
    """Where an object's parts start: ceil(size / step) of them, and one (empty) for an empty object."""
    return range(0, max(size, 1), step)


def object_entry(size: int, part_size: int, part_digests: Iterable[bytes]) -> dict[str, Any]:
    """A COMMIT's entry for one object, from the digest of each of its parts, in order."""
    return {"size": size, "part_size": part_size, "blake3_of_parts": part_digest(b"".join(part_digests)).hex()}


def bytes_entry(data: bytes) -> dict[str, Any]:
    step = part_size(len(data))
    view = memoryview(data)
    digests = (part_digest(view[offset : offset + step]) for offset in part_offsets(len(data), step))
    return object_entry(len(data), step, digests)


def local_entry(path: Path) -> dict[str, Any]:
    """The COMMIT entry of a local file (to compare a local copy or a re-run's files with a manifest)."""
    size = path.stat().st_size
    step = part_size(size)
    with open(path, "rb") as file:
        digests = [part_digest(file.read(step)) for _ in part_offsets(size, step)]
    return object_entry(size, step, digests)


def copy_hashed(source: Path, target: Path) -> dict[str, Any]:
    """Copy a local file through a fsynced temporary name, hashing its parts on the way: its COMMIT entry."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(temporary_name(target))
    size = source.stat().st_size
    step = part_size(size)
    digests = []
    try:
        with open(source, "rb") as reader, open(temporary, "wb") as writer:
            for offset in part_offsets(size, step):
                chunk = reader.read(step)
                if len(chunk) != min(step, size - offset):
                    raise MoeloopError(f"{source} changed while it was being copied")
                digests.append(part_digest(chunk))
                writer.write(chunk)
            writer.flush()
            os.fsync(writer.fileno())
        os.replace(temporary, target)
    finally:
        if temporary.exists():
            temporary.unlink()
    remove_dead_temporaries(target)
    return object_entry(size, step, digests)


def json_bytes(value: Any, source: str = "JSON") -> bytes:
    """Strict JSON: a NaN or an infinity (which json.dumps would write as a literal no JSON parser reads) is an
    error naming its key, and nothing is written."""
    try:
        return (json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
    except ValueError:
        raise MoeloopError(f"refusing to write {source}: {non_finite_key(value)} is not a finite number") from None


def non_finite_key(value: Any, path: str = "") -> str | None:
    """The dotted key of the first NaN or infinity in a JSON-like value (None if there is none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path or 'the value'} ({value})"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for key, item in items:
        if (found := non_finite_key(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


def manifest_of(files: dict[str, dict[str, Any]], extra: dict[str, Any] | None) -> dict[str, Any]:
    return {**(extra or {}), "files": dict(sorted(files.items())), "format": MANIFEST_FORMAT}


def parse_manifest(raw: bytes, source: str) -> dict[str, Any]:
    """A COMMIT: {"format": 2, "files": {name: {"size", "part_size", "blake3_of_parts"}}, ...}; anything else
    is not ours (and a first-format COMMIT, with a whole-object "sha256" per file, is named as such)."""
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        if "format" not in manifest and isinstance(files, dict) and "sha256" in next(iter(files.values()), {}):
            raise MoeloopError(
                f"{source} is in the first {COMMIT} format (a whole-object sha256 per file), which this moeloop no"
                f" longer reads (format {MANIFEST_FORMAT}: blake3_of_parts): start a new run, or re-create this one"
            )
        valid = (
            manifest["format"] == MANIFEST_FORMAT
            and isinstance(files, dict)
            and all(valid_name(name) and valid_entry(entry) for name, entry in files.items())
        )
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        valid = False
    if not valid:
        raise MoeloopError(f"not a valid {COMMIT} manifest: {source}")
    return manifest


def valid_name(name: Any) -> bool:
    return (
        isinstance(name, str) and bool(name) and not name.startswith("/") and not {"", ".", ".."} & set(name.split("/"))
    )


def valid_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and entry["size"] >= 0
        and isinstance(entry.get("part_size"), int)
        and entry["part_size"] >= MIN_PART_SIZE
        and bool(DIGEST.match(str(entry.get("blake3_of_parts", ""))))
    )


def parse_latest(raw: bytes, source: str) -> dict[str, Any]:
    try:
        latest = json.loads(raw)
        if isinstance(latest.get("iteration"), int) and isinstance(latest.get("checkpoint"), str):
            return latest
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        pass
    raise MoeloopError(f"not a valid LATEST pointer: {source}")
