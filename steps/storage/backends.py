"""The two places a run lives, behind one small interface that RunStorage (steps/storage/run.py) drives.

Each backend gives the protocol's primitives their atomicity its own way: a local folder with fsynced temporary
names, renames, hard links and a flock; S3 with atomic PUTs, multipart uploads, If-None-Match and If-Match.
Reads and listings of single objects go through the backend's fsspec filesystem (`fs`), the same call on both.
Paths here are RunStorage.full paths (the run's root joined with a checked relative path).
"""

from __future__ import annotations

import fcntl
import os
import posixpath
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import fsspec

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage import s3
from moeloop.steps.storage.manifest import (
    COMMIT,
    PART_SIZE,
    bytes_entry,
    copy_hashed,
    object_entry,
    remove_dead_temporaries,
    temporary_name,
)

if TYPE_CHECKING:
    from moeloop.steps.storage.run import RunStorage

LATEST_ATTEMPTS = 20  # compare-and-swap rounds before giving up on a LATEST that keeps changing
# Fault injection (tests/faults/test_storage_faults.py): with MOELOOP_CRASH_AFTER_WRITES=N set, the process kills
# itself with SIGKILL right after its N-th completed write, so that a crash lands between two given writes.
# MOELOOP_CRASH_RANK=R limits that to the process whose torchrun RANK is R (no RANK: 0), so that one rank of the
# train step dies mid-save while the others go on; unset, every process counts to N.
CRASH_AFTER_WRITES = "MOELOOP_CRASH_AFTER_WRITES"
CRASH_RANK = "MOELOOP_CRASH_RANK"
_completed_writes = 0

# read(name, offset, length, size): length bytes of folder/name at offset, checking the object is size bytes long.
PartReader = Callable[[str, int, int, int], bytes]


def crash_point() -> None:
    global _completed_writes
    _completed_writes += 1
    chosen_rank = os.environ.get(CRASH_RANK)
    this_rank = chosen_rank is None or chosen_rank == os.environ.get("RANK", "0")
    if this_rank and os.environ.get(CRASH_AFTER_WRITES) == str(_completed_writes):
        os.kill(os.getpid(), signal.SIGKILL)


class Backend(Protocol):
    fs: Any

    def probe(self) -> None: ...

    def exists(self, relative: str) -> bool: ...

    def write(self, relative: str, data: bytes) -> None: ...

    def create(self, relative: str, data: bytes) -> bool: ...

    def put_objects(self, folder: str, sources: dict[str, Path | bytes]) -> dict[str, dict[str, Any]]: ...

    def part_reader(self, folder: str) -> PartReader: ...

    def compare_and_swap(self, relative: str, decide: Callable[[bytes | None], bytes | None]) -> None: ...

    def delete_if(self, relative: str, decide: Callable[[bytes], bool]) -> None: ...


class LocalBackend:
    """A run in a local folder."""

    def __init__(self, storage: RunStorage) -> None:
        self.storage = storage
        self.fs = fsspec.filesystem("file")

    def probe(self) -> None:
        pass

    def exists(self, relative: str) -> bool:
        return self.fs.exists(self.storage.full(relative))

    def write(self, relative: str, data: bytes) -> None:
        path = self.storage.full(relative)
        with local_temporary(path, data) as temporary:
            os.replace(temporary, path)

    def create(self, relative: str, data: bytes) -> bool:
        path = self.storage.full(relative)
        with local_temporary(path, data) as temporary:
            try:
                os.link(temporary, path)  # atomic, and fails if path exists
            except FileExistsError:
                return False
        return True

    def put_objects(self, folder: str, sources: dict[str, Path | bytes]) -> dict[str, dict[str, Any]]:
        files = {}
        for name, source in sources.items():
            target = self.storage.full(f"{folder}/{name}")
            with self.storage.errors(f"{folder}/{name}"):
                if isinstance(source, bytes):
                    with local_temporary(target, source) as temporary:
                        os.replace(temporary, target)
                    files[name] = bytes_entry(source)
                else:
                    files[name] = copy_hashed(source, Path(target))
            crash_point()
        return files

    def part_reader(self, folder: str) -> PartReader:
        storage = self.storage

        def read_local(name: str, offset: int, length: int, size: int) -> bytes:
            relative = f"{folder}/{name}"
            with storage.errors(relative), open(storage.full(relative), "rb") as file:
                found = os.fstat(file.fileno()).st_size
                data = os.pread(file.fileno(), length, offset)
            if found != size or len(data) != length:
                raise MoeloopError(
                    f"object does not match its {COMMIT} (size {found}, the manifest says {size}):"
                    f" {storage.display(relative)}"
                )
            return data

        return read_local

    def compare_and_swap(self, relative: str, decide: Callable[[bytes | None], bytes | None]) -> None:
        path = self.storage.full(relative)
        with self.storage.errors(relative), self._lock():
            current = Path(path).read_bytes() if os.path.exists(path) else None
            replacement = decide(current)
            if replacement is not None:
                with local_temporary(path, replacement) as temporary:
                    os.replace(temporary, path)
                crash_point()

    def delete_if(self, relative: str, decide: Callable[[bytes], bool]) -> None:
        path = self.storage.full(relative)
        with self.storage.errors(relative), self._lock():
            if os.path.exists(path) and decide(Path(path).read_bytes()):
                os.unlink(path)

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """An exclusive lock on the run's folder, for read-compare-write of LATEST between processes."""
        descriptor = os.open(self.storage.root, os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)


