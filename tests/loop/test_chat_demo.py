"""configs/tiny-chat.yaml, the real inputs' path on the tiny model: a byte-level BPE tokenizer that start trains on the
task's text, with ChatML's template and end token; messages prompts from reasoning-gym's spell_backward, generated at
start and committed as the run's prompt sets; the task's own scorer on the responses decoded without special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerFast

from moeloop.steps.config import load_config, parse_config
from moeloop.steps.prompting import ChatSettings, end_token_ids, render_prompt
from moeloop.steps.rewards.reasoning_gym import score
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.prompt_set import prompt_count, read_prompts
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import run_uri
from tests.conftest import REPO, run_in_process


def test_the_chat_demo_runs_an_iteration_on_its_own_tokenizer_and_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One iteration, cut small, its steps in this process (the runner is test_loop.py's), transformers generating
    (vLLM's start would cost more than the loop at this size)."""
    monkeypatch.setenv("MOELOOP_CACHE", str(tmp_path / "cache"))
    data = load_config(REPO / "configs" / "tiny-chat.yaml").model_dump(mode="json")
    data["iterations"], data["model"]["sft"]["steps"], data["eval"]["max_prompts"] = 1, 3, 8
    data["rollout"].update(engine="transformers", prompts_per_iteration=8, samples_per_prompt=4)
    data["task"]["reasoning_gym"]["tasks"][0].update(train_size=200, eval_size=8)
    data["trainer"]["minibatch_size"] = 16
    config = parse_config(data, "tiny-chat")
    uri = run_uri(config, str(tmp_path / "runs"))

    run_in_process(config, uri)

    storage = RunStorage(uri)
    checkpoint = fetch_checkpoint(storage, 0)
    tokenizer_model = json.loads((checkpoint / "tokenizer.json").read_text())["model"]
    assert tokenizer_model["type"] == "BPE" and len(tokenizer_model["vocab"]) == 300
    records = read_prompts(storage, "train", range(prompt_count(storage, "train")))
    assert {record["data_source"] for record in records.values()} == {"spell_backward"}
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    assert end_token_ids(checkpoint, tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    shards = [storage.rollout_shard(1, k, 2) for k in range(2)]
    rows = [row for shard in shards for row in read_table(storage, shard)]
    rewards = {row["sample_id"]: row["reward"] for row in read_table(storage, storage.rewards(1))}
    assert len(rows) == 32
    for row in rows:
        record = records[row["prompt_id"]]
        assert row["prompt_text"] == render_prompt(tokenizer, record["prompt"], ChatSettings())[0]
        assert row["prompt_text"].startswith("<|im_start|>user\nSpell this word backward")
        assert row["prompt_text"].endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert row["finish_reason"] in ("stop", "length") and "<|im_end|>" not in row["response_text"]
        assert rewards[row["sample_id"]] == pytest.approx(score(record, row["response_text"], answer_tag=None))


def read_table(storage: RunStorage, relative: str) -> list[dict]:
    return pq.read_table(pa.BufferReader(storage.read_bytes(relative))).to_pylist()
