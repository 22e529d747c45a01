"""The one storage layout of a run, and the commit protocol every step reads and writes it with.

RunStorage holds the layout (every path of a run), atomic single objects, committed folders and LATEST, over one
of two backends (steps/storage/backends.py): a local folder or s3://bucket/prefix. The tree and the protocol are
in README.md in this folder."""

from __future__ import annotations

import json
import os
import posixpath
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeloop.steps.config import MoeloopConfig, parse_config_text
from moeloop.steps.errors import MoeloopError
from moeloop.steps.inputs import check_location_text
from moeloop.steps.storage import s3
from moeloop.steps.storage.backends import Backend, LocalBackend, S3Backend, crash_point
from moeloop.steps.storage.manifest import (
    COMMIT,
    TEMPORARY,
    json_bytes,
    local_entry,
    manifest_of,
    object_entry,
    parse_latest,
    parse_manifest,
    part_digest,
    part_offsets,
)

CRITIC_DIR = "critic"  # PPO: the critic's trainer state in trainer/iter-NNNNNN/critic/ (steps/rl/checkpoint.py)


def iteration_dir(iteration: int) -> str:
    return f"iter-{iteration:06d}"


@dataclass(frozen=True)
class RunStorage:
    """Paths, atomic objects and committed folders under one run's folder: a local path or s3://bucket/prefix."""

    uri: str

    def __post_init__(self) -> None:
        try:
            check_location_text(self.uri, run=True)
        except ValueError as error:
            raise MoeloopError(f"the run's storage URI: {error}") from None
        backend: Backend
        if self.uri.startswith("s3://"):
            location = s3.parse_s3_uri(self.uri)
            root = f"{location.bucket}/{location.key}".rstrip("/")
            backend = S3Backend(self, location)
        elif "://" in self.uri and not self.uri.startswith("file://"):
            scheme = self.uri.split("://", 1)[0]
            raise MoeloopError(f"unsupported storage URI scheme {scheme!r} (use a local path or s3://bucket/prefix)")
        else:
            path = self.uri.removeprefix("file://")
            if not path.strip():
                raise MoeloopError("the run's storage URI is empty")
            if ".." in path.split("/"):
                raise MoeloopError(f"a storage URI must not contain '..' path segments: {self.uri}")
            root = os.path.abspath(path)
            backend = LocalBackend(self)
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "fs", backend.fs)
        object.__setattr__(self, "_probed", False)

    # -- the layout -------------------------------------------------------------------------
    CONFIG = "config.yaml"
    LATEST = "LATEST"
    MODEL_SOURCE = "data/model-source.json"

    @staticmethod
    def prompt_set(split: str) -> str:
        """The committed prompt set of split, train or eval (steps/storage/prompt_set.py)."""
        return f"data/{split}"

    @staticmethod
    def prompt_lines(split: str) -> str:
        """A run started before prompt sets were committed holds its prompts here, as JSON Lines."""
        return f"data/{split}.jsonl"

    @staticmethod
    def checkpoint(iteration: int) -> str:
        return f"checkpoints/{iteration_dir(iteration)}"

    @staticmethod
    def delta(iteration: int) -> str:
        return f"deltas/{iteration_dir(iteration)}"

    @staticmethod
    def trainer_state(iteration: int) -> str:
        return f"trainer/{iteration_dir(iteration)}"

    TRAINER_HEARTBEAT = "commands/trainer.json"

    @staticmethod
    def train_command(iteration: int) -> str:
        return f"commands/{iteration_dir(iteration)}-train.json"

    @staticmethod
    def rollout_command(iteration: int, shard: int) -> str:
        return f"commands/{iteration_dir(iteration)}-rollout-{shard:05d}.json"

    @staticmethod
    def engine_heartbeat(shard: int) -> str:
        return f"commands/rollout-engine-{shard:05d}.json"

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
        with self.errors(relative):
            return self.backend.exists(relative)

    def read_bytes(self, relative: str) -> bytes:
        with self.errors(relative):
            return self.fs.cat_file(self.full(relative))

    def read_json(self, relative: str) -> Any:
        try:
            return json.loads(self.read_bytes(relative))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise MoeloopError(f"not valid JSON: {self.display(relative)}") from None

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write one object so that readers see either nothing or all of it (and the old one until then)."""
        with self.errors(relative):
            self.backend.write(relative, data)
        crash_point()

    def create_bytes(self, relative: str, data: bytes) -> bool:
        """Create the object only if it does not exist (S3: If-None-Match: *); False if it already did."""
        with self.errors(relative):
            if not self.backend.create(relative, data):
                return False
        crash_point()
        return True

    def write_json(self, relative: str, value: Any) -> None:
        self.write_bytes(relative, json_bytes(value, self.display(relative)))

    def list(self, folder: str) -> list[str]:
        """Names of the objects directly in folder (a local write in progress is not one)."""
        with self.errors(folder):
            try:
                paths = self.fs.ls(self.full(folder), detail=False)
            except FileNotFoundError:
                return []
        return sorted(name for name in (posixpath.basename(p.rstrip("/")) for p in paths) if TEMPORARY not in name)

    def sizes(self, folder: str) -> dict[str, int]:
        """Every object under folder, recursively: {name relative to folder: size}."""
        base = self.full(folder)
        with self.errors(folder):
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
        return self.backend.put_objects(folder, sources)

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

    def read_verified_ranges(
        self, folder: str, manifest: dict[str, Any], ranges: list[tuple[str, int, int, str]]
    ) -> list[bytes]:
        """Byte ranges (object, offset, length, BLAKE3 hex digest) of a committed folder's objects, fetched in parallel
        and each checked against its digest (a prompt set's row groups, whose COMMIT lists theirs: prompt_set.py)."""
        read_piece = self.backend.part_reader(folder)
        sizes = {name: manifest["files"][name]["size"] for name, *_ in ranges}
        pending = [s3.pool().submit(read_piece, name, offset, length, sizes[name]) for name, offset, length, _ in ranges]
        pieces = [future.result() for future in pending]
        for (name, offset, length, digest), data in zip(ranges, pieces, strict=True):
            if part_digest(data).hex() != digest:
                shown = self.display(f"{folder}/{name}")
                raise MoeloopError(f"object does not match its {COMMIT} (bytes {offset}..{offset + length}): {shown}")
        return pieces

    def fetch_as_found(self, folder: str, local_dir: Path) -> dict[str, dict[str, Any]]:
        """Download every object under a folder that has no COMMIT to be verified against (a starting model
        uploaded from outside moeloop), each checked against its listed size: their entries, computed from
        the bytes that arrived. What these bytes are is trusted as found; steps/start.py records it."""
        files = {}
        for name, size in self.sizes(folder).items():
            relative = f"{folder}/{name}"
            target = local_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.errors(relative):
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
        read_piece = self.backend.part_reader(folder)
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
            return [part_digest(view[start : start + step]) for start in part_offsets(length, step)]

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
                    offsets, step = part_offsets(entry["size"], entry["part_size"]), entry["part_size"]
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

    # -- the run ----------------------------------------------------------------------------------
    def require_run(self) -> None:
        if not self.exists(self.CONFIG):
            raise MoeloopError(f"run does not exist (no {self.CONFIG}): {self.uri}")

    def latest(self) -> dict[str, Any] | None:
        return parse_latest(self.read_bytes(self.LATEST), self.display(self.LATEST)) if self.exists(self.LATEST) else None

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

        self.backend.compare_and_swap(self.LATEST, decide)

    # -- errors ----------------------------------------------------------------------------------
    @contextmanager
    def errors(self, relative: str) -> Iterator[None]:
        """Storage failures as one line naming the object; the first S3 call also checks the bucket."""
        if not self._probed:
            self.backend.probe()
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
            if isinstance(error, OSError) and error.strerror:  # no space left, read-only, not a directory, ...
                raise MoeloopError(f"{error.strerror}: {self.display(relative)}") from None
            raise


def open_run(run_uri: str) -> tuple[RunStorage, MoeloopConfig]:
    """The run's storage and the config its start committed; a one-line error where there is no run."""
    storage = RunStorage(run_uri)
    storage.require_run()
    return storage, parse_config_text(storage.read_bytes(RunStorage.CONFIG), storage.display(RunStorage.CONFIG))
