"""train: one GRPO or PPO update on the iteration's experience; commits the trainer state (weights, optimizer;
with PPO the critic's too, in critic/).

Starts from the trainer state of the previous iteration (checkpoint 0 for the first, and for PPO a critic made
from it), so the optimizer's moments carry across iterations. The reference policy for the KL is checkpoint 0,
the SFT start. The losses and advantages are in steps/grpo.py and steps/ppo.py; README "Algorithms".

With `trainer.world_size` > 1 it runs under torchrun over a (dp, ep) device mesh: each rank holds the dense
weights and routers whole and its EP slice of the experts, and takes a distinct share of every minibatch's
samples. The update equals one process's on the whole minibatch (tests/test_train_ep.py). Rank 0 alone writes:
the report, and the trainer state with the experts gathered, so the storage layout and publish are unchanged.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from steps.common import (
    already_committed,
    derive_seed,
    fetch_checkpoint,
    local_scratch,
    open_iteration,
    print_json,
    quiet_libraries,
    step_parser,
    write_report,
)
from steps.config import MismatchConfig, MoeloopConfig, TrainerConfig
from steps.errors import MoeloopError, run_cli
from steps.experience import read_rewards, read_rollouts
from steps.grpo import behavior_weights, clipped_policy_loss, group_advantages, varied_groups
from steps.importance import behavior_ratio, mismatch_mask
from steps.moe import MoeBlock, gather_over, hf_state_dict, replaying
from steps.policy import (
    load_critic_shard,
    load_policy_shard,
    pack_sequences,
    save_hf_state_dict,
    token_logprobs,
    token_values,
)
from steps.ppo import gae, token_rewards, value_loss, whiten
from steps.router_health import RouterHealth
from steps.storage import CRITIC_DIR, OPTIMIZER_FILE, RunStorage


@dataclass(frozen=True)
class Parallel:
    """This process's place in the (dp, ep) mesh. The default is one process without torch.distributed."""

    rank: int = 0
    world_size: int = 1
    ep_group: dist.ProcessGroup | None = None  # the ranks that share one copy of the experts
    dp_group: dist.ProcessGroup | None = None  # the ranks holding the same experts
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def init_parallel(settings: TrainerConfig) -> Parallel:
    """Join the torchrun job (env://) and build the mesh; trainer.world_size 1 is one plain process."""
    if settings.world_size == 1:
        return Parallel()
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != settings.world_size:
        raise MoeloopError(
            f"trainer.world_size is {settings.world_size} but {launched} processes were started;"
            f" run it under torchrun --nproc-per-node {settings.world_size}"
        )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    return mesh_parallel(settings.expert_parallel, "cuda" if cuda else "cpu")


