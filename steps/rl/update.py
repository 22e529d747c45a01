"""One iteration's update: advantages (GRPO: group-normalised; PPO: GAE with the critic), then the actor's and the
critic's optimizer steps, each a plain loop over one precomputed minibatch schedule (README.md in this folder).

Every rank draws the same minibatches and takes its share of each. The losses are aggregated over the whole
minibatch (its global token and sequence counts are the denominators), so the gradients summed over the ranks
are one process's on the whole minibatch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from steps.config import MismatchConfig, MoeloopConfig
from steps.errors import MoeloopError
from steps.model.moe import replaying
from steps.model.policy import token_logprobs, token_values
from steps.rl.batch import ExperienceBatch, frozen_logprobs, frozen_pass, masked_mean, minibatch_schedule
from steps.rl.grpo import behavior_weights, clipped_policy_loss, group_advantages, varied_groups
from steps.rl.importance import behavior_ratio, mismatch_mask
from steps.rl.parallel import Parallel, all_reduce_sum, clip_gradients, expert_parameters, rank_share, sync_gradients
from steps.rl.ppo import gae, token_rewards, value_loss, whiten
from steps.rl.router_health import RouterHealth
from steps.rl.router_loss import router_aux_loss


@dataclass
class Critic:
    """PPO's value model (`steps.model.policy.load_critic_shard`) and its optimizer."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    max_grad_norm: float,
    parallel: Parallel,
) -> float:
    """Backward, gradients summed over the ranks and clipped, one step; returns the gradient norm before clipping."""
    experts = expert_parameters(model)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    sync_gradients(model, experts, parallel)
    grad_norm = clip_gradients(model, experts, max_grad_norm, parallel)
    optimizer.step()
    return grad_norm


