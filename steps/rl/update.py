"""One iteration's update: advantages (GRPO: group-normalised; PPO: GAE with the critic), then the actor's and the
critic's optimizer steps, each a plain loop over one precomputed minibatch schedule (README.md in this folder).

Every rank draws the same minibatches and takes its share of each. The losses are aggregated over the whole
minibatch (its global token and sequence counts are the denominators), so the gradients summed over the ranks
are one process's on the whole minibatch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.config_algorithm import MismatchConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.families import moe_layers
from moeloop.steps.model.logprobs import packed_token_logprobs, packed_token_values
from moeloop.steps.model.microbatch import Microbatch
from moeloop.steps.model.moe import check_route_layers, replaying
from moeloop.steps.rl.batch import (
    ExperienceBatch,
    frozen_logprobs,
    frozen_pass,
    masked_mean,
    minibatch_schedule,
    rank_microbatches,
)
from moeloop.steps.rl.grpo import behavior_weights, clipped_policy_loss, group_advantages, kl_estimate, varied_groups
from moeloop.steps.rl.importance import behavior_ratio, mismatch_mask
from moeloop.steps.rl.parallel import Parallel, clip_grad_norm
from moeloop.steps.rl.ppo import gae, token_rewards, value_loss, whiten
from moeloop.steps.rl.router_bias import bias_update_rate, update_correction_biases
from moeloop.steps.rl.router_health import RouterHealth
from moeloop.steps.rl.router_loss import router_aux_loss


@dataclass
class Critic:
    """PPO's value model (`moeloop.steps.model.policy.load_critic_shard`) and its optimizer."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def require_finite(value: float, what: str) -> float:
    """Stop the step at a NaN or an infinity, so that nothing non-finite is committed. Every value checked is the
    same on all ranks, so they all stop together."""
    if not math.isfinite(value):
        raise MoeloopError(f"{what} is {value}: stopping the update before it commits non-finite weights")
    return value


def minibatch_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: ExperienceBatch,
    minibatch_rows: torch.Tensor,
    lengths: list[int],
    loss_of: Callable[[Microbatch], tuple[torch.Tensor, tuple[torch.Tensor, ...], list[torch.Tensor]]],
    config: MoeloopConfig,
    parallel: Parallel,
    health: RouterHealth,
    replay: bool = False,
) -> torch.Tensor:
    """One optimizer step over a minibatch. For each of this rank's packed microbatches of it, loss_of(micro) gives
    (that microbatch's part of the minibatch's loss, its router logits, figures to report with that loss first, as
    tensors); its loss and the routers' aux loss are backpropagated. Then the gradients (summed over the ranks in
    FSDP2's reduce-scatters) are clipped and the optimizer steps; where the family balances its load with the
    routers' correction bias (`moeloop.steps.rl.router_bias`), that bias then moves by the step's expert load. Returns,
    on the device, the gradient norm before clipping and the figures summed over this rank's microbatches
    (`read_steps` reads them): nothing here waits for the GPU, the packing reads the host's lengths (`row_counts`
    of every row). health: given each forward's router logits, it counts the experts' load too; replay: each
    microbatch routes as the engine did (`algorithm.routing_replay`), in its backward too (activation
    checkpointing recomputes the forward there)."""
    settings = config.trainer
    balance_rate = 0.0 if settings.freeze_router else bias_update_rate(settings, model.config.model_type)
    step_load_LE = torch.zeros_like(health.load_LE)
    microbatches = rank_microbatches(batch, minibatch_rows, settings.max_tokens_per_microbatch, parallel, lengths)
    minibatch_tokens = sum(lengths[row] for row in minibatch_rows.tolist())
    optimizer.zero_grad(set_to_none=True)
    sums: list[torch.Tensor] = []
    for micro in microbatches:
        routes = batch.routes_of(micro)
        with replaying(model, routes if replay else None):
            loss, router_logits_L, figures = loss_of(micro)
            (loss + router_aux_loss(model, router_logits_L, micro.real_tokens(), minibatch_tokens, parallel)).backward()
        step_load_LE += health.add(router_logits_L, micro.real_tokens().unsqueeze(0), routes, replayed=replay)
        sums = [a + b.detach() for a, b in zip(sums, figures, strict=True)] if sums else [f.detach() for f in figures]
    grad_norm = clip_grad_norm(model.parameters(), settings.max_grad_norm, parallel)
    optimizer.step()
    if balance_rate:
        update_correction_biases(health.routers, step_load_LE, balance_rate, parallel)
    return torch.stack([value.double() for value in (grad_norm, *sums)])


