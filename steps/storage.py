"""The one storage layout of a run, and the commit protocol every step reads and writes it with.

    <run>/config.yaml                                  the run's config (written by start; a later submission
                                                       may change only iterations and placement)
    <run>/data/{train,eval}.jsonl                      the prompts, copied in by start
    <run>/reward-models/model-KK/                      reward.models[K], committed by start (HF files + COMMIT)
    <run>/checkpoints/iter-NNNNNN/                     HF checkpoint of the policy after iteration N
    <run>/checkpoints/iter-NNNNNN/COMMIT               written last: names every file with size and sha256
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
- A folder's data objects are written first, then its COMMIT manifest (each name with size and sha256),
  created only if absent (If-None-Match: * on S3, a hard link locally). Readers trust a folder only
  through its COMMIT and verify what they read against it. A COMMIT that does not match its objects is
  foreign data: an error, never overwritten.
- LATEST moves only to a committed checkpoint, by compare-and-swap, and never backwards.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import posixpath
import re
import signal
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from steps import s3
from steps.errors import MoeloopError

COMMIT = "COMMIT"
OPTIMIZER_FILE = "optimizer.pt"  # in trainer/iter-NNNNNN/, beside the HF files
CRITIC_DIR = "critic"  # PPO: the critic's HF files and optimizer.pt in trainer/iter-NNNNNN/critic/
TEMPORARY = ".tmp-"  # in the name of a local write in progress; never part of a committed name
SHA256 = re.compile(r"^[0-9a-f]{64}$")
COPY_CHUNK = 8 << 20
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


def file_entry(size: int, sha256: str) -> dict[str, Any]:
    return {"size": size, "sha256": sha256}


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
            local = {name: file_entry(p.stat().st_size, sha256_file(p)) for name, p in sources.items()}
            return self._same_or_foreign(folder, existing, {"files": local, **(extra or {})})
        return self.commit(folder, self.put_objects(folder, sources), extra)

    def put_objects(self, folder: str, sources: dict[str, Path | bytes]) -> dict[str, dict[str, Any]]:
        """The data objects of a commit, in parallel on S3: {name: {size, sha256}} for its manifest."""
        for name in sources:
            self.full(f"{folder}/{name}")  # refuses names that leave the folder
        if self.s3 is not None:
            uploaded = s3.upload(self._location(folder), sources)
            crash_point()
            return {name: file_entry(u.size, u.sha256) for name, u in uploaded.items()}
        files = {}
        for name, source in sources.items():
            target = self.full(f"{folder}/{name}")
            with self._errors(f"{folder}/{name}"):
                if isinstance(source, bytes):
                    with self._local_temporary(target, source) as temporary:
                        os.replace(temporary, target)
                    files[name] = file_entry(len(source), hashlib.sha256(source).hexdigest())
                else:
                    files[name] = copy_hashed(source, Path(target))
            crash_point()
        return files

    def commit(
        self, folder: str, files: dict[str, dict[str, Any]], extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Write folder/COMMIT naming files, only if there is none (If-None-Match: *). If another writer
        committed first with the same content, that is this commit; with other content, an error."""
        manifest = {"files": dict(sorted(files.items())), **(extra or {})}
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
        wanted = {n: e for n, e in manifest["files"].items() if n not in set(exclude)}
        local_dir.mkdir(parents=True, exist_ok=True)
        if self.s3 is not None:
            items = [s3.Download(name, entry["size"], local_dir / name) for name, entry in wanted.items()]
            digests = {name: digest for name, (digest, _) in s3.download(self._location(folder), items).items()}
        else:
            digests = {}
            for name in wanted:
                with self._errors(f"{folder}/{name}"):
                    digests[name] = copy_hashed(Path(self.full(f"{folder}/{name}")), local_dir / name)["sha256"]
        for name, entry in wanted.items():
            self._check_digest(folder, name, entry, digests[name])
        return manifest

    def read_committed(self, folder: str, manifest: dict[str, Any], names: Iterable[str]) -> dict[str, bytes]:
        """Objects of a committed folder, in memory, each verified against the manifest."""
        entries = {name: manifest["files"][name] for name in names}
        if self.s3 is not None:
            items = [s3.Download(name, entry["size"], None) for name, entry in entries.items()]
            fetched = s3.download(self._location(folder), items)  # hashed on the way in
            objects = {name: data for name, (_, data) in fetched.items()}
            digests = {name: digest for name, (digest, _) in fetched.items()}
        else:
            objects = {name: self.read_bytes(f"{folder}/{name}") for name in entries}
            digests = {name: hashlib.sha256(data).hexdigest() for name, data in objects.items()}
        for name, entry in entries.items():
            self._check_digest(folder, name, entry, digests[name], objects[name])
        return objects

    def _check_digest(
        self, folder: str, name: str, entry: dict[str, Any], digest: str, data: bytes | None = None
    ) -> None:
        if digest != entry["sha256"] or (data is not None and len(data) != entry["size"]):
            raise MoeloopError(f"object does not match its {COMMIT}: {self.display(folder)}/{name}")

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


def parse_manifest(raw: bytes, source: str) -> dict[str, Any]:
    """A COMMIT: {"files": {name: {"size": int, "sha256": hex}}, ...}; anything else is not ours."""
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        valid = isinstance(files, dict) and all(
            isinstance(name, str)
            and name
            and not name.startswith("/")
            and not {"", ".", ".."} & set(name.split("/"))
            and isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and entry["size"] >= 0
            and SHA256.match(str(entry.get("sha256", "")))
            for name, entry in files.items()
        )
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        valid = False
    if not valid:
        raise MoeloopError(f"not a valid {COMMIT} manifest: {source}")
    return manifest


def parse_latest(raw: bytes, source: str) -> dict[str, Any]:
    try:
        latest = json.loads(raw)
        if isinstance(latest.get("iteration"), int) and isinstance(latest.get("checkpoint"), str):
            return latest
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        pass
    raise MoeloopError(f"not a valid LATEST pointer: {source}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def copy_hashed(source: Path, target: Path) -> dict[str, Any]:
    """Copy a local file through a fsynced temporary name, hashing it on the way: {size, sha256}."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f"{target.name}{TEMPORARY}{uuid.uuid4().hex}")
    digest, size = hashlib.sha256(), 0
    try:
        with open(source, "rb") as reader, open(temporary, "wb") as writer:
            while chunk := reader.read(COPY_CHUNK):
                digest.update(chunk)
                writer.write(chunk)
                size += len(chunk)
            writer.flush()
            os.fsync(writer.fileno())
        os.replace(temporary, target)
    finally:
        if temporary.exists():
            temporary.unlink()
    return file_entry(size, digest.hexdigest())


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
