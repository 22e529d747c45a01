"""The trainer state between iterations: AdamW per model, and its moments saved and loaded by HF parameter name
(the experts' gathered over the EP group), so one process's state whatever the mesh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from steps.config import MoeloopConfig, TrainerConfig
from steps.model.moe import gather_over, hf_state_dict
from steps.model.policy import load_critic_shard, load_policy_shard, save_hf_state_dict
from steps.rl.parallel import Parallel, expert_parameters
from steps.rl.router_loss import freeze_routers
from steps.rl.update import Critic
from steps.storage.cache import fetch_checkpoint
from steps.storage.run import CRITIC_DIR, OPTIMIZER_FILE, RunStorage


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
