"""GRPO's group advantages, and the clipped surrogate policy loss and the KL estimators that GRPO and PPO share.
Pure tensor math.

The loss has the variants users ask for: token, sequence or Dr. GRPO aggregation, asymmetric clipping (DAPO's
clip-higher), dual clip, an entropy bonus, four KL estimators, and truncated importance weights for a behaviour
policy older than the trainer's (decoupled objective). steps/rl/README.md names the peer function each term equals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from moeloop.steps.config_algorithm import KlEstimator
from moeloop.steps.rl.importance import ImportanceLevel, importance_ratio


def group_advantages(
    rewards_B: torch.Tensor, group_ids_B: torch.Tensor, scale: bool, eps: float = 1e-6
) -> torch.Tensor:
    """Each sample's reward minus its group's mean, divided by the group's std (ddof=1) when scale is set.

    A group whose rewards are all equal gets exactly zero advantage: it carries no signal (and the rounding
    error of its mean, divided by a zero std, must not become one).
    """
    _, group_index_B = torch.unique(group_ids_B, return_inverse=True)
    groups = int(group_index_B.max()) + 1
    counts_G = torch.bincount(group_index_B, minlength=groups).to(rewards_B.dtype)
    mean_G = rewards_B.new_zeros(groups).index_add_(0, group_index_B, rewards_B) / counts_G
    varied_B = varied_groups(rewards_B, group_ids_B)
    centred_B = torch.where(varied_B, rewards_B - mean_G[group_index_B], torch.zeros_like(rewards_B))
    if not scale:
        return centred_B
    square_sum_G = rewards_B.new_zeros(groups).index_add_(0, group_index_B, centred_B**2)
    std_G = (square_sum_G / (counts_G - 1).clamp(min=1)).sqrt()
    return centred_B / (std_G[group_index_B] + eps)


def varied_groups(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """Whether each sample's group has rewards that are not all equal (exact comparison: equal floats only)."""
    _, group_index_B = torch.unique(group_ids_B, return_inverse=True)
    groups = int(group_index_B.max()) + 1
    low_G = rewards_B.new_full((groups,), torch.inf).scatter_reduce(0, group_index_B, rewards_B, "amin")
    high_G = rewards_B.new_full((groups,), -torch.inf).scatter_reduce(0, group_index_B, rewards_B, "amax")
    return (high_G > low_G)[group_index_B]


Aggregation = Literal["token", "sequence", "dr_grpo"]


def aggregate(
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    aggregation: Aggregation,
    max_length: int | None = None,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
) -> torch.Tensor:
    """Reduce per-token values over the masked tokens to one number.

    token: the sum over all tokens / num_tokens (every token weighs the same; long answers weigh more).
    sequence: each sequence's token mean, summed / num_sequences (every sequence weighs the same).
    dr_grpo: each sequence's token sum / max_length (a constant), summed / num_sequences (Dr. GRPO, Liu et al.
    2025, arXiv:2503.20783: no length normalisation, so a token's weight does not depend on its answer's length).
    num_tokens and num_sequences are the whole minibatch's counts when it is split over ranks, so that the ranks'
    results add up to the minibatch's; by default they are these rows' own.
    """
    mask = mask_BT.to(values_BT.dtype)
    masked_BT = values_BT * mask
    if aggregation == "token":
        return masked_BT.sum() / (float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1))
    sequences = float(num_sequences) if num_sequences is not None else float(len(values_BT))
    if aggregation == "sequence":
        per_sequence_B = masked_BT.sum(1) / mask.sum(1).clamp(min=1)
    elif aggregation == "dr_grpo":
        if max_length is None:
            raise ValueError("dr_grpo aggregation needs max_length")
        per_sequence_B = masked_BT.sum(1) / max_length
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    return per_sequence_B.sum() / sequences


