"""moeloop.steps.rl.grpo: group advantages and the clipped token-level surrogate, checked against values
computed by hand here (plain Python loops over the same numbers), never by calling the code under
test a second way."""

from __future__ import annotations

import math

import pytest
import torch

from moeloop.steps.rl.grpo import (
    aggregate,
    behavior_weights,
    clipped_policy_loss,
    group_advantages,
    kl_estimate,
    varied_groups,
)
from moeloop.steps.rl.importance import behavior_ratio

EPS = 1e-6  # group_advantages' default eps
CLIP = 0.2


# ---------------------------------------------------------------------------------------------
# Hand computations


def hand_advantages(rewards: list[float], group_ids: list[int], scale: bool, eps: float = EPS) -> list[float]:
    """(r - group mean) / (group std, ddof=1, + eps), or only r - group mean when scale is off."""
    members: dict[int, list[float]] = {}
    for reward, group in zip(rewards, group_ids, strict=False):
        members.setdefault(group, []).append(reward)
    stats = {}
    for group, values in members.items():
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        stats[group] = (mean, std)
    advantages = []
    for reward, group in zip(rewards, group_ids, strict=False):
        mean, std = stats[group]
        advantages.append((reward - mean) / (std + eps) if scale else reward - mean)
    return advantages


def hand_token_objective(ratio: float, advantage: float, clip_eps: float) -> tuple[float, bool, float]:
    """Per-token loss -min(r A, clip(r) A), whether the ratio lies outside the clip range, and
    d(loss)/d(logprob) for that token (d r / d logprob = r; zero where the clipped term is the min)."""
    clipped_ratio = min(max(ratio, 1 - clip_eps), 1 + clip_eps)
    unclipped, clipped = ratio * advantage, clipped_ratio * advantage
    loss = -min(unclipped, clipped)
    outside = ratio > 1 + clip_eps or ratio < 1 - clip_eps
    gradient = -ratio * advantage if unclipped <= clipped else 0.0
    return loss, outside, gradient


def hand_k3(logprob: float, ref_logprob: float) -> float:
    log_ratio = ref_logprob - logprob
    return math.exp(log_ratio) - log_ratio - 1


def hand_loss(logprobs, old_logprobs, advantages, mask, clip_eps, ref=None, kl_coef=0.0, num_tokens=None):
    """policy loss, kl, clip fraction and loss, as token sums over the unmasked tokens."""
    policy_sum, kl_sum, outside_count, unmasked = 0.0, 0.0, 0, 0
    for row, advantage in enumerate(advantages):
        for col, keep in enumerate(mask[row]):
            if not keep:
                continue
            unmasked += 1
            ratio = math.exp(logprobs[row][col] - old_logprobs[row][col])
            loss, outside, _ = hand_token_objective(ratio, advantage, clip_eps)
            policy_sum += loss
            outside_count += outside
            if ref is not None:
                kl_sum += hand_k3(logprobs[row][col], ref[row][col])
    denominator = num_tokens if num_tokens is not None else unmasked
    policy = policy_sum / denominator
    kl = kl_sum / denominator
    return {"policy_loss": policy, "kl": kl, "clip_fraction": outside_count / unmasked, "loss": policy + kl_coef * kl}


def old_for_ratios(logprobs_BT: torch.Tensor, ratios: list[list[float]]) -> torch.Tensor:
    """Old logprobs such that exp(logprobs - old) is the given ratio at every token."""
    return logprobs_BT - torch.log(torch.tensor(ratios, dtype=logprobs_BT.dtype))


# ---------------------------------------------------------------------------------------------
# group_advantages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("scale", [True, False], ids=["scale", "centre"])
# 0.2, 2/3 and 0.8 are rewards the demo verifier really gives (correct positions / answer length).
@pytest.mark.parametrize("value", [0.0, 0.5, 1.0, 0.2, 2 / 3, 0.8])
def test_group_of_equal_rewards_gets_exactly_zero_advantage(value: float, scale: bool, dtype: torch.dtype) -> None:
    group_size = 8  # rollout.samples_per_prompt of configs/tiny.yaml
    torch.manual_seed(0)
    varying = torch.rand(group_size, dtype=dtype)
    # Interleave the all-equal group (id 5) with a varying one (id 2).
    rewards = torch.stack([torch.full((group_size,), value, dtype=dtype), varying], dim=1).reshape(-1)
    group_ids = torch.tensor([5, 2] * group_size)

    advantages = group_advantages(rewards, group_ids, scale=scale)

    equal_group = advantages[group_ids == 5]
    assert equal_group.tolist() == [0.0] * group_size, (
        f"an all-equal group must carry no signal, got {equal_group.tolist()}"
    )
    assert (advantages[group_ids == 2] != 0).all()


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_hand_formula_for_interleaved_groups_of_different_sizes(scale: bool) -> None:
    torch.manual_seed(1234)
    sizes = {7: 2, 42: 3, 3: 5, 100: 8, 11: 4}  # non-contiguous group ids, different sizes
    group_list = [group for group, size in sizes.items() for _ in range(size)]
    order = torch.randperm(len(group_list)).tolist()
    group_ids = [group_list[i] for i in order]  # groups interleaved at random
    rewards = (torch.rand(len(group_ids), dtype=torch.float64) * 3 - 1).tolist()

    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(group_ids), scale=scale)

    expected = hand_advantages(rewards, group_ids, scale=scale)
    assert advantages.dtype == torch.float64
    assert advantages.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # Spot-check one group written out in full: the two members of group 7.
    first, second = [i for i, g in enumerate(group_ids) if g == 7]
    mean = (rewards[first] + rewards[second]) / 2
    std = math.sqrt(((rewards[first] - mean) ** 2 + (rewards[second] - mean) ** 2) / (2 - 1))
    want = (rewards[first] - mean) / (std + EPS) if scale else rewards[first] - mean
    assert float(advantages[first]) == pytest.approx(want, rel=1e-12)


