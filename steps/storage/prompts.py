"""Prompt files: JSON lines of {"prompt": str, ...}, from a local path or any fsspec URI, and the run's copies."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import fsspec

from steps.errors import MoeloopError
from steps.storage import s3
from steps.storage.run import RunStorage


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


def train_prompts(storage: RunStorage) -> list[dict[str, Any]]:
    return read_jsonl(
        storage.read_bytes(RunStorage.TRAIN_PROMPTS).decode().splitlines(), storage.display(RunStorage.TRAIN_PROMPTS)
    )


def eval_prompts(storage: RunStorage) -> list[dict[str, Any]]:
    return read_jsonl(
        storage.read_bytes(RunStorage.EVAL_PROMPTS).decode().splitlines(), storage.display(RunStorage.EVAL_PROMPTS)
    )
