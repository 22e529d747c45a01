"""PPO's token rewards, generalized advantage estimation and clipped value loss. Pure tensor math.

Positions follow `moeloop.steps.model.policy.token_logprobs`: position t of a response holds the logprob of token t given the
tokens before it, and the critic's value of the state those tokens were chosen in (see `moeloop.steps.train.token_values`).
"""

from __future__ import annotations

import torch

from moeloop.steps.config_algorithm import KlEstimator
from moeloop.steps.rl.grpo import aggregate, kl_estimate


def last_token_index(mask_BT: torch.Tensor) -> torch.Tensor:
    """Each row's last masked position (the response's last token; 0 for an empty row)."""
    positions_T = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    return (positions_T * mask_BT.long()).argmax(1)


def token_rewards(
    rewards_B: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_coef: float,
    logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    kl_estimator: KlEstimator = "k1",
    kl_clamp: float | None = None,
) -> torch.Tensor:
    """The per-token rewards: -kl_coef * the KL estimate (`kl_estimate`; k1, log pi - log pi_ref, by default: its
    sum over a sequence the sequence's KL) on every response token, plus the sequence's reward on its last token.
    Zero elsewhere."""
    mask = mask_BT.to(logprobs_BT.dtype)
    rewards_BT = -kl_coef * kl_estimate(logprobs_BT, ref_logprobs_BT, kl_estimator, kl_clamp).detach() * mask
    rows_B = torch.arange(len(rewards_B), device=rewards_BT.device)
    rewards_BT[rows_B, last_token_index(mask_BT)] += rewards_B.to(rewards_BT.dtype)
    return rewards_BT


def gae(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438) over each row's response tokens.

    delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1}, where the state after the last
    response token is terminal (V = 0, A = 0), also for a response cut at max_new_tokens. Returns (advantages_BT,
    returns_BT = advantages + values), zero outside the mask. A response is one contiguous run of masked positions.
    """
    mask = mask_BT.to(values_BT.dtype)
    advantages_BT = torch.zeros_like(values_BT)
    next_value_B = torch.zeros_like(values_BT[:, 0])
    next_advantage_B = torch.zeros_like(values_BT[:, 0])
    for t in reversed(range(values_BT.shape[1])):
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        advantages_BT[:, t] = (delta_B + gamma * lam * next_advantage_B) * mask[:, t]
        # A masked-out position ends the recursion: whatever comes before it starts from a terminal state.
        next_value_B = values_BT[:, t] * mask[:, t]
        next_advantage_B = advantages_BT[:, t]
    return advantages_BT, (advantages_BT + values_BT) * mask


def whiten(values_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Shift and scale to mean 0, std 1 (population std) over the masked positions; zero outside the mask."""
    mask = mask_BT.to(values_BT.dtype)
    count = mask.sum().clamp(min=1)
    mean = (values_BT * mask).sum() / count
    variance = (((values_BT - mean) * mask) ** 2).sum() / count
    return (values_BT - mean) / (variance.sqrt() + eps) * mask


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    value_clip: float | None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clip(V - V_old, -value_clip, value_clip), a token
    mean (num_tokens: the minibatch's token count); without value_clip, 0.5 (V - R)^2. Returns (loss, the share of
    tokens where the clipped term was the larger)."""
    mask = mask_BT.to(values_BT.dtype)
    unclipped_BT = (values_BT - returns_BT) ** 2
    if value_clip is None:
        loss_BT, clipped_BT = unclipped_BT, torch.zeros_like(mask, dtype=torch.bool)
    else:
        clipped_values_BT = old_values_BT + torch.clamp(values_BT - old_values_BT, -value_clip, value_clip)
        clipped_square_BT = (clipped_values_BT - returns_BT) ** 2
        loss_BT = torch.maximum(unclipped_BT, clipped_square_BT)
        clipped_BT = clipped_square_BT > unclipped_BT
    loss = 0.5 * aggregate(loss_BT, mask_BT, "token", num_tokens=num_tokens)
    return loss, (clipped_BT.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