def test_group_advantages_are_centred_per_group_and_unit_std_when_scaled() -> None:
    torch.manual_seed(7)
    group_ids = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 0, 0])
    rewards = torch.rand(len(group_ids), dtype=torch.float64)
    for scale in (True, False):
        advantages = group_advantages(rewards, group_ids, scale=scale)
        for group in (0, 1, 2):
            members = advantages[group_ids == group].tolist()
            assert sum(members) == pytest.approx(0.0, abs=1e-12)
            if scale:
                mean = sum(members) / len(members)
                std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
                assert std == pytest.approx(1.0, rel=1e-4)  # 1 up to the eps in the denominator


def test_group_advantages_float32_rewards_like_the_trainer() -> None:
    torch.manual_seed(3)
    group_ids = [4, 9, 4, 9, 4, 9, 4, 9, 1, 1, 1]
    rewards = torch.rand(len(group_ids), dtype=torch.float32)
    advantages = group_advantages(rewards, torch.tensor(group_ids), scale=True)
    assert advantages.dtype == torch.float32
    expected = hand_advantages([float(r) for r in rewards], group_ids, scale=True)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-5)


# ---------------------------------------------------------------------------------------------
# clipped_policy_loss: clipping


# (ratio, advantage): expected per-token loss, whether the token counts as clipped, d loss / d logprob
CLIP_CASES = {
    "above, A>0: clipped term is the min": (1.5, 2.0, -(1 + CLIP) * 2.0, True, 0.0),
    "above, A<0: unclipped term is the min": (1.5, -2.0, -(1.5 * -2.0), True, -(1.5 * -2.0)),
    "below, A>0: unclipped term is the min": (0.5, 2.0, -(0.5 * 2.0), True, -(0.5 * 2.0)),
    "below, A<0: clipped term is the min": (0.5, -2.0, -(1 - CLIP) * -2.0, True, 0.0),
    "inside, A>0": (1.1, 2.0, -(1.1 * 2.0), False, -(1.1 * 2.0)),
    "inside, A<0": (0.9, -2.0, -(0.9 * -2.0), False, -(0.9 * -2.0)),
}


@pytest.mark.parametrize("case", CLIP_CASES)
def test_single_token_clipped_objective(case: str) -> None:
    ratio, advantage, want_loss, want_clipped, want_gradient = CLIP_CASES[case]
    # The hand helper agrees with the explicit values written above.
    assert hand_token_objective(ratio, advantage, CLIP) == pytest.approx((want_loss, want_clipped, want_gradient))

    logprobs = torch.tensor([[-1.3]], dtype=torch.float64, requires_grad=True)
    old = old_for_ratios(logprobs.detach(), [[ratio]])
    terms = clipped_policy_loss(
        logprobs, old, torch.tensor([advantage], dtype=torch.float64), torch.ones(1, 1), clip_low=CLIP
    )

    assert terms.policy_loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert terms.loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert terms.out_of_range.item() == (1.0 if want_clipped else 0.0)
    terms.loss.backward()
    assert float(logprobs.grad[0, 0]) == pytest.approx(want_gradient, rel=1e-12, abs=1e-15)


def test_clipping_on_both_sides_over_a_batch() -> None:
    torch.manual_seed(11)
    ratios = [
        [1.50, 0.50, 1.10, 1.35],  # A > 0: above (clipped), below, inside, above (clipped)
        [1.50, 0.50, 0.95, 0.70],  # A < 0: above, below (clipped), inside, below (clipped)
        [1.25, 0.79, 1.19, 0.81],  # A > 0: just outside / just inside both bounds
        [2.00, 0.10, 1.00, 1.21],  # A < 0
    ]
    advantages = [1.3, -0.7, 0.4, -2.0]
    mask = [[1, 1, 1, 1]] * 4
    logprobs = -torch.rand(4, 4, dtype=torch.float64) * 3
    old = old_for_ratios(logprobs, ratios)

    terms = clipped_policy_loss(
        logprobs, old, torch.tensor(advantages, dtype=torch.float64), torch.tensor(mask), clip_low=CLIP
    )

    expected = hand_loss(logprobs.tolist(), old.tolist(), advantages, mask, CLIP)
    assert float(terms.policy_loss) == pytest.approx(expected["policy_loss"], rel=1e-12)
    assert float(terms.loss) == pytest.approx(expected["policy_loss"], rel=1e-12)
    # Outside the range [0.8, 1.2]: row 0: 1.5, 0.5, 1.35; row 1: 1.5, 0.5, 0.7; row 2: 1.25, 0.79; row 3: 2.0, 0.1, 1.21.
    assert float(terms.out_of_range) == pytest.approx(11 / 16, rel=1e-12)
    assert expected["clip_fraction"] == pytest.approx(11 / 16)
    # Written out for row 0 (A = 1.3): -(1.2 A) - (0.5 A) - (1.1 A) - (1.2 A), over 16 tokens in all.
    row0 = -(1.2 * 1.3) - (0.5 * 1.3) - (1.1 * 1.3) - (1.2 * 1.3)
    row0_alone = clipped_policy_loss(
        logprobs[:1], old[:1], torch.tensor([1.3], dtype=torch.float64), torch.ones(1, 4), clip_low=CLIP
    )
    assert float(row0_alone.policy_loss) == pytest.approx(row0 / 4, rel=1e-12)


def test_the_binding_clip_fraction_counts_only_clips_the_min_picks() -> None:
    """The batch above: 11 of 16 ratios lie outside [0.8, 1.2], but the clip binds (its term is the larger loss,
    verl's pg_clipfrac) only above the range with A > 0 and below it with A < 0: 6 of 16."""
    ratios = [[1.50, 0.50, 1.10, 1.35], [1.50, 0.50, 0.95, 0.70], [1.25, 0.79, 1.19, 0.81], [2.00, 0.10, 1.00, 1.21]]
    advantages = [1.3, -0.7, 0.4, -2.0]
    logprobs = -torch.rand(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(11)) * 3
    old = old_for_ratios(logprobs, ratios)
    terms = clipped_policy_loss(logprobs, old, torch.tensor(advantages, dtype=torch.float64), torch.ones(4, 4), CLIP)
    binding = sum(
        (ratio > 1 + CLIP and advantage > 0) or (ratio < 1 - CLIP and advantage < 0)
        for row, advantage in zip(ratios, advantages, strict=True)
        for ratio in row
    )
    assert binding == 6
    assert float(terms.clipped) == pytest.approx(6 / 16, rel=1e-12)
    assert float(terms.out_of_range) == pytest.approx(11 / 16, rel=1e-12)
    assert float(terms.dual_clipped) == 0.0