def behavior_weights(behavior_ratio_BT: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights min(pi_old / pi_behavior, cap) and whether each was truncated, from the ratio
    per token or per sequence (`moeloop.steps.rl.importance.behavior_ratio`).

    The decoupled PPO objective (Hilton et al. 2022, "Batch size-invariance for policy optimization",
    arXiv:2110.00641) clips the ratio against a proximal policy pi_old (here: the trainer's policy at the start
    of the update) and corrects for the behaviour policy that sampled (a stale checkpoint, or the rollout
    engine's numerics) with pi_old / pi_behavior; truncating that weight at a cap bounds its variance, as
    V-trace does (Espeholt et al. 2018, arXiv:1802.01561) and as asynchronous RL for LLMs does (AReaL, Fu et al.
    2025, arXiv:2505.24298). Constants: no gradient flows through them.
    """
    ratio_BT = behavior_ratio_BT.detach()
    return ratio_BT.clamp(max=cap), ratio_BT > cap


def kl_estimate(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: KlEstimator, clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimates of KL(pi || pi_ref) at tokens sampled from pi (Schulman, "Approximating KL divergence",
    2020), with x = log pi - log pi_ref: k1 = x; k2 = x^2 / 2; k3 = r - log r - 1 with r = pi_ref / pi = e^-x;
    k3_plus: k3's value with k2's gradient (x grad log pi, whose mean is the KL's gradient; straight-through, as
    verl's "k3+"). Each value clamped to [-clamp, clamp], no gradient past it (k3_plus' k2 gradient is not)."""
    x_BT = logprobs_BT - ref_logprobs_BT
    value_BT = x_BT if estimator == "k1" else 0.5 * x_BT**2 if estimator == "k2" else torch.exp(-x_BT) + x_BT - 1
    if clamp is not None:
        value_BT = value_BT.clamp(-clamp, clamp)
    if estimator == "k3_plus":
        k2_BT = 0.5 * x_BT**2
        value_BT = k2_BT - k2_BT.detach() + value_BT.detach()
    return value_BT


@dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor  # what is minimised
    policy_loss: torch.Tensor
    kl: torch.Tensor  # KL(policy || reference) by the kl_estimator, aggregated like the policy loss
    entropy: torch.Tensor  # the policy's token entropy, aggregated like the policy loss
    # Shares of the masked tokens: the ratio outside [1 - clip_low, 1 + clip_high]; the clip binding (the clipped
    # term the larger loss); the dual clip binding (the loss held at -c A).
    out_of_range: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor


def clipped_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
    aggregation: Aggregation = "token",
    max_length: int | None = None,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    weights_BT: torch.Tensor | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    importance_level: ImportanceLevel = "token",
    dual_clip: float | None = None,
    kl_estimator: KlEstimator = "k3",
    kl_clamp: float | None = None,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> LossTerms:
    """Clipped surrogate -w min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), where A < 0 at most -dual_clip A,
    aggregated; plus kl_coef times the KL estimate; minus entropy_coef times the entropy, aggregated alike.

    advantages is per sequence [B] (GRPO) or per token [B, T] (PPO). weights_BT are the behaviour importance
    weights (None: 1). clip_high None is clip_low (symmetric); a larger one is DAPO's clip-higher (Yu et al. 2025,
    arXiv:2503.14476), which lets unlikely tokens with A > 0 gain more before the clip stops them. dual_clip c > 1
    bounds a negative advantage's loss, whatever the ratio (Ye et al. 2020, arXiv:1912.09729). importance_level picks
    r (`moeloop.steps.rl.importance.importance_ratio`): per token, or GSPO's per sequence over mask_BT. entropy_BT:
    the policy's entropy at each token's position (`moeloop.steps.model.logprobs`).
    """
    clip_high = clip_low if clip_high is None else clip_high
    mask = mask_BT.to(logprobs_BT.dtype)
    advantages_BT = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    ratio_BT = importance_ratio(logprobs_BT, old_logprobs_BT, mask_BT, importance_level)
    unclipped_BT = -ratio_BT * advantages_BT
    clipped_BT = -torch.clamp(ratio_BT, 1 - clip_low, 1 + clip_high) * advantages_BT
    surrogate_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_clipped_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    if dual_clip is not None:
        bound_BT = -dual_clip * advantages_BT
        dual_clipped_BT = (advantages_BT < 0) & (surrogate_BT > bound_BT)
        surrogate_BT = torch.where(advantages_BT < 0, torch.minimum(surrogate_BT, bound_BT), surrogate_BT)
    if weights_BT is not None:
        surrogate_BT = surrogate_BT * weights_BT
    counts = {"max_length": max_length, "num_tokens": num_tokens, "num_sequences": num_sequences}
    policy_loss = aggregate(surrogate_BT, mask_BT, aggregation, **counts)
    zero = torch.zeros((), dtype=logprobs_BT.dtype, device=logprobs_BT.device)
    kl = zero
    if ref_logprobs_BT is not None:
        kl_BT = kl_estimate(logprobs_BT, ref_logprobs_BT, kl_estimator, kl_clamp)
        kl = aggregate(kl_BT, mask_BT, aggregation, **counts)
    entropy = zero if entropy_BT is None else aggregate(entropy_BT, mask_BT, aggregation, **counts)

    def share(flags_BT: torch.Tensor) -> torch.Tensor:
        return (flags_BT.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)

    out_of_range_BT = (ratio_BT < 1 - clip_low) | (ratio_BT > 1 + clip_high)
    return LossTerms(
        policy_loss + kl_coef * kl - entropy_coef * entropy,
        policy_loss,
        kl,
        entropy,
        share(out_of_range_BT.detach()),
        share(clipped_BT.detach() > unclipped_BT.detach()),
        share(dual_clipped_BT.detach()),
    )
