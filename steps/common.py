"""What every step CLI shares: its arguments, opening the run, seeds, checkpoint cache and reports."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from steps.config import MoeloopConfig, parse_config
from steps.errors import MoeloopError
from steps.experience import read_rollout_shard
from steps.outputs import write_outputs
from steps.storage import RunStorage, local_entry, read_jsonl

# Single-object outputs, checked before a step skips its work because they exist.
ROLLOUT_SHARD_PATH = re.compile(r"experience/iter-(\d+)/rollout-(\d+)-of-(\d+)\.parquet")
METRICS_PATH = re.compile(r"metrics/iter-(\d+)\.json")


def step_parser(description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run", required=True, help="the run's folder URI (local path or s3://...)")
    parser.add_argument("--iteration", required=True, type=int)
    return parser


def open_run(run_uri: str) -> tuple[RunStorage, MoeloopConfig]:
    storage = RunStorage(run_uri)
    storage.require_run()
    config = parse_config(yaml.safe_load(storage.read_bytes(RunStorage.CONFIG)), storage.display(RunStorage.CONFIG))
    return storage, config


def open_iteration(run_uri: str, iteration: int, first: int = 1) -> tuple[RunStorage, MoeloopConfig]:
    """The run, checked to have the iteration (RL iterations start at 1; 0 is the SFT start)."""
    storage, config = open_run(run_uri)
    if not first <= iteration <= config.iterations:
        raise MoeloopError(f"iteration {iteration} is outside this run's iterations {first}..{config.iterations}")
    return storage, config


def already_committed(storage: RunStorage, relative: str) -> dict[str, str]:
    """The report of a step that finds its output committed and does nothing: re-runs are no-ops.

    Only if the output is this step's own: a rollout shard must hold rows of its iteration and shard, a
    metrics file its iteration (a committed folder was checked against its COMMIT when it was looked up).
    Anything else at the output path is foreign data: an error, neither used nor overwritten."""
    if shard := ROLLOUT_SHARD_PATH.fullmatch(relative):
        read_rollout_shard(storage, int(shard[1]), int(shard[2]), int(shard[3]))
    elif metrics := METRICS_PATH.fullmatch(relative):
        value = storage.read_json(relative)
        if not isinstance(value, dict) or value.get("iteration") != int(metrics[1]):
            raise MoeloopError(
                f"{storage.display(relative)} is not iteration {int(metrics[1])}'s metrics: foreign data,"
                " refusing to use or overwrite it"
            )
    return {"skipped": f"already committed: {storage.display(relative)}"}


def derive_seed(*parts: object) -> int:
    """A seed from names and numbers: the same inputs give the same samples."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def train_prompts(storage: RunStorage) -> list[dict[str, Any]]:
    return read_jsonl(
        storage.read_bytes(RunStorage.TRAIN_PROMPTS).decode().splitlines(), storage.display(RunStorage.TRAIN_PROMPTS)
    )


def eval_prompts(storage: RunStorage) -> list[dict[str, Any]]:
    return read_jsonl(
        storage.read_bytes(RunStorage.EVAL_PROMPTS).decode().splitlines(), storage.display(RunStorage.EVAL_PROMPTS)
    )


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


def write_report(storage: RunStorage, iteration: int, name: str, report: dict[str, Any]) -> None:
    """The step's report, stamped with its wall-clock span in Unix seconds: `ended_at` now, as the step writes
    it (before it commits its output), and `started_at` the report's `seconds` earlier. Evaluate reads the
    stamps of all steps, wherever they ran, to tell how long each waited on the others."""
    ended_at = time.time()
    report.update(started_at=round(ended_at - report["seconds"], 3), ended_at=round(ended_at, 3))
    storage.write_json(storage.report(iteration, name), report)


def quiet_libraries() -> None:
    """Step logs hold our lines, not library progress bars."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def print_json(report: dict[str, Any]) -> None:
    """Print the step's report as one JSON line; under Argo also write its scalars as output parameters."""
    print(json.dumps(report, sort_keys=True))
    write_outputs(report)