def ppo_advantages(
    critic: Critic,
    batch: ExperienceBatch,
    old_logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    config: MoeloopConfig,
    parallel: Parallel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(whitened advantages_BT, returns_BT, old_values_BT): GAE over the token rewards, with the critic's values
    before the update. Whitened over the whole batch's response tokens, so the minibatch split changes nothing."""
    algorithm, mask_BT = config.algorithm, batch.response_mask_BT
    values = partial(token_values, critic.model)
    old_values_BT = frozen_pass(values, critic.model, batch, config.trainer.minibatch_size, parallel) * mask_BT
    rewards_BT = token_rewards(batch.rewards_B, mask_BT, algorithm.kl_coef, old_logprobs_BT, ref_logprobs_BT)
    advantages_BT, returns_BT = gae(rewards_BT, old_values_BT, mask_BT, algorithm.gae_gamma, algorithm.gae_lambda)
    return whiten(advantages_BT, mask_BT), returns_BT, old_values_BT


def mismatch_loss_mask(
    old_logprobs_BT: torch.Tensor,
    behavior_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    settings: MismatchConfig,
    report: dict[str, Any],
) -> torch.Tensor:
    """The policy loss's mask: the response tokens, less those (or the sequences) whose pi_old / pi_behavior leaves
    [low, high]. Reports the share of response tokens and of sequences masked (0 with masking off)."""
    loss_mask_BT = mask_BT
    if settings.level != "off":
        ratio_BT = behavior_ratio(old_logprobs_BT, behavior_logprobs_BT, mask_BT, sequence=settings.level == "sequence")
        loss_mask_BT = mismatch_mask(ratio_BT, mask_BT, settings.low, settings.high)
    responses_B = mask_BT.any(1)
    report["mismatch_masked"] = 1 - float(loss_mask_BT.sum()) / max(float(mask_BT.sum()), 1.0)
    dropped = float((responses_B & ~loss_mask_BT.any(1)).sum())
    report["mismatch_masked_sequences"] = dropped / max(float(responses_B.sum()), 1.0)
    return loss_mask_BT


def policy_update(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: ExperienceBatch,
    config: MoeloopConfig,
    seed: int,
    parallel: Parallel = Parallel(),
    critic: Critic | None = None,
) -> dict[str, Any]:
    """Advantages, then epochs x minibatches of clipped-surrogate steps of the policy (PPO: then as many clipped
    value-loss steps of the critic, over the same minibatches); returns what it measured (the same on all ranks)."""
    settings, algorithm = config.trainer, config.algorithm
    if (algorithm.name == "ppo") != (critic is not None):
        raise MoeloopError(f"algorithm {algorithm.name} {'needs' if critic is None else 'takes no'} critic")
    temperature = config.rollout.temperature
    report: dict[str, Any] = {"samples": len(batch.rewards_B), "dropped_samples": 0}
    if algorithm.drop_equal_groups:
        kept_B = varied_groups(batch.rewards_B, batch.group_ids_B)
        report["dropped_samples"] = int((~kept_B).sum())
        batch = batch.select(kept_B.nonzero().squeeze(1))
    if len(batch.rewards_B) < parallel.world_size:  # nothing left that every rank could take a share of
        return {**report, "optimizer_steps": 0, "response_tokens": int(batch.response_mask_BT.sum())}
    mask_BT = batch.response_mask_BT
    replay = algorithm.routing_replay == "rollout"
    if replay and batch.routes_BTLK is None:
        raise MoeloopError("algorithm.routing_replay rollout needs the engine's recorded routed_experts")
    # pi_old is the trainer's own policy at the start of the update, so the first step's ratio is exactly 1. Its pass
    # measures the routing agreement: pi_old is the policy the engine sampled with (at max_staleness 0), which the
    # training forwards move away from.
    old_health = RouterHealth(model.config.num_experts, model.config.num_experts_per_tok, parallel.device)
    old_logprobs_BT = frozen_logprobs(model, batch, temperature, settings.minibatch_size, parallel, replay, old_health)
    old_routing = old_health.report(distributed=parallel.world_size > 1)
    ref_logprobs_BT = frozen_logprobs(reference, batch, temperature, settings.minibatch_size, parallel)
    log_ratio_BT = ref_logprobs_BT - old_logprobs_BT
    report["kl"] = masked_mean(torch.exp(log_ratio_BT) - log_ratio_BT - 1, mask_BT)
    # Engine vs trainer: mean |difference| and KL(behaviour || trainer), k3. With a stale behaviour policy
    # (rollout.max_staleness) it also measures how far the policy moved since the rollouts' checkpoint.
    behavior_gap_BT = old_logprobs_BT - batch.behavior_logprobs_BT
    report["logprob_mismatch"] = masked_mean(behavior_gap_BT.abs(), mask_BT)
    report["behavior_kl"] = masked_mean(torch.exp(behavior_gap_BT) - behavior_gap_BT - 1, mask_BT)
    weights_BT = None
    if algorithm.behavior_weight_cap is not None:
        ratio_BT = behavior_ratio(
            old_logprobs_BT, batch.behavior_logprobs_BT, mask_BT, sequence=algorithm.importance_level != "token"
        )
        weights_BT, truncated_BT = behavior_weights(ratio_BT, algorithm.behavior_weight_cap)
        report["behavior_weight_mean"] = masked_mean(weights_BT, mask_BT)
        report["behavior_weight_truncated"] = masked_mean(truncated_BT.to(weights_BT.dtype), mask_BT)
    loss_mask_BT = mismatch_loss_mask(old_logprobs_BT, batch.behavior_logprobs_BT, mask_BT, algorithm.mismatch, report)
    if critic is None:
        advantages = group_advantages(batch.rewards_B, batch.group_ids_B, scale=algorithm.scale_rewards)
    else:
        advantages, returns_BT, old_values_BT = ppo_advantages(
            critic, batch, old_logprobs_BT, ref_logprobs_BT, config, parallel
        )
        report["value_mean"] = masked_mean(old_values_BT, mask_BT)
        report["return_mean"] = masked_mean(returns_BT, mask_BT)
    # GRPO puts the KL in the loss (k3); PPO has it in the token rewards (k1).
    kl_reference_BT = ref_logprobs_BT if critic is None and algorithm.kl_coef > 0 else None

    schedule = minibatch_schedule(len(batch.rewards_B), settings, seed, parallel.world_size)
    measured = actor_steps(
        model, optimizer, batch, schedule, advantages, old_logprobs_BT, weights_BT, kl_reference_BT, loss_mask_BT,
        config, parallel,
    )  # fmt: skip
    report.update(measured.pop("router_health"))
    if "routing_agreement" in old_routing:
        report["routing_agreement"] = old_routing["routing_agreement"]
    if critic is not None:
        measured |= critic_steps(critic, batch, schedule, old_values_BT, returns_BT, config, parallel)
    report.update({name: sum(values) / len(values) for name, values in measured.items()})
    advantages_abs = advantages.abs() if advantages.dim() == 1 else advantages.abs()[mask_BT]
    report["advantage_abs_mean"] = float(advantages_abs.mean())
    report["optimizer_steps"] = len(measured["loss"])
    report["response_tokens"] = int(mask_BT.sum())
    return report


def actor_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: ExperienceBatch,
    schedule: list[torch.Tensor],
    advantages: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    weights_BT: torch.Tensor | None,
    kl_reference_BT: torch.Tensor | None,
    loss_mask_BT: torch.Tensor,
    config: MoeloopConfig,
    parallel: Parallel,
) -> dict[str, Any]:
    """One clipped-surrogate step of the policy per minibatch of the schedule, with the routers' aux loss and, given
    kl_reference_BT (GRPO with kl_coef > 0), the k3 KL to the reference in the loss. loss_mask_BT: the response
    tokens the loss keeps (`mismatch_loss_mask`). With routing replay each forward routes as the engine did. Also
    the routers' health over these forwards, under "router_health"."""
    algorithm, temperature = config.algorithm, config.rollout.temperature
    replay = algorithm.routing_replay == "rollout"
    health = RouterHealth(model.config.num_experts, model.config.num_experts_per_tok, parallel.device)
    measured: dict[str, Any] = defaultdict(list)
    model.train()
    for minibatch_rows in schedule:
        num_tokens = max(int(loss_mask_BT[minibatch_rows].sum()), 1)
        num_sequences = max(int(loss_mask_BT[minibatch_rows].any(1).sum()), 1)  # masked-out sequences drop out
        rows = rank_share(minibatch_rows, parallel)
        input_ids_bT, attention_mask_bT = batch.input_ids_BT[rows], batch.attention_mask_BT[rows]
        routes_bTLK = batch.routes_BTLK[rows] if batch.routes_BTLK is not None else None
        with replaying(model, routes_bTLK if replay else None):
            logprobs_bT, router_logits_L = token_logprobs(model, input_ids_bT, attention_mask_bT, temperature)
        terms = clipped_policy_loss(
            logprobs_bT,
            old_logprobs_BT[rows],
            advantages[rows],
            loss_mask_BT[rows],
            clip_low=algorithm.clip_eps,
            clip_high=algorithm.clip_eps_high,
            aggregation=algorithm.loss_aggregation,
            max_length=config.rollout.max_new_tokens,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            weights_BT=weights_BT[rows] if weights_BT is not None else None,
            ref_logprobs_BT=kl_reference_BT[rows] if kl_reference_BT is not None else None,
            kl_coef=algorithm.kl_coef if kl_reference_BT is not None else 0.0,
            importance_level=algorithm.importance_level,
        )
        health.add(router_logits_L, attention_mask_bT, routes_bTLK, replayed=replay)
        aux = router_aux_loss(model, router_logits_L, attention_mask_bT, parallel)
        measured["grad_norm"].append(
            optimizer_step(model, optimizer, terms.loss + aux, config.trainer.max_grad_norm, parallel)
        )
        # The rank's loss is its part of the minibatch's; its clip fraction is over its tokens.
        share_tokens = float(loss_mask_BT[rows].sum())
        loss, clipped = all_reduce_sum([terms.loss.item(), float(terms.clip_fraction) * share_tokens], parallel)
        measured["loss"].append(loss)
        measured["clip_fraction"].append(clipped / num_tokens)
    health_report = health.report(distributed=parallel.world_size > 1)
    health_report.pop("routing_agreement", None)  # measured on pi_old's pass (policy_update)
    measured["router_health"] = health_report
    return measured


