"""The iteration's experience as tensors, its minibatches, and the no-gradient passes over all of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from moeloop.steps.config import TrainerConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.logprobs import packed_token_logprobs
from moeloop.steps.model.microbatch import Microbatch, pack_rows
from moeloop.steps.model.moe import replaying
from moeloop.steps.model.policy import pack_sequences
from moeloop.steps.model.sharding import reshard
from moeloop.steps.rl.packing import plan_microbatches
from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.rl.router_health import RouterHealth


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

    def select(self, rows_b: torch.Tensor) -> ExperienceBatch:
        return ExperienceBatch(*(_apply(getattr(self, f.name), lambda t: t[rows_b]) for f in fields(self)))


def _apply(tensor: torch.Tensor | None, function: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return function(tensor) if tensor is not None else None


def recorded_routes(rollouts: dict[str, list]) -> bool:
    """Whether every sample has the engine's routed experts (shards from before the column read as nulls)."""
    return all(routes is not None for routes in rollouts.get("routed_experts", [None]))


def experience_batch(
    rollouts: dict[str, list], rewards_by_sample: dict[str, float], top_k: int | None = None
) -> ExperienceBatch:
    """The rollouts right-padded (with token 0, which no forward reads: they run on packed microbatches); with top_k
    (the model's experts per token), the recorded routes as well."""
    prompts, responses = rollouts["prompt_token_ids"], rollouts["response_token_ids"]
    input_ids_BT, attention_mask_BT, response_mask_BT = pack_sequences(prompts, responses, pad_id=0)
    behavior_BT = torch.zeros(input_ids_BT.shape)
    for row, (prompt, logprobs) in enumerate(zip(prompts, rollouts["behavior_logprobs"], strict=False)):
        behavior_BT[row, len(prompt) : len(prompt) + len(logprobs)] = torch.tensor(logprobs)
    return ExperienceBatch(
        input_ids_BT,
        attention_mask_BT,
        response_mask_BT,
        behavior_BT,
        torch.tensor([rewards_by_sample[s] for s in rollouts["sample_id"]], dtype=torch.float32),
        torch.tensor(rollouts["prompt_id"]),
        routes_tensor(rollouts, prompts, responses, input_ids_BT.shape, top_k) if top_k is not None else None,
    )


def routes_tensor(
    rollouts: dict[str, list], prompts: list, responses: list, shape: torch.Size, top_k: int
) -> torch.Tensor:
    """`ExperienceBatch.routes_BTLK` from the rows' flat routed_experts ([token][layer][k] per response token)."""
    tokens, routed = next(((len(r), len(e)) for r, e in zip(responses, rollouts["routed_experts"], strict=True) if r))
    layers = max(routed // (tokens * top_k), 1)
    routes_BTLK = torch.full((*shape, layers, top_k), -1, dtype=torch.long)
    recorded = zip(prompts, responses, rollouts["routed_experts"], strict=True)
    for row, (prompt, response, routes) in enumerate(recorded):
        if len(routes) != len(response) * layers * top_k:
            raise MoeloopError(
                f"sample {rollouts['sample_id'][row]}: {len(routes)} routed experts for {len(response)} tokens,"
                f" {layers} MoE layers and top-{top_k}: damaged data"
            )
        start = len(prompt) - 1  # the position whose forward sampled the first response token
        routes_BTLK[row, start : start + len(response)] = torch.tensor(routes).view(len(response), layers, top_k)
    return routes_BTLK


def minibatches(order_B: torch.Tensor, size: int, world_size: int) -> list[torch.Tensor]:
    """order_B in chunks of size; a last chunk too small to give every rank a sample joins the one before it
    (a batch shrunk by drop_equal_groups need not split evenly)."""
    chunks = list(order_B.split(size))
    if len(chunks) > 1 and len(chunks[-1]) < world_size:
        chunks[-2:] = [torch.cat(chunks[-2:])]
    return chunks


def minibatch_schedule(batch_size: int, settings: TrainerConfig, seed: int, world_size: int) -> list[torch.Tensor]:
    """The update's minibatches, every epoch's in order: each epoch a fresh permutation of the batch's rows
    (seeded, so every rank draws the same), in chunks of trainer.minibatch_size. The actor and the critic each
    take one optimizer step per minibatch, in this order."""
    generator = torch.Generator().manual_seed(seed)
    return [
        rows_b
        for _ in range(settings.epochs)
        for rows_b in minibatches(torch.randperm(batch_size, generator=generator), settings.minibatch_size, world_size)
    ]


@torch.no_grad()
def frozen_pass(
    per_token: Callable[[torch.nn.Module, Microbatch], tuple[torch.Tensor, Any]],
    model: torch.nn.Module,
    batch: ExperienceBatch,
    max_tokens: int,
    parallel: Parallel,
    replay: bool = False,
    health: RouterHealth | None = None,
) -> torch.Tensor:
    """per_token(model, microbatch) (token logprobs or values, [n, T], and router logits) for the whole batch, on
    every rank: each rank runs its microbatches of the batch's packing in eval mode; each row is then summed in from
    the one rank that computed it (the others hold zeros there). replay: routed as the engine was; health: given
    the router logits of this rank's microbatches."""
    model.eval()
    values_BT = torch.zeros(batch.input_ids_BT.shape, device=batch.input_ids_BT.device)
    for micro in rank_microbatches(batch, torch.arange(len(batch.input_ids_BT)), max_tokens, parallel):
        routes_1NLK = micro.pack(batch.routes_BTLK).unsqueeze(0) if batch.routes_BTLK is not None else None
        with replaying(model, routes_1NLK if replay else None):
            values_nT, router_logits_L = per_token(model, micro)
        values_BT[micro.rows_n] = values_nT
        if health is not None:
            health.add(router_logits_L, micro.real_tokens().unsqueeze(0), routes_1NLK, replayed=replay)
    reshard(model)
    if parallel.world_size > 1:
        dist.all_reduce(values_BT)
    return values_BT


def rank_microbatches(
    batch: ExperienceBatch, rows_b: torch.Tensor, max_tokens: int, parallel: Parallel
) -> list[Microbatch]:
    """This rank's packed microbatches of the samples rows_b (`moeloop.steps.rl.packing.plan_microbatches`: every rank
    runs as many)."""
    lengths = batch.attention_mask_BT.sum(1).tolist()
    rows = rows_b.tolist()
    plan = plan_microbatches([lengths[row] for row in rows], max_tokens, parallel.world_size)[parallel.rank]
    return [pack_rows(batch.input_ids_BT, lengths, [rows[i] for i in members]) for members in plan]


def frozen_logprobs(
    model: torch.nn.Module,
    batch: ExperienceBatch,
    temperature: float,
    max_tokens: int,
    parallel: Parallel,
    replay: bool = False,
    health: RouterHealth | None = None,
) -> torch.Tensor:
    """The whole batch's token logprobs on every rank."""
    logprobs = partial(packed_token_logprobs, temperature=temperature)
    return frozen_pass(logprobs, model, batch, max_tokens, parallel, replay, health)


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return float((values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))
