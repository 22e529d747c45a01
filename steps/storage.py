"""The one storage layout of a run, and the commit protocol every step reads and writes it with.

    <run>/config.yaml                                  the run's config (written by start; a later submission
                                                       may change only iterations and placement)
    <run>/data/{train,eval}.jsonl                      the prompts, copied in by start
    <run>/reward-models/model-KK/                      reward.models[K], committed by start (HF files + COMMIT)
    <run>/data/model-source.json                       model.checkpoint's files as start first found them,
                                                       when it has no COMMIT (sizes and digests)
    <run>/checkpoints/iter-NNNNNN/                     HF checkpoint of the policy after iteration N
    <run>/checkpoints/iter-NNNNNN/COMMIT               written last: names every file with its size and digest
    <run>/experience/iter-NNNNNN/rollout-SSSSS-of-KKKKK.parquet   one rollout shard
    <run>/experience/iter-NNNNNN/rewards.parquet       one row per sample
    <run>/experience/iter-NNNNNN/COMMIT                written last (by reward): names the shards and rewards
    <run>/critics/iter-NNNNNN/                         PPO: HF checkpoint of the critic after iteration N + COMMIT
    <run>/trainer/iter-NNNNNN/                         trainer state (weights, optimizer; PPO: critic/ too) + COMMIT
    <run>/reports/iter-NNNNNN/<step>.json              what each step measured
    <run>/metrics/iter-NNNNNN.json                     one JSON object per iteration
    <run>/LATEST                                       {"iteration": N, "checkpoint": "checkpoints/iter-NNNNNN"}

A run lives in a local folder or under s3://bucket/prefix. Single objects and listings go through fsspec
(s3fs for S3); bulk transfers and compare-and-swap through boto3 (steps/s3.py). The commit protocol:

- A single object becomes visible whole: a local write goes to a fsynced temporary name and is renamed;
  an S3 PUT is atomic. Objects over one part are a parallel multipart upload, also visible only whole.
- A folder's data objects are written first, then its COMMIT manifest (each name with its size and
  digest), created only if absent (If-None-Match: * on S3, a hard link locally). Readers trust a folder
  only through its COMMIT and verify every byte they read against it. A COMMIT that does not match its
  objects is foreign data: an error, never overwritten.
- An object's digest is blake3_of_parts: the BLAKE3 of the concatenated BLAKE3 digests of its parts of
  part_size bytes (the last one shorter; one empty part for an empty object), both named in the COMMIT.
  As strong as a hash of the whole, but each part is hashed by the thread that moves it, in parallel.
- LATEST moves only to a committed checkpoint, by compare-and-swap, and never backwards.
"""

from __future__ import annotations

import fcntl
import json
import os
import posixpath
import re
import signal
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from steps import s3
from steps.errors import MoeloopError

COMMIT = "COMMIT"
# The COMMIT's "format"; the first (no "format", a whole-object "sha256" per file) is refused by name.
MANIFEST_FORMAT = 2
OPTIMIZER_FILE = "optimizer.pt"  # in trainer/iter-NNNNNN/, beside the HF files
CRITIC_DIR = "critic"  # PPO: the critic's HF files and optimizer.pt in trainer/iter-NNNNNN/critic/
TEMPORARY = ".tmp-"  # in the name of a local write in progress; never part of a committed name
DIGEST = re.compile(r"^[0-9a-f]{64}$")
MIN_PART_SIZE = 1 << 20  # in a COMMIT: smaller parts would have a reader send a request per few bytes
LATEST_ATTEMPTS = 20  # compare-and-swap rounds before giving up on a LATEST that keeps changing
# Fault injection (tests/test_storage_faults.py): with MOELOOP_CRASH_AFTER_WRITES=N set, the process kills
# itself with SIGKILL right after its N-th completed write, so that a crash lands between two given writes.
CRASH_AFTER_WRITES = "MOELOOP_CRASH_AFTER_WRITES"
_completed_writes = 0


def crash_point() -> None:
    global _completed_writes
    _completed_writes += 1
    if os.environ.get(CRASH_AFTER_WRITES) == str(_completed_writes):
        os.kill(os.getpid(), signal.SIGKILL)


