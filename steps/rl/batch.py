"""The iteration's experience as tensors, its minibatches, and the no-gradient passes over all of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from steps.config import TrainerConfig
from steps.model.logprobs import packed_token_logprobs
from steps.model.policy import pack_sequences
from steps.model.sharding import reshard
from steps.rl.packing import Microbatch, pack_rows, plan_microbatches
from steps.rl.parallel import Parallel


@dataclass(frozen=True)
class ExperienceBatch:
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    behavior_logprobs_BT: torch.Tensor  # the engine's logprobs, at the response positions
    rewards_B: torch.Tensor
    group_ids_B: torch.Tensor  # samples of one prompt form a group

    def to(self, device: torch.device) -> ExperienceBatch:
        return ExperienceBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def select(self, rows_b: torch.Tensor) -> ExperienceBatch:
        return ExperienceBatch(*(getattr(self, f.name)[rows_b] for f in fields(self)))


def experience_batch(rollouts: dict[str, list], rewards_by_sample: dict[str, float]) -> ExperienceBatch:
    """The rollouts right-padded (with token 0, which no forward reads: they run on packed microbatches)."""
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
    )


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
) -> torch.Tensor:
    """per_token(model, microbatch)[0] (token logprobs or values, [n, T]) for the whole batch, on every rank: each
    rank runs its microbatches of the batch's packing in eval mode; each row is then summed in from the one rank
    that computed it (the others hold zeros there)."""
    model.eval()
    values_BT = torch.zeros(batch.input_ids_BT.shape, device=batch.input_ids_BT.device)
    for micro in rank_microbatches(batch, torch.arange(len(batch.input_ids_BT)), max_tokens, parallel):
        values_BT[micro.rows_n] = per_token(model, micro)[0]
    reshard(model)
    if parallel.world_size > 1:
        dist.all_reduce(values_BT)
    return values_BT


def rank_microbatches(
    batch: ExperienceBatch, rows_b: torch.Tensor, max_tokens: int, parallel: Parallel
) -> list[Microbatch]:
    """This rank's packed microbatches of the samples rows_b (`steps.rl.packing.plan_microbatches`: every rank
    runs as many)."""
    lengths = batch.attention_mask_BT.sum(1).tolist()
    rows = rows_b.tolist()
    plan = plan_microbatches([lengths[row] for row in rows], max_tokens, parallel.world_size)[parallel.rank]
    return [pack_rows(batch.input_ids_BT, lengths, [rows[i] for i in members]) for members in plan]


def frozen_logprobs(
    model: torch.nn.Module, batch: ExperienceBatch, temperature: float, max_tokens: int, parallel: Parallel
) -> torch.Tensor:
    """The whole batch's token logprobs on every rank."""
    logprobs = partial(packed_token_logprobs, temperature=temperature)
    return frozen_pass(logprobs, model, batch, max_tokens, parallel)


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return float((values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))