# (ratio, advantage): the token's loss with dual clip c = 3, d loss / d logprob, (out of range, clip binds, dual binds)
DUAL_CLIP_CASES = {
    "A<0, ratio 4: the dual clip holds the loss at 3": (4.0, -1.0, 3.0, 0.0, (True, False, True)),
    "A<0, ratio 2: below the bound, the unclipped loss": (2.0, -1.0, 2.0, 2.0, (True, False, False)),
    "A<0, ratio 0.5: the clip binds, under the bound": (0.5, -1.0, 0.8, 0.0, (True, True, False)),
    "A>0, ratio 4: the clip binds, no dual clip for A>0": (4.0, 1.0, -1.2, 0.0, (True, True, False)),
    "A<0, ratio 1.1: inside": (1.1, -1.0, 1.1, 1.1, (False, False, False)),
}


@pytest.mark.parametrize("case", DUAL_CLIP_CASES)
def test_dual_clip_bounds_a_negative_advantages_loss(case: str) -> None:
    """Dual-clip PPO (verl's clip_ratio_c): for A < 0 the loss is min(max(-r A, -clip(r) A), -c A)."""
    ratio, advantage, want_loss, want_gradient, (outside, clipped, dual) = DUAL_CLIP_CASES[case]
    logprobs = torch.tensor([[-1.1]], dtype=torch.float64, requires_grad=True)
    terms = clipped_policy_loss(
        logprobs,
        old_for_ratios(logprobs.detach(), [[ratio]]),
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 1),
        clip_low=CLIP,
        dual_clip=3.0,
    )
    assert float(terms.loss) == pytest.approx(want_loss, rel=1e-12)
    terms.loss.backward()
    assert float(logprobs.grad[0, 0]) == pytest.approx(want_gradient, rel=1e-12, abs=1e-15)
    shares = (terms.out_of_range, terms.clipped, terms.dual_clipped)
    assert [float(share) for share in shares] == [float(outside), float(clipped), float(dual)]
    old = old_for_ratios(logprobs.detach(), [[ratio]])
    without = clipped_policy_loss(logprobs.detach(), old, torch.tensor([advantage]), torch.ones(1, 1), CLIP)
    assert float(without.loss) == pytest.approx(-min(ratio * advantage, min(max(ratio, 0.8), 1.2) * advantage))


# x = log pi - log pi_ref per token: the estimators' values and d/d log pi, clamped at 10 (k3 at x = -4 is 49.6).
KL_XS = [0.3, -0.5, 1.2, -4.0, 12.0]


def hand_kl(estimator: str, x: float, clamp: float | None) -> tuple[float, float]:
    """(value, d value / d log pi) of one token's estimate, as the README writes them."""
    value, gradient = {
        "k1": (x, 1.0),
        "k2": (x * x / 2, x),
        "k3": (math.exp(-x) + x - 1, 1 - math.exp(-x)),
        "k3_plus": (math.exp(-x) + x - 1, x),  # k3's value, k2's gradient
    }[estimator]
    if clamp is not None and abs(value) > clamp:
        value = math.copysign(clamp, value)
        gradient = x if estimator == "k3_plus" else 0.0  # k3_plus keeps k2's gradient past the clamp, as verl's
    return value, gradient


