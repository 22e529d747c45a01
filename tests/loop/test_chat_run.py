"""A user's own model and data through the loop: a chat checkpoint built here (tests/chat_checkpoints.py: Qwen3-style
template and end tokens), a verl-layout Parquet set on SeaweedFS (messages, reward_model.ground_truth, a mixed
data_source, extra_info) and a reward of this file's reading the ground truth. Two iterations, every step called
in-process (conftest.py:run_in_process; their CLIs are the same functions): the prompts reach the engine rendered
by the checkpoint's template with the system prompt and template switch of the config, the reward sees the whole
record and the response without special tokens, the overlong penalty is added, and the same set as a save_to_disk
folder and as JSON Lines commits the same prompt set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeloop.steps.config import MoeloopConfig, parse_config
from moeloop.steps.engines.engine import FINISH_REASONS
from moeloop.steps.prompting import end_token_ids
from moeloop.steps.rl.overlong import overlong_penalty
from moeloop.steps.start import start
from moeloop.steps.storage.prompt_set import read_prompts
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import run_uri
from tests.chat_checkpoints import QWEN3, chat_checkpoint, chat_tokenizer
from tests.conftest import run_in_process
from tests.seaweed import SeaweedS3
from tests.storage.test_prompt_sets import verl_records, write_jsonl

SYSTEM = "answer with digits."
LONG = [5, 11]  # prompts past rollout.max_prompt_tokens: dropped at start


def ground_truth_reward(record: dict[str, Any], response: str) -> float:
    """The share of the response's characters that are the ground truth's digits, a bonus for one data_source."""
    assert "<|im_end|>" not in response and "<|endoftext|>" not in response
    truth = record["reward_model"]["ground_truth"]
    hits = sum(character in truth for character in response) / max(len(response), 1)
    return hits + 0.5 * (record["data_source"] == "arith")


def user_records(count: int) -> list[dict[str, Any]]:
    records = verl_records(count)
    for index in LONG:
        records[index]["prompt"][0]["content"] += " and then?" * 20
    return records


def chat_config(tmp_path: Path, train_prompts: str, eval_prompts: str) -> MoeloopConfig:
    data = {
        "run_name": "chat",
        "iterations": 2,
        "model": {"checkpoint": str(tmp_path / "checkpoint")},
        "task": {"train_prompts": train_prompts, "eval_prompts": eval_prompts, "system_prompt": SYSTEM},
        "rollout": {
            "engine": "transformers", "prompts_per_iteration": 4, "samples_per_prompt": 4, "num_shards": 2,
            "max_new_tokens": 12, "stop": ["0"], "chat_template_kwargs": {"enable_thinking": False},
            "max_prompt_tokens": 100,
        },  # fmt: skip
        "reward": {"functions": [{"path": "tests.loop.test_chat_run:ground_truth_reward"}]},
        "algorithm": {"overlong": {"mode": "penalty", "buffer_tokens": 4}},
        "trainer": {"minibatch_size": 8},
        "eval": {"max_prompts": 6},
    }
    return parse_config(data, "test")


@pytest.fixture
def sets_on_s3(tmp_path: Path, seaweed: SeaweedS3, s3_run_root: str) -> tuple[str, str]:
    """The verl-layout train set as two Parquet shards and the eval set as one file, on SeaweedFS."""
    chat_checkpoint(QWEN3, tmp_path / "checkpoint")
    train, evaluation = user_records(24), verl_records(6)
    prefix = s3_run_root.removeprefix(f"s3://{seaweed.bucket}/")
    for key, records in (("train/part-0.parquet", train[:12]), ("train/part-1.parquet", train[12:]),
                         ("eval.parquet", evaluation)):  # fmt: skip
        datasets.Dataset.from_list(records).to_parquet(tmp_path / "part.parquet")
        body = (tmp_path / "part.parquet").read_bytes()
        seaweed.client().put_object(Bucket=seaweed.bucket, Key=f"{prefix}/data/{key}", Body=body)
    return f"{s3_run_root}/data/train", f"{s3_run_root}/data/eval.parquet"


def test_a_verl_parquet_set_on_s3_runs_two_iterations(tmp_path: Path, sets_on_s3: tuple[str, str]) -> None:
    config = chat_config(tmp_path, *sets_on_s3)
    uri = run_uri(config, sets_on_s3[0].rsplit("/data/", 1)[0] + "/runs")

    run_in_process(config, uri)

    storage = RunStorage(uri)
    report = storage.read_json(storage.report(0, "start"))
    assert (report["train_prompts"], report["dropped_train_prompts"]) == (22, 2)
    kept = [record for index, record in enumerate(user_records(24)) if index not in LONG]
    assert list(read_prompts(storage, "train", range(22)).values()) == kept
    tokenizer = chat_tokenizer(QWEN3)
    ends = end_token_ids(tmp_path / "checkpoint", tokenizer)
    for iteration in (1, 2):
        rows = [row for k in range(2) for row in read_table(storage, storage.rollout_shard(iteration, k, 2))]
        rewards = {row["sample_id"]: row["reward"] for row in read_table(storage, storage.rewards(iteration))}
        for row in rows:
            record = kept[row["prompt_id"]]
            messages = [{"role": "system", "content": SYSTEM}, *record["prompt"]]
            expected = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, enable_thinking=False
            )["input_ids"]
            assert row["prompt_token_ids"] == expected and row["prompt_text"].endswith("<think>\n\n</think>\n\n")
            assert row["finish_reason"] in FINISH_REASONS
            assert (row["response_token_ids"][-1] in ends) == (row["finish_reason"] == "stop")
            assert row["response_text"] == tokenizer.decode(row["response_token_ids"], skip_special_tokens=True)
            penalty = overlong_penalty(len(row["response_token_ids"]), 12, config.algorithm.overlong)
            value = ground_truth_reward(record, row["response_text"]) + penalty
            assert rewards[row["sample_id"]] == pytest.approx(value, abs=1e-6)
        metrics = storage.read_json(storage.metrics(iteration))
        assert metrics["truncated_fraction"] is not None and metrics["reward_mean"] is not None


def read_table(storage: RunStorage, relative: str) -> list[dict[str, Any]]:
    return pq.read_table(pa.BufferReader(storage.read_bytes(relative))).to_pylist()


def test_the_same_set_as_save_to_disk_and_json_lines_commits_the_same_prompt_set(
    tmp_path: Path, sets_on_s3: tuple[str, str], run_root: Path
) -> None:
    records = user_records(24)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(saved), num_shards=3)
    lines = write_jsonl(tmp_path / "train.jsonl", records)
    committed = []
    for name, source in (("s3", sets_on_s3[0]), ("saved", str(saved)), ("lines", str(lines))):
        config = chat_config(tmp_path, source, sets_on_s3[1])
        start(str(run_root / name), config)
        manifest = json.loads((run_root / name / "data/train/COMMIT").read_text())
        assert manifest.pop("source") == source
        committed.append(manifest)
    assert committed[0] == committed[1] == committed[2] and committed[0]["rows"] == 22
