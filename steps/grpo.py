"""GRPO: group-normalised advantages and the clipped, token-level surrogate loss. Pure tensor math."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(
    rewards_N: torch.Tensor, group_ids_N: torch.Tensor, scale: bool, eps: float = 1e-6
) -> torch.Tensor:
    """Each sample's reward minus its group's mean, divided by the group's std (ddof=1) when scale is set.

    A group whose rewards are all equal gets exactly zero advantage: it carries no signal (and the rounding
    error of its mean, divided by a zero std, must not become one).
    """
    _, group_index_N = torch.unique(group_ids_N, return_inverse=True)
    groups = int(group_index_N.max()) + 1
    counts_G = torch.bincount(group_index_N, minlength=groups).to(rewards_N.dtype)
    mean_G = torch.zeros(groups, dtype=rewards_N.dtype).index_add_(0, group_index_N, rewards_N) / counts_G
    low_G = torch.full((groups,), torch.inf, dtype=rewards_N.dtype).scatter_reduce(0, group_index_N, rewards_N, "amin")
    high_G = torch.full((groups,), -torch.inf, dtype=rewards_N.dtype).scatter_reduce(
        0, group_index_N, rewards_N, "amax"
    )
    varied_N = (high_G > low_G)[group_index_N]
    centred_N = torch.where(varied_N, rewards_N - mean_G[group_index_N], torch.zeros_like(rewards_N))
    if not scale:
        return centred_N
    square_sum_G = torch.zeros(groups, dtype=rewards_N.dtype).index_add_(0, group_index_N, centred_N**2)
    std_G = (square_sum_G / (counts_G - 1).clamp(min=1)).sqrt()
    return centred_N / (std_G[group_index_N] + eps)


@dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor  # what is minimised
    policy_loss: torch.Tensor
    kl: torch.Tensor  # mean per-token KL(policy || reference), k3 estimator
    clip_fraction: torch.Tensor  # share of tokens whose ratio was clipped


def grpo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_eps: float,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: int | None = None,
) -> LossTerms:
    """Clipped surrogate -min(r A, clip(r, 1-eps, 1+eps) A) plus kl_coef * KL, averaged over tokens.

    num_tokens is the denominator of the token mean: the token count of the whole batch when a batch is
    split into minibatches, so that every token weighs the same whatever minibatch it falls in.
    """
    mask = mask_BT.to(logprobs_BT.dtype)
    denominator = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1)
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT)
    advantages_BT = advantages_B.unsqueeze(1)
    unclipped_BT = ratio_BT * advantages_BT
    clipped_BT = torch.clamp(ratio_BT, 1 - clip_eps, 1 + clip_eps) * advantages_BT
    policy_loss = (-torch.minimum(unclipped_BT, clipped_BT) * mask).sum() / denominator
    clip_fraction = ((unclipped_BT != clipped_BT).to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
    if ref_logprobs_BT is None:
        kl = torch.zeros((), dtype=logprobs_BT.dtype)
    else:
        log_ratio_BT = ref_logprobs_BT - logprobs_BT
        kl = ((torch.exp(log_ratio_BT) - log_ratio_BT - 1) * mask).sum() / denominator
    return LossTerms(policy_loss + kl_coef * kl, policy_loss, kl, clip_fraction)
