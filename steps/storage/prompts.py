"""Prompt sets as users have them, read into records: JSON Lines, Parquet (a file, a folder of shards or a glob) and
`datasets` save_to_disk folders, local or on S3; generated from reasoning-gym's tasks (task.source: reasoning_gym); or
rollout.environment's datasets (task.source: environment).
A bad file or row is a one-line error naming the file and the row.

A save_to_disk folder is read with pyarrow alone: its data-*.arrow files (listed in its state.json) are Arrow IPC
streams, so moeloop does not depend on `datasets` (which pulls pandas and multiprocess) to read what it wrote.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.config_task import EnvironmentConfig, TaskConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.inputs import decode_text, read_limited
from moeloop.steps.prompting import sft_answer, sft_episode
from moeloop.steps.storage import s3
from moeloop.steps.storage.prompt_set import SPLITS

# A prompt set's records, and where each came from (`file:line`, `file, row N`) for the errors that name it.
PromptRows = tuple[list[dict[str, Any]], list[str]]
MAX_PROMPT_FILE_BYTES = 2 << 30  # one file of a set, read whole: past this, a file is not prompts
GLOB = set("*?[")


def task_prompt_sets(config: MoeloopConfig) -> dict[str, PromptRows]:
    """The task's prompt sets by split ("train", "eval"): read from its files, generated from its reasoning-gym
    tasks, or rollout.environment's datasets."""
    task = config.task
    if task.source == "files":
        return {"train": read_prompt_set(task.train_prompts, task), "eval": read_prompt_set(task.eval_prompts, task)}
    if task.source == "environment":
        generated = environment_records(config.rollout.environment)
    else:
        from moeloop.steps.rewards.reasoning_gym import generate_records  # imports reasoning-gym: only when chosen

        generated = generate_records(task.reasoning_gym)
    sets = {}
    for split, records in zip(SPLITS, generated, strict=True):
        if not records:
            raise MoeloopError(f"{set_name(config, split)}: no prompts")
        wheres = [f"{set_name(config, split)}, record {index}" for index in range(len(records))]
        sets[split] = [check_record(r, where, task) for r, where in zip(records, wheres, strict=True)], wheres
    return sets


def environment_records(settings: EnvironmentConfig) -> list[list[dict[str, Any]]]:
    """The records of rollout.environment's train and eval datasets (steps/episodes/environment.py)."""
    from moeloop.steps.episodes.environment import cached_environment, dataset_records  # imports verifiers

    environment = cached_environment(settings.model_dump_json())  # the one ChatSettings.of renders with
    try:
        return [dataset_records(environment, split) for split in SPLITS]
    except Exception as error:  # the environment's own code builds its datasets: any failure is its
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise MoeloopError(f"rollout.environment {settings.name}: its datasets do not load ({reason})") from error


def set_name(config: MoeloopConfig, split: str) -> str:
    """How error lines name a split's prompt set."""
    if config.task.source == "environment":
        return f"rollout.environment {config.rollout.environment.name}'s {split} set"
    return getattr(config.task, f"{split}_prompts") or f"task.reasoning_gym's {split} set"


def read_prompt_set(location: str, task: TaskConfig) -> PromptRows:
    """Every record of the prompt set at location (a file, a folder or a glob), its columns renamed as
    task.columns says, each checked (`check_record`); and where each came from (`file:line`, `file, row N`)."""
    found = [located for file in set_files(location) for located in file_records(file, task)]
    if not found:
        raise MoeloopError(f"prompt set {location}: no prompts")
    return [record for _, record in found], [where for where, _ in found]


def filesystem(location: str) -> tuple[Any, str]:
    if location.startswith("s3://"):
        s3.parse_s3_uri(location.split("*", 1)[0])
        return fsspec.filesystem("s3", use_listings_cache=False), location.removeprefix("s3://")
    return fsspec.filesystem("file"), location.removeprefix("file://")


def set_files(location: str) -> list[str]:
    """The files of a prompt set, in order, as URIs or local paths: a file; a glob's matches; a save_to_disk folder's
    Arrow files; a folder's *.parquet and *.jsonl files."""
    fs, path = filesystem(location)
    scheme = "s3://" if location.startswith("s3://") else ""
    try:
        if GLOB & set(path):
            found = sorted(fs.glob(path))
            if not found:
                raise MoeloopError(f"prompt set {location}: the pattern matches no file")
            return [scheme + name for name in found]
        if not fs.isdir(path):
            return [location]
        names = {posixpath.basename(name.rstrip("/")) for name in fs.ls(path, detail=False)}
    except MoeloopError:
        raise
    except Exception as error:
        if (described := s3.describe(error, location)) is not None:
            raise described from None
        if isinstance(error, OSError) and error.strerror:
            raise MoeloopError(f"cannot read prompt set {location}: {error.strerror}") from None
        raise
    folder = location.rstrip("/")
    if "dataset_dict.json" in names:
        raise MoeloopError(f"prompt set {location} is a DatasetDict: name one split's folder (e.g. {folder}/train)")
    if "state.json" in names:
        return [f"{folder}/{name}" for name in saved_arrow_files(f"{folder}/state.json")]
    files = sorted(name for name in names if name.endswith((".parquet", ".jsonl")))
    if not files:
        raise MoeloopError(
            f"prompt set {location}: a folder with no *.parquet or *.jsonl file, and no save_to_disk dataset"
            " (state.json)"
        )
    return [f"{folder}/{name}" for name in files]


