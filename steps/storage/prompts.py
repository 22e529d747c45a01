"""Prompt files: JSON lines of {"prompt": str or [{"role", "content"}, ...], ...}, from a local path or any fsspec URI,
and the run's copies; or records generated from reasoning-gym's tasks (task.source: reasoning_gym)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import fsspec

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.config_task import TaskConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.inputs import decode_text, read_limited
from moeloop.steps.storage import s3
from moeloop.steps.storage.run import RunStorage

MAX_PROMPT_FILE_BYTES = 2 << 30  # read whole by start and by every rollout: past this, a file is not prompts


def read_jsonl(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise MoeloopError(f"{source}:{number}: not valid JSON") from None
        if not isinstance(record, dict) or not (isinstance(record.get("prompt"), str) or is_messages(record["prompt"])):
            raise MoeloopError(f"{source}:{number}: expected an object with a 'prompt': a string or a list of messages")
        records.append(record)
    if not records:
        raise MoeloopError(f"{source}: no prompts")
    return records


def is_messages(prompt: Any) -> bool:
    """A chat prompt: [{"role": str, "content": str}, ...]."""
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    )


def task_records(task: TaskConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The task's (train, eval) records: read from its prompt files, or generated from its reasoning-gym tasks."""
    if task.source == "reasoning_gym":
        from moeloop.steps.rewards.reasoning_gym import generate_records  # imports reasoning-gym: only when chosen

        return generate_records(task.reasoning_gym)
    return read_prompt_file(task.train_prompts), read_prompt_file(task.eval_prompts)


def train_source(task: TaskConfig) -> str:
    """How error lines name the train records' source."""
    return task.train_prompts or "task.reasoning_gym's train set"


def read_prompt_file(location: str) -> list[dict[str, Any]]:
    """Prompts from a local path or an s3:// URI; a missing, unreadable or non-UTF-8 file is a one-line error."""
    if location.startswith("s3://"):
        s3.parse_s3_uri(location)
    data = read_limited(location, "prompt file", MAX_PROMPT_FILE_BYTES, fsspec.open, s3.describe)
    return read_jsonl(decode_text(data, f"prompt file {location}").splitlines(), location)


def check_prompts(config: MoeloopConfig, train: list[dict[str, Any]], source: str) -> None:
    """What the config asks of the train prompts, checked before start writes anything."""
    wanted = config.rollout.prompts_per_iteration
    if len(train) < wanted:
        raise MoeloopError(
            f"{source} has {len(train)} prompts, fewer than rollout.prompts_per_iteration {wanted}"
        )
    if config.model.checkpoint is None and config.model.sft.steps:
        for number, record in enumerate(train, start=1):
            if not isinstance(record.get("answer"), str):
                raise MoeloopError(
                    f"{source}: prompt {number} has no string 'answer', which model.sft trains the tiny model on"
                )


def train_prompts(storage: RunStorage) -> list[dict[str, Any]]:
    return read_jsonl(
        storage.read_bytes(RunStorage.TRAIN_PROMPTS).decode().splitlines(), storage.display(RunStorage.TRAIN_PROMPTS)
    )


def eval_prompts(storage: RunStorage) -> list[dict[str, Any]]:
    return read_jsonl(
        storage.read_bytes(RunStorage.EVAL_PROMPTS).decode().splitlines(), storage.display(RunStorage.EVAL_PROMPTS)
    )
