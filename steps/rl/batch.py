"""The iteration's experience as tensors, its minibatches, and the no-gradient passes over all of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeloop.steps.config import TrainerConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.logprobs import packed_token_logprobs
from moeloop.steps.model.microbatch import Microbatch, pack_rows
from moeloop.steps.model.moe import Routes, replaying
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
    # The engine's experts per input position and MoE layer, [B, T, L, K] (int16): at position t those of the
    # forward at t, which sampled token t + 1 where that is a response token; -1 where none were recorded (the
    # prompt's positions but its last with rollout.prompt_routes last). None: not recorded.
    routes_BTLK: torch.Tensor | None = None
    route_layers: tuple[int, ...] = ()  # the decoder layer of each L column
    truncated_B: torch.Tensor | None = None  # cut by rollout.max_new_tokens (finish_reason length); None: not known

    def to(self, device: torch.device) -> ExperienceBatch:
        return ExperienceBatch(*(_apply(getattr(self, f.name), lambda t: t.to(device)) for f in fields(self)))

    def select(self, rows_b: torch.Tensor) -> ExperienceBatch:
        return ExperienceBatch(*(_apply(getattr(self, f.name), lambda t: t[rows_b]) for f in fields(self)))

    def routes_of(self, micro: Microbatch) -> Routes | None:
        """The recorded routes at the microbatch's tokens, as its packed forward takes them ([1, N, L, K])."""
        if self.routes_BTLK is None:
            return None
        sampled_BT = self.response_mask_BT.roll(-1, 1)  # position t's forward sampled token t + 1
        packed = (micro.pack(self.routes_BTLK).unsqueeze(0), micro.pack(sampled_BT).unsqueeze(0))
        return Routes(packed[0], self.route_layers, packed[1])


def _apply(value: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return function(value) if isinstance(value, torch.Tensor) else value


def recorded_routes(rollouts: dict[str, list]) -> bool:
    """Whether every sample has the engine's routed experts (shards from before the column read as nulls)."""
    return all(routes is not None for routes in rollouts.get("routed_experts", [None]))


def experience_batch(
    rollouts: dict[str, list],
    rewards_by_sample: dict[str, float],
    top_k: int | None = None,
    moe_layers: tuple[int, ...] = (),
) -> ExperienceBatch:
    """The rollouts right-padded (with token 0, which no forward reads: they run on packed microbatches); with top_k
    (the model's experts per token), the recorded routes as well, keyed by the decoder layers the shards name
    (moe_layers, the model's MoE layers, for shards from before they named them)."""
    prompts, responses = rollouts["prompt_token_ids"], rollouts["response_token_ids"]
    reasons = rollouts.get("finish_reason")
    input_ids_BT, attention_mask_BT, response_mask_BT = pack_sequences(prompts, responses, pad_id=0)
    # An episode's response holds the environment's tokens too: only the policy's are trained on (and compared).
    for row, (prompt, policy) in enumerate(zip(prompts, rollouts.get("response_mask", []), strict=False)):
        if policy is not None:
            response_mask_BT[row, len(prompt) : len(prompt) + len(policy)] = torch.tensor(policy, dtype=torch.bool)
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
        *(routes_tensor(rollouts, prompts, responses, input_ids_BT.shape, top_k, moe_layers) if top_k else (None, ())),
        torch.tensor([r == "length" for r in reasons], dtype=torch.bool) if reasons is not None else None,
    )


def routes_tensor(
    rollouts: dict[str, list],
    prompts: list,
    responses: list,
    shape: torch.Size,
    top_k: int,
    moe_layers: tuple[int, ...],
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(`ExperienceBatch.routes_BTLK`, its columns' decoder layers) from the rows' routed_experts, flat
    [position][layer][k] from the prompt's first position (prompt_routes all) or its last (last) to the response's
    second to last, and routed_layers (null in shards from before it, whose routes are the response's only)."""
    named = next((tuple(layers) for layers in rollouts.get("routed_layers", []) if layers is not None), None)
    if named is None:  # the response's positions only, of the MoE layers in order
        tokens, routed = next(
            ((len(r), len(e)) for r, e in zip(responses, rollouts["routed_experts"], strict=True) if r)
        )
        named = moe_layers or tuple(range(max(routed // (tokens * top_k), 1)))
    routes_BTLK = torch.full((*shape, len(named), top_k), -1, dtype=torch.int16)
    recorded = zip(prompts, responses, rollouts["routed_experts"], strict=True)
    for row, (prompt, response, routes) in enumerate(recorded):
        end = len(prompt) + len(response) - 1  # every position has a forward but the last token's
        positions, rest = divmod(len(routes), len(named) * top_k)
        if rest or end - positions not in (0, len(prompt) - 1):
            raise MoeloopError(
                f"sample {rollouts['sample_id'][row]}: {len(routes)} routed experts for a {len(prompt)}-token prompt,"
                f" a {len(response)}-token response, {len(named)} MoE layers and top-{top_k}: damaged data"
            )
        ids = torch.from_numpy(np.asarray(routes, dtype=np.int16))  # a copy: the shard's arrays are read-only
        routes_BTLK[row, end - positions : end] = ids.view(positions, len(named), top_k)
    return routes_BTLK, named


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
    rows_B = torch.arange(len(batch.input_ids_BT))
    for micro in rank_microbatches(batch, rows_B, max_tokens, parallel, row_lengths(batch)):
        routes = batch.routes_of(micro)
        with replaying(model, routes if replay else None):
            values_nT, router_logits_L = per_token(model, micro)
        values_BT[micro.rows_n] = values_nT
        if health is not None:
            health.add(router_logits_L, micro.real_tokens().unsqueeze(0), routes, replayed=replay)
    reshard(model)
    if parallel.world_size > 1:
        dist.all_reduce(values_BT)
    return values_BT


def row_lengths(batch: ExperienceBatch) -> list[int]:
    """Each row's tokens, on the host: what packing must read (a wait on the GPU where the batch is there)."""
    return batch.attention_mask_BT.sum(1).tolist()


def rank_microbatches(
    batch: ExperienceBatch, rows_b: torch.Tensor, max_tokens: int, parallel: Parallel, lengths: list[int] | None = None
) -> list[Microbatch]:
    """This rank's packed microbatches of the samples rows_b (a CPU tensor; `moeloop.steps.rl.packing.plan_microbatches`:
    every rank runs as many). lengths: `row_lengths` of the batch, read once by a caller that packs it more than
    once (None: read here)."""
    lengths = row_lengths(batch) if lengths is None else lengths
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

    def logprobs(model: torch.nn.Module, micro: Microbatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        logprobs_nT, _, router_logits_L = packed_token_logprobs(model, micro, temperature)
        return logprobs_nT, router_logits_L

    return frozen_pass(logprobs, model, batch, max_tokens, parallel, replay, health)


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return float((values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))