class S3Backend:
    """A run under s3://bucket/prefix: single objects through s3fs, bulk transfers and conditions through boto3."""

    def __init__(self, storage: RunStorage, location: s3.S3Location) -> None:
        self.storage = storage
        self.run_location = location
        self.fs = fsspec.filesystem("s3", use_listings_cache=False)

    def probe(self) -> None:
        s3.probe(self.run_location)

    def exists(self, relative: str) -> bool:
        # A listing, not a HEAD: S3 answers a HEAD of a missing key with 403 unless s3:ListBucket applies
        # to it, and a ListBucket scoped to the run's prefix (manifests/iam/) never applies to a HEAD.
        key = self._key(relative)
        listed = s3.client().list_objects_v2(Bucket=self.run_location.bucket, Prefix=key, MaxKeys=1)
        return any(entry["Key"] == key for entry in listed.get("Contents", []))

    def write(self, relative: str, data: bytes) -> None:
        if len(data) > PART_SIZE:
            s3.upload(self.location(posixpath.dirname(relative)), {posixpath.basename(relative): data})
        else:
            self.fs.pipe_file(self.storage.full(relative), data)

    def create(self, relative: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(self.storage.full(relative), data, mode="create")
        except FileExistsError:
            return False  # AWS names the failed condition, and s3fs turns it into this
        except OSError as error:
            if s3.is_precondition_failure(error):
                return False  # servers that do not name the condition (SeaweedFS)
            raise
        return True

    def put_objects(self, folder: str, sources: dict[str, Path | bytes]) -> dict[str, dict[str, Any]]:
        uploaded = s3.upload(self.location(folder), sources)
        crash_point()
        return {name: object_entry(u.size, u.part_size, u.part_digests) for name, u in uploaded.items()}

    def part_reader(self, folder: str) -> PartReader:
        location = self.location(folder)
        return lambda name, offset, length, size: s3.read_range(location, name, offset, length, size)

    def compare_and_swap(self, relative: str, decide: Callable[[bytes | None], bytes | None]) -> None:
        client, bucket, key, shown = s3.client(), self.run_location.bucket, self._key(relative), self.storage.display(relative)
        for _ in range(LATEST_ATTEMPTS):
            current, condition = None, {"IfNoneMatch": "*"}
            if self.storage.exists(relative):
                try:
                    response = client.get_object(Bucket=bucket, Key=key)
                    current, condition = response["Body"].read(), {"IfMatch": response["ETag"]}
                except s3.S3_ERRORS as error:
                    raise s3.translated(error, shown) from None
            replacement = decide(current)
            if replacement is None:
                return
            try:
                client.put_object(Bucket=bucket, Key=key, Body=replacement, **condition)
                crash_point()
                return
            except s3.S3_ERRORS as error:
                if not s3.is_precondition_failure(error) and s3.error_code(error) != "ConditionalRequestConflict":
                    raise s3.translated(error, shown) from None
        raise MoeloopError(f"{shown} kept changing: gave up after {LATEST_ATTEMPTS} attempts")

    def delete_if(self, relative: str, decide: Callable[[bytes], bool]) -> None:
        """DeleteObject with If-Match: the ETag of the object decide was shown (a changed one stays)."""
        client, bucket, key, shown = s3.client(), self.run_location.bucket, self._key(relative), self.storage.display(relative)
        try:
            response = client.get_object(Bucket=bucket, Key=key)
            if decide(response["Body"].read()):
                client.delete_object(Bucket=bucket, Key=key, IfMatch=response["ETag"])
        except s3.S3_ERRORS as error:
            if s3.error_code(error) not in ("NoSuchKey", "404", "ConditionalRequestConflict"):
                if not s3.is_precondition_failure(error):
                    raise s3.translated(error, shown) from None

    def location(self, folder: str) -> s3.S3Location:
        path = self.storage.full(folder) if folder else self.storage.root
        return s3.S3Location(self.run_location.bucket, path.split("/", 1)[1] if "/" in path else "")

    def _key(self, relative: str) -> str:
        return self.storage.full(relative).split("/", 1)[1]


@contextmanager
def local_temporary(path: str, data: bytes) -> Iterator[str]:
    """data in a fsynced temporary file beside path, removed afterwards unless it was renamed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = temporary_name(path)
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        yield temporary
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    remove_dead_temporaries(path)  # this write is whole: what a killed earlier writer of path left goes
