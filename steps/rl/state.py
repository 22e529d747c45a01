"""The trainer's models and their state between iterations.

The policy (and PPO's critic) are this rank's EP shard (`moeloop.steps.model.policy`), held as `prepare_trainer_model`
makes them: FSDP2 over the mesh at `trainer.precision`, packed forwards. The optimizer is AdamW (its moments in
host memory with `trainer.offload_optimizer`). Between iterations the trainer state holds the fp32 weights (the
optimizer's master weights, so no update smaller than the checkpoint dtype's resolution is lost) and the moments,
by HF parameter name, each rank writing and reading its own shards (`moeloop.steps.rl.checkpoint`), so a state written at
one mesh resumes at another. Publish makes the HF checkpoint, in the checkpoint's dtype, from it.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from moeloop.steps.config import MoeloopConfig, TrainerConfig, derive_seed
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.attention import attention_backend, use_packed_attention
from moeloop.steps.model.families import moe_layers
from moeloop.steps.model.logprobs import use_logprob_head
from moeloop.steps.model.moe import compile_decoder_layers
from moeloop.steps.model.policy import hf_model_on_meta, load_critic_shard, load_policy_shard, read_config, shard_model
from moeloop.steps.model.sharding import PRECISIONS, checkpoint_decoder_layers, shard_trainer_model
from moeloop.steps.rl.batch import ExperienceBatch, experience_batch, frozen_logprobs, recorded_routes
from moeloop.steps.rl.checkpoint import METADATA, WEIGHTS_DIR, load_sharded, save_sharded
from moeloop.steps.rl.offload import OffloadedAdamW
from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.rl.router_loss import freeze_routers
from moeloop.steps.rl.update import Critic, policy_update, require_finite
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.experience import read_rewards, read_rollouts, rollout_columns
from moeloop.steps.storage.run import CRITIC_DIR, RunStorage


def prepare_trainer_model(model: nn.Module, settings: TrainerConfig, parallel: Parallel) -> nn.Module:
    """An EP shard as `load_policy_shard` or `load_critic_shard` builds it, made the trainer's, in place: the LM head
    computes logprobs (`moeloop.steps.model.logprobs.LogprobHead`), attention runs over packed samples
    (`trainer.attention`), the routers are frozen with `trainer.freeze_router`, FSDP2 shards it at
    the trainer's precision (with its activation checkpointing), and on CUDA the decoder layers are compiled. With no
    mesh (`Parallel()`, one process without torch.distributed) it is not sharded."""
    freeze_routers(model, settings.freeze_router)  # before fully_shard, which keeps requires_grad per parameter
    if hasattr(model, "lm_head"):
        use_logprob_head(model)
    use_packed_attention(model, trainer_attention(settings, parallel))
    precision = settings.compute_precision(parallel.device.type == "cuda")
    if settings.activation_checkpointing:
        checkpoint_decoder_layers(model)
    if parallel.world_mesh is not None:
        shard_trainer_model(model, parallel.world_mesh, parallel.dp_mesh, precision)
    elif precision != "fp32":  # one process without torch.distributed (tests): no FSDP, so no mixed precision
        raise MoeloopError(f"trainer.precision {precision} needs the trainer's process group (init_parallel)")
    compile_decoder_layers(model)  # CUDA only: HF's elementwise code around the MoE blocks dominates, eager
    return model


def trainer_attention(settings: TrainerConfig, parallel: Parallel) -> str:
    """`trainer.attention` resolved for this process's device and precision: a one-line error where it cannot run."""
    precision = settings.compute_precision(parallel.device.type == "cuda")
    return attention_backend(settings.attention, parallel.device, PRECISIONS[precision])


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
    to the update's peak memory (tests/gpu/test_cuda.py checks that on a GPU). At kl_coef 0 only the rows that the kl
    metric is measured on (`algorithm.kl_metric_samples`) are computed; the others are NaN."""
    settings = config.trainer
    logprobs_BT = torch.full(batch.input_ids_BT.shape, math.nan, device=batch.input_ids_BT.device)
    rows = len(batch.input_ids_BT) if config.algorithm.kl_coef > 0 else config.algorithm.kl_metric_samples
    if rows == 0:
        return logprobs_BT
    reference = load_trainer_model(directory, settings, parallel)[0]  # its optimizer, which holds it, dropped here
    sample_b = torch.arange(min(rows, len(batch.input_ids_BT)), device=batch.input_ids_BT.device)
    logprobs_BT[sample_b] = frozen_logprobs(
        reference, batch.select(sample_b), config.rollout.temperature, settings.max_tokens_per_microbatch, parallel
    )
    del reference
    gc.collect()  # the model's reference cycles (hooks, FSDP state): freed now, not at the next collection
    if parallel.device.type == "cuda":
        torch.cuda.empty_cache()
    return logprobs_BT


def load_trainer_start(
    storage: RunStorage, iteration: int, scratch: Path, config: MoeloopConfig, parallel: Parallel
) -> tuple[Any, Any, torch.optim.Optimizer, Critic | None]:
    """This rank's share of the previous trainer state if there is one (`moeloop.steps.rl.checkpoint`: DCP resharded to
    this mesh), else of the checkpoint the rollouts used: (policy, tokenizer, its optimizer, the critic with its
    optimizer for PPO)."""
    settings = config.trainer
    previous = storage.trainer_state(iteration - 1)
    resumed = storage.is_committed(previous)
    directory = fetch_trainer_state(storage, previous, scratch / "previous") if resumed else None
    if directory is not None:
        model, tokenizer, optimizer = resume_model(directory, AutoModelForCausalLM, config, None, parallel)
    else:
        directory = fetch_checkpoint(storage, iteration - 1)
        model, tokenizer, optimizer = load_trainer_model(directory, settings, parallel)
    if config.algorithm.name != "ppo":
        return model, tokenizer, optimizer, None
    # The critic resumes from its state beside the policy's; the first one starts from the policy (zero head).
    rate = config.algorithm.critic_learning_rate
    if resumed:
        critic_model, _, critic_optimizer = resume_model(
            directory / CRITIC_DIR, AutoModelForTokenClassification, config, rate, parallel
        )
        return model, tokenizer, optimizer, Critic(critic_model, critic_optimizer)
    shard = (settings.dispatcher, settings.experts_impl, parallel.ep_group, parallel.device)
    critic_model, _ = load_critic_shard(directory, *shard, from_policy=True)
    critic_model = prepare_trainer_model(critic_model, settings, parallel)
    return model, tokenizer, optimizer, Critic(critic_model, make_optimizer(critic_model, settings, rate))


def fetch_trainer_state(storage: RunStorage, folder: str, local_dir: Path) -> Path:
    """A committed trainer state, verified, into local_dir; one in the format before DCP is refused."""
    manifest = storage.manifest(folder)
    if f"{WEIGHTS_DIR}/{METADATA}" not in manifest["files"]:
        raise MoeloopError(
            f"trainer state {storage.display(folder)} is in the format before sharded (DCP) trainer states"
            " (HF files + optimizer.pt), which this moeloop does not resume from: start a new run"
        )
    storage.fetch_files(folder, manifest["files"], local_dir)
    return local_dir


def resume_model(
    directory: Path, auto_class: Any, config: MoeloopConfig, learning_rate: float | None, parallel: Parallel
) -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    """A model (of auto_class) and its optimizer as the trainer holds them, from a trainer-state folder."""
    settings = config.trainer
    model_config, tokenizer = read_config(directory)
    shard = (settings.dispatcher, settings.experts_impl, parallel.ep_group, parallel.device)
    model = prepare_trainer_model(shard_model(auto_class, model_config, *shard), settings, parallel)
    optimizer = make_optimizer(model, settings, learning_rate)
    load_sharded(model, optimizer, parallel, directory, str(directory))
    return model, tokenizer, optimizer


def save_trainer_state(
    model: nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer, parallel: Parallel, directory: Path
) -> None:
    """This rank's shards of the weights (fp32) and the optimizer state into directory (`moeloop.steps.rl.checkpoint`);
    rank 0 also writes the HF config and tokenizer. Collective: every rank calls it."""
    save_sharded(model, optimizer, parallel, directory)
    if parallel.rank == 0:
        model.config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)


@dataclass(frozen=True)
class UpdatedTrainer:
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    critic: Critic | None
    report: dict[str, Any]


def update_policy(
    storage: RunStorage,
    config: MoeloopConfig,
    iteration: int,
    scratch: Path,
    parallel: Parallel = Parallel(),
    start: tuple[Any, Any, torch.optim.Optimizer, Critic | None] | None = None,
) -> UpdatedTrainer:
    """The iteration's update in memory: the policy (PPO: and the critic) after it, and the report. Deterministic.
    It starts from `start` (policy, tokenizer, optimizer, critic: a trainer that holds them, steps/rl/held.py), else
    from the previous iteration's trainer state (`load_trainer_start`)."""
    rollouts = rollout_columns(read_rollouts(storage, iteration, config.rollout.num_shards))
    recorded = recorded_routes(rollouts)
    if config.algorithm.routing_replay == "rollout" and not recorded:
        raise MoeloopError(
            f"algorithm.routing_replay rollout needs the rollout shards' routed_experts column: iteration {iteration}'s"
            " shards lack it (written before it existed, or by an engine that did not record routes)"
        )
    rewards = read_rewards(storage, iteration).to_pydict()
    rewards_by_sample = dict(zip(rewards["sample_id"], rewards["reward"], strict=False))
    for sample, value in rewards_by_sample.items():  # the reward step refuses these: this is foreign data
        require_finite(value, f"{storage.display(storage.rewards(iteration))}: the reward of sample {sample}")
    seed = derive_seed(config.run_name, config.seed, "train", iteration)
    torch.manual_seed(seed)
    settings = config.trainer
    architecture = read_config(fetch_checkpoint(storage, 0))[0]
    top_k = architecture.num_experts_per_tok if recorded else None
    layers = moe_layers(hf_model_on_meta(architecture)) if recorded else ()  # for shards that name none
    batch = experience_batch(rollouts, rewards_by_sample, top_k, layers)
    batch = batch.to(parallel.device)
    ref_logprobs_BT = reference_logprobs(fetch_checkpoint(storage, 0), batch, config, parallel)
    model, tokenizer, optimizer, critic = start or load_trainer_start(storage, iteration, scratch, config, parallel)
    started = time.perf_counter()
    report = policy_update(model, ref_logprobs_BT, optimizer, batch, config, seed, parallel, critic)
    seconds = time.perf_counter() - started
    report["train_tokens_per_second"] = round(int(batch.attention_mask_BT.sum()) * settings.epochs / seconds, 1)
    report["device"] = str(parallel.device)
    report["precision"] = settings.compute_precision(parallel.device.type == "cuda")
    report["attention"] = model.config._attn_implementation
    if parallel.device.type == "cuda":
        report["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(parallel.device)
    return UpdatedTrainer(model, tokenizer, optimizer, critic, report)
