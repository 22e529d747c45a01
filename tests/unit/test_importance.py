"""moeloop.steps.rl.importance and the policy loss at each importance level: GSPO, GSPO-token (Zheng et al. 2025,
arXiv:2507.18071) and the mismatch masks, against values computed by hand here (plain Python loops), including
the gradient of the sequence ratio; and the config's refusals of combinations that make no sense."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from moeloop.steps.config import parse_config
from moeloop.steps.errors import MoeloopError
from moeloop.steps.rl.grpo import behavior_weights, clipped_policy_loss
from moeloop.steps.rl.importance import behavior_ratio, importance_ratio, mismatch_mask

CLIP = 0.2


def random_batch(seed: int = 0, rows: int = 5, cols: int = 7):
    """logprobs (requiring grad), old logprobs, per-sequence advantages, and a mask with a response of 1..cols
    tokens per row starting at varied positions (float64: the hand sums are exact to 1e-12)."""
    generator = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(rows, cols, generator=generator, dtype=torch.float64)
    logprobs = (old + 0.4 * torch.randn(rows, cols, generator=generator, dtype=torch.float64)).requires_grad_()
    advantages = torch.randn(rows, generator=generator, dtype=torch.float64)
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    for row in range(rows):
        start, length = row % 3, 1 + (2 * row + 1) % (cols - 2)
        mask[row, start : start + length] = True
    return logprobs, old, advantages, mask


def hand_sequence_ratios(logprobs, old, mask) -> list[float]:
    """s_i = exp(1/|y_i| sum_t (log pi - log pi_old)) over each row's masked tokens."""
    ratios = []
    for row in range(len(mask)):
        log_ratios = [logprobs[row][t] - old[row][t] for t in range(len(mask[row])) if mask[row][t]]
        ratios.append(math.exp(sum(log_ratios) / len(log_ratios)))
    return ratios


def assert_equal_to(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-12, atol=1e-12)


def clip(value: float) -> float:
    return min(max(value, 1 - CLIP), 1 + CLIP)


def test_the_sequence_ratio_and_its_gradient_are_gspos() -> None:
    logprobs, old, _, mask = random_batch()
    ratio_BT = importance_ratio(logprobs, old, mask, "sequence")
    hand = hand_sequence_ratios(logprobs.tolist(), old.tolist(), mask.tolist())
    for row, s in enumerate(hand):
        assert ratio_BT[row].tolist() == pytest.approx([s] * mask.shape[1], rel=1e-12)
    # d s_i / d log pi(y_it) = s_i / |y_i| on row i's response tokens, 0 on every other position and row.
    rows, cols = mask.shape
    for row, s in enumerate(hand):
        (gradient,) = torch.autograd.grad(ratio_BT[row, 0], logprobs, retain_graph=True)
        length = int(mask[row].sum())
        expected = [[s / length if r == row and mask[r, t] else 0.0 for t in range(cols)] for r in range(rows)]
        assert_equal_to(gradient, expected)


def test_the_gspo_token_ratio_is_valued_s_with_gradient_s_per_token() -> None:
    logprobs, old, _, mask = random_batch(1)
    ratio_BT = importance_ratio(logprobs, old, mask, "sequence_token")
    hand = hand_sequence_ratios(logprobs.tolist(), old.tolist(), mask.tolist())
    for row, s in enumerate(hand):
        assert ratio_BT[row].tolist() == pytest.approx([s] * mask.shape[1], rel=1e-12)
        (gradient,) = torch.autograd.grad(ratio_BT[row, 2], logprobs, retain_graph=True)
        expected = [[s if (r, t) == (row, 2) else 0.0 for t in range(mask.shape[1])] for r in range(len(mask))]
        assert_equal_to(gradient, expected)


def test_the_token_ratio_is_unchanged() -> None:
    logprobs, old, _, mask = random_batch(2)
    pairs = zip(logprobs.tolist(), old.tolist(), strict=True)
    expected = [[math.exp(a - b) for a, b in zip(x, y, strict=True)] for x, y in pairs]
    assert_equal_to(importance_ratio(logprobs, old, mask, "token").detach(), expected)


@pytest.mark.parametrize("seed", [0, 3, 4])
def test_the_gspo_loss_and_gradient_match_the_hand_computed_objective(seed: int) -> None:
    """J = 1/G sum_i min(s_i A_i, clip(s_i) A_i); its gradient -A_i s_i / |y_i| per response token where the
    unclipped term is the min, 0 where the clip holds it. Some sequences of these batches are clipped."""
    logprobs, old, advantages, mask = random_batch(seed)
    terms = clipped_policy_loss(
        logprobs, old, advantages, mask, clip_low=CLIP, aggregation="sequence", importance_level="sequence"
    )
    terms.loss.backward()
    ratios = hand_sequence_ratios(logprobs.tolist(), old.tolist(), mask.tolist())
    rows, cols = mask.shape
    loss, clipped_tokens, gradient = 0.0, 0, [[0.0] * cols for _ in range(rows)]
    for row, (s, advantage) in enumerate(zip(ratios, advantages.tolist(), strict=True)):
        unclipped, clipped = s * advantage, clip(s) * advantage
        loss -= min(unclipped, clipped) / rows
        length = int(mask[row].sum())
        clipped_tokens += length * (s != clip(s))
        for t in range(cols):
            if mask[row, t] and unclipped <= clipped:
                gradient[row][t] = -advantage * s / length / rows
    assert float(terms.loss.detach()) == pytest.approx(loss, rel=1e-12)
    assert_equal_to(logprobs.grad, gradient)
    assert float(terms.out_of_range) == pytest.approx(clipped_tokens / int(mask.sum()))
    assert 0 < clipped_tokens < int(mask.sum()) or seed == 0  # seeds 3, 4 clip some sequences, not all


