"""The trainer's models and their state between iterations.

The policy (and PPO's critic) are this rank's EP shard (`steps.model.policy`), held as `prepare_trainer_model`
makes them: FSDP2 over the mesh at `trainer.precision`, packed forwards. The optimizer is AdamW (its moments in
host memory with `trainer.offload_optimizer`). Weights and moments are saved and loaded by HF parameter name,
unsharded and with the experts gathered over EP, so the state is one process's whatever the mesh. The HF weights
keep the checkpoint's dtype; where that is not fp32, the fp32 master weights are saved beside the moments, so no
update smaller than the checkpoint dtype's resolution is lost between iterations.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
from torch import nn

from steps.config import MoeloopConfig, TrainerConfig
from steps.errors import MoeloopError
from steps.model.attention import VARLEN
from steps.model.logprobs import use_logprob_head
from steps.model.moe import compile_decoder_layers, gather_over, hf_state_dict
from steps.model.policy import load_critic_shard, load_policy_shard, save_hf_state_dict, stored_dtype
from steps.model.sharding import checkpoint_decoder_layers, full_value, shard_like, shard_trainer_model
from steps.rl.batch import ExperienceBatch, frozen_logprobs
from steps.rl.offload import OffloadedAdamW
from steps.rl.parallel import Parallel, expert_parameters
from steps.rl.router_loss import freeze_routers
from steps.rl.update import Critic
from steps.storage.cache import fetch_checkpoint
from steps.storage.run import CRITIC_DIR, OPTIMIZER_FILE, RunStorage

MASTER = "master_weight"  # the optimizer state's key for a parameter's fp32 master weight


def prepare_trainer_model(model: nn.Module, settings: TrainerConfig, parallel: Parallel) -> nn.Module:
    """An EP shard as `load_policy_shard` or `load_critic_shard` builds it, made the trainer's, in place: the LM head
    computes logprobs (`steps.model.logprobs.LogprobHead`), attention runs over packed samples, the routers are
    frozen with `trainer.freeze_router`, FSDP2 shards it at
    the trainer's precision (with its activation checkpointing), and on CUDA the decoder layers are compiled. With no
    mesh (`Parallel()`, one process without torch.distributed) it is not sharded."""
    freeze_routers(model, settings.freeze_router)  # before fully_shard, which keeps requires_grad per parameter
    if hasattr(model, "lm_head"):
        use_logprob_head(model)
    model.config._attn_implementation = VARLEN
    precision = settings.compute_precision(parallel.device.type == "cuda")
    if settings.activation_checkpointing:
        checkpoint_decoder_layers(model)
    if parallel.world_mesh is not None:
        shard_trainer_model(model, parallel.world_mesh, parallel.dp_mesh, precision)
    elif precision != "fp32":  # one process without torch.distributed (tests): no FSDP, so no mixed precision
        raise MoeloopError(f"trainer.precision {precision} needs the trainer's process group (init_parallel)")
    compile_decoder_layers(model)  # CUDA only: HF's elementwise code around the MoE blocks dominates, eager
    return model


def make_optimizer(model: nn.Module, settings: TrainerConfig, learning_rate: float | None = None) -> torch.optim.Optimizer:
    """AdamW with the trainer's settings, at learning_rate (the critic's) or else trainer.learning_rate: torch's
    (fused on CUDA), or with its moments in host memory."""
    options = {"lr": learning_rate or settings.learning_rate, "betas": settings.betas, "weight_decay": settings.weight_decay}
    if settings.offload_optimizer:
        return OffloadedAdamW(model.parameters(), **options)
    cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(model.parameters(), fused=cuda or None, **options)


def load_trainer_model(
    directory: Path, settings: TrainerConfig, parallel: Parallel
) -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    """The policy of an HF checkpoint folder as the trainer holds it, its tokenizer, and a fresh optimizer."""
    model, tokenizer = load_policy_shard(
        directory, settings.dispatcher, settings.experts_impl, parallel.ep_group, parallel.device
    )
    model = prepare_trainer_model(model, settings, parallel)
    return model, tokenizer, make_optimizer(model, settings)


def reference_logprobs(
    directory: Path, batch: ExperienceBatch, config: MoeloopConfig, parallel: Parallel
) -> torch.Tensor:
    """The reference policy's token logprobs of the batch (directory: checkpoint 0's HF folder), computed once per
    update, sharded as the trainer's policy; the reference is freed before the policy is loaded, so it adds nothing
    to the update's peak memory (tests/test_cuda.py checks that on a GPU)."""
    settings = config.trainer
    reference = load_trainer_model(directory, settings, parallel)[0]  # its optimizer, which holds it, dropped here
    logprobs_BT = frozen_logprobs(
        reference, batch, config.rollout.temperature, settings.max_tokens_per_microbatch, parallel
    )
    del reference
    gc.collect()  # the model's reference cycles (hooks, FSDP state): freed now, not at the next collection
    if parallel.device.type == "cuda":
        torch.cuda.empty_cache()
    return logprobs_BT


