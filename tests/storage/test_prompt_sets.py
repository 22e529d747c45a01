"""Prompt sets as users have them (steps/storage/prompts.py) and as the run commits them (steps/storage/prompt_set.py):
JSON Lines, a Parquet file, a folder of Parquet shards, a glob and a save_to_disk folder (written by `datasets`
itself), locally and on SeaweedFS, read as the same verl-layout records; other layouts through task.columns; a bad
file or row named by file and row; the committed set read a row group at a time, each verified; a run started before
prompt sets were committed still reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeloop.steps.config_task import TaskConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.prompt_set import ROW_GROUP_ROWS, commit_prompt_set, prompt_count, read_prompts
from moeloop.steps.storage.prompts import read_prompt_set
from moeloop.steps.storage.run import RunStorage
from tests.seaweed import SeaweedS3


def verl_records(count: int) -> list[dict[str, Any]]:
    """verl's layout: messages, the ground truth under reward_model, a mixed data_source, extra_info."""
    return [
        {
            "prompt": [{"role": "user", "content": f"what is {i}+{i}?"}],
            "data_source": ("arith", "count", "words")[i % 3],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(count)
    ]


RECORDS = verl_records(30)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_shards(folder: Path, records: list[dict[str, Any]], count: int) -> Path:
    """records as `count` Parquet shards, as `datasets` writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-len(records) // count)
    for k in range(count):
        datasets.Dataset.from_list(records[k * size : (k + 1) * size]).to_parquet(
            folder / f"train-{k:05d}-of-{count:05d}.parquet"
        )
    return folder


def write_saved(folder: Path, records: list[dict[str, Any]]) -> Path:
    datasets.Dataset.from_list(records).save_to_disk(str(folder), num_shards=2)
    return folder


def location(tmp_path: Path, kind: str) -> str:
    """RECORDS written as kind; the location a config would name."""
    if kind == "jsonl":
        return str(write_jsonl(tmp_path / "train.jsonl", RECORDS))
    if kind == "parquet":
        return str(next(write_shards(tmp_path / "one", RECORDS, 1).iterdir()))
    if kind == "shards":
        return str(write_shards(tmp_path / "shards", RECORDS, 3))
    if kind == "glob":
        return str(write_shards(tmp_path / "shards", RECORDS, 3) / "train-*.parquet")
    return str(write_saved(tmp_path / "saved", RECORDS))


KINDS = ["jsonl", "parquet", "shards", "glob", "save_to_disk"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_reads_as_the_same_records(tmp_path: Path, kind: str) -> None:
    records, rows = read_prompt_set(location(tmp_path, kind), TaskConfig(train_prompts="t", eval_prompts="e"))

    assert records == RECORDS
    assert rows[0].endswith(":1" if kind == "jsonl" else ", row 0")
    if kind in ("shards", "glob"):  # each row named in its own shard
        assert rows[10].endswith("train-00001-of-00003.parquet, row 0")


def test_the_same_set_in_every_format_commits_the_same_prompt_set(tmp_path: Path) -> None:
    committed = []
    for kind in KINDS:
        storage = RunStorage(str(tmp_path / "runs" / kind))
        records, _ = read_prompt_set(location(tmp_path / kind, kind), TaskConfig(train_prompts="t", eval_prompts="e"))
        commit_prompt_set(storage, "train", records, {"source": "the same"})
        committed.append(Path(storage.root, storage.prompt_set("train"), "COMMIT").read_bytes())
    assert len(set(committed)) == 1


def test_sets_on_s3_read_as_local_ones(tmp_path: Path, seaweed: SeaweedS3, s3_environment: dict[str, str]) -> None:
    prefix = f"prompt-sets/{tmp_path.name}"
    for kind in ("shards", "save_to_disk"):
        folder = Path(location(tmp_path, kind))
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = f"{prefix}/{kind}/{path.relative_to(folder).as_posix()}"
            seaweed.client().put_object(Bucket=seaweed.bucket, Key=key, Body=path.read_bytes())
    task = TaskConfig(train_prompts="t", eval_prompts="e")
    base = f"s3://{seaweed.bucket}/{prefix}"

    for uri in (f"{base}/shards", f"{base}/shards/train-*.parquet", f"{base}/save_to_disk"):
        records, rows = read_prompt_set(uri, task)
        assert records == RECORDS and rows[0].startswith(f"s3://{seaweed.bucket}/{prefix}/"), uri
    with pytest.raises(MoeloopError, match="the pattern matches no file"):
        read_prompt_set(f"{base}/shards/test-*.parquet", task)


def test_another_layout_reads_through_the_column_map(tmp_path: Path) -> None:
    rows = [{"question": f"what is {i}?", "answer": str(i), "source": "mine"} for i in range(4)]
    path = tmp_path / "mine.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    task = TaskConfig(train_prompts="t", eval_prompts="e", columns={"prompt": "question", "data_source": "source"})

    records, _ = read_prompt_set(str(path), task)

    assert records[1] == {"prompt": "what is 1?", "answer": "1", "data_source": "mine"}
    lines = write_jsonl(tmp_path / "mine.jsonl", rows)
    assert read_prompt_set(str(lines), task)[0] == records
    with pytest.raises(MoeloopError, match=rf"^{path}: no column 'problem' \(task.columns.prompt\); its columns: "):
        read_prompt_set(str(path), TaskConfig(train_prompts="t", eval_prompts="e", columns={"prompt": "problem"}))


def bad_parquet(path: Path, rows: list[dict[str, Any]], schema: pa.Schema | None = None) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def state_naming(folder: Path, name: str) -> Path:
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"][0]["filename"] = name
    (folder / "state.json").write_text(json.dumps(state))
    return folder


BINARY = pa.schema([("prompt", pa.string()), ("blob", pa.binary())])


@pytest.mark.parametrize(
    ("make", "named"),
    [
        pytest.param(lambda p: write_jsonl(p / "a.jsonl", RECORDS[:2]).open("a").write("{nope\n") and p / "a.jsonl",
                     "a.jsonl:3: not valid JSON", id="not-json"),  # fmt: skip
        pytest.param(lambda p: write_jsonl(p / "a.jsonl", [*RECORDS[:1], ["a list"]]), "a.jsonl:2: not a JSON object",
                     id="not-an-object"),  # fmt: skip
        pytest.param(lambda p: write_jsonl(p / "a.jsonl", [{"question": "hi"}]), "a.jsonl:1: no 'prompt'",
                     id="no-prompt"),  # fmt: skip
        pytest.param(lambda p: bad_parquet(p / "a.parquet", [{"prompt": "hi"}, {"prompt": " "}]),
                     "a.parquet, row 1: an empty prompt", id="empty-prompt"),  # fmt: skip
        pytest.param(lambda p: write_jsonl(p / "a.jsonl", [{"prompt": []}]),
                     "a.jsonl:1: 'prompt' is neither a string nor a list of {{role, content}} string messages",
                     id="no-messages"),  # fmt: skip
        pytest.param(lambda p: write_jsonl(p / "a.jsonl", [{"prompt": [{"role": "user", "content": 3}]}]),
                     "a.jsonl:1: 'prompt' is neither", id="message-content"),  # fmt: skip
        pytest.param(lambda p: write_jsonl(p / "a.jsonl", [{"prompt": "hi", "data_source": 7}]),
                     "a.jsonl:1: 'data_source' is int, not a string", id="data-source"),  # fmt: skip
        pytest.param(lambda p: bad_parquet(p / "a.parquet", [{"prompt": "hi", "blob": b"\x00"}], BINARY),
                     "a.parquet, row 0: 'blob' holds b'\\x00', not JSON", id="not-json-value"),  # fmt: skip
        pytest.param(lambda p: (p / "a.parquet").write_bytes(b"PAR1 not really") and p / "a.parquet",
                     "not a readable Parquet file: {tmp}/a.parquet", id="not-parquet"),  # fmt: skip
        pytest.param(lambda p: (p / "empty").mkdir() or p / "empty",
                     "prompt set {tmp}/empty: a folder with no *.parquet or *.jsonl file", id="empty-folder"),  # fmt: skip
        pytest.param(lambda p: datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(
                     str(p / "dict")) or p / "dict", "is a DatasetDict: name one split's folder (e.g. {tmp}/dict/train)",
                     id="dataset-dict"),  # fmt: skip
        pytest.param(lambda p: write_jsonl(p / "a.jsonl", []), "prompt set {tmp}/a.jsonl: no prompts", id="none"),
        pytest.param(lambda p: state_naming(write_saved(p / "saved", RECORDS), "../a.arrow"),
                     "saved/state.json: its _data_files name something else than .arrow files of its folder",
                     id="state-outside-its-folder"),  # fmt: skip
    ],
)
def test_a_bad_file_or_row_is_one_line_naming_it(tmp_path: Path, make: Any, named: str) -> None:
    where = make(tmp_path)

    with pytest.raises(MoeloopError) as raised:
        read_prompt_set(str(where), TaskConfig(train_prompts="t", eval_prompts="e"))
    assert named.format(tmp=tmp_path) in str(raised.value) and "\n" not in str(raised.value)


def test_a_system_prompt_needs_messages(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [RECORDS[0], {"prompt": "12+30="}])
    task = TaskConfig(train_prompts="t", eval_prompts="e", system_prompt="be brief.")

    with pytest.raises(MoeloopError, match=r"a.jsonl:2: a string prompt, and task.system_prompt needs messages"):
        read_prompt_set(str(path), task)


def test_steps_read_only_the_row_groups_of_their_rows(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    records = verl_records(5 * ROW_GROUP_ROWS)
    commit_prompt_set(storage, "train", records, {})
    assert prompt_count(storage, "train") == len(records)
    wanted = [3, 2 * ROW_GROUP_ROWS + 5, 4 * ROW_GROUP_ROWS]
    assert read_prompts(storage, "train", wanted) == {i: records[i] for i in wanted}

    manifest = json.loads((tmp_path / "run/data/train/COMMIT").read_text())
    (name, shard), = manifest["shards"].items()
    offset, length, _ = shard["row_groups"][1]
    path = tmp_path / "run/data/train" / name
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0xFF  # damage row group 1 alone
    path.write_bytes(bytes(data))

    assert read_prompts(storage, "train", wanted) == {i: records[i] for i in wanted}  # row group 1 is never read
    with pytest.raises(MoeloopError, match=rf"object does not match its COMMIT \(bytes {offset}\.\.{offset + length}\)"):
        read_prompts(storage, "train", [ROW_GROUP_ROWS + 1])
    with pytest.raises(MoeloopError, match=rf"prompt {len(records)} is not in .*data/train \({len(records)} prompts\)"):
        read_prompts(storage, "train", [len(records)])


def test_a_prompt_set_is_committed_once(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    commit_prompt_set(storage, "eval", RECORDS, {"source": "s"})
    before = {p.name: p.read_bytes() for p in (tmp_path / "run/data/eval").iterdir()}

    commit_prompt_set(storage, "eval", RECORDS, {"source": "s"})  # a re-run of start: nothing changes
    with pytest.raises(MoeloopError, match="data/eval already holds other prompts"):
        commit_prompt_set(storage, "eval", RECORDS[:-1], {"source": "s"})
    assert {p.name: p.read_bytes() for p in (tmp_path / "run/data/eval").iterdir()} == before


def test_a_run_started_before_prompt_sets_reads_its_json_lines(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    write_jsonl(tmp_path / "run" / storage.prompt_lines("train"), RECORDS)

    assert prompt_count(storage, "train") == len(RECORDS)
    assert read_prompts(storage, "train", [7, 1]) == {1: RECORDS[1], 7: RECORDS[7]}
