"""PPO: token rewards, GAE, whitening and the clipped value loss against values computed by hand here (plain
Python recursions over the same numbers); the critic built from the policy; the PPO update with its critic. (The
update under EP 2: tests/distributed/test_ppo_ep.py; the critic through the loop and the demos' learning:
tests/loop/test_ppo_demo.py.)"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForTokenClassification, Qwen3MoeForCausalLM

from moeloop.steps.model.policy import build_tokenizer, load_critic_shard, load_policy_shard, save_policy, token_values
from moeloop.steps.rl.grpo import clipped_policy_loss
from moeloop.steps.rl.ppo import gae, last_token_index, token_rewards, value_loss, whiten
from moeloop.steps.config import MoeloopConfig
from moeloop.steps.rl.batch import frozen_logprobs
from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.rl.state import load_trainer_model, make_optimizer, prepare_trainer_model
from moeloop.steps.rl.update import Critic, policy_update
from tests.conftest import small_config
from tests.unit.test_moe import tiny_config
from tests.distributed.test_train_ep import experience

CPU = torch.device("cpu")


def hand_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """The backward recursion over one response's tokens; the state after the last token is terminal."""
    advantages = [0.0] * len(rewards)
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        next_advantage = advantages[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        advantages[t] = delta + gamma * lam * next_advantage
    return advantages


def response_masks(lengths: list[int], starts: list[int], width: int) -> torch.Tensor:
    return torch.tensor([[s <= c < s + n for c in range(width)] for s, n in zip(starts, lengths, strict=True)])


@pytest.mark.parametrize(
    ("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)], ids=["default", "both", "mc", "td"]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_equals_the_backward_recursion_per_response(gamma: float, lam: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    width = 11
    lengths = [1, 4, 7, 2, 9]
    starts = [int(torch.randint(0, width - n + 1, (1,), generator=generator)) for n in lengths]  # varied prompts
    mask_BT = response_masks(lengths, starts, width)
    rewards_BT = torch.randn(5, width, dtype=torch.float64, generator=generator)  # garbage outside the mask too
    values_BT = torch.randn(5, width, dtype=torch.float64, generator=generator)

    advantages_BT, returns_BT = gae(rewards_BT * mask_BT, values_BT, mask_BT, gamma, lam)

    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        span = slice(start, start + length)
        want = hand_gae(rewards_BT[row, span].tolist(), values_BT[row, span].tolist(), gamma, lam)
        assert advantages_BT[row, span].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
        want_returns = [a + v for a, v in zip(want, values_BT[row, span].tolist(), strict=True)]
        assert returns_BT[row, span].tolist() == pytest.approx(want_returns, rel=1e-12, abs=1e-12)
    assert (advantages_BT[~mask_BT] == 0).all() and (returns_BT[~mask_BT] == 0).all()


def test_gae_with_lambda_one_and_gamma_one_is_reward_to_go_minus_value() -> None:
    rewards, values = [0.1, -0.2, 0.0, 1.0], [0.3, 0.5, -0.1, 0.7]
    mask_BT = torch.tensor([[False, True, True, True, True, False]])
    rewards_BT = torch.tensor([[0.0, *rewards, 0.0]], dtype=torch.float64)
    values_BT = torch.tensor([[9.0, *values, 9.0]], dtype=torch.float64)
    advantages_BT, _ = gae(rewards_BT, values_BT, mask_BT, 1.0, 1.0)
    want = [sum(rewards[t:]) - values[t] for t in range(4)]  # 0.9-0.3, 0.8-0.5, 1.0+0.1, 1.0-0.7
    assert advantages_BT[0, 1:5].tolist() == pytest.approx(want, rel=1e-12)


def test_token_rewards_put_the_reward_on_the_last_token_and_k1_kl_on_every_token() -> None:
    mask_BT = response_masks([3, 1], [1, 3], 5)
    logprobs_BT = torch.tensor([[0.0, -1.0, -0.5, -2.0, -9.0], [0.0, -9.0, -9.0, -0.3, -9.0]], dtype=torch.float64)
    ref_BT = torch.tensor([[0.0, -1.5, -0.5, -1.0, 5.0], [0.0, 5.0, 5.0, -0.1, 5.0]], dtype=torch.float64)
    rewards_B = torch.tensor([0.75, -1.0], dtype=torch.float64)
    got = token_rewards(rewards_B, mask_BT, 0.1, logprobs_BT, ref_BT)
    want = [
        [0.0, -0.1 * (-1.0 + 1.5), -0.1 * 0.0, -0.1 * (-2.0 + 1.0) + 0.75, 0.0],
        [0.0, 0.0, 0.0, -0.1 * (-0.3 + 0.1) - 1.0, 0.0],
    ]
    for row in range(2):
        assert got[row].tolist() == pytest.approx(want[row], rel=1e-12, abs=1e-15)
    assert last_token_index(mask_BT).tolist() == [3, 3]
    # algorithm.kl_estimator k3 (e^-x + x - 1, x = log pi - log pi_ref), clamped at 0.1: row 0's tokens at x = 0.5,
    # 0, -1 give 0.1065 (clamped to 0.1), 0, 0.7183 (clamped to 0.1).
    k3 = token_rewards(rewards_B, mask_BT, 0.1, logprobs_BT, ref_BT, "k3", kl_clamp=0.1)
    assert k3[0].tolist() == pytest.approx([0.0, -0.1 * 0.1, 0.0, -0.1 * 0.1 + 0.75, 0.0], rel=1e-12, abs=1e-15)
    x = -0.3 + 0.1
    assert k3[1].tolist() == pytest.approx([0.0, 0.0, 0.0, -0.1 * (math.exp(-x) + x - 1) - 1.0, 0.0], rel=1e-12)


def test_whiten_gives_mean_zero_std_one_over_the_masked_tokens() -> None:
    values = [1.0, 2.0, 4.0, -3.0, 0.5]
    mask_BT = torch.tensor([[True, True, True, False], [False, True, True, False]])
    values_BT = torch.tensor([[1.0, 2.0, 4.0, 100.0], [-50.0, -3.0, 0.5, 7.0]], dtype=torch.float64)
    mean = sum(values) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 5)
    got = whiten(values_BT, mask_BT)
    assert got[mask_BT].tolist() == pytest.approx([(v - mean) / std for v in values], rel=1e-7)
    assert (got[~mask_BT] == 0).all()


# (value, old value, return) with value_clip 0.2: expected per-token loss, whether clipped, d loss / d value.
VALUE_CASES = {
    "moved past the clip toward the return": (0.9, 0.5, 1.0, 0.5 * (0.7 - 1.0) ** 2, True, 0.0),
    "inside the clip range": (0.6, 0.5, 1.0, 0.5 * (0.6 - 1.0) ** 2, False, 0.6 - 1.0),
    "moved past the clip away from the return": (0.2, 0.5, 1.0, 0.5 * (0.2 - 1.0) ** 2, False, 0.2 - 1.0),
    "below the return, clipped from above": (-0.4, 0.0, -1.0, 0.5 * (-0.2 + 1.0) ** 2, True, 0.0),
}


@pytest.mark.parametrize("case", VALUE_CASES)
def test_value_loss_clipping_per_token(case: str) -> None:
    value, old, target, want_loss, want_clipped, want_gradient = VALUE_CASES[case]
    values_BT = torch.tensor([[value]], dtype=torch.float64, requires_grad=True)
    loss, clipped = value_loss(
        values_BT, torch.tensor([[old]], dtype=torch.float64), torch.tensor([[target]]), torch.ones(1, 1), 0.2
    )
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-12)
    assert float(clipped) == (1.0 if want_clipped else 0.0)
    loss.backward()
    assert float(values_BT.grad[0, 0]) == pytest.approx(want_gradient, rel=1e-12, abs=1e-15)


def test_value_loss_is_a_token_mean_and_unclipped_without_value_clip() -> None:
    generator = torch.Generator().manual_seed(4)
    mask_BT = response_masks([3, 2], [0, 2], 5)
    values_BT = torch.randn(2, 5, dtype=torch.float64, generator=generator)
    old_BT = values_BT + torch.randn(2, 5, dtype=torch.float64, generator=generator)
    returns_BT = torch.randn(2, 5, dtype=torch.float64, generator=generator)
    hand_clipped, hand_plain = [], []
    for r in range(2):
        for c in range(5):
            if mask_BT[r, c]:
                v, o, g = float(values_BT[r, c]), float(old_BT[r, c]), float(returns_BT[r, c])
                clipped_value = o + min(max(v - o, -0.3), 0.3)
                hand_clipped.append(0.5 * max((v - g) ** 2, (clipped_value - g) ** 2))
                hand_plain.append(0.5 * (v - g) ** 2)
    loss, _ = value_loss(values_BT, old_BT, returns_BT, mask_BT, 0.3)
    assert float(loss) == pytest.approx(sum(hand_clipped) / 5, rel=1e-12)
    plain, share = value_loss(values_BT, old_BT, returns_BT, mask_BT, None, num_tokens=10)
    assert float(plain) == pytest.approx(sum(hand_plain) / 10, rel=1e-12)
    assert float(share) == 0.0


def test_ppo_policy_loss_with_per_token_advantages() -> None:
    generator = torch.Generator().manual_seed(6)
    mask_BT = response_masks([4, 2], [1, 0], 5)
    logprobs_BT = -torch.rand(2, 5, dtype=torch.float64, generator=generator)
    old_BT = logprobs_BT + (torch.rand(2, 5, dtype=torch.float64, generator=generator) - 0.5) * 0.8
    advantages_BT = torch.randn(2, 5, dtype=torch.float64, generator=generator)
    terms = clipped_policy_loss(logprobs_BT, old_BT, advantages_BT, mask_BT, clip_low=0.2)
    hand = []
    for r in range(2):
        for c in range(5):
            if mask_BT[r, c]:
                ratio = math.exp(float(logprobs_BT[r, c] - old_BT[r, c]))
                advantage = float(advantages_BT[r, c])
                hand.append(-min(ratio * advantage, min(max(ratio, 0.8), 1.2) * advantage))
    assert float(terms.policy_loss) == pytest.approx(sum(hand) / 6, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# The PPO update with its critic


def tiny_policy(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    save_policy(Qwen3MoeForCausalLM(tiny_config()), build_tokenizer(["abc"]), tmp_path / "policy")
    return tmp_path / "policy"


def test_critic_starts_from_the_policy_body_with_a_zero_head_and_loads_in_transformers(tmp_path: Path) -> None:
    policy_dir = tiny_policy(tmp_path)
    policy, tokenizer = load_policy_shard(policy_dir, "auto", "grouped_mm", None, CPU)
    critic, _ = load_critic_shard(policy_dir, "auto", "grouped_mm", None, CPU, from_policy=True)
    for name, tensor in policy.model.state_dict().items():
        torch.testing.assert_close(critic.model.state_dict()[name], tensor, rtol=0, atol=0)
    batch = experience()
    values_BT, _ = token_values(critic, batch.input_ids_BT, batch.attention_mask_BT)
    assert (values_BT == 0).all()

    with torch.no_grad():
        critic.score.weight.normal_()
        critic.score.bias.fill_(0.25)
    from moeloop.steps.model.moe import hf_state_dict
    from moeloop.steps.model.policy import hf_model_on_meta

    whole = hf_model_on_meta(critic.config)
    whole.load_state_dict(hf_state_dict(critic), strict=True, assign=True)
    save_policy(whole, tokenizer, tmp_path / "critic")
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32).eval()
    critic.eval()
    with torch.no_grad():
        logits_BT = loaded(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits.squeeze(-1)
        values_BT, _ = token_values(critic, batch.input_ids_BT, batch.attention_mask_BT)
    # The value of token t's state is the head's output at t - 1.
    torch.testing.assert_close(values_BT[:, 1:], logits_BT[:, :-1], rtol=1e-5, atol=1e-5)


def ppo_trainer(policy_dir: Path, config: MoeloopConfig, parallel: Parallel) -> tuple:
    """(policy, critic, the policy's optimizer, the reference's logprobs of `experience()`) as the train step makes
    them from a policy checkpoint; on this rank's mesh, or unsharded with Parallel()."""
    settings = config.trainer
    reference, _, _ = load_trainer_model(policy_dir, settings, parallel)
    ref_logprobs_BT = frozen_logprobs(reference, experience(), 1.0, settings.max_tokens_per_microbatch, parallel)
    model, _, optimizer = load_trainer_model(policy_dir, settings, parallel)
    critic_model, _ = load_critic_shard(policy_dir, "auto", "grouped_mm", parallel.ep_group, CPU, from_policy=True)
    critic_model = prepare_trainer_model(critic_model, settings, parallel)
    critic = Critic(critic_model, make_optimizer(critic_model, settings, config.algorithm.critic_learning_rate))
    return model, critic, optimizer, ref_logprobs_BT


def test_ppo_update_fits_the_critic_and_moves_the_policy(tmp_path: Path) -> None:
    policy_dir = tiny_policy(tmp_path)
    config = small_config(
        iterations=1,
        algorithm={"name": "ppo", "kl_coef": 0.05, "value_clip": 0.5},
        trainer={"minibatch_size": 6, "epochs": 2, "learning_rate": 1e-3},
    )
    model, critic, optimizer, ref_logprobs_BT = ppo_trainer(policy_dir, config, Parallel())
    before = copy.deepcopy(model.state_dict())
    batch = experience()
    reports = [policy_update(model, ref_logprobs_BT, optimizer, batch, config, seed, critic=critic) for seed in range(4)]
    for report in reports:
        for key in ("loss", "value_loss", "kl", "grad_norm", "critic_grad_norm", "behavior_weight_mean"):
            assert math.isfinite(report[key]), key
        assert report["optimizer_steps"] == 4
    assert reports[0]["value_mean"] == 0.0  # the zero head
    # The critic fits the same batch's returns: its loss falls from update to update.
    value_losses = [r["value_loss"] for r in reports]
    assert value_losses[-1] < value_losses[0] * 0.8, value_losses
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # A batch of the wrong algorithm is refused, not silently half-run.
    with pytest.raises(Exception, match="needs critic"):
        policy_update(model, ref_logprobs_BT, optimizer, batch, config, 0)
