"""Episodes through the loop: a verifiers tool environment (tests/environments/calc_env.py) as the task, a user's chat
checkpoint (tests/chat_checkpoints.py: Qwen3-style tool calling and its response template), every step called
in-process (conftest.py:run_in_process). start commits the environment's datasets as the prompt sets; the rollouts are
episodes, the experience carries their masks and turns, the reward is the rubric's with its weight, the trainer trains
on the policy's tokens only, evaluate scores episodes, and re-running a shard repeats its episodes."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeloop.steps.config import parse_config
from moeloop.steps.rollout import rollout
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import run_uri
from tests.chat_checkpoints import QWEN3_TOOLS, chat_checkpoint
from tests.conftest import run_in_process

pytestmark = pytest.mark.slow
ENVIRONMENTS = Path(__file__).parents[1] / "environments"
WEIGHT = 2.0


def test_a_tool_environment_runs_the_loop(tmp_path: Path, run_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    monkeypatch.setenv("PYTHONPATH", str(ENVIRONMENTS))  # the tool workers load the environment themselves
    chat_checkpoint(QWEN3_TOOLS, tmp_path / "checkpoint")
    config = parse_config(
        {
            "run_name": "episodes",
            "iterations": 1,
            "model": {"checkpoint": str(tmp_path / "checkpoint")},
            "task": {"source": "environment"},
            "rollout": {
                "engine": "transformers", "prompts_per_iteration": 4, "samples_per_prompt": 2, "num_shards": 2,
                "max_new_tokens": 24,
                "environment": {"package": "calc-env", "name": "calc-env", "args": {"train_size": 8, "eval_size": 2},
                                "max_turns": 2, "max_episode_tokens": 48, "reward_weight": WEIGHT},
            },
            "trainer": {"minibatch_size": 8},
            "eval": {"max_prompts": 2},
        },
        "test",
    )  # fmt: skip
    uri = run_uri(config, str(run_root))

    run_in_process(config, uri)

    storage = RunStorage(uri)
    assert storage.read_json(storage.report(0, "start"))["train_prompts"] == 8
    shards = [storage.read_bytes(storage.rollout_shard(1, k, 2)) for k in range(2)]
    rows = [row for data in shards for row in pq.read_table(pa.BufferReader(data)).to_pylist()]
    rewards = {r["sample_id"]: r["reward"] for r in pq.read_table(pa.BufferReader(
        storage.read_bytes(storage.rewards(1)))).to_pylist()}  # fmt: skip
    policy_tokens = 0
    for row in rows:
        mask, turns = row["response_mask"], row["turns"]
        assert (
            len(mask)
            == len(row["response_token_ids"])
            == sum(t["environment_tokens"] + t["policy_tokens"] for t in turns)
        )
        assert 1 <= len(turns) <= 2 and row["episode_end"] is not None
        assert len(row["prompt_token_ids"]) + len(mask) <= len(row["prompt_token_ids"]) + 48  # max_episode_tokens
        assert rewards[row["sample_id"]] == pytest.approx(WEIGHT * row["environment_reward"])
        policy_tokens += sum(mask)
    assert storage.read_json(storage.report(1, "train"))["response_tokens"] == policy_tokens
    assert storage.read_json(storage.metrics(1))["eval_reward_mean"] is not None

    # A shard generated again (a retried pod) is the same episodes: every column the same but the turns' seconds.
    (run_root / config.run_name / storage.rollout_shard(1, 0, 2)).unlink()
    rollout(uri, 1, 0, 2)
    again = pq.read_table(pa.BufferReader(storage.read_bytes(storage.rollout_shard(1, 0, 2)))).to_pylist()
    assert [untimed(row) for row in again] == [untimed(row) for row in rows[: len(again)]]


def untimed(row: dict) -> dict:
    turns = [{key: value for key, value in turn.items() if not key.endswith("_seconds")} for turn in row["turns"]]
    return {**row, "turns": turns}