def saved_arrow_files(state_file: str) -> list[str]:
    """The Arrow files of a save_to_disk folder, in order, as its state.json lists them."""
    data = read_limited(state_file, "save_to_disk state", 1 << 20, fsspec.open, s3.describe)
    try:
        names = [entry["filename"] for entry in json.loads(decode_text(data, state_file))["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise MoeloopError(f"{state_file}: not a save_to_disk state (no _data_files list)") from None
    if not all(isinstance(name, str) and name.endswith(".arrow") and "/" not in name for name in names):
        raise MoeloopError(f"{state_file}: its _data_files name something else than .arrow files of its folder")
    return names


def file_records(file: str, task: TaskConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    data = read_limited(file, "prompt file", MAX_PROMPT_FILE_BYTES, fsspec.open, s3.describe)
    if file.endswith((".parquet", ".arrow")):
        for row, record in enumerate(table_rows(data, file, task.columns)):
            yield f"{file}, row {row}", check_record(record, f"{file}, row {row}", task)
        return
    for number, line in enumerate(decode_text(data, f"prompt file {file}").splitlines(), start=1):
        if line.strip():
            where = f"{file}:{number}"
            yield where, check_record(json_record(line, where, task.columns), where, task)


def table_rows(data: bytes, file: str, columns: dict[str, str]) -> list[dict[str, Any]]:
    """A Parquet file's rows (a save_to_disk Arrow stream's, for .arrow) as dicts, columns renamed."""
    try:
        if file.endswith(".arrow"):
            table = pa.ipc.open_stream(data).read_all()
        else:  # one thread: see steps/storage/experience.py:parse_table
            table = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
    except (pa.ArrowInvalid, OSError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        kind = "Arrow" if file.endswith(".arrow") else "Parquet"
        raise MoeloopError(f"not a readable {kind} file: {file} ({reason})") from None
    names = table.column_names
    for field, column in columns.items():
        if column not in names:
            raise MoeloopError(f"{file}: no column {column!r} (task.columns.{field}); its columns: {', '.join(names)}")
        if field in names:
            raise MoeloopError(f"{file} has a column {field!r} and task.columns reads {column!r} as {field!r}")
    renamed = {column: field for field, column in columns.items()}
    return table.rename_columns([renamed.get(name, name) for name in names]).to_pylist()


def json_record(line: str, where: str, columns: dict[str, str]) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise MoeloopError(f"{where}: not valid JSON") from None
    if not isinstance(record, dict):
        raise MoeloopError(f"{where}: not a JSON object")
    for field, column in columns.items():
        if column not in record:
            raise MoeloopError(f"{where}: no {column!r} (task.columns.{field})")
        if field in record:
            raise MoeloopError(f"{where} has {field!r} and task.columns reads {column!r} as {field!r}")
        record[field] = record.pop(column)
    return record


def check_record(record: dict[str, Any], where: str, task: TaskConfig) -> dict[str, Any]:
    """A record moeloop can use: a non-empty `prompt` string or list of {role, content} messages (a string only
    without task.system_prompt), a string `data_source` where there is one, every value JSON (the run commits it
    as JSON)."""
    prompt = record.get("prompt")
    if "prompt" not in record:
        raise MoeloopError(f"{where}: no 'prompt' (task.columns names the column that holds it)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise MoeloopError(f"{where}: an empty prompt")
        if task.system_prompt is not None:
            raise MoeloopError(f"{where}: a string prompt, and task.system_prompt needs messages prompts")
    elif not (isinstance(prompt, list) and prompt and all(is_message(m) for m in prompt)):
        raise MoeloopError(f"{where}: 'prompt' is neither a string nor a list of {{role, content}} string messages")
    if record.get("data_source") is not None and not isinstance(record["data_source"], str):
        raise MoeloopError(f"{where}: 'data_source' is {type(record['data_source']).__name__}, not a string")
    for key, value in record.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise MoeloopError(f"{where}: {key!r} holds {value!r}, not JSON (the run stores a record as JSON)") from None
    return record


def is_message(message: Any) -> bool:
    return isinstance(message, dict) and all(isinstance(message.get(key), str) for key in ("role", "content"))


def check_prompts(config: MoeloopConfig, train: list[dict[str, Any]], source: str) -> None:
    """What the config asks of the train prompts, checked before start writes anything."""
    wanted = config.rollout.prompts_per_iteration
    if len(train) < wanted:
        raise MoeloopError(f"{source} has {len(train)} prompts, fewer than rollout.prompts_per_iteration {wanted}")
    if config.model.checkpoint is None and config.model.sft.steps:
        for number, record in enumerate(train, start=1):
            if sft_answer(record) is None and sft_episode(record) is None:
                raise MoeloopError(
                    f"{source}: prompt {number} has no string 'answer' (nor reward_model.ground_truth, nor a reference"
                    " episode's 'completion' messages), which model.sft trains the tiny model on"
                )