def iteration_dir(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def object_entry(size: int, part_size: int, part_digests: Iterable[bytes]) -> dict[str, Any]:
    """A COMMIT's entry for one object, from the digest of each of its parts, in order."""
    return {"size": size, "part_size": part_size, "blake3_of_parts": s3.part_digest(b"".join(part_digests)).hex()}


def bytes_entry(data: bytes) -> dict[str, Any]:
    step = s3.part_size(len(data))
    view = memoryview(data)
    digests = (s3.part_digest(view[offset : offset + step]) for offset in s3.part_offsets(len(data), step))
    return object_entry(len(data), step, digests)


@dataclass(frozen=True)
class RunStorage:
    """Paths, atomic objects and committed folders under one run's folder: a local path or s3://bucket/prefix."""

    uri: str

    def __post_init__(self) -> None:
        location = None
        if self.uri.startswith("s3://"):
            location = s3.parse_s3_uri(self.uri)
            fs = fsspec.filesystem("s3", use_listings_cache=False)
            root = f"{location.bucket}/{location.key}".rstrip("/")
        elif "://" in self.uri and not self.uri.startswith("file://"):
            scheme = self.uri.split("://", 1)[0]
            raise MoeloopError(f"unsupported storage URI scheme {scheme!r} (use a local path or s3://bucket/prefix)")
        else:
            path = self.uri.removeprefix("file://")
            if not path.strip():
                raise MoeloopError("the run's storage URI is empty")
            if ".." in path.split("/"):
                raise MoeloopError(f"a storage URI must not contain '..' path segments: {self.uri}")
            fs = fsspec.filesystem("file")
            root = os.path.abspath(path)
        object.__setattr__(self, "fs", fs)
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "s3", location)
        object.__setattr__(self, "_probed", location is None)

    # -- the layout -------------------------------------------------------------------------
    CONFIG = "config.yaml"
    LATEST = "LATEST"
    TRAIN_PROMPTS = "data/train.jsonl"
    EVAL_PROMPTS = "data/eval.jsonl"
    MODEL_SOURCE = "data/model-source.json"

    @staticmethod
    def checkpoint(iteration: int) -> str:
        return f"checkpoints/{iteration_dir(iteration)}"

    @staticmethod
    def trainer_state(iteration: int) -> str:
        return f"trainer/{iteration_dir(iteration)}"

    @staticmethod
    def reward_model(index: int) -> str:
        return f"reward-models/model-{index:02d}"

    @staticmethod
    def critic(iteration: int) -> str:
        return f"critics/{iteration_dir(iteration)}"

    @staticmethod
    def experience(iteration: int) -> str:
        return f"experience/{iteration_dir(iteration)}"

    @classmethod
    def rollout_shard(cls, iteration: int, shard: int, num_shards: int) -> str:
        return f"{cls.experience(iteration)}/rollout-{shard:05d}-of-{num_shards:05d}.parquet"

    @classmethod
    def rewards(cls, iteration: int) -> str:
        return f"{cls.experience(iteration)}/rewards.parquet"

    @staticmethod
    def reports(iteration: int) -> str:
        return f"reports/{iteration_dir(iteration)}"

    @classmethod
    def report(cls, iteration: int, step: str) -> str:
        return f"{cls.reports(iteration)}/{step}.json"

    @staticmethod
    def metrics(iteration: int) -> str:
        return f"metrics/{iteration_dir(iteration)}.json"

    # -- single objects: atomic --------------------------------------------------------------------
    def full(self, relative: str) -> str:
        if relative.startswith("/") or any(part in ("", ".", "..") for part in relative.split("/")):
            raise MoeloopError(f"refusing path outside the run: {relative!r}")
        return posixpath.join(self.root, relative)

    def display(self, relative: str) -> str:
        return f"{self.uri.rstrip('/')}/{relative}"

    def exists(self, relative: str) -> bool:
        with self._errors(relative):
            if self.s3 is None:
                return self.fs.exists(self.full(relative))
            # A listing, not a HEAD: S3 answers a HEAD of a missing key with 403 unless s3:ListBucket applies
            # to it, and a ListBucket scoped to the run's prefix (manifests/iam/) never applies to a HEAD.
            key = self.full(relative).split("/", 1)[1]
            listed = s3.client().list_objects_v2(Bucket=self.s3.bucket, Prefix=key, MaxKeys=1)
            return any(entry["Key"] == key for entry in listed.get("Contents", []))

    def read_bytes(self, relative: str) -> bytes:
        with self._errors(relative):
            return self.fs.cat_file(self.full(relative))

    def read_json(self, relative: str) -> Any:
        try:
            return json.loads(self.read_bytes(relative))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise MoeloopError(f"not valid JSON: {self.display(relative)}") from None

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write one object so that readers see either nothing or all of it (and the old one until then)."""
        path = self.full(relative)
        with self._errors(relative):
            if self.s3 is None:
                with self._local_temporary(path, data) as temporary:
                    os.replace(temporary, path)
            elif len(data) > s3.PART_SIZE:
                s3.upload(self._location(posixpath.dirname(relative)), {posixpath.basename(relative): data})
            else:
                self.fs.pipe_file(path, data)
        crash_point()

    def create_bytes(self, relative: str, data: bytes) -> bool:
        """Create the object only if it does not exist (S3: If-None-Match: *); False if it already did."""
        path = self.full(relative)
        with self._errors(relative):
            if self.s3 is None:
                with self._local_temporary(path, data) as temporary:
                    try:
                        os.link(temporary, path)  # atomic, and fails if path exists
                    except FileExistsError:
                        return False
            else:
                try:
                    self.fs.pipe_file(path, data, mode="create")
                except FileExistsError:
                    return False  # AWS names the failed condition, and s3fs turns it into this
                except OSError as error:
                    if s3.is_precondition_failure(error):
                        return False  # servers that do not name the condition (SeaweedFS)
                    raise
        crash_point()
        return True

    def write_json(self, relative: str, value: Any) -> None:
        self.write_bytes(relative, json_bytes(value))

    def list(self, folder: str) -> list[str]:
        """Names of the objects directly in folder (a local write in progress is not one)."""
        with self._errors(folder):
            try:
                paths = self.fs.ls(self.full(folder), detail=False)
            except FileNotFoundError:
                return []
        return sorted(name for name in (posixpath.basename(p.rstrip("/")) for p in paths) if TEMPORARY not in name)

    def sizes(self, folder: str) -> dict[str, int]:
        """Every object under folder, recursively: {name relative to folder: size}."""
        base = self.full(folder)
        with self._errors(folder):
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
        return {
            posixpath.relpath(path, base): int(info["size"])
            for path, info in found.items()
            if info.get("type") == "file" and TEMPORARY not in path
        }

    # -- committed folders ---------------------------------------------------------------------------
    def manifest(self, folder: str) -> dict[str, Any] | None:
        """The folder's COMMIT, or None while it has none. A COMMIT that is not a manifest, or that names an
        object that is missing or of another size, is foreign or damaged data: an error, never trusted."""
        marker = f"{folder}/{COMMIT}"
        try:
            raw = self.read_bytes(marker)
        except MoeloopError:
            if not self.exists(marker):
                return None
            raise
        manifest = parse_manifest(raw, self.display(marker))
        present = self.sizes(folder)
        for name, entry in manifest["files"].items():
            if present.get(name) != entry["size"]:
                found = "missing" if name not in present else f"size {present[name]}"
                raise MoeloopError(
                    f"{self.display(f'{folder}/{name}')} does not match its {COMMIT} ({found}, the manifest says"
                    f" size {entry['size']}): foreign or damaged data, refusing to use or overwrite it"
                )
        return manifest

    def is_committed(self, folder: str) -> bool:
        return self.manifest(folder) is not None

    def commit_folder(self, folder: str, local_dir: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Upload every file of local_dir into folder, then write COMMIT naming them: the folder's commit point.

        A folder that is already committed with the same files is left as it is; with other files it is
        foreign, and an error."""
        sources = {p.relative_to(local_dir).as_posix(): p for p in sorted(local_dir.rglob("*")) if p.is_file()}
        existing = self.manifest(folder)
        if existing is not None:
            local = {name: local_entry(p) for name, p in sources.items()}
            return self._same_or_foreign(folder, existing, manifest_of(local, extra))
        return self.commit(folder, self.put_objects(folder, sources), extra)

    def put_objects(self, folder: str, sources: dict[str, Path | bytes]) -> dict[str, dict[str, Any]]:
        """The data objects of a commit, in parallel on S3: {name: its entry} for its manifest."""
        for name in sources:
            self.full(f"{folder}/{name}")  # refuses names that leave the folder
        if self.s3 is not None:
            uploaded = s3.upload(self._location(folder), sources)
            crash_point()
            return {name: object_entry(u.size, u.part_size, u.part_digests) for name, u in uploaded.items()}
        files = {}
        for name, source in sources.items():
            target = self.full(f"{folder}/{name}")
            with self._errors(f"{folder}/{name}"):
                if isinstance(source, bytes):
                    with self._local_temporary(target, source) as temporary:
                        os.replace(temporary, target)
                    files[name] = bytes_entry(source)
                else:
                    files[name] = copy_hashed(source, Path(target))
            crash_point()
        return files

    def commit(
        self, folder: str, files: dict[str, dict[str, Any]], extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Write folder/COMMIT naming files, only if there is none (If-None-Match: *). If another writer
        committed first with the same content, that is this commit; with other content, an error."""
        manifest = manifest_of(files, extra)
        if self.create_bytes(f"{folder}/{COMMIT}", json_bytes(manifest)):
            return manifest
        existing = self.manifest(folder)
        if existing is None:
            raise MoeloopError(f"{COMMIT} vanished while committing: {self.display(folder)}")
        return self._same_or_foreign(folder, existing, manifest)

    def _same_or_foreign(self, folder: str, existing: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
        if existing != ours:
            raise MoeloopError(
                f"{self.display(folder)} is already committed with different content: foreign data (or a"
                " concurrent writer), refusing to overwrite it"
            )
        return existing

    def fetch_folder(self, folder: str, local_dir: Path, exclude: Iterable[str] = ()) -> dict[str, Any]:
        """Download a committed folder (less the names in exclude), verifying every file against its COMMIT."""
        manifest = self.manifest(folder)
        if manifest is None:
            raise MoeloopError(f"not committed (no {COMMIT} marker): {self.display(folder)}")
        self.fetch_files(folder, {n: e for n, e in manifest["files"].items() if n not in set(exclude)}, local_dir)
        return manifest

    def fetch_files(self, folder: str, files: dict[str, dict[str, Any]], local_dir: Path) -> None:
        """Download the named files of folder into local_dir, each verified against its entry in files."""
        self._read_verified(folder, files, local_dir)

    def read_committed(self, folder: str, manifest: dict[str, Any], names: Iterable[str]) -> dict[str, bytes]:
        """Objects of a committed folder, in memory, each verified against the manifest."""
        return self._read_verified(folder, {name: manifest["files"][name] for name in names}, None)

    def fetch_as_found(self, folder: str, local_dir: Path) -> dict[str, dict[str, Any]]:
        """Download every object under a folder that has no COMMIT to be verified against (a starting model
        uploaded from outside moeloop), each checked against its listed size: their entries, computed from
        the bytes that arrived. What these bytes are is trusted as found; steps/start.py records it."""
        files = {}
        for name, size in self.sizes(folder).items():
            relative = f"{folder}/{name}"
            target = local_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with self._errors(relative):
                self.fs.get_file(self.full(relative), str(target))
            files[name] = local_entry(target)
            if files[name]["size"] != size:
                raise MoeloopError(
                    f"{self.display(relative)} arrived with {files[name]['size']} bytes, the listing says {size}"
                )
        return files

    def _read_verified(
        self, folder: str, entries: dict[str, dict[str, Any]], local_dir: Path | None
    ) -> dict[str, bytes]:
        """Every read of committed objects, all fetched in parallel, each piece hashed part by part by the
        thread that fetched it; this thread collects the part digests in order, at most s3.WINDOW pieces
        behind. An object whose digest differs from the manifest's is an error naming it, never returned.

        Into files under local_dir, the pieces are single parts (ranged GETs on S3), each written at its
        offset. Into memory, the piece is the whole object, one GET: assembling parts into one buffer would
        cost a copy and a second set of page faults, more CPU than the parallel parts save on busy cores.
        """
        read_piece = self._part_reader(folder)
        objects: dict[str, bytes] = {}
        files: dict[str, int] = {}  # name -> its open file under local_dir, closed once its last part is in
        digests: dict[str, list[bytes]] = {}
        pending: deque[tuple[str, Future, bool]] = deque()  # (name, a piece's part digests, whether the last)

        def fetch(name: str, offset: int, length: int) -> list[bytes]:
            size, step = entries[name]["size"], entries[name]["part_size"]
            data = read_piece(name, offset, length, size)
            if name in files:
                os.pwrite(files[name], data, offset)
            else:
                objects[name] = data
            view = memoryview(data)
            return [s3.part_digest(view[start : start + step]) for start in s3.part_offsets(length, step)]

        def collect_oldest() -> None:
            name, future, last = pending.popleft()
            digests[name] += future.result()
            if last:
                if name in files:
                    os.close(files.pop(name))
                entry = entries[name]
                if object_entry(entry["size"], entry["part_size"], digests[name]) != entry:
                    objects.pop(name, None)
                    raise MoeloopError(f"object does not match its {COMMIT}: {self.display(folder)}/{name}")

        try:
            for name, entry in entries.items():
                digests[name] = []
                if local_dir is None:
                    offsets, step = range(1), max(entry["size"], 1)  # the whole object in one piece
                else:
                    target = local_dir / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    files[name] = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    offsets, step = s3.part_offsets(entry["size"], entry["part_size"]), entry["part_size"]
                for offset in offsets:
                    while len(pending) >= s3.WINDOW:
                        collect_oldest()
                    length = min(step, entry["size"] - offset)
                    pending.append((name, s3.pool().submit(fetch, name, offset, length), offset == offsets[-1]))
            while pending:
                collect_oldest()
        finally:
            for _, future, _ in pending:
                future.cancel()
            for _, future, _ in pending:
                if not future.cancelled():
                    future.exception()  # a part still running must end before its file is closed
            for descriptor in files.values():
                os.close(descriptor)
        return objects

    def _part_reader(self, folder: str) -> Callable[[str, int, int, int], bytes]:
        """read(name, offset, length, size): length bytes of folder/name at offset, checking that the object
        is size bytes long (a ranged GET on S3, a pread locally)."""
        if self.s3 is not None:
            location = self._location(folder)
            return lambda name, offset, length, size: s3.read_range(location, name, offset, length, size)

        def read_local(name: str, offset: int, length: int, size: int) -> bytes:
            relative = f"{folder}/{name}"
            with self._errors(relative), open(self.full(relative), "rb") as file:
                found = os.fstat(file.fileno()).st_size
                data = os.pread(file.fileno(), length, offset)
            if found != size or len(data) != length:
                raise MoeloopError(
                    f"object does not match its {COMMIT} (size {found}, the manifest says {size}):"
                    f" {self.display(relative)}"
                )
            return data

        return read_local

    # -- the run ----------------------------------------------------------------------------------
    def require_run(self) -> None:
        if not self.exists(self.CONFIG):
            raise MoeloopError(f"run does not exist (no {self.CONFIG}): {self.uri}")

    def latest(self) -> dict[str, Any] | None:
        return (
            parse_latest(self.read_bytes(self.LATEST), self.display(self.LATEST)) if self.exists(self.LATEST) else None
        )

    def move_latest(self, iteration: int) -> None:
        """Point LATEST at a committed checkpoint. It never moves backwards, even with concurrent publishers:
        the write is a compare-and-swap (S3: If-Match on the ETag read, If-None-Match: * for the first)."""
        folder = self.checkpoint(iteration)
        if not self.is_committed(folder):
            raise MoeloopError(f"refusing to point LATEST at an uncommitted checkpoint: {self.display(folder)}")
        wanted = json_bytes({"iteration": iteration, "checkpoint": folder})

        def decide(current: bytes | None) -> bytes | None:
            if current is not None and parse_latest(current, self.display(self.LATEST))["iteration"] >= iteration:
                return None  # a re-run of an older (or the same) publish
            return wanted

        self._compare_and_swap(self.LATEST, decide)

    def _compare_and_swap(self, relative: str, decide: Callable[[bytes | None], bytes | None]) -> None:
        path = self.full(relative)
        if self.s3 is None:
            with self._errors(relative), self._local_lock():
                current = Path(path).read_bytes() if os.path.exists(path) else None
                replacement = decide(current)
                if replacement is not None:
                    with self._local_temporary(path, replacement) as temporary:
                        os.replace(temporary, path)
                    crash_point()
            return
        client, bucket, key = s3.client(), self.s3.bucket, path.split("/", 1)[1]
        for _ in range(LATEST_ATTEMPTS):
            current, condition = None, {"IfNoneMatch": "*"}
            if self.exists(relative):
                try:
                    response = client.get_object(Bucket=bucket, Key=key)
                    current, condition = response["Body"].read(), {"IfMatch": response["ETag"]}
                except s3.S3_ERRORS as error:
                    raise s3.translated(error, self.display(relative)) from None
            replacement = decide(current)
            if replacement is None:
                return
            try:
                client.put_object(Bucket=bucket, Key=key, Body=replacement, **condition)
                crash_point()
                return
            except s3.S3_ERRORS as error:
                if not s3.is_precondition_failure(error) and s3.error_code(error) != "ConditionalRequestConflict":
                    raise s3.translated(error, self.display(relative)) from None
        raise MoeloopError(f"{self.display(relative)} kept changing: gave up after {LATEST_ATTEMPTS} attempts")

    # -- backends -----------------------------------------------------------------------------------
    def _location(self, folder: str) -> s3.S3Location:
        path = self.full(folder) if folder else self.root
        return s3.S3Location(self.s3.bucket, path.split("/", 1)[1] if "/" in path else "")

    @contextmanager
    def _errors(self, relative: str) -> Iterator[None]:
        """Storage failures as one line naming the object; the first S3 call also checks the bucket."""
        if not self._probed:
            s3.probe(self.s3)
            object.__setattr__(self, "_probed", True)
        try:
            yield
        except MoeloopError:
            raise
        except Exception as error:
            described = s3.describe(error, self.display(relative))
            if described is not None:
                raise described from None
            if isinstance(error, FileNotFoundError):
                raise MoeloopError(f"missing object: {self.display(relative)}") from None
            if isinstance(error, PermissionError):
                raise MoeloopError(f"permission denied: {self.display(relative)}") from None
            raise

    @contextmanager
    def _local_temporary(self, path: str, data: bytes) -> Iterator[str]:
        """data in a fsynced temporary file beside path, removed afterwards unless it was renamed."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}{TEMPORARY}{uuid.uuid4().hex}"
        try:
            with open(temporary, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            yield temporary
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)

    @contextmanager
    def _local_lock(self) -> Iterator[None]:
        """An exclusive lock on the run's folder, for read-compare-write of LATEST between processes."""
        descriptor = os.open(self.root, os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)


def json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


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


def local_entry(path: Path) -> dict[str, Any]:
    """The COMMIT entry of a local file (to compare a local copy or a re-run's files with a manifest)."""
    size = path.stat().st_size
    step = s3.part_size(size)
    with open(path, "rb") as file:
        digests = [s3.part_digest(file.read(step)) for _ in s3.part_offsets(size, step)]
    return object_entry(size, step, digests)


def copy_hashed(source: Path, target: Path) -> dict[str, Any]:
    """Copy a local file through a fsynced temporary name, hashing its parts on the way: its COMMIT entry."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f"{target.name}{TEMPORARY}{uuid.uuid4().hex}")
    size = source.stat().st_size
    step = s3.part_size(size)
    digests = []
    try:
        with open(source, "rb") as reader, open(temporary, "wb") as writer:
            for offset in s3.part_offsets(size, step):
                chunk = reader.read(step)
                if len(chunk) != min(step, size - offset):
                    raise MoeloopError(f"{source} changed while it was being copied")
                digests.append(s3.part_digest(chunk))
                writer.write(chunk)
            writer.flush()
            os.fsync(writer.fileno())
        os.replace(temporary, target)
    finally:
        if temporary.exists():
            temporary.unlink()
    return object_entry(size, step, digests)


def read_jsonl(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise MoeloopError(f"{source}:{number}: not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise MoeloopError(f"{source}:{number}: expected an object with a string 'prompt'")
        records.append(record)
    if not records:
        raise MoeloopError(f"{source}: no prompts")
    return records


def read_prompt_file(location: str) -> list[dict[str, Any]]:
    """Prompts from a local path or any fsspec URI; a missing file is a one-line error."""
    if location.startswith("s3://"):
        s3.parse_s3_uri(location)
    try:
        with fsspec.open(location, "rt") as file:
            return read_jsonl(file.read().splitlines(), location)
    except FileNotFoundError:
        raise MoeloopError(f"prompt file not found: {location}") from None
    except MoeloopError:
        raise
    except Exception as error:
        described = s3.describe(error, location)
        if described is None:
            raise
        raise described from None