def critic_steps(
    critic: Critic,
    batch: ExperienceBatch,
    schedule: list[torch.Tensor],
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    config: MoeloopConfig,
    parallel: Parallel,
) -> dict[str, list[float]]:
    """One clipped value-loss step of the critic (with its routers' aux loss) per minibatch of the schedule."""
    mask_BT = batch.response_mask_BT
    measured: dict[str, list[float]] = defaultdict(list)
    critic.model.train()
    for minibatch_rows in schedule:
        num_tokens = max(int(mask_BT[minibatch_rows].sum()), 1)
        rows = rank_share(minibatch_rows, parallel)
        input_ids_bT, attention_mask_bT = batch.input_ids_BT[rows], batch.attention_mask_BT[rows]
        values_bT, router_logits_L = token_values(critic.model, input_ids_bT, attention_mask_bT)
        loss, value_clipped = value_loss(
            values_bT, old_values_BT[rows], returns_BT[rows], mask_BT[rows], config.algorithm.value_clip, num_tokens
        )
        aux = router_aux_loss(critic.model, router_logits_L, attention_mask_bT, parallel)
        measured["critic_grad_norm"].append(
            optimizer_step(critic.model, critic.optimizer, loss + aux, config.trainer.max_grad_norm, parallel)
        )
        share_tokens = float(mask_BT[rows].sum())
        loss_sum, clipped = all_reduce_sum([loss.item(), float(value_clipped) * share_tokens], parallel)
        measured["value_loss"].append(loss_sum)
        measured["value_clip_fraction"].append(clipped / num_tokens)
    return measured
