"""Reward models: a tiny random Qwen3-MoE sequence classifier built here scores batches as one sample at a time
does, and as transformers' own forward does; the start step commits it into the run and the reward step adds its
weighted score to the rule rewards (or uses it alone); bad models are one-line errors."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.demo_task import reverse_positions
from moeloop.steps.errors import MoeloopError
from moeloop.steps.prompting import ChatSettings
from moeloop.steps.reward import reward
from moeloop.steps.reward_model import build_tiny_reward_model
from moeloop.steps.rewards.models import RewardModelScorer
from moeloop.steps.rollout import rollout
from moeloop.steps.start import start
from moeloop.steps.storage.prompt_set import read_prompts
from moeloop.steps.storage.run import RunStorage
from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, small_config
from moeloop.workflows.dag import run_uri

# (prompt, response): a string prompt is scored as prompt + response
SAMPLES = [("abc=", "cba"), ("hg=", ""), ("abcdefgh=", "hgfedcba"), ("a=", "a"), ("ddd=", "ddd" + "d" * 9), ("e", "")]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("rm") / "tiny-rm"
    build_tiny_reward_model(small_config(), directory, seed=3)
    return directory


def test_batched_scores_equal_transformers_one_sample_at_a_time(reward_model: Path) -> None:
    scorer = RewardModelScorer(reward_model, batch_size=4)
    assert scorer.device.type == "cpu" and scorer.model.dtype == torch.float32
    scores = scorer.score(SAMPLES, ChatSettings())  # two batches, the second one shorter; rows padded apart

    model = AutoModelForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    with torch.no_grad():
        alone = [float(model(**tokenizer(p + r, return_tensors="pt")).logits[0, 0]) for p, r in SAMPLES]
    assert scores == pytest.approx(alone, rel=1e-4, abs=1e-5)
    assert len(set(scores)) == len(SAMPLES)  # a random model, but not a constant one


def rm_config(reward_model: Path, functions: bool, weight: float = 0.5) -> MoeloopConfig:
    rule = [{"path": "moeloop.steps.demo_task:reverse_positions", "weight": 1.0}] if functions else []
    return small_config(
        iterations=1,
        rollout=SMALL_TRANSFORMERS_ROLLOUT,
        reward={"functions": rule, "models": [{"path": str(reward_model), "weight": weight, "batch_size": 5}]},
    )


@pytest.mark.parametrize("functions", [True, False], ids=["rule+model", "model-alone"])
def test_reward_step_adds_the_weighted_model_score(reward_model: Path, run_root: Path, functions: bool) -> None:
    config = rm_config(reward_model, functions)
    uri = run_uri(config, str(run_root))
    start(uri, config)
    storage = RunStorage(uri)
    assert storage.is_committed(storage.reward_model(0))
    for shard in range(config.rollout.num_shards):
        rollout(uri, 1, shard, config.rollout.num_shards)
    report = reward(uri, 1)

    rollouts = pq.read_table(Path(uri) / "experience/iter-000001/rollout-00000-of-00002.parquet").to_pylist()
    rewards = {row["sample_id"]: row["reward"] for row in pq.read_table(Path(uri) / storage.rewards(1)).to_pylist()}
    records = read_prompts(storage, "train", [row["prompt_id"] for row in rollouts])
    scores = RewardModelScorer(reward_model, batch_size=1).score(
        [(records[r["prompt_id"]]["prompt"], r["response_text"]) for r in rollouts], ChatSettings()
    )
    for row, model_score in zip(rollouts, scores, strict=True):
        rule = reverse_positions(records[row["prompt_id"]], row["response_text"]) if functions else 0.0
        assert rewards[row["sample_id"]] == pytest.approx(rule + 0.5 * model_score, rel=1e-4, abs=1e-5)
    assert "reward_model_0_mean" in report and report["samples"] == 32


def test_a_folder_that_is_not_a_model_or_has_more_labels_is_refused(tmp_path: Path, run_root: Path) -> None:
    (tmp_path / "empty").mkdir()
    for missing in (tmp_path / "empty", tmp_path / "nowhere"):
        config = rm_config(missing, functions=True)
        with pytest.raises(MoeloopError, match="reward.models.0.path is not an HF model folder"):
            start(run_uri(config, str(run_root)), config)
        assert not list(run_root.iterdir())  # refused before anything was written

    build_tiny_reward_model(small_config(), tmp_path / "two", seed=0)
    two_labels = AutoConfig.from_pretrained(tmp_path / "two", num_labels=2)
    AutoModelForSequenceClassification.from_config(two_labels).save_pretrained(tmp_path / "two")
    with pytest.raises(MoeloopError, match="num_labels 2, not 1"):
        RewardModelScorer(tmp_path / "two", batch_size=2)


def test_config_needs_a_reward_function_or_model() -> None:
    with pytest.raises(Exception, match="reward: name at least one reward function or reward model"):
        small_config(reward={"functions": [], "models": []})
