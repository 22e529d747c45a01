"""The local checkpoint cache: committed folders (checkpoints, critics, reward models) as local folders, verified
against their COMMIT on the way in and again before every use; and scratch folders for a step's local files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.manifest import local_entry
from moeloop.steps.storage.run import RunStorage


def cache_root() -> Path:
    return Path(os.environ.get("MOELOOP_CACHE", Path(tempfile.gettempdir()) / "moeloop-cache"))


def fetch_checkpoint(storage: RunStorage, iteration: int) -> Path:
    """A committed checkpoint as a local folder, verified against its COMMIT and cached."""
    return fetch_committed(storage, storage.checkpoint(iteration), f"checkpoint of iteration {iteration}")


def fetch_committed(storage: RunStorage, folder: str, what: str = "folder") -> Path:
    """A committed folder (a checkpoint, a critic, a reward model) as a local folder, verified and cached."""
    manifest = storage.manifest(folder)
    if manifest is None:
        raise MoeloopError(f"{what} is not committed: {storage.display(folder)}")
    return fetch_verified(storage, folder, manifest["files"])


def fetch_verified(storage: RunStorage, folder: str, files: dict[str, Any], fetched: Path | None = None) -> Path:
    """The files of a folder (a COMMIT's, or another record of their sizes and digests) as a local folder,
    cached by where the folder lives and the digest of that record.

    A download is verified against the record before it enters the cache, and a cached copy again before
    every use: a damaged copy is set aside and fetched anew. fetched: a folder under cache_root() already
    downloaded and checked against files, to move into the cache instead of downloading."""
    files_digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    location_digest = hashlib.sha256(storage.display(folder).encode()).hexdigest()[:16]
    local = cache_root() / location_digest / f"{Path(folder).name}-{files_digest}"
    if local.exists():
        if matches_files(local, files):
            if fetched is not None:
                shutil.rmtree(fetched, ignore_errors=True)
            return local
        damaged = local.with_name(f"{local.name}.damaged-{uuid.uuid4().hex}")
        os.replace(local, damaged)  # out of the way of other readers first, then gone
        shutil.rmtree(damaged, ignore_errors=True)
    cache_root().mkdir(parents=True, exist_ok=True)
    staging = fetched or Path(tempfile.mkdtemp(dir=cache_root()))
    try:
        if fetched is None:
            storage.fetch_files(folder, files, staging)
        local.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, local)
    except OSError:
        if not local.exists():  # not a concurrent fetch of the same folder that won the rename
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local


def matches_files(local: Path, files: dict[str, Any]) -> bool:
    for name, entry in files.items():
        path = local / name
        if not path.is_file() or path.stat().st_size != entry["size"] or local_entry(path) != entry:
            return False
    return True


@contextmanager
def local_scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="moeloop-") as directory:
        yield Path(directory)
