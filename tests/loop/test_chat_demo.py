"""configs/tiny-chat.yaml, the real inputs' path on the tiny model, run as a user runs it (`moeloop run`, vLLM
generating): a byte-level BPE tokenizer that start trains on the task's text, with ChatML's template and end token;
messages prompts from reasoning-gym's spell_backward, generated at start and committed as the run's prompt sets; the
task's own scorer on the responses decoded without special tokens. And it learns."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerFast

from moeloop.steps.config import load_config
from moeloop.steps.prompting import ChatSettings, end_token_ids, render_prompt
from moeloop.steps.rewards.reasoning_gym import score
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.prompt_set import prompt_count, read_prompts
from moeloop.steps.storage.run import RunStorage
from tests.conftest import REPO
from tests.processes import moeloop_cli

CONFIG = REPO / "configs" / "tiny-chat.yaml"
# The config's first 16 of its 20 iterations (`moeloop run --iterations`), for the suite's time. Measured at 16, on
# one core: pass@1 0.578 -> 0.720 over the last 4 (+0.140), the rollouts' reward 0.750 -> 0.907 (+0.157); again
# (2026-12-07, one core): pass@1 0.617 -> 0.763 (+0.146), the rollouts' reward 0.781 -> 0.913 (+0.131). Not fewer:
# at 12 the reward's gain was +0.117, too close to the 0.1 asked.
ITERATIONS = 16


@pytest.mark.usefixtures("private_cache")
def test_the_chat_demo_learns_on_its_own_tokenizer_and_template(tmp_path: Path) -> None:
    """Learning, measured on what a user of the task reads: greedy pass@1 on the 256 held-out words over the last 4
    evaluations, 0.1 above the SFT checkpoint's, and the rollouts' reward on prompts not seen before over the last 4
    iterations, 0.1 above the first iteration's (measured: ITERATIONS)."""
    config = load_config(CONFIG)
    runs = str(tmp_path / "runs")
    moeloop_cli("run", str(CONFIG), "--root", runs, "--iterations", str(ITERATIONS), "--no-progress", check=True)
    storage = RunStorage(f"{tmp_path / 'runs'}/{config.run_name}")

    checkpoint = fetch_checkpoint(storage, 0)
    tokenizer_model = json.loads((checkpoint / "tokenizer.json").read_text())["model"]
    assert tokenizer_model["type"] == "BPE" and len(tokenizer_model["vocab"]) == 300
    records = read_prompts(storage, "train", range(prompt_count(storage, "train")))
    assert {record["data_source"] for record in records.values()} == {"spell_backward"}
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    assert end_token_ids(checkpoint, tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    shards = config.rollout.num_shards
    rows = [row for k in range(shards) for row in read_table(storage, storage.rollout_shard(1, k, shards))]
    rewards = {row["sample_id"]: row["reward"] for row in read_table(storage, storage.rewards(1))}
    assert len(rows) == config.rollout.prompts_per_iteration * config.rollout.samples_per_prompt
    rendered = {row["prompt_id"]: row["prompt_text"] for row in rows}
    for prompt_id, prompt_text in rendered.items():
        assert prompt_text == render_prompt(tokenizer, records[prompt_id]["prompt"], ChatSettings())[0]
        assert prompt_text.startswith("<|im_start|>user\nSpell this word backward")
        assert prompt_text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    for row in rows:
        assert row["finish_reason"] in ("stop", "length") and "<|im_end|>" not in row["response_text"]
        expected = score(records[row["prompt_id"]], row["response_text"], answer_tag=None)
        assert rewards[row["sample_id"]] == pytest.approx(expected)

    metrics = [storage.read_json(storage.metrics(i)) for i in range(ITERATIONS + 1)]
    pass_at_1 = [m["eval_pass_at_1"] for m in metrics]
    rollout_reward = [m["reward_mean"] for m in metrics[1:]]
    print(f"eval_pass_at_1: {' '.join(f'{p:.3f}' for p in pass_at_1)}")
    print(f"rollouts' reward_mean: {' '.join(f'{r:.3f}' for r in rollout_reward)}")
    assert metrics[0]["eval_by_source"]["spell_backward"]["prompts"] == 256
    assert statistics.mean(pass_at_1[-4:]) >= pass_at_1[0] + 0.1
    assert statistics.mean(rollout_reward[-4:]) >= rollout_reward[0] + 0.1


def read_table(storage: RunStorage, relative: str) -> list[dict]:
    return pq.read_table(pa.BufferReader(storage.read_bytes(relative))).to_pylist()
