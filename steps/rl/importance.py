"""Importance ratios at token or sequence level (GSPO) and train/inference mismatch masks. Pure tensor math.

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071) replaces the token ratio
pi(y_t) / pi_old(y_t) by the sequence's length-normalised ratio s = exp(mean over the response of the log-ratio),
one per sequence, clipped per sequence: on MoE models a few tokens routed to other experts no longer make single
token ratios explode. GSPO-token carries s per token as sg[s] * pi(y_t) / sg[pi(y_t)]: the value is s on every
token, the gradient s * grad log pi(y_t), so token-level advantages still work.
"""

from __future__ import annotations

from typing import Literal

import torch

ImportanceLevel = Literal["token", "sequence", "sequence_token"]


def sequence_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its masked positions: [B] (0 for a row with none)."""
    mask = mask_BT.to(values_BT.dtype)
    return (values_BT * mask).sum(1) / mask.sum(1).clamp(min=1)


def importance_ratio(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, level: ImportanceLevel
) -> torch.Tensor:
    """The ratio the surrogate clips, per token [B, T]: differentiable in logprobs_BT, old_logprobs_BT a constant.

    token: pi / pi_old. sequence: GSPO's s_i = exp(mean_t log(pi / pi_old)) over the masked tokens, the same on
    every token of row i (gradient s_i / |y_i| * grad log pi per token). sequence_token: GSPO-token's
    exp(sg[log s_i] + log pi - sg[log pi]), valued s_i, gradient s_i * grad log pi.
    """
    log_ratio_BT = logprobs_BT - old_logprobs_BT.detach()
    if level == "token":
        return torch.exp(log_ratio_BT)
    sequence_log_ratio_B1 = sequence_mean(log_ratio_BT, mask_BT).unsqueeze(1)
    if level == "sequence":
        return torch.exp(sequence_log_ratio_B1).expand_as(logprobs_BT)
    if level == "sequence_token":
        return torch.exp(sequence_log_ratio_B1.detach() + logprobs_BT - logprobs_BT.detach())
    raise ValueError(f"unknown importance level {level!r}")


SequenceWeight = Literal["geometric", "product"]


def behavior_ratio(
    old_logprobs_BT: torch.Tensor,
    behavior_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    sequence: SequenceWeight | None = None,
) -> torch.Tensor:
    """pi_old / pi_behavior per token (sequence None), or each row's ratio on every token of the row: geometric, the
    length-normalised exp(mean_t log(...)), as GSPO normalises; product, exp(sum_t log(...)), the whole sequence's
    likelihood ratio (an overflow is inf: a cap truncates it). A constant: no gradient flows through it."""
    log_ratio_BT = (old_logprobs_BT - behavior_logprobs_BT).detach()
    if sequence == "geometric":
        log_ratio_BT = sequence_mean(log_ratio_BT, mask_BT).unsqueeze(1).expand_as(log_ratio_BT)
    elif sequence == "product":
        log_ratio_BT = (log_ratio_BT * mask_BT).sum(1, keepdim=True).expand_as(log_ratio_BT)
    return torch.exp(log_ratio_BT)


def mismatch_mask(ratio_BT: torch.Tensor, mask_BT: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """The loss mask: the masked positions whose trainer/behaviour ratio lies in [low, high] (two-sided masking,
    as IcePop does). With a sequence ratio (`behavior_ratio(..., sequence=True)`) whole rows are kept or dropped."""
    return mask_BT.bool() & (ratio_BT >= low) & (ratio_BT <= high)