def read_steps(
    steps: list[torch.Tensor], parallel: Parallel, what: Callable[[int], str]
) -> list[tuple[float, list[float]]]:
    """`minibatch_step`'s results as (gradient norm, figures summed over the ranks), read from the GPU once, when every
    step is queued. A non-finite loss (the first figure) or gradient norm stops the update, naming what(number) of
    the first such step (the weights changed in memory are never committed). Collective: every rank calls it."""
    norms_S, figures_SF = torch.stack(steps).split([1, len(steps[0]) - 1], dim=1)
    figures_SF = figures_SF.contiguous()
    if parallel.world_size > 1:
        dist.all_reduce(figures_SF)
    read = []
    for number, ([norm], figures) in enumerate(zip(norms_S.tolist(), figures_SF.tolist(), strict=True), start=1):
        require_finite(figures[0], f"the loss of {what(number)}")
        read.append((require_finite(norm, f"the gradient norm of {what(number)}"), figures))
    return read


def row_counts(batch: ExperienceBatch, mask_BT: torch.Tensor) -> tuple[list[int], list[int]]:
    """Each row's tokens (what packing reads) and its tokens in mask_BT, on the host: the update's one wait on the
    GPU before its minibatches, so that the host queues them all without waiting again."""
    lengths, masked = torch.stack([batch.attention_mask_BT.sum(1), mask_BT.sum(1)]).tolist()
    return lengths, masked


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
    budget = config.trainer.max_tokens_per_microbatch
    old_values_BT = frozen_pass(packed_token_values, critic.model, batch, budget, parallel) * mask_BT
    rewards_BT = token_rewards(
        batch.rewards_B, mask_BT, algorithm.kl_coef, old_logprobs_BT, ref_logprobs_BT, algorithm.kl_estimator,
        algorithm.kl_clamp,
    )  # fmt: skip
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
        ratio_BT = behavior_ratio(
            old_logprobs_BT, behavior_logprobs_BT, mask_BT, "geometric" if settings.level == "sequence" else None
        )
        loss_mask_BT = mismatch_mask(ratio_BT, mask_BT, settings.low, settings.high)
    responses_B = mask_BT.any(1)
    report["mismatch_masked"] = 1 - float(loss_mask_BT.sum()) / max(float(mask_BT.sum()), 1.0)
    dropped = float((responses_B & ~loss_mask_BT.any(1)).sum())
    report["mismatch_masked_sequences"] = dropped / max(float(responses_B.sum()), 1.0)
    return loss_mask_BT