@pytest.mark.parametrize("clamp", [None, 10.0], ids=["unclamped", "clamp10"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3_plus"])
def test_kl_estimators_values_and_gradients_are_the_hand_formulas(estimator: str, clamp: float | None) -> None:
    ref = torch.tensor([[-1.0, -2.0, -0.7, -3.0, -15.0]], dtype=torch.float64)
    logprobs = (ref + torch.tensor([KL_XS], dtype=torch.float64)).requires_grad_()
    value_BT = kl_estimate(logprobs, ref, estimator, clamp)
    value_BT.sum().backward()
    want = [hand_kl(estimator, x, clamp) for x in KL_XS]
    assert value_BT.detach()[0].tolist() == pytest.approx([v for v, _ in want], rel=1e-12)
    assert logprobs.grad[0].tolist() == pytest.approx([g for _, g in want], rel=1e-12, abs=1e-15)
    if estimator == "k3" and clamp is None:
        assert float(value_BT[0, 3]) == pytest.approx(math.exp(4) - 5)  # 49.6, the unclamped outlier


def test_the_loss_adds_kl_coef_times_the_estimators_aggregate_and_subtracts_the_entropy_bonus() -> None:
    """Sequence aggregation, two rows of 2 and 3 tokens, A = 0 (no policy gradient): loss = kl_coef * mean over rows
    of each row's mean k2 - entropy_coef * the same mean of the entropies; gradients by hand."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ref = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -1.5, -2.5]], dtype=torch.float64)
    xs = [[0.4, -0.2, 5.0], [0.1, 0.3, -0.6]]
    logprobs = (ref + torch.tensor(xs, dtype=torch.float64)).requires_grad_()
    entropy = torch.tensor([[1.5, 0.5, 9.0], [2.0, 1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    terms = clipped_policy_loss(
        logprobs, logprobs.detach(), torch.zeros(2, dtype=torch.float64), mask, CLIP, aggregation="sequence",
        ref_logprobs_BT=ref, kl_coef=0.5, kl_estimator="k2", entropy_BT=entropy, entropy_coef=0.01,
    )  # fmt: skip
    kl = ((0.4**2 + 0.2**2) / 2 / 2 + (0.1**2 + 0.3**2 + 0.6**2) / 2 / 3) / 2
    mean_entropy = ((1.5 + 0.5) / 2 + (2.0 + 1.0 + 0.0) / 3) / 2
    assert float(terms.kl) == pytest.approx(kl, rel=1e-12)
    assert float(terms.entropy) == pytest.approx(mean_entropy, rel=1e-12)
    assert float(terms.loss) == pytest.approx(0.5 * kl - 0.01 * mean_entropy, rel=1e-12)
    terms.loss.backward()
    # d/d log pi of 0.5 * k2 / (row length * 2 rows) = 0.5 * x / (2 L); d/d H = -0.01 / (2 L); 0 where masked.
    want_logprob = [[0.5 * x / (2 * 2) for x in xs[0][:2]] + [0.0], [0.5 * x / (2 * 3) for x in xs[1]]]
    assert logprobs.grad.tolist() == [pytest.approx(row, rel=1e-12) for row in want_logprob]
    assert entropy.grad.tolist() == [pytest.approx([-0.01 / 4] * 2 + [0.0]), pytest.approx([-0.01 / 6] * 3)]


# ---------------------------------------------------------------------------------------------
# clipped_policy_loss: token-level aggregation


def test_masked_tokens_do_not_count_and_every_unmasked_token_weighs_the_same() -> None:
    torch.manual_seed(5)
    # One long sequence (6 response tokens) and one short one (2 tokens), padded to T = 6.
    mask = [[1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]]
    advantages = [0.8, -1.5]
    logprobs = -torch.rand(2, 6, dtype=torch.float64) * 2
    old = logprobs + (torch.rand(2, 6, dtype=torch.float64) - 0.5) * 0.6  # some ratios clip
    mask_t = torch.tensor(mask)
    adv_t = torch.tensor(advantages, dtype=torch.float64)

    terms = clipped_policy_loss(logprobs, old, adv_t, mask_t, clip_low=CLIP)

    expected = hand_loss(logprobs.tolist(), old.tolist(), advantages, mask, CLIP)
    assert float(terms.policy_loss) == pytest.approx(expected["policy_loss"], rel=1e-12)
    assert float(terms.out_of_range) == pytest.approx(expected["clip_fraction"], rel=1e-12)

    # Token mean over all 8 unmasked tokens, not the mean of the two sequence means.
    per_token = {
        (row, col): hand_token_objective(math.exp(float(logprobs[row, col] - old[row, col])), advantages[row], CLIP)[0]
        for row in range(2)
        for col in range(6)
        if mask[row][col]
    }
    token_mean = sum(per_token.values()) / 8
    sequence_means = [sum(v for (row, _), v in per_token.items() if row == r) / sum(mask[r]) for r in range(2)]
    assert float(terms.policy_loss) == pytest.approx(token_mean, rel=1e-12)
    assert abs(token_mean - sum(sequence_means) / 2) > 1e-3  # the two aggregations really differ here

    # Whatever sits in the masked positions (here: ratios of e^5 and e^-5) changes nothing.
    garbage_old = old.clone()
    garbage_old[mask_t == 0] = (
        logprobs[mask_t == 0] + torch.where(torch.rand(int((mask_t == 0).sum())) > 0.5, 5.0, -5.0).double()
    )
    garbage = clipped_policy_loss(logprobs, garbage_old, adv_t, mask_t, clip_low=CLIP)
    assert float(garbage.policy_loss) == float(terms.policy_loss)
    assert float(garbage.out_of_range) == float(terms.out_of_range)


def test_num_tokens_makes_minibatch_losses_add_up_to_the_batch_loss() -> None:
    torch.manual_seed(9)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    logprobs = -torch.rand(4, 5, dtype=torch.float64)
    old = logprobs + (torch.rand(4, 5, dtype=torch.float64) - 0.5) * 0.5
    ref = logprobs + (torch.rand(4, 5, dtype=torch.float64) - 0.5)
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    total = int(mask.sum())  # 11

    whole = clipped_policy_loss(logprobs, old, advantages, mask, CLIP, ref_logprobs_BT=ref, kl_coef=0.1)
    parts = [
        clipped_policy_loss(
            logprobs[rows],
            old[rows],
            advantages[rows],
            mask[rows],
            CLIP,
            ref_logprobs_BT=ref[rows],
            kl_coef=0.1,
            num_tokens=total,
        )
        for rows in (slice(0, 1), slice(1, 4))
    ]

    assert sum(float(p.loss) for p in parts) == pytest.approx(float(whole.loss), rel=1e-12)
    expected = hand_loss(
        logprobs[1:4].tolist(),
        old[1:4].tolist(),
        advantages[1:4].tolist(),
        mask[1:4].tolist(),
        CLIP,
        ref=ref[1:4].tolist(),
        kl_coef=0.1,
        num_tokens=total,
    )
    assert float(parts[1].policy_loss) == pytest.approx(expected["policy_loss"], rel=1e-12)
    assert float(parts[1].kl) == pytest.approx(expected["kl"], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# clipped_policy_loss: the KL term


def test_kl_is_the_masked_mean_k3_estimate_and_kl_coef_adds_it() -> None:
    torch.manual_seed(21)
    mask = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    advantages = [0.5, -1.0, 1.5]
    logprobs = -torch.rand(3, 4, dtype=torch.float64) * 2
    old = logprobs + (torch.rand(3, 4, dtype=torch.float64) - 0.5) * 0.3
    ref = logprobs + (torch.rand(3, 4, dtype=torch.float64) - 0.5) * 1.5
    ref[0, 3] = logprobs[0, 3] + 8.0  # a masked token with a huge KL must not count
    args = (logprobs, old, torch.tensor(advantages, dtype=torch.float64), torch.tensor(mask))

    with_kl = clipped_policy_loss(*args, clip_low=CLIP, ref_logprobs_BT=ref, kl_coef=0.25)

    expected = hand_loss(logprobs.tolist(), old.tolist(), advantages, mask, CLIP, ref=ref.tolist(), kl_coef=0.25)
    k3_sum = sum(
        math.exp(float(ref[r, c] - logprobs[r, c])) - float(ref[r, c] - logprobs[r, c]) - 1
        for r in range(3)
        for c in range(4)
        if mask[r][c]
    )
    assert expected["kl"] == pytest.approx(k3_sum / 9, rel=1e-12)
    assert float(with_kl.kl) == pytest.approx(k3_sum / 9, rel=1e-12)
    assert float(with_kl.kl) > 0
    assert float(with_kl.policy_loss) == pytest.approx(expected["policy_loss"], rel=1e-12)
    assert float(with_kl.loss) == pytest.approx(expected["policy_loss"] + 0.25 * k3_sum / 9, rel=1e-12)

    # kl_coef 0 still reports the KL but leaves it out of the loss.
    reported = clipped_policy_loss(*args, clip_low=CLIP, ref_logprobs_BT=ref, kl_coef=0.0)
    assert float(reported.kl) == pytest.approx(k3_sum / 9, rel=1e-12)
    assert float(reported.loss) == pytest.approx(expected["policy_loss"], rel=1e-12)

    # The reference equal to the policy: zero KL.
    same = clipped_policy_loss(*args, clip_low=CLIP, ref_logprobs_BT=logprobs.clone(), kl_coef=0.25)
    assert float(same.kl) == 0.0


def test_kl_is_zero_without_a_reference() -> None:
    torch.manual_seed(22)
    logprobs = -torch.rand(2, 3, dtype=torch.float64)
    old = logprobs + 0.05
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    terms = clipped_policy_loss(
        logprobs, old, advantages, torch.ones(2, 3), clip_low=CLIP, ref_logprobs_BT=None, kl_coef=0.5
    )
    assert float(terms.kl) == 0.0
    assert float(terms.loss) == float(terms.policy_loss)
    expected = hand_loss(logprobs.tolist(), old.tolist(), advantages.tolist(), [[1, 1, 1]] * 2, CLIP)
    assert float(terms.loss) == pytest.approx(expected["policy_loss"], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# clipped_policy_loss: gradients


def test_gradient_with_respect_to_logprobs_matches_hand_derivation() -> None:
    torch.manual_seed(31)
    ratios = [
        [1.05, 0.92, 1.50, 1.00],  # A > 0: inside, inside, clipped (no gradient), masked
        [0.97, 1.15, 0.50, 1.30],  # A < 0: inside, inside, clipped (no gradient), above with A<0 (gradient)
    ]
    mask = [[1, 1, 1, 0], [1, 1, 1, 1]]
    advantages = [0.9, -1.4]
    base = -torch.rand(2, 4, dtype=torch.float64) * 2
    old = old_for_ratios(base, ratios)
    ref = base + (torch.rand(2, 4, dtype=torch.float64) - 0.5)
    n = 7  # unmasked tokens

    logprobs = base.clone().requires_grad_(True)
    clipped_policy_loss(
        logprobs, old, torch.tensor(advantages, dtype=torch.float64), torch.tensor(mask), clip_low=CLIP
    ).loss.backward()

    # Unclipped token: d/dlogp of -r A / N is -r A / N.
    assert float(logprobs.grad[0, 0]) == pytest.approx(-1.05 * 0.9 / n, rel=1e-12)
    assert float(logprobs.grad[1, 1]) == pytest.approx(-1.15 * -1.4 / n, rel=1e-12)
    for row in range(2):
        for col in range(4):
            want = hand_token_objective(ratios[row][col], advantages[row], CLIP)[2] / n if mask[row][col] else 0.0
            assert float(logprobs.grad[row, col]) == pytest.approx(want, rel=1e-12, abs=1e-15), (row, col)
    assert float(logprobs.grad[0, 2]) == 0.0  # clipped: the constant clipped term is the min
    assert float(logprobs.grad[1, 2]) == 0.0
    assert float(logprobs.grad[0, 3]) == 0.0  # masked

    # With the KL: d/dlogp of kl_coef * k3 / N is kl_coef * (1 - exp(ref - logp)) / N on top.
    logprobs = base.clone().requires_grad_(True)
    clipped_policy_loss(
        logprobs,
        old,
        torch.tensor(advantages, dtype=torch.float64),
        torch.tensor(mask),
        clip_low=CLIP,
        ref_logprobs_BT=ref,
        kl_coef=0.3,
    ).loss.backward()
    kl_part = 0.3 * (1 - math.exp(float(ref[0, 0] - base[0, 0]))) / n
    assert float(logprobs.grad[0, 0]) == pytest.approx(-1.05 * 0.9 / n + kl_part, rel=1e-12)
    assert float(logprobs.grad[0, 3]) == 0.0


# ---------------------------------------------------------------------------------------------
# Variants: aggregation, asymmetric clipping, behaviour importance weights, equal-group filter


def hand_variant_loss(logprobs, old, advantages, mask, clip_low, clip_high, aggregation, max_length, weights=None):
    """The policy loss written out per sequence: each token's -w min(r A, clip(r, 1-lo, 1+hi) A), then reduced."""
    token_losses = []  # per row: the losses of its unmasked tokens
    for row, advantage in enumerate(advantages):
        row_losses = []
        for col, keep in enumerate(mask[row]):
            if keep:
                ratio = math.exp(logprobs[row][col] - old[row][col])
                clipped_ratio = min(max(ratio, 1 - clip_low), 1 + clip_high)
                weight = 1.0 if weights is None else weights[row][col]
                row_losses.append(-min(ratio * advantage, clipped_ratio * advantage) * weight)
        token_losses.append(row_losses)
    if aggregation == "token":
        return sum(sum(r) for r in token_losses) / sum(len(r) for r in token_losses)
    if aggregation == "sequence":
        return sum(sum(r) / len(r) for r in token_losses) / len(token_losses)
    return sum(sum(r) / max_length for r in token_losses) / len(token_losses)


def random_batch(seed: int, rows: int = 4, length: int = 7):
    generator = torch.Generator().manual_seed(seed)
    lengths = [1 + int(torch.randint(0, length, (1,), generator=generator)) for _ in range(rows)]
    starts = [int(torch.randint(0, length - n + 1, (1,), generator=generator)) for n in lengths]
    mask = [[1 if s <= c < s + n else 0 for c in range(length)] for s, n in zip(starts, lengths, strict=True)]
    logprobs = -torch.rand(rows, length, dtype=torch.float64, generator=generator) * 2
    old = logprobs + (torch.rand(rows, length, dtype=torch.float64, generator=generator) - 0.5) * 0.8
    advantages = (torch.rand(rows, dtype=torch.float64, generator=generator) - 0.5) * 4
    return logprobs, old, advantages, mask


@pytest.mark.parametrize("aggregation", ["token", "sequence", "dr_grpo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_aggregations_match_hand_reductions(aggregation: str, seed: int) -> None:
    logprobs, old, advantages, mask = random_batch(seed)
    terms = clipped_policy_loss(
        logprobs, old, advantages, torch.tensor(mask), clip_low=CLIP, aggregation=aggregation, max_length=10
    )
    want = hand_variant_loss(logprobs.tolist(), old.tolist(), advantages.tolist(), mask, CLIP, CLIP, aggregation, 10)
    assert float(terms.policy_loss) == pytest.approx(want, rel=1e-12)


def test_aggregations_weigh_tokens_as_documented() -> None:
    """Two sequences, 4 tokens and 1 token, every token's loss 1: token mean 1; sequence mean 1; Dr. GRPO with
    max_length 8: (4/8 + 1/8) / 2. A token of the short sequence weighs 1/5, 1/2 and 1/16 of the loss."""
    mask_BT = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    ones_BT = torch.ones(2, 4, dtype=torch.float64)
    assert float(aggregate(ones_BT, mask_BT, "token")) == 1.0
    assert float(aggregate(ones_BT, mask_BT, "sequence")) == 1.0
    assert float(aggregate(ones_BT, mask_BT, "dr_grpo", max_length=8)) == pytest.approx((4 / 8 + 1 / 8) / 2)
    for aggregation, want in (("token", 1 / 5), ("sequence", 1 / 2), ("dr_grpo", 1 / 16)):
        values_BT = ones_BT.clone().requires_grad_(True)
        aggregate(values_BT, mask_BT, aggregation, max_length=8).backward()
        assert float(values_BT.grad[1, 0]) == pytest.approx(want), aggregation
        assert float(values_BT.grad[1, 1]) == 0.0  # masked


@pytest.mark.parametrize("aggregation", ["token", "sequence", "dr_grpo"])
def test_minibatch_split_over_ranks_adds_up_for_every_aggregation(aggregation: str) -> None:
    logprobs, old, advantages, mask = random_batch(5, rows=6)
    mask_BT = torch.tensor(mask)
    counts = {"num_tokens": int(mask_BT.sum()), "num_sequences": 6, "max_length": 10}
    whole = clipped_policy_loss(logprobs, old, advantages, mask_BT, CLIP, aggregation=aggregation, max_length=10)
    parts = [
        clipped_policy_loss(logprobs[r], old[r], advantages[r], mask_BT[r], CLIP, aggregation=aggregation, **counts)
        for r in (slice(0, 2), slice(2, 6))
    ]
    assert sum(float(p.policy_loss) for p in parts) == pytest.approx(float(whole.policy_loss), rel=1e-12)


# (ratio, advantage) with clip range [0.8, 1.28]: the clipped ratio the min picks, whether the token is clipped.
ASYMMETRIC_CASES = {
    "1.25, A>0: inside the higher bound": (1.25, 1.5, 1.25, False),
    "1.30, A>0: clipped at 1.28": (1.30, 1.5, 1.28, True),
    "1.30, A<0: the unclipped term is the min": (1.30, -1.5, 1.30, True),
    "0.75, A<0: clipped at 0.8": (0.75, -1.5, 0.80, True),
    "0.75, A>0: the unclipped term is the min": (0.75, 1.5, 0.75, True),
    "0.85, A<0: inside": (0.85, -1.5, 0.85, False),
}


@pytest.mark.parametrize("case", ASYMMETRIC_CASES)
def test_clip_higher_bounds_each_side_separately(case: str) -> None:
    ratio, advantage, effective_ratio, clipped = ASYMMETRIC_CASES[case]
    logprobs = torch.tensor([[-0.7]], dtype=torch.float64)
    terms = clipped_policy_loss(
        logprobs,
        old_for_ratios(logprobs, [[ratio]]),
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 1),
        clip_low=0.2,
        clip_high=0.28,
    )
    assert float(terms.policy_loss) == pytest.approx(-effective_ratio * advantage, rel=1e-12)
    assert float(terms.out_of_range) == (1.0 if clipped else 0.0)


def test_behavior_weights_are_truncated_ratios_of_old_to_behavior() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -1.2]], dtype=torch.float64)
    behavior = torch.tensor([[-1.0, -1.0, -2.0], [-2.5, -0.1, -0.2]], dtype=torch.float64)
    weights, truncated = behavior_weights(behavior_ratio(old, behavior, torch.ones_like(old), ), cap=2.0)
    # exp(0) = 1, exp(-1) = 0.368, exp(1.5) = 4.48 -> 2, exp(-0.5) = 0.607, exp(0) = 1, exp(-1) = 0.368.
    want = [[1.0, math.exp(-1.0), 2.0], [math.exp(-0.5), 1.0, math.exp(-1.0)]]
    assert weights.reshape(-1).tolist() == pytest.approx([w for row in want for w in row], rel=1e-12)
    assert truncated.tolist() == [[False, False, True], [False, False, False]]