def mesh_parallel(expert_parallel: int, device_type: str) -> Parallel:
    """The (dp, ep) mesh over the initialised default process group; EP ranks are neighbours (ep varies fastest)."""
    world_size = dist.get_world_size()
    mesh = init_device_mesh(device_type, (world_size // expert_parallel, expert_parallel), mesh_dim_names=("dp", "ep"))
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return Parallel(dist.get_rank(), world_size, mesh["ep"].get_group(), mesh["dp"].get_group(), device)


@dataclass(frozen=True)
class ExperienceBatch:
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    behavior_logprobs_BT: torch.Tensor  # the engine's logprobs, at the response positions
    rewards_B: torch.Tensor
    group_ids_B: torch.Tensor  # samples of one prompt form a group
    # The engine's experts per input position and MoE layer, [B, T, L, K]: at position t those of the forward that
    # sampled token t + 1 (so response positions shifted back by one); -1 elsewhere. None: not recorded.
    routes_BTLK: torch.Tensor | None = None

    def to(self, device: torch.device) -> ExperienceBatch:
        return ExperienceBatch(*(_apply(getattr(self, f.name), lambda t: t.to(device)) for f in fields(self)))

    def select(self, rows_N: torch.Tensor) -> ExperienceBatch:
        return ExperienceBatch(*(_apply(getattr(self, f.name), lambda t: t[rows_N]) for f in fields(self)))


def _apply(tensor: torch.Tensor | None, function: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return function(tensor) if tensor is not None else None


def recorded_routes(rollouts: dict[str, list]) -> bool:
    """Whether every sample has the engine's routed experts (shards from before the column read as nulls)."""
    return all(routes is not None for routes in rollouts.get("routed_experts", [None]))


def experience_batch(
    rollouts: dict[str, list], rewards_by_sample: dict[str, float], pad_id: int, top_k: int | None = None
) -> ExperienceBatch:
    """The padded batch; with top_k (the model's experts per token), the recorded routes as well."""
    prompts, responses = rollouts["prompt_token_ids"], rollouts["response_token_ids"]
    input_ids_BT, attention_mask_BT, response_mask_BT = pack_sequences(prompts, responses, pad_id)
    behavior_BT = torch.zeros(input_ids_BT.shape)
    for row, (prompt, logprobs) in enumerate(zip(prompts, rollouts["behavior_logprobs"], strict=False)):
        behavior_BT[row, len(prompt) : len(prompt) + len(logprobs)] = torch.tensor(logprobs)
    routes_BTLK = None
    if top_k is not None:
        first = rollouts["routed_experts"][0]
        layers = len(first) // (len(responses[0]) * top_k) if responses[0] else 0
        routes_BTLK = torch.full((*input_ids_BT.shape, max(layers, 1), top_k), -1, dtype=torch.long)
        recorded = zip(prompts, responses, rollouts["routed_experts"], strict=True)
        for row, (prompt, response, routes) in enumerate(recorded):
            if len(routes) != len(response) * layers * top_k:
                raise MoeloopError(
                    f"sample {rollouts['sample_id'][row]}: {len(routes)} routed experts for {len(response)} tokens,"
                    f" {layers} MoE layers and top-{top_k}: damaged data"
                )
            start = len(prompt) - 1
            routes_BTLK[row, start : start + len(response)] = torch.tensor(routes).view(len(response), layers, top_k)
    return ExperienceBatch(
        input_ids_BT,
        attention_mask_BT,
        response_mask_BT,
        behavior_BT,
        torch.tensor([rewards_by_sample[s] for s in rollouts["sample_id"]], dtype=torch.float32),
        torch.tensor(rollouts["prompt_id"]),
        routes_BTLK,
    )


def rank_share(rows_N: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """This rank's distinct, contiguous share of rows_N (sizes differ by at most one). Every rank takes one,
    EP ranks included: the all-to-all moves their tokens to the experts and back."""
    return rows_N.tensor_split(parallel.world_size)[parallel.rank]


@torch.no_grad()
def frozen_pass(
    per_token: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]],
    model: torch.nn.Module,
    batch: ExperienceBatch,
    minibatch: int,
    parallel: Parallel,
    replay: bool = False,
) -> torch.Tensor:
    """per_token(input_ids, attention_mask)[0] (token logprobs or values) for the whole batch on every rank: each
    rank computes its share in eval mode, then the shares are all-gathered. replay: routed as the engine was."""
    model.eval()
    batch_size = len(batch.input_ids_BT)
    rows_b = rank_share(torch.arange(batch_size), parallel)
    # Every rank runs the MoE layers (collectives inside) equally often: the chunk count of the largest share.
    largest_share = -(-batch_size // parallel.world_size)
    chunks = []
    for rows in rows_b.tensor_split(-(-largest_share // minibatch)):
        with replaying(model, batch.routes_BTLK[rows] if replay else None):
            chunks.append(per_token(batch.input_ids_BT[rows], batch.attention_mask_BT[rows])[0])
    return all_gather_rows(torch.cat(chunks), batch_size, parallel)


def frozen_logprobs(
    model: torch.nn.Module,
    batch: ExperienceBatch,
    temperature: float,
    minibatch: int,
    parallel: Parallel,
    replay: bool = False,
) -> torch.Tensor:
    """The whole batch's token logprobs on every rank."""
    per_token = partial(token_logprobs, model, temperature=temperature)
    return frozen_pass(per_token, model, batch, minibatch, parallel, replay)


def all_gather_rows(share_bT: torch.Tensor, batch_size: int, parallel: Parallel) -> torch.Tensor:
    """Every rank's `rank_share` of the rows, concatenated in rank order: [batch_size, T]."""
    if parallel.world_size == 1:
        return share_bT
    sizes = [len(rows) for rows in torch.arange(batch_size).tensor_split(parallel.world_size)]
    padded_bT = share_bT.new_zeros((sizes[0], *share_bT.shape[1:]))  # all_gather wants equal shapes
    padded_bT[: len(share_bT)] = share_bT
    slices = [torch.empty_like(padded_bT) for _ in sizes]
    dist.all_gather(slices, padded_bT)
    return torch.cat([padded[:size] for padded, size in zip(slices, sizes, strict=True)])


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return float((values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))


def load_balancing_loss(
    router_logits_L: tuple[torch.Tensor, ...],
    attention_mask_bT: torch.Tensor,
    num_experts: int,
    top_k: int,
    parallel: Parallel,
) -> torch.Tensor:
    """This rank's share of HF's load-balancing loss (`load_balancing_loss_func`) over the whole minibatch.

    That loss is E * sum_e f_e * P_e: f_e the share of top-k assignments to expert e and P_e its mean router
    probability, over all layers and unpadded tokens. f has no gradient, so with f and the token count summed over
    all ranks first, the ranks' shares E * f . (their P sums) / count add up to the loss and to its gradient (the
    router gradients are summed over all ranks). A rank's own aux loss, on its tokens only, would not.
    """
    mask_t = attention_mask_bT.reshape(-1).float()
    assigned_E = mask_t.new_zeros(num_experts)
    probability_sum_E = mask_t.new_zeros(num_experts)
    for logits_tE in router_logits_L:
        probabilities_tE = F.softmax(logits_tE.float(), dim=-1)
        chosen_tK = torch.topk(probabilities_tE, top_k, dim=-1).indices
        assigned_E = assigned_E.index_add(0, chosen_tK.reshape(-1), mask_t.repeat_interleave(top_k))
        probability_sum_E = probability_sum_E + (probabilities_tE * mask_t.unsqueeze(1)).sum(0)
    counts = torch.cat([assigned_E, (mask_t.sum() * len(router_logits_L)).reshape(1)])
    if parallel.world_size > 1:
        dist.all_reduce(counts)
    assigned_E, rows = counts[:-1], counts[-1]
    return num_experts * ((assigned_E / rows) * (probability_sum_E / rows)).sum()


def expert_parameters(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    return {p for module in model.modules() if isinstance(module, MoeBlock) for p in module.experts.parameters()}


def router_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The routers' weights, of `MoeBlock`s and of HF's own blocks alike (`TopKRouter` subclasses HF's router)."""
    return [p for module in model.modules() if isinstance(module, Qwen3MoeTopKRouter) for p in module.parameters()]


def freeze_routers(model: torch.nn.Module, frozen: bool) -> None:
    """`trainer.freeze_router`: the routers take no gradient, so no optimizer step (and no weight decay) moves them."""
    for parameter in router_parameters(model):
        parameter.requires_grad_(not frozen)


def sync_gradients(model: torch.nn.Module, experts: set[torch.nn.Parameter], parallel: Parallel) -> None:
    """Sum each gradient over the ranks that hold the parameter and saw different tokens.

    Plain all-reduces rather than DDP or FSDP2 (fully_shard does run on gloo): the replicated dense weights and
    routers sum over the whole world, but the experts only over dp, and DDP reduces one parameter set over one
    group. Sharding the dense weights (FSDP2 over dp, HSDP-style over ep) pays off only for models whose dense
    part does not fit one GPU, not for the CPU model here; it is the step to take for large models on GPUs.
    """
    if parallel.world_size == 1:
        return
    for parameter in trained_parameters(model):
        if parameter.grad is None:  # every rank must join every all-reduce
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad, group=parallel.dp_group if parameter in experts else None)


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the update trains: all but frozen ones (`trainer.freeze_router`)."""
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def clip_gradients(
    model: torch.nn.Module, experts: set[torch.nn.Parameter], max_norm: float, parallel: Parallel
) -> float:
    """`clip_grad_norm_` over the whole model: the expert part of the squared norm is summed over the EP group."""
    trained = trained_parameters(model)
    dense_square = sum(p.grad.pow(2).sum() for p in trained if p not in experts)
    # Summed in the model's order, not the set's (which follows memory addresses): the same norm to the last bit
    # in every process, so a re-run or a long-lived worker trains exactly the same weights.
    expert_square = sum(
        (p.grad.pow(2).sum() for p in trained if p in experts), torch.zeros((), device=parallel.device)
    )
    if parallel.ep_group is not None:
        dist.all_reduce(expert_square, group=parallel.ep_group)
    total_norm = (dense_square + expert_square).sqrt()
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # as clip_grad_norm_ computes it
    for parameter in trained:
        parameter.grad.mul_(scale)
    return float(total_norm)


def all_reduce_sum(values: list[float], parallel: Parallel) -> list[float]:
    if parallel.world_size == 1:
        return values
    summed = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(summed)
    return summed.tolist()


@dataclass
class Critic:
    """PPO's value model (`steps.policy.load_critic_shard`) and its optimizer."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def minibatches(order_N: torch.Tensor, size: int, world_size: int) -> list[torch.Tensor]:
    """order_N in chunks of size; a last chunk too small to give every rank a sample joins the one before it
    (a batch shrunk by drop_equal_groups need not split evenly)."""
    chunks = list(order_N.split(size))
    if len(chunks) > 1 and len(chunks[-1]) < world_size:
        chunks[-2:] = [torch.cat(chunks[-2:])]
    return chunks


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


def router_aux_loss(
    model: torch.nn.Module, router_logits_L: tuple, attention_mask_bT: torch.Tensor, parallel: Parallel
) -> torch.Tensor:
    """The load-balancing loss of model's routers, weighted by its config's router_aux_loss_coef; 0 when the routers
    are frozen (it only balances the load by training them)."""
    config = model.config
    routers = router_parameters(model)
    if routers and not any(parameter.requires_grad for parameter in routers):
        return torch.zeros((), device=attention_mask_bT.device)
    aux = load_balancing_loss(
        router_logits_L, attention_mask_bT, config.num_experts, config.num_experts_per_tok, parallel
    )
    return config.router_aux_loss_coef * aux


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
    report["mismatch_masked_sequences"] = float((responses_B & ~loss_mask_BT.any(1)).sum()) / max(
        float(responses_B.sum()), 1.0
    )
    return loss_mask_BT


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
    """Advantages (GRPO: group-normalised; PPO: GAE with critic), then epochs x minibatches of clipped-surrogate
    steps (PPO: and clipped value-loss steps of the critic); returns what it measured (the same on all ranks).

    Every rank draws the same minibatches and takes its share of each. The losses are aggregated over the whole
    minibatch (its global token and sequence counts are the denominators), so the gradients summed over the ranks
    are one process's on the whole minibatch.
    """
    settings, algorithm = config.trainer, config.algorithm
    if (algorithm.name == "ppo") != (critic is not None):
        raise MoeloopError(f"algorithm {algorithm.name} {'needs' if critic is None else 'takes no'} critic")
    temperature = config.rollout.temperature
    report: dict[str, Any] = {"samples": len(batch.rewards_B), "dropped_samples": 0}
    if algorithm.drop_equal_groups:
        kept_N = varied_groups(batch.rewards_B, batch.group_ids_B)
        report["dropped_samples"] = int((~kept_N).sum())
        batch = batch.select(kept_N.nonzero().squeeze(1))
    if len(batch.rewards_B) < parallel.world_size:  # nothing left that every rank could take a share of
        return {**report, "optimizer_steps": 0, "response_tokens": int(batch.response_mask_BT.sum())}
    mask_BT = batch.response_mask_BT
    replay = algorithm.routing_replay == "rollout"
    if replay and batch.routes_BTLK is None:
        raise MoeloopError("algorithm.routing_replay rollout needs the engine's recorded routed_experts")
    # pi_old is the trainer's own policy at the start of the update, so the first step's ratio is exactly 1.
    old_logprobs_BT = frozen_logprobs(model, batch, temperature, settings.minibatch_size, parallel, replay)
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
    kl_in_loss = critic is None and algorithm.kl_coef > 0

    generator = torch.Generator().manual_seed(seed)
    measured: dict[str, list[float]] = defaultdict(list)
    health = RouterHealth(model.config.num_experts, model.config.num_experts_per_tok, parallel.device)
    model.train()
    if critic is not None:
        critic.model.train()
    for _ in range(settings.epochs):
        order = torch.randperm(len(batch.rewards_B), generator=generator)
        for minibatch_rows in minibatches(order, settings.minibatch_size, parallel.world_size):
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
                ref_logprobs_BT=ref_logprobs_BT[rows] if kl_in_loss else None,
                kl_coef=algorithm.kl_coef if kl_in_loss else 0.0,
                importance_level=algorithm.importance_level,
            )
            health.add(router_logits_L, attention_mask_bT, routes_bTLK, replayed=replay)
            aux = router_aux_loss(model, router_logits_L, attention_mask_bT, parallel)
            measured["grad_norm"].append(
                optimizer_step(model, optimizer, terms.loss + aux, settings.max_grad_norm, parallel)
            )
            # The rank's loss is its part of the minibatch's; its clip fraction is over its tokens.
            share_tokens = float(loss_mask_BT[rows].sum())
            sums = [terms.loss.item(), float(terms.clip_fraction) * share_tokens]
            if critic is not None:
                values_bT, critic_router_logits_L = token_values(critic.model, input_ids_bT, attention_mask_bT)
                value_tokens = max(int(mask_BT[minibatch_rows].sum()), 1)  # the critic learns from every token
                loss, value_clipped = value_loss(
                    values_bT, old_values_BT[rows], returns_BT[rows], mask_BT[rows], algorithm.value_clip, value_tokens
                )
                aux = router_aux_loss(critic.model, critic_router_logits_L, attention_mask_bT, parallel)
                measured["critic_grad_norm"].append(
                    optimizer_step(critic.model, critic.optimizer, loss + aux, settings.max_grad_norm, parallel)
                )
                sums += [loss.item(), float(value_clipped) * float(mask_BT[rows].sum())]
            sums = all_reduce_sum(sums, parallel)
            measured["loss"].append(sums[0])
            measured["clip_fraction"].append(sums[1] / num_tokens)
            if critic is not None:
                measured["value_loss"].append(sums[2])
                measured["value_clip_fraction"].append(sums[3] / value_tokens)
    report.update({name: sum(values) / len(values) for name, values in measured.items()})
    report.update(health.report(distributed=parallel.world_size > 1))
    advantages_abs = advantages.abs() if advantages.dim() == 1 else advantages.abs()[mask_BT]
    report["advantage_abs_mean"] = float(advantages_abs.mean())
    report["optimizer_steps"] = len(measured["loss"])
    report["response_tokens"] = int(mask_BT.sum())
    return report


def optimizer_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel
) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state by HF parameter name, the experts' moments gathered over the EP group: one process's
    state whatever the mesh. Collective: every rank calls it."""
    experts = expert_parameters(model)
    return {
        name: {
            key: gather_over(value, parallel.ep_group) if parameter in experts and value.dim() else value.clone()
            for key, value in sorted(optimizer.state[parameter].items())
        }
        for name, parameter in model.named_parameters()
    }


def load_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: dict[str, dict[str, torch.Tensor]],
    parallel: Parallel,
) -> None:
    """The inverse of `optimizer_state_by_name`: each rank takes its experts' slice of their moments."""
    experts = expert_parameters(model)
    ep_size, ep_rank = (parallel.ep_group.size(), parallel.ep_group.rank()) if parallel.ep_group else (1, 0)
    for name, parameter in model.named_parameters():
        state = {}
        for key, value in saved[name].items():
            if parameter in experts and value.dim():
                value = value.chunk(ep_size)[ep_rank]
            state[key] = value.to(parallel.device) if value.dim() else value  # AdamW keeps `step` on the CPU
        optimizer.state[parameter] = state


def load_trainer_start(
    storage: RunStorage, iteration: int, scratch: Path, config: MoeloopConfig, parallel: Parallel
) -> tuple[Any, Any, torch.optim.Optimizer, Critic | None]:
    """This rank's share of the previous trainer state if there is one, else of the checkpoint the rollouts used:
    (policy, tokenizer, its optimizer, the critic with its optimizer for PPO)."""
    settings = config.trainer
    previous = storage.trainer_state(iteration - 1)
    resumed = storage.is_committed(previous)
    if resumed:
        storage.fetch_folder(previous, scratch / "previous")
        directory = scratch / "previous"
    else:
        directory = fetch_checkpoint(storage, iteration - 1)
    shard = (settings.dispatcher, settings.experts_impl, parallel.ep_group, parallel.device)
    model, tokenizer = load_policy_shard(directory, *shard)
    freeze_routers(model, settings.freeze_router)
    optimizer = make_optimizer(model, settings)
    if resumed:
        load_optimizer_state(model, optimizer, torch.load(directory / OPTIMIZER_FILE, weights_only=True), parallel)
    if config.algorithm.name != "ppo":
        return model, tokenizer, optimizer, None
    # The critic resumes from its state beside the policy's; the first one starts from the policy (zero head).
    critic_state = directory / CRITIC_DIR
    critic_model, _ = load_critic_shard(critic_state if resumed else directory, *shard, from_policy=not resumed)
    freeze_routers(critic_model, settings.freeze_router)
    critic = Critic(critic_model, make_optimizer(critic_model, settings, config.algorithm.critic_learning_rate))
    if resumed:
        saved = torch.load(critic_state / OPTIMIZER_FILE, weights_only=True)
        load_optimizer_state(critic.model, critic.optimizer, saved, parallel)
    return model, tokenizer, optimizer, critic


def make_optimizer(
    model: torch.nn.Module, settings: TrainerConfig, learning_rate: float | None = None
) -> torch.optim.Optimizer:
    """AdamW with the trainer's settings, at learning_rate (the critic's) or else trainer.learning_rate."""
    return torch.optim.AdamW(
        model.parameters(),
        lr=learning_rate or settings.learning_rate,
        betas=settings.betas,
        weight_decay=settings.weight_decay,
    )


@dataclass(frozen=True)
class UpdatedTrainer:
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    critic: Critic | None
    report: dict[str, Any]


def update_policy(
    storage: RunStorage, config: MoeloopConfig, iteration: int, scratch: Path, parallel: Parallel = Parallel()
) -> UpdatedTrainer:
    """The iteration's update in memory: the policy (PPO: and the critic) after it, and the report. Deterministic."""
    rollouts = read_rollouts(storage, iteration, config.rollout.num_shards).to_pydict()
    rewards = read_rewards(storage, iteration).to_pydict()
    rewards_by_sample = dict(zip(rewards["sample_id"], rewards["reward"], strict=False))
    seed = derive_seed(config.run_name, config.seed, "train", iteration)
    torch.manual_seed(seed)
    settings = config.trainer
    model, tokenizer, optimizer, critic = load_trainer_start(storage, iteration, scratch, config, parallel)
    reference, _ = load_policy_shard(
        fetch_checkpoint(storage, 0), settings.dispatcher, settings.experts_impl, parallel.ep_group, parallel.device
    )
    recorded = recorded_routes(rollouts)
    if config.algorithm.routing_replay == "rollout" and not recorded:
        raise MoeloopError(
            f"algorithm.routing_replay rollout needs the rollout shards' routed_experts column: iteration {iteration}'s"
            " shards lack it (written before it existed, or by an engine that did not record routes)"
        )
    top_k = model.config.num_experts_per_tok if recorded else None
    batch = experience_batch(rollouts, rewards_by_sample, tokenizer.pad_token_id, top_k).to(parallel.device)
    started = time.perf_counter()
    report = policy_update(model, reference, optimizer, batch, config, seed, parallel, critic)
    seconds = time.perf_counter() - started
    report["train_tokens_per_second"] = round(int(batch.attention_mask_BT.sum()) * settings.epochs / seconds, 1)
    return UpdatedTrainer(model, tokenizer, optimizer, critic, report)


def save_trainer_state(
    model: torch.nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer, parallel: Parallel, directory: Path
) -> bool:
    """Rank 0 writes the HF files and optimizer.pt, the experts gathered; returns whether this rank wrote.
    Collective: every rank calls it."""
    weights = hf_state_dict(model)
    moments = optimizer_state_by_name(model, optimizer, parallel)
    if parallel.rank != 0:
        return False
    save_hf_state_dict(weights, model.config, tokenizer, directory)
    torch.save(moments, directory / OPTIMIZER_FILE)
    return True


def train(run_uri: str, iteration: int) -> dict[str, Any] | None:
    """The train step on this rank; the report on rank 0, None on the others (they write nothing)."""
    started = time.perf_counter()
    storage, config = open_iteration(run_uri, iteration)
    output = storage.trainer_state(iteration)
    if storage.is_committed(output):
        return already_committed(storage, output)
    parallel = init_parallel(config.trainer)
    try:
        with local_scratch() as scratch:
            updated = update_policy(storage, config, iteration, scratch, parallel)
            state = scratch / "state"
            if updated.critic is not None:  # the critic's state goes in the same commit, in critic/
                critic = updated.critic
                save_trainer_state(critic.model, updated.tokenizer, critic.optimizer, parallel, state / CRITIC_DIR)
            if not save_trainer_state(updated.model, updated.tokenizer, updated.optimizer, parallel, state):
                return None
            report = {**updated.report, "seconds": round(time.perf_counter() - started, 3)}
            write_report(storage, iteration, "train", report)
            storage.commit_folder(output, state, extra={"iteration": iteration})
        return report
    finally:
        if parallel.world_size > 1:
            dist.destroy_process_group()


def main() -> None:
    args = step_parser(__doc__).parse_args()
    quiet_libraries()
    if (report := train(args.run, args.iteration)) is not None:
        print_json(report)


if __name__ == "__main__":
    run_cli(main)
