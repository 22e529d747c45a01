"""The PPO demos: the loop with PPO, a rule reward and a reward model commits, publishes and resumes the critic;
configs/tiny-ppo.yaml learns (with a reward model: tests/loop/test_ppo_rm_demo.py, a file of its own so that the two
long runs go to two test workers)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForTokenClassification

from moeloop.steps.model.policy import token_values
from moeloop.steps.rl.checkpoint import METADATA, OPTIMIZER_DIR, WEIGHTS_DIR, read_whole
from moeloop.steps.storage.run import CRITIC_DIR, RunStorage
from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, run_in_process, small_config
from tests.distributed.test_train_ep import experience


def test_ppo_loop_commits_publishes_and_resumes_the_critic(run_root: Path, tmp_path: Path) -> None:
    from moeloop.steps.reward_model import build_tiny_reward_model
    from moeloop.workflows.dag import run_uri

    build_tiny_reward_model(small_config(), tmp_path / "rm", seed=1)
    config = small_config(
        iterations=2,
        rollout=SMALL_TRANSFORMERS_ROLLOUT,
        algorithm={"name": "ppo", "kl_coef": 0.02},
        reward={
            "functions": [{"path": "moeloop.steps.demo_task:reverse_positions", "weight": 1.0}],
            "models": [{"path": str(tmp_path / "rm"), "weight": 0.05, "batch_size": 16}],
        },
    )
    uri = run_uri(config, str(run_root))
    run_in_process(config, uri)
    storage = RunStorage(uri)
    assert storage.latest()["iteration"] == 2
    steps_per_iteration = config.trainer.epochs * -(-32 // config.trainer.minibatch_size)
    for iteration in (1, 2):
        state = storage.manifest(storage.trainer_state(iteration))["files"]
        assert {f"{CRITIC_DIR}/{OPTIMIZER_DIR}/{METADATA}", f"{CRITIC_DIR}/{WEIGHTS_DIR}/{METADATA}"} <= state.keys()
        published = storage.manifest(storage.critic(iteration))["files"]
        assert not any(name.startswith(OPTIMIZER_DIR) for name in published) and "model.safetensors" in published
        assert not any(name.startswith(CRITIC_DIR) for name in storage.manifest(storage.checkpoint(iteration))["files"])
        train_report = storage.read_json(storage.report(iteration, "train"))
        assert math.isfinite(train_report["value_loss"]) and train_report["optimizer_steps"] == steps_per_iteration
        assert "reward_model_0_mean" in storage.read_json(storage.report(iteration, "reward"))
    # Iteration 2 resumed the critic's optimizer: its moments count both iterations' steps.
    critic_state = Path(uri) / storage.trainer_state(2) / CRITIC_DIR
    critic_moments = read_whole(critic_state / OPTIMIZER_DIR, torch.float32)
    assert float(critic_moments["score.weight.step"]) == 2 * steps_per_iteration
    # The published critic loads in transformers and gives the trainer state's values.
    critic_dir = Path(uri) / storage.critic(2)
    loaded = AutoModelForTokenClassification.from_pretrained(critic_dir, dtype=torch.float32).eval()
    trained = AutoModelForTokenClassification.from_config(loaded.config, dtype=torch.float32)
    trained.load_state_dict(read_whole(critic_state / WEIGHTS_DIR, torch.float32), strict=True)
    batch = experience()
    with torch.no_grad():
        logits_BT = loaded(input_ids=batch.input_ids_BT % 10, attention_mask=batch.attention_mask_BT).logits
        values_BT, _ = token_values(trained.eval(), batch.input_ids_BT % 10, batch.attention_mask_BT)
    torch.testing.assert_close(values_BT[:, 1:], logits_BT.squeeze(-1)[:, :-1], rtol=1e-5, atol=1e-5)
    assert float(values_BT.abs().max()) > 0  # the head moved away from zero


def test_ppo_demo_learns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop issue's measure on the PPO demo (with a reward model: tests/loop/test_ppo_rm_demo.py, a file of its
    own so that the two long runs go to two test workers)."""
    check_ppo_demo_learns("tiny-ppo.yaml", tmp_path, monkeypatch)


# The PPO demos learn in these of their 24 iterations: greedy eval_reward_mean from the SFT checkpoint's 0.509 to
# 0.774 (tiny-ppo.yaml) and 0.765 (tiny-ppo-rm.yaml) after 10, gains of 0.265 and 0.256 against the 0.2 asked
# (measured in a CI run of `make test`; after 8: 0.726 and 0.740, after 12: 0.789 and 0.769; over 24 earlier:
# 0.818 and 0.851).
PPO_DEMO_ITERATIONS = 10


def check_ppo_demo_learns(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The PPO demo `name`, with its reward models built here (random ones, as its config says), cut to
    PPO_DEMO_ITERATIONS: greedy eval_reward_mean beats the SFT checkpoint's by 0.2."""
    from moeloop.steps.config import MoeloopConfig, load_config
    from moeloop.steps.reward_model import build_tiny_reward_model
    from tests.conftest import REPO, eval_reward_gain
    from moeloop.workflows.dag import run_uri
    from moeloop.workflows.local.runner import run_local

    monkeypatch.setenv("MOELOOP_CACHE", str(tmp_path / "cache"))
    data = load_config(REPO / "configs" / name).model_dump()
    data["iterations"] = PPO_DEMO_ITERATIONS
    for model in data["reward"]["models"]:
        model["path"] = str(tmp_path / "reward-model")
        build_tiny_reward_model(MoeloopConfig.model_validate(data), Path(model["path"]))
    config = MoeloopConfig.model_validate(data)
    uri = run_uri(config, str(tmp_path / "runs"))
    run_local(config, uri, tmp_path / "logs", progress=False)
    storage = RunStorage(uri)
    start, last = eval_reward_gain(storage, config.iterations, name)
    assert storage.is_committed(storage.critic(config.iterations))
    if config.reward.models:
        assert storage.read_json(storage.report(config.iterations, "reward"))["reward_model_0_mean"] != 0
    assert last >= start + 0.2