def test_gspo_token_with_token_advantages_matches_the_hand_computed_objective() -> None:
    """J = 1/G sum_i 1/|y_i| sum_t min(s_it A_it, clip(s_it) A_it); gradient -A_it s_i / (|y_i| G) per token
    where the unclipped term is the min."""
    logprobs, old, _, mask = random_batch(5)
    advantages_BT = torch.randn(mask.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    terms = clipped_policy_loss(
        logprobs, old, advantages_BT, mask, CLIP, aggregation="sequence", importance_level="sequence_token"
    )
    terms.loss.backward()
    ratios = hand_sequence_ratios(logprobs.tolist(), old.tolist(), mask.tolist())
    rows, cols = mask.shape
    loss, gradient = 0.0, [[0.0] * cols for _ in range(rows)]
    for row, s in enumerate(ratios):
        length = int(mask[row].sum())
        for t in range(cols):
            if not mask[row, t]:
                continue
            advantage = float(advantages_BT[row, t])
            unclipped, clipped = s * advantage, clip(s) * advantage
            loss -= min(unclipped, clipped) / length / rows
            if unclipped <= clipped:
                gradient[row][t] = -advantage * s / length / rows
    assert float(terms.loss.detach()) == pytest.approx(loss, rel=1e-12)
    assert_equal_to(logprobs.grad, gradient)


def test_gspo_token_with_sequence_advantages_equals_gspo() -> None:
    """The paper's remark: with A_it = A_i, GSPO-token and GSPO have the same objective and gradient."""
    logprobs, old, advantages, mask = random_batch(3)
    gradients, losses = [], []
    for level in ("sequence", "sequence_token"):
        leaf = logprobs.detach().clone().requires_grad_()
        terms = clipped_policy_loss(leaf, old, advantages, mask, CLIP, aggregation="sequence", importance_level=level)
        terms.loss.backward()
        losses.append(float(terms.loss.detach()))
        gradients.append(leaf.grad)
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    torch.testing.assert_close(gradients[0], gradients[1], rtol=1e-12, atol=1e-14)


def test_mismatch_masks_tokens_or_whole_sequences_outside_the_band() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    # pi_old / pi_behavior: row 0 [1, 3, 0.4, pad]; row 1 [1.5, 1.5, 0.9, 1.2]
    behavior = old - torch.log(torch.tensor([[1.0, 3.0, 0.4, 1.0], [1.5, 1.5, 0.9, 1.2]]))
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    token = mismatch_mask(behavior_ratio(old, behavior, mask), mask, 0.5, 2.0)
    assert token.tolist() == [[True, False, False, False], [True, True, True, True]]
    # Sequence ratios: row 0 (1 * 3 * 0.4) ** (1/3) = 1.0627, kept; row 1 (1.5 * 1.5 * 0.9 * 1.2) ** (1/4) = 1.2359.
    sequence_ratio = behavior_ratio(old, behavior, mask, sequence="geometric")
    assert sequence_ratio[:, 0].tolist() == pytest.approx([1.2 ** (1 / 3), 2.43 ** (1 / 4)], rel=1e-5)
    assert mismatch_mask(sequence_ratio, mask, 0.5, 2.0).tolist() == mask.tolist()
    assert mismatch_mask(sequence_ratio, mask, 0.5, 1.1).tolist() == [[True, True, True, False], [False] * 4]


def test_behaviour_weights_per_sequence_truncate_the_sequence_ratio() -> None:
    old = torch.zeros(1, 3)
    behavior = -torch.log(torch.tensor([[4.0, 4.0, 1.0]]))
    ratio = behavior_ratio(old, behavior, torch.ones(1, 3), sequence="geometric")
    weights, truncated = behavior_weights(ratio, cap=2.0)
    assert weights.tolist() == [[2.0] * 3] and truncated.tolist() == [[True] * 3]  # 16 ** (1/3) = 2.52 > 2
    weights, truncated = behavior_weights(ratio, cap=3.0)
    assert weights[0].tolist() == pytest.approx([16 ** (1 / 3)] * 3) and not truncated.any()


def test_behaviour_weights_per_sequence_by_product_are_the_whole_sequences_likelihood_ratio() -> None:
    """algorithm.sequence_weight product: the product of the masked tokens' ratios (verl's rollout_is sequence),
    truncated at the cap; an overflowing product is capped, never NaN."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))
    # pi_old / pi_behavior: row 0 [1.5, 0.8, 1.25, pad (9)], row 1 [0.5, 0.5, 1.1, 1.0]
    ratios = [[1.5, 0.8, 1.25, 9.0], [0.5, 0.5, 1.1, 1.0]]
    behavior = old - torch.log(torch.tensor(ratios, dtype=torch.float64))
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    product = behavior_ratio(old, behavior, mask, sequence="product")
    assert product[:, 0].tolist() == pytest.approx([1.5 * 0.8 * 1.25, 0.5 * 0.5 * 1.1 * 1.0], rel=1e-12)
    assert product[0].tolist() == pytest.approx([1.5] * 4, rel=1e-12)  # the same on every token of the row
    weights, truncated = behavior_weights(product, cap=1.2)
    assert weights[:, 0].tolist() == pytest.approx([1.2, 0.275], rel=1e-12)
    assert truncated[:, 0].tolist() == [True, False]
    huge = behavior_ratio(torch.zeros(1, 200), torch.full((1, 200), -5.0), torch.ones(1, 200), sequence="product")
    assert behavior_weights(huge, cap=2.0)[0].tolist() == [[2.0] * 200]  # e^1000 overflows to inf: capped


BASE = {
    "run_name": "x",
    "iterations": 1,
    "task": {"train_prompts": "a", "eval_prompts": "b"},
    "reward": {"functions": [{"path": "m:f"}]},
}


@pytest.mark.parametrize(
    "algorithm, message",
    [
        (
            {"importance_level": "sequence", "name": "ppo", "loss_aggregation": "sequence"},
            "with ppo use sequence_token",
        ),
        ({"importance_level": "sequence"}, "set loss_aggregation sequence"),
        ({"mismatch": {"level": "token", "low": 1.5}}, "algorithm.mismatch.low"),
        ({"mismatch": {"level": "token", "high": 0.9}}, "algorithm.mismatch.high"),
        ({"sequence_weight": "product"}, "it needs importance_level sequence or sequence_token"),
        ({"dual_clip": 1.0}, "algorithm.dual_clip: Input should be greater than 1"),
        ({"kl_estimator": "k4"}, "algorithm.kl_estimator"),
    ],
)
def test_meaningless_combinations_are_refused_in_one_line(algorithm: dict, message: str) -> None:
    with pytest.raises(MoeloopError, match=message) as error:
        parse_config({**BASE, "algorithm": algorithm}, "c.yaml")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "algorithm",
    [
        {"importance_level": "sequence", "loss_aggregation": "sequence", "clip_eps": 0.01},
        {"importance_level": "sequence_token", "mismatch": {"level": "token", "low": 0.1, "high": 1.25}},
        {"mismatch": {"level": "sequence", "low": 0.07, "high": 1.03}},
    ],
    ids=["gspo", "gspo_token_token_mask", "sequence_mask"],
)
def test_the_update_masks_and_reports_the_share_masked(algorithm: dict, tmp_path) -> None:
    from moeloop.steps.model.policy import token_logprobs
    from moeloop.steps.rl.state import make_optimizer
    from moeloop.steps.rl.update import policy_update
    from tests.conftest import small_config
    from tests.distributed.test_train_ep import experience, reference_logprobs_of, tiny_policy

    model = tiny_policy(tmp_path)
    config = small_config(iterations=1, algorithm=algorithm, trainer={"minibatch_size": 12, "epochs": 1})
    batch = experience()
    reference = reference_logprobs_of(model, batch)
    with torch.no_grad():
        old_BT, _ = token_logprobs(copy.deepcopy(model).eval(), batch.input_ids_BT, batch.attention_mask_BT)
    report = policy_update(model, reference, make_optimizer(model, config.trainer), batch, config, seed=0)
    assert math.isfinite(report["loss"]) and report["optimizer_steps"] == 1
    # The share masked, by hand from pi_old / pi_behavior on each response token (or its sequence's mean log-ratio).
    mismatch = {"level": "off", "low": 0.5, "high": 2.0, **algorithm.get("mismatch", {})}
    masked = total = masked_sequences = 0
    for row in range(len(old_BT)):
        positions = batch.response_mask_BT[row].nonzero().squeeze(1).tolist()
        log_ratios = [float(old_BT[row, t] - batch.behavior_logprobs_BT[row, t]) for t in positions]
        if mismatch["level"] == "sequence":
            log_ratios = [sum(log_ratios) / len(log_ratios)] * len(log_ratios)
        low, high = mismatch["low"], mismatch["high"]
        out = [mismatch["level"] != "off" and not low <= math.exp(x) <= high for x in log_ratios]
        masked, total, masked_sequences = masked + sum(out), total + len(out), masked_sequences + all(out)
    assert report["mismatch_masked"] == pytest.approx(masked / total)
    assert report["mismatch_masked_sequences"] == pytest.approx(masked_sequences / len(old_BT))
    if mismatch["level"] != "off":
        assert 0 < masked < total  # the bands are chosen so that some tokens go and some stay