def policy_update(
    model: torch.nn.Module,
    ref_logprobs_BT: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    batch: ExperienceBatch,
    config: MoeloopConfig,
    seed: int,
    parallel: Parallel = Parallel(),
    critic: Critic | None = None,
) -> dict[str, Any]:
    """Advantages, then epochs x minibatches of clipped-surrogate steps of the policy (PPO: then as many clipped
    value-loss steps of the critic, over the same minibatches); returns what it measured (the same on all ranks).
    ref_logprobs_BT: the reference policy's token logprobs of the batch (`moeloop.steps.rl.state.reference_logprobs`); at
    kl_coef 0, NaN rows are the ones not measured: the kl metric is the measured rows' (kl_samples of them)."""
    settings, algorithm = config.trainer, config.algorithm
    if (algorithm.name == "ppo") != (critic is not None):
        raise MoeloopError(f"algorithm {algorithm.name} {'needs' if critic is None else 'takes no'} critic")
    temperature = config.rollout.temperature
    report: dict[str, Any] = {"samples": len(batch.rewards_B), "dropped_samples": 0}
    if algorithm.drop_equal_groups:
        kept_B = varied_groups(batch.rewards_B, batch.group_ids_B)
        report["dropped_samples"] = int((~kept_B).sum())
        kept_b = kept_B.nonzero().squeeze(1)
        batch, ref_logprobs_BT = batch.select(kept_b), ref_logprobs_BT[kept_b]
    if len(batch.rewards_B) < parallel.world_size:  # nothing left that every rank could take a share of
        return {**report, "optimizer_steps": 0, "response_tokens": int(batch.response_mask_BT.sum())}
    mask_BT = batch.response_mask_BT
    measured_B = ~ref_logprobs_BT.isnan().any(1)
    if algorithm.kl_coef > 0 and not measured_B.all():
        raise MoeloopError("algorithm.kl_coef > 0 needs the reference policy's logprobs of every sample")
    ref_logprobs_BT = ref_logprobs_BT.nan_to_num(0.0)  # unmeasured rows: they reach no loss at kl_coef 0
    replay = algorithm.routing_replay == "rollout"
    if replay and batch.routes_BTLK is None:
        raise MoeloopError("algorithm.routing_replay rollout needs the engine's recorded routed_experts")
    if batch.routes_BTLK is not None:  # before any forward: routes of other layers are refused in one line
        check_route_layers(batch.route_layers, moe_layers(model))
    # pi_old is the trainer's own policy at the start of the update, so the first step's ratio is exactly 1. Its pass
    # measures the routing agreement: pi_old is the policy the engine sampled with (at max_staleness 0), which the
    # training forwards move away from.
    old_health = RouterHealth.of(model, parallel.device)
    budget = settings.max_tokens_per_microbatch
    old_logprobs_BT = frozen_logprobs(model, batch, temperature, budget, parallel, replay, old_health)
    old_routing = old_health.report(distributed=parallel.world_size > 1)
    kl_mask_BT = mask_BT & measured_B.unsqueeze(1)
    report["kl_samples"] = int(measured_B.sum())
    kl_BT = kl_estimate(old_logprobs_BT, ref_logprobs_BT, "k3")  # the metric: k3, unclamped, whatever the loss's
    report["kl"] = masked_mean(kl_BT, kl_mask_BT) if kl_mask_BT.any() else None
    # Engine vs trainer: mean |difference| and KL(behaviour || trainer), k3. With a stale behaviour policy
    # (rollout.max_staleness) it also measures how far the policy moved since the rollouts' checkpoint.
    report["logprob_mismatch"] = masked_mean((old_logprobs_BT - batch.behavior_logprobs_BT).abs(), mask_BT)
    report["behavior_kl"] = masked_mean(kl_estimate(batch.behavior_logprobs_BT, old_logprobs_BT, "k3"), mask_BT)
    weights_BT = None
    if algorithm.behavior_weight_cap is not None:
        sequence = algorithm.sequence_weight if algorithm.importance_level != "token" else None
        ratio_BT = behavior_ratio(old_logprobs_BT, batch.behavior_logprobs_BT, mask_BT, sequence)
        weights_BT, truncated_BT = behavior_weights(ratio_BT, algorithm.behavior_weight_cap)
        report["behavior_weight_mean"] = masked_mean(weights_BT, mask_BT)
        report["behavior_weight_truncated"] = masked_mean(truncated_BT.to(weights_BT.dtype), mask_BT)
    loss_mask_BT = mismatch_loss_mask(old_logprobs_BT, batch.behavior_logprobs_BT, mask_BT, algorithm.mismatch, report)
    if algorithm.overlong.mode == "mask" and batch.truncated_B is not None:  # DAPO's overlong filtering
        loss_mask_BT = loss_mask_BT & ~batch.truncated_B.unsqueeze(1)
    if critic is None:
        advantages = group_advantages(batch.rewards_B, batch.group_ids_B, scale=algorithm.scale_rewards)
    else:
        advantages, returns_BT, old_values_BT = ppo_advantages(
            critic, batch, old_logprobs_BT, ref_logprobs_BT, config, parallel
        )
        report["value_mean"] = masked_mean(old_values_BT, mask_BT)
        report["return_mean"] = masked_mean(returns_BT, mask_BT)
    require_finite(float(advantages.abs().max()), "the largest advantage")  # inf or nan if any one is
    # GRPO puts the KL in the loss (k3); PPO has it in the token rewards (k1).
    kl_reference_BT = ref_logprobs_BT if critic is None and algorithm.kl_coef > 0 else None

    schedule = minibatch_schedule(len(batch.rewards_B), settings, seed, parallel.world_size)
    measured = actor_steps(
        model, optimizer, batch, schedule, advantages, old_logprobs_BT, weights_BT, kl_reference_BT, loss_mask_BT,
        config, parallel,
    )  # fmt: skip
    report.update(measured.pop("router_health"))
    report.update({key: value for key, value in old_routing.items() if key.startswith("routing_agreement")})
    if critic is not None:
        measured |= critic_steps(critic, batch, schedule, old_values_BT, returns_BT, config, parallel)
    report.update({name: sum(values) / len(values) for name, values in measured.items()})
    advantages_abs = advantages.abs() if advantages.dim() == 1 else advantages.abs()[mask_BT]
    report["advantage_abs_mean"] = float(advantages_abs.mean())
    report["optimizer_steps"] = len(measured["loss"])
    report["response_tokens"] = int(mask_BT.sum())
    return report


