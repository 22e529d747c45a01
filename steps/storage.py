"""The one storage layout of a run, read and written through fsspec.

    <run>/config.yaml                                  the run's config (written by start; a later submission
                                                       may change only iterations and placement)
    <run>/data/{train,eval}.jsonl                      the prompts, copied in by start
    <run>/checkpoints/iter-NNNNNN/                     HF checkpoint of the policy after iteration N
    <run>/checkpoints/iter-NNNNNN/COMMIT               written last: names every file with size and sha256
    <run>/experience/iter-NNNNNN/rollout-SSSSS-of-KKKKK.parquet   one rollout shard
    <run>/experience/iter-NNNNNN/rewards.parquet       one row per sample
    <run>/trainer/iter-NNNNNN/                         trainer state (weights, optimizer) + COMMIT
    <run>/reports/iter-NNNNNN/<step>.json              what each step measured
    <run>/metrics/iter-NNNNNN.json                     one JSON object per iteration
    <run>/LATEST                                       {"iteration": N, "checkpoint": "checkpoints/iter-NNNNNN"}

Paths are deterministic, so re-running a step rewrites the same objects. A single object becomes
visible whole (a local write goes to a temporary name and is renamed; an S3 put is atomic). A folder
of objects is visible only once its COMMIT marker exists, and the marker is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from steps.errors import MoeloopError

COMMIT = "COMMIT"
OPTIMIZER_FILE = "optimizer.pt"  # in trainer/iter-NNNNNN/, beside the HF files


def iteration_dir(iteration: int) -> str:
    return f"iter-{iteration:06d}"


@dataclass(frozen=True)
class RunStorage:
    """Paths and atomic reads/writes under one run's folder."""

    uri: str

    def __post_init__(self) -> None:
        fs, root = fsspec.core.url_to_fs(self.uri)
        object.__setattr__(self, "fs", fs)
        object.__setattr__(self, "root", root.rstrip("/"))

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
    def rollout_shard(iteration: int, shard: int, num_shards: int) -> str:
        return f"experience/{iteration_dir(iteration)}/rollout-{shard:05d}-of-{num_shards:05d}.parquet"

    @staticmethod
    def rewards(iteration: int) -> str:
        return f"experience/{iteration_dir(iteration)}/rewards.parquet"

    @staticmethod
    def reports(iteration: int) -> str:
        return f"reports/{iteration_dir(iteration)}"

    @classmethod
    def report(cls, iteration: int, step: str) -> str:
        return f"{cls.reports(iteration)}/{step}.json"

    @staticmethod
    def metrics(iteration: int) -> str:
        return f"metrics/{iteration_dir(iteration)}.json"

    # -- primitives ---------------------------------------------------------------------------
    def full(self, relative: str) -> str:
        if relative.startswith("/") or ".." in relative.split("/"):
            raise MoeloopError(f"refusing path outside the run: {relative!r}")
        return posixpath.join(self.root, relative)

    def exists(self, relative: str) -> bool:
        return self.fs.exists(self.full(relative))

    def read_bytes(self, relative: str) -> bytes:
        try:
            return self.fs.cat_file(self.full(relative))
        except FileNotFoundError:
            raise MoeloopError(f"missing object: {self.display(relative)}") from None

    def read_json(self, relative: str) -> Any:
        try:
            return json.loads(self.read_bytes(relative))
        except json.JSONDecodeError:
            raise MoeloopError(f"not valid JSON: {self.display(relative)}") from None

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write one object so that readers see either nothing or all of it."""
        path = self.full(relative)
        if isinstance(self.fs, LocalFileSystem):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temporary = f"{path}.tmp-{uuid.uuid4().hex}"
            with open(temporary, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        else:
            self.fs.pipe_file(path, data)

    def write_json(self, relative: str, value: Any) -> None:
        self.write_bytes(relative, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())

    def display(self, relative: str) -> str:
        return f"{self.uri.rstrip('/')}/{relative}"

    # -- committed folders --------------------------------------------------------------------
    def commit_folder(self, folder: str, local_dir: Path, extra: dict[str, Any] | None = None) -> None:
        """Upload every file of local_dir into folder, then write COMMIT naming them: the folder's commit point."""
        files: dict[str, dict[str, Any]] = {}
        for file in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            name = file.relative_to(local_dir).as_posix()
            data = file.read_bytes()
            self.write_bytes(f"{folder}/{name}", data)
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self.write_json(f"{folder}/{COMMIT}", {"files": files, **(extra or {})})

    def is_committed(self, folder: str) -> bool:
        return self.exists(f"{folder}/{COMMIT}")

    def fetch_folder(self, folder: str, local_dir: Path) -> dict[str, Any]:
        """Download a committed folder, verifying every file against its COMMIT; returns the COMMIT."""
        if not self.is_committed(folder):
            raise MoeloopError(f"not committed (no {COMMIT} marker): {self.display(folder)}")
        commit = self.read_json(f"{folder}/{COMMIT}")
        local_dir.mkdir(parents=True, exist_ok=True)
        for name, expected in commit["files"].items():
            data = self.read_bytes(f"{folder}/{name}")
            if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
                raise MoeloopError(f"object does not match its {COMMIT}: {self.display(folder)}/{name}")
            target = local_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return commit

    # -- the run ----------------------------------------------------------------------------------
    def require_run(self) -> None:
        if not self.exists(self.CONFIG):
            raise MoeloopError(f"run does not exist (no {self.CONFIG}): {self.uri}")

    def latest(self) -> dict[str, Any] | None:
        return self.read_json(self.LATEST) if self.exists(self.LATEST) else None

    def move_latest(self, iteration: int) -> None:
        folder = self.checkpoint(iteration)
        if not self.is_committed(folder):
            raise MoeloopError(f"refusing to point LATEST at an uncommitted checkpoint: {self.display(folder)}")
        current = self.latest()
        if current is not None and current["iteration"] > iteration:
            return  # never move LATEST backwards (a re-run of an old publish)
        self.write_json(self.LATEST, {"iteration": iteration, "checkpoint": folder})

    def list(self, folder: str) -> list[str]:
        try:
            return sorted(posixpath.basename(p) for p in self.fs.ls(self.full(folder), detail=False))
        except FileNotFoundError:
            return []


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
    try:
        with fsspec.open(location, "rt") as file:
            return read_jsonl(file.read().splitlines(), location)
    except FileNotFoundError:
        raise MoeloopError(f"prompt file not found: {location}") from None