def test_behavior_weights_scale_each_tokens_loss_and_gradient_without_a_gradient_of_their_own() -> None:
    logprobs_value, old, advantages, mask = random_batch(8, rows=3, length=5)
    behavior = old + (torch.rand(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) - 0.5) * 2
    old_requiring = old.clone().requires_grad_(True)
    ratio = behavior_ratio(old_requiring, behavior, torch.ones_like(old), )
    weights, _ = behavior_weights(ratio, cap=1.5)
    assert not weights.requires_grad
    logprobs = logprobs_value.clone().requires_grad_(True)
    terms = clipped_policy_loss(logprobs, old, advantages, torch.tensor(mask), CLIP, weights_BT=weights)
    hand_weights = [
        [min(math.exp(o - b), 1.5) for o, b in zip(ro, rb, strict=True)]
        for ro, rb in zip(old.tolist(), behavior.tolist(), strict=True)
    ]
    want = hand_variant_loss(
        logprobs_value.tolist(), old.tolist(), advantages.tolist(), mask, CLIP, CLIP, "token", None, hand_weights
    )
    assert float(terms.policy_loss.detach()) == pytest.approx(want, rel=1e-12)
    terms.loss.backward()
    tokens = sum(map(sum, mask))
    for row in range(3):
        for col in range(5):
            ratio = math.exp(float(logprobs_value[row, col] - old[row, col]))
            gradient = hand_token_objective(ratio, float(advantages[row]), CLIP)[2] * hand_weights[row][col] / tokens
            want_gradient = gradient if mask[row][col] else 0.0
            assert float(logprobs.grad[row, col]) == pytest.approx(want_gradient, rel=1e-12, abs=1e-15)