def whole(value: torch.Tensor, parameter: nn.Parameter, experts: set[nn.Parameter], parallel: Parallel) -> torch.Tensor:
    """A parameter's (or its state's) whole tensor, as one process holds it. Collective."""
    full = full_value(value, parameter)
    return gather_over(full, parallel.ep_group) if parameter in experts else full


def optimizer_state_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel
) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state by HF parameter name, unsharded, the experts' moments gathered over the EP group: one
    process's state whatever the mesh; with each fp32 master weight where the checkpoint holds another dtype.
    Collective: every rank calls it."""
    experts = expert_parameters(model)
    stored_in_fp32 = stored_dtype(model.config) == torch.float32
    state = {}
    for name, parameter in model.named_parameters():
        moments = optimizer.state[parameter]
        state[name] = {
            key: whole(value, parameter, experts, parallel) if value.dim() else value.clone()
            for key, value in sorted(moments.items())
        }
        if not stored_in_fp32:
            state[name][MASTER] = whole(parameter.detach(), parameter, experts, parallel)
    return state


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, dict[str, torch.Tensor]], parallel: Parallel
) -> None:
    """The inverse of `optimizer_state_by_name`: each rank takes its shard of its experts' slice (host memory for
    an `OffloadedAdamW`), and the fp32 master weights replace the checkpoint's rounded ones."""
    experts = expert_parameters(model)
    ep_size, ep_rank = (parallel.ep_group.size(), parallel.ep_group.rank()) if parallel.ep_group else (1, 0)
    offloaded = isinstance(optimizer, OffloadedAdamW)
    for name, parameter in model.named_parameters():
        state = {}
        for key, value in saved[name].items():
            if not value.dim():  # AdamW keeps `step` on the CPU
                state[key] = value
                continue
            shard = shard_like(value.chunk(ep_size)[ep_rank] if parameter in experts else value, parameter)
            if key == MASTER:
                with torch.no_grad():
                    parameter.copy_(shard)
            elif offloaded:
                local = shard.to_local() if hasattr(shard, "to_local") else shard
                state[key] = local.to("cpu").pin_memory() if local.is_cuda else local.clone()
            else:
                state[key] = shard
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
    model, tokenizer, optimizer = load_trainer_model(directory, settings, parallel)
    if resumed:
        load_optimizer_state(model, optimizer, torch.load(directory / OPTIMIZER_FILE, weights_only=True), parallel)
    if config.algorithm.name != "ppo":
        return model, tokenizer, optimizer, None
    # The critic resumes from its state beside the policy's; the first one starts from the policy (zero head).
    critic_state = directory / CRITIC_DIR
    shard = (settings.dispatcher, settings.experts_impl, parallel.ep_group, parallel.device)
    critic_model, _ = load_critic_shard(critic_state if resumed else directory, *shard, from_policy=not resumed)
    critic_model = prepare_trainer_model(critic_model, settings, parallel)
    critic = Critic(critic_model, make_optimizer(critic_model, settings, config.algorithm.critic_learning_rate))
    if resumed:
        saved = torch.load(critic_state / OPTIMIZER_FILE, weights_only=True)
        load_optimizer_state(critic.model, critic.optimizer, saved, parallel)
    return model, tokenizer, optimizer, critic


def save_trainer_state(
    model: nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer, parallel: Parallel, directory: Path
) -> bool:
    """Rank 0 writes the HF files (in the checkpoint's dtype) and optimizer.pt, unsharded and the experts gathered;
    returns whether this rank wrote. Collective: every rank calls it."""
    weights = hf_state_dict(model)
    moments = optimizer_state_by_name(model, optimizer, parallel)
    if parallel.rank != 0:
        return False
    save_hf_state_dict(weights, model.config, tokenizer, directory)
    torch.save(moments, directory / OPTIMIZER_FILE)
    return True
