"""What every step CLI shares: its arguments, opening the run, seeds, checkpoint cache and reports."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from steps.config import MoeloopConfig, parse_config
from steps.errors import MoeloopError
from steps.storage import RunStorage, read_jsonl


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
    """The report of a step that finds its output committed and does nothing: re-runs are no-ops."""
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
    """A committed checkpoint as a local folder, cached by checkpoint id (run, iteration, COMMIT digest)."""
    folder = storage.checkpoint(iteration)
    if not storage.is_committed(folder):
        raise MoeloopError(f"checkpoint of iteration {iteration} is not committed: {storage.display(folder)}")
    commit_digest = hashlib.sha256(storage.read_bytes(f"{folder}/COMMIT")).hexdigest()[:16]
    run_digest = hashlib.sha256(storage.uri.encode()).hexdigest()[:16]
    local = cache_root() / run_digest / f"{Path(folder).name}-{commit_digest}"
    if local.exists():
        return local
    cache_root().mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_root()))
    try:
        storage.fetch_folder(folder, staging)
        local.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, local)
    except OSError:
        if not local.exists():  # not a concurrent fetch of the same checkpoint that won the rename
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local


@contextmanager
def local_scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="moeloop-") as directory:
        yield Path(directory)


def write_report(storage: RunStorage, iteration: int, name: str, report: dict[str, Any]) -> None:
    storage.write_json(storage.report(iteration, name), report)


def quiet_libraries() -> None:
    """Step logs hold our lines, not library progress bars."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def print_json(value: dict[str, Any]) -> None:
    print(json.dumps(value, sort_keys=True))