def test_varied_groups_marks_samples_of_groups_with_unequal_rewards() -> None:
    rewards = torch.tensor([0.5, 0.5, 1.0, 0.2, 0.2, 0.2, 0.0, 1.0, 0.3])
    groups = torch.tensor([3, 3, 3, 8, 8, 8, 1, 1, 5])  # group 5 has one sample: nothing varies
    assert varied_groups(rewards, groups).tolist() == [True, True, True, False, False, False, True, True, False]


# ---------------------------------------------------------------------------------------------
# The train step's update with each variant (tiny model, one optimizer step)


@pytest.mark.parametrize(
    "algorithm",
    [
        {},
        {"loss_aggregation": "sequence"},
        {"loss_aggregation": "dr_grpo", "scale_rewards": False},
        {"clip_eps_high": 0.28},
        {"drop_equal_groups": True},
        {"behavior_weight_cap": None},
        {"kl_coef": 0.1, "loss_aggregation": "sequence"},
        {"kl_coef": 0.1, "kl_estimator": "k3_plus", "kl_clamp": None},
        {"dual_clip": 3.0, "entropy_coef": 0.01},
    ],
    ids=["token", "sequence", "dr_grpo", "clip_higher", "drop_equal_groups", "no_behavior_weights", "kl", "k3_plus",
         "dual_clip_entropy"],
)
def test_every_variant_updates_the_policy_with_a_finite_loss(algorithm: dict, tmp_path) -> None:
    import copy

    from moeloop.steps.model.policy import token_logprobs
    from moeloop.steps.rl.state import make_optimizer
    from moeloop.steps.rl.update import policy_update
    from tests.conftest import small_config
    from tests.distributed.test_train_ep import experience, reference_logprobs_of, tiny_policy

    model = tiny_policy(tmp_path)
    reference = copy.deepcopy(model)
    config = small_config(iterations=1, algorithm=algorithm, trainer={"minibatch_size": 12, "epochs": 1})
    before = [p.detach().clone() for p in model.parameters()]
    ref_logprobs_BT = reference_logprobs_of(model, experience())
    report = policy_update(model, ref_logprobs_BT, make_optimizer(model, config.trainer), experience(), config, seed=0)

    assert math.isfinite(report["loss"]) and math.isfinite(report["grad_norm"]) and report["optimizer_steps"] == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    # experience(): 3 groups of 4, the last with equal rewards; the filter drops it and the batch shrinks to 8.
    dropped = 4 if algorithm.get("drop_equal_groups") else 0
    assert report["samples"] == 12 and report["dropped_samples"] == dropped
    assert report["response_tokens"] == sum(2 + s % 5 for s in range(12) if s < 12 - dropped)
    # The weights: min(exp(old - behaviour), cap) over the kept samples' response tokens, old from the start policy.
    batch = experience()
    kept = slice(0, 12 - dropped)
    with torch.no_grad():
        old_BT, _ = token_logprobs(reference.eval(), batch.input_ids_BT[kept], batch.attention_mask_BT[kept])
    mask_BT = batch.response_mask_BT[kept]
    ratios = torch.exp(old_BT - batch.behavior_logprobs_BT[kept])[mask_BT].tolist()
    if algorithm.get("behavior_weight_cap", 2.0) is None:
        assert "behavior_weight_mean" not in report
    else:
        weights = [min(ratio, 2.0) for ratio in ratios]
        assert report["behavior_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-4)
        assert report["behavior_weight_truncated"] == pytest.approx(sum(r > 2.0 for r in ratios) / len(ratios))


def test_a_last_minibatch_too_small_for_every_rank_joins_the_one_before() -> None:
    from moeloop.steps.rl.batch import minibatches

    order = torch.arange(10)
    assert [len(m) for m in minibatches(order, 4, world_size=2)] == [4, 4, 2]
    assert [len(m) for m in minibatches(order, 4, world_size=3)] == [4, 6]
    assert torch.cat(minibatches(order, 4, world_size=3)).tolist() == order.tolist()
    assert [len(m) for m in minibatches(torch.arange(2), 4, world_size=3)] == [2]  # policy_update skips this batch


def test_at_kl_coef_0_the_reference_runs_on_the_kl_metrics_sample_only_and_the_update_is_unchanged(
    tmp_path, monkeypatch
) -> None:
    """The reference pass feeds only the kl metric at kl_coef 0: it runs on algorithm.kl_metric_samples rows (or
    none), and the update (loss, gradient norm, weights) is the one with the whole batch's reference logprobs."""
    import copy

    from moeloop.steps.errors import MoeloopError
    from moeloop.steps.rl import state
    from moeloop.steps.rl.parallel import Parallel
    from moeloop.steps.rl.state import make_optimizer, reference_logprobs
    from moeloop.steps.rl.update import policy_update
    from tests.conftest import small_config
    from tests.distributed.test_train_ep import experience, tiny_policy

    passed_rows = []
    frozen_logprobs = state.frozen_logprobs

    def counted(model, batch, *args):
        passed_rows.append(len(batch.input_ids_BT))
        return frozen_logprobs(model, batch, *args)

    monkeypatch.setattr(state, "frozen_logprobs", counted)
    model = tiny_policy(tmp_path)  # saved under tmp_path/policy: the reference
    with torch.no_grad():  # the policy moved away from it, so that the kl is not 0
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    configs = {
        samples: small_config(
            iterations=1, algorithm={"kl_metric_samples": samples}, trainer={"minibatch_size": 6, "epochs": 1}
        )
        for samples in (0, 4, 12)
    }
    refs = {s: reference_logprobs(tmp_path / "policy", experience(), c, Parallel()) for s, c in configs.items()}
    assert passed_rows == [4, 12]  # none at kl_metric_samples 0: the reference is not even loaded
    whole_BT = refs[12]
    torch.testing.assert_close(refs[4][:4], whole_BT[:4])  # packed with other rows: equal up to rounding
    assert refs[4][4:].isnan().all() and refs[0].isnan().all()

    reports, weights = {}, {}
    for samples, config in configs.items():
        policy = copy.deepcopy(model)
        reports[samples] = policy_update(
            policy, refs[samples], make_optimizer(policy, config.trainer), experience(), config, seed=0
        )
        weights[samples] = [p.detach().clone() for p in policy.parameters()]
    for samples in (0, 4):
        for key in ("loss", "grad_norm", "clip_fraction_binding", "entropy", "behavior_kl"):
            assert reports[samples][key] == reports[12][key], key
        assert all(torch.equal(a, b) for a, b in zip(weights[samples], weights[12], strict=True))
    assert [reports[s]["kl_samples"] for s in (0, 4, 12)] == [0, 4, 12]
    assert reports[0]["kl"] is None and reports[12]["kl"] > 0 and reports[4]["kl"] > 0
    assert reports[4]["kl"] != reports[12]["kl"]  # measured on the first 4 samples only

    kl_config = small_config(iterations=1, algorithm={"kl_coef": 0.1, "kl_metric_samples": 0})
    passed_rows.clear()
    assert not reference_logprobs(tmp_path / "policy", experience(), kl_config, Parallel()).isnan().any()
    assert passed_rows == [12]  # at kl_coef > 0: the whole batch, whatever the sample size
    with pytest.raises(MoeloopError, match="kl_coef > 0 needs"):
        policy = copy.deepcopy(model)
        policy_update(policy, refs[4], make_optimizer(policy, kl_config.trainer), experience(), kl_config, seed=0)


def test_the_entropy_metric_is_the_policys_and_its_bonus_lowers_the_loss_by_coef_times_it(tmp_path) -> None:
    """One minibatch, one epoch: the update's one forward is the start policy's, so `entropy` is its mean token
    entropy over the response tokens, counted here from HF's whole logits; with entropy_coef c (token aggregation) the
    loss is c times it lower, the policy loss being the same."""
    import copy

    from moeloop.steps.rl.state import make_optimizer
    from moeloop.steps.rl.update import policy_update
    from tests.conftest import small_config
    from tests.distributed.test_train_ep import experience, reference_logprobs_of, tiny_policy

    model = tiny_policy(tmp_path)
    batch = experience()
    with torch.no_grad():
        logits_BTV = copy.deepcopy(model)(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    log_p_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    entropy_BT = torch.nn.functional.pad(-(log_p_BTV.exp() * log_p_BTV).sum(-1)[:, :-1], (1, 0))  # drew token t
    hand = [float(entropy_BT[row, col]) for row, col in batch.response_mask_BT.nonzero().tolist()]
    reports = {}
    for coef in (0.0, 0.05):
        trainer = {"minibatch_size": 12, "epochs": 1}
        config = small_config(iterations=1, algorithm={"entropy_coef": coef}, trainer=trainer)
        policy = copy.deepcopy(model)
        reference = reference_logprobs_of(policy, batch)
        reports[coef] = policy_update(policy, reference, make_optimizer(policy, config.trainer), batch, config, seed=0)
    assert reports[0.0]["entropy"] == pytest.approx(sum(hand) / len(hand), rel=1e-5)
    assert reports[0.05]["entropy"] == pytest.approx(reports[0.0]["entropy"], rel=1e-6)
    assert reports[0.05]["loss"] == pytest.approx(reports[0.0]["loss"] - 0.05 * reports[0.0]["entropy"], rel=1e-5)
    assert reports[0.05]["grad_norm"] != reports[0.0]["grad_norm"]  # the bonus has a gradient of its own


def test_product_sequence_weights_in_the_update_are_the_capped_sequence_likelihood_ratios(tmp_path) -> None:
    """GSPO-token with sequence_weight product: each sequence's behaviour weight is min(prod_t pi_old / pi_behavior,
    cap) on every one of its tokens; the report's mean is over the response tokens."""
    import copy
    import dataclasses

    from moeloop.steps.model.policy import token_logprobs
    from moeloop.steps.rl.state import make_optimizer
    from moeloop.steps.rl.update import policy_update
    from tests.conftest import small_config
    from tests.distributed.test_train_ep import experience, reference_logprobs_of, tiny_policy

    model = tiny_policy(tmp_path)
    batch = experience()
    with torch.no_grad():
        old_BT, _ = token_logprobs(copy.deepcopy(model).eval(), batch.input_ids_BT, batch.attention_mask_BT)
    noise_BT = 0.4 * torch.randn(old_BT.shape, generator=torch.Generator().manual_seed(3))
    # A behaviour policy near pi_old, so that some sequences' products pass the cap and some do not.
    batch = dataclasses.replace(batch, behavior_logprobs_BT=(old_BT + noise_BT) * batch.response_mask_BT)
    algorithm = {"importance_level": "sequence_token", "sequence_weight": "product", "behavior_weight_cap": 2.0}
    config = small_config(iterations=1, algorithm=algorithm, trainer={"minibatch_size": 12, "epochs": 1})
    report = policy_update(
        model, reference_logprobs_of(model, batch), make_optimizer(model, config.trainer), batch, config, seed=0
    )
    weights, truncated = [], []
    for row in range(12):
        positions = batch.response_mask_BT[row].nonzero().squeeze(1).tolist()
        product = math.exp(sum(float(old_BT[row, t] - batch.behavior_logprobs_BT[row, t]) for t in positions))
        weights += [min(product, 2.0)] * len(positions)
        truncated += [product > 2.0] * len(positions)
    assert report["behavior_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-4)
    assert report["behavior_weight_truncated"] == pytest.approx(sum(truncated) / len(truncated))
    assert 0 < sum(truncated) < len(truncated)  # some sequences capped, some not