# The policy's token figures, each a mean over the minibatch's loss tokens, then over the optimizer steps: its
# entropy, the shares of ratios outside the clip range, of clips that bind, of dual clips that bind.
TOKEN_FIGURES = ("entropy", "clip_fraction_out_of_range", "clip_fraction_binding", "dual_clip_fraction")


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
    """One clipped-surrogate step of the policy per minibatch of the schedule, with the routers' aux loss, the
    entropy bonus and, given kl_reference_BT (GRPO with kl_coef > 0), the KL to the reference in the loss.
    loss_mask_BT: the response tokens the loss keeps (`mismatch_loss_mask`). With routing replay each forward routes
    as the engine did. Also the routers' health over these forwards, under "router_health"."""
    algorithm, temperature = config.algorithm, config.rollout.temperature
    replay = algorithm.routing_replay == "rollout"
    health = RouterHealth.of(model, parallel.device)
    model.train()
    lengths, loss_tokens = row_counts(batch, loss_mask_BT)
    steps, token_counts = [], []
    for minibatch_rows in schedule:
        rows_b = minibatch_rows.tolist()
        num_tokens = max(sum(loss_tokens[row] for row in rows_b), 1)
        num_sequences = max(sum(loss_tokens[row] > 0 for row in rows_b), 1)  # masked-out sequences drop out
        token_counts.append(num_tokens)

        def loss_of(micro: Microbatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[torch.Tensor]]:
            logprobs_nT, entropy_nT, router_logits_L = packed_token_logprobs(model, micro, temperature)
            rows = micro.rows_n
            terms = clipped_policy_loss(
                logprobs_nT,
                old_logprobs_BT[rows],
                advantages[rows],
                loss_mask_BT[rows],
                clip_low=algorithm.clip_eps,
                clip_high=algorithm.clip_eps_high,
                aggregation=algorithm.loss_aggregation,
                max_length=config.rollout.max_new_tokens,
                num_tokens=num_tokens,
                num_sequences=num_sequences,  # noqa: B023 -- called in this iteration only
                weights_BT=weights_BT[rows] if weights_BT is not None else None,
                ref_logprobs_BT=kl_reference_BT[rows] if kl_reference_BT is not None else None,
                kl_coef=algorithm.kl_coef if kl_reference_BT is not None else 0.0,
                importance_level=algorithm.importance_level,
                dual_clip=algorithm.dual_clip,
                kl_estimator=algorithm.kl_estimator,
                kl_clamp=algorithm.kl_clamp,
                entropy_BT=entropy_nT,
                entropy_coef=algorithm.entropy_coef,
            )
            # The microbatch's part of the minibatch's loss; the token figures over its own tokens, summed.
            tokens = loss_mask_BT[rows].sum()
            entropy_sum = (entropy_nT.detach() * loss_mask_BT[rows]).sum()
            shares = (terms.out_of_range, terms.clipped, terms.dual_clipped)
            return terms.loss, router_logits_L, [terms.loss, entropy_sum, *(share * tokens for share in shares)]

        steps.append(minibatch_step(model, optimizer, batch, minibatch_rows, lengths, loss_of, config, parallel, health,
                                    replay))  # fmt: skip
    measured: dict[str, Any] = defaultdict(list)
    read = read_steps(steps, parallel, lambda number: f"the policy at minibatch {number} of {len(schedule)}")
    for (grad_norm, (loss, *token_sums)), num_tokens in zip(read, token_counts, strict=True):
        measured["grad_norm"].append(grad_norm)
        measured["loss"].append(loss)
        for name, token_sum in zip(TOKEN_FIGURES, token_sums, strict=True):
            measured[name].append(token_sum / num_tokens)
    health_report = health.report(distributed=parallel.world_size > 1)
    # The agreements are measured on pi_old's pass (policy_update).
    measured["router_health"] = {k: v for k, v in health_report.items() if not k.startswith("routing_agreement")}
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
    critic.model.train()
    health = RouterHealth.of(critic.model, parallel.device)  # its load, for the correction bias
    lengths, mask_tokens = row_counts(batch, mask_BT)
    steps, token_counts = [], []
    for minibatch_rows in schedule:
        num_tokens = max(sum(mask_tokens[row] for row in minibatch_rows.tolist()), 1)
        token_counts.append(num_tokens)

        def loss_of(micro: Microbatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[torch.Tensor]]:
            values_nT, router_logits_L = packed_token_values(critic.model, micro)
            rows = micro.rows_n
            loss, value_clipped = value_loss(
                values_nT, old_values_BT[rows], returns_BT[rows], mask_BT[rows], config.algorithm.value_clip,
                num_tokens,  # noqa: B023 -- called in this iteration only
            )  # fmt: skip
            return loss, router_logits_L, [loss, value_clipped * mask_BT[rows].sum()]

        steps.append(minibatch_step(critic.model, critic.optimizer, batch, minibatch_rows, lengths, loss_of, config,
                                    parallel, health))  # fmt: skip
    measured: dict[str, list[float]] = defaultdict(list)
    read = read_steps(steps, parallel, lambda number: f"the critic at minibatch {number} of {len(schedule)}")
    for (grad_norm, (loss, clipped)), num_tokens in zip(read, token_counts, strict=True):
        measured["critic_grad_norm"].append(grad_norm)
        measured["value_loss"].append(loss)
        measured["value_clip_fraction"].append(clipped / num_tokens)
    return measured
