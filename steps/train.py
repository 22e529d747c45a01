"""train: one GRPO policy update on the iteration's experience; commits the trainer state (weights, optimizer).

Starts from the trainer state of the previous iteration (checkpoint 0 for the first), so the optimizer's
moments carry across iterations. The reference policy for the KL is checkpoint 0, the SFT start.

With `trainer.world_size` > 1 it runs under torchrun over a (dp, ep) device mesh: each rank holds the dense
weights and routers whole and its EP slice of the experts, and takes a distinct share of every minibatch's
samples. The update equals one process's on the whole minibatch (tests/test_train_ep.py). Rank 0 alone writes:
the report, and the trainer state with the experts gathered, so the storage layout and publish are unchanged.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

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
from steps.config import MoeloopConfig, TrainerConfig
from steps.errors import MoeloopError, run_cli
from steps.experience import read_rewards, read_rollouts
from steps.grpo import group_advantages, grpo_loss
from steps.moe import MoeBlock, gather_over, hf_state_dict
from steps.policy import load_policy_shard, pack_sequences, save_hf_state_dict, token_logprobs
from steps.storage import OPTIMIZER_FILE, RunStorage


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

    def to(self, device: torch.device) -> ExperienceBatch:
        return ExperienceBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def experience_batch(rollouts: dict[str, list], rewards_by_sample: dict[str, float], pad_id: int) -> ExperienceBatch:
    prompts, responses = rollouts["prompt_token_ids"], rollouts["response_token_ids"]
    input_ids_BT, attention_mask_BT, response_mask_BT = pack_sequences(prompts, responses, pad_id)
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


def rank_share(rows_N: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """This rank's distinct, contiguous share of rows_N (sizes differ by at most one). Every rank takes one,
    EP ranks included: the all-to-all moves their tokens to the experts and back."""
    return rows_N.tensor_split(parallel.world_size)[parallel.rank]


@torch.no_grad()
def frozen_logprobs(
    model: torch.nn.Module, batch: ExperienceBatch, temperature: float, minibatch: int, parallel: Parallel
) -> torch.Tensor:
    """The whole batch's token logprobs on every rank: each rank computes its share, then they are all-gathered."""
    model.eval()
    batch_size = len(batch.input_ids_BT)
    rows_b = rank_share(torch.arange(batch_size), parallel)
    # Every rank runs the MoE layers (collectives inside) equally often: the chunk count of the largest share.
    largest_share = -(-batch_size // parallel.world_size)
    chunks = [
        token_logprobs(model, batch.input_ids_BT[rows], batch.attention_mask_BT[rows], temperature)[0]
        for rows in rows_b.tensor_split(-(-largest_share // minibatch))
    ]
    return all_gather_rows(torch.cat(chunks), batch_size, parallel)


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


def sync_gradients(model: torch.nn.Module, experts: set[torch.nn.Parameter], parallel: Parallel) -> None:
    """Sum each gradient over the ranks that hold the parameter and saw different tokens.

    Plain all-reduces rather than DDP or FSDP2 (fully_shard does run on gloo): the replicated dense weights and
    routers sum over the whole world, but the experts only over dp, and DDP reduces one parameter set over one
    group. Sharding the dense weights (FSDP2 over dp, HSDP-style over ep) pays off only for models whose dense
    part does not fit one GPU, not for the CPU model here; it is the step to take for large models on GPUs.
    """
    if parallel.world_size == 1:
        return
    for parameter in model.parameters():
        if parameter.grad is None:  # every rank must join every all-reduce
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad, group=parallel.dp_group if parameter in experts else None)


def clip_gradients(
    model: torch.nn.Module, experts: set[torch.nn.Parameter], max_norm: float, parallel: Parallel
) -> float:
    """`clip_grad_norm_` over the whole model: the expert part of the squared norm is summed over the EP group."""
    dense_square = sum(p.grad.pow(2).sum() for p in model.parameters() if p not in experts)
    expert_square = sum((p.grad.pow(2).sum() for p in experts), torch.zeros((), device=parallel.device))
    if parallel.ep_group is not None:
        dist.all_reduce(expert_square, group=parallel.ep_group)
    total_norm = (dense_square + expert_square).sqrt()
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # as clip_grad_norm_ computes it
    for parameter in model.parameters():
        parameter.grad.mul_(scale)
    return float(total_norm)


def all_reduce_sum(values: list[float], parallel: Parallel) -> list[float]:
    if parallel.world_size == 1:
        return values
    summed = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(summed)
    return summed.tolist()


def grpo_update(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: ExperienceBatch,
    config: MoeloopConfig,
    seed: int,
    parallel: Parallel = Parallel(),
) -> dict[str, float]:
    """Advantages, then epochs x minibatches of clipped-surrogate steps; returns what it measured (all ranks).

    Every rank draws the same minibatches and takes its share of each. The loss is a token mean over the whole
    minibatch (its global token count is the denominator), so the gradients summed over the ranks are one
    process's on the whole minibatch.
    """
    settings, algorithm = config.trainer, config.algorithm
    temperature = config.rollout.temperature
    mask_BT = batch.response_mask_BT
    advantages_B = group_advantages(batch.rewards_B, batch.group_ids_B, scale=algorithm.scale_rewards)
    # pi_old is the trainer's own view of the behaviour policy, so the first step's ratio is exactly 1.
    old_logprobs_BT = frozen_logprobs(model, batch, temperature, settings.minibatch_size, parallel)
    ref_logprobs_BT = frozen_logprobs(reference, batch, temperature, settings.minibatch_size, parallel)
    log_ratio_BT = ref_logprobs_BT - old_logprobs_BT
    kl_before = masked_mean(torch.exp(log_ratio_BT) - log_ratio_BT - 1, mask_BT)
    # Engine vs trainer on the same policy version: mean |difference| and KL(behaviour || trainer), k3.
    behavior_gap_BT = old_logprobs_BT - batch.behavior_logprobs_BT
    mismatch = masked_mean(behavior_gap_BT.abs(), mask_BT)
    behavior_kl = masked_mean(torch.exp(behavior_gap_BT) - behavior_gap_BT - 1, mask_BT)

    model_config = model.config
    experts = expert_parameters(model)
    generator = torch.Generator().manual_seed(seed)
    losses, clip_fractions, grad_norms = [], [], []
    model.train()
    for _ in range(settings.epochs):
        order = torch.randperm(len(advantages_B), generator=generator)
        for start in range(0, len(order), settings.minibatch_size):
            minibatch_rows = order[start : start + settings.minibatch_size]
            num_tokens = max(int(mask_BT[minibatch_rows].sum()), 1)
            rows = rank_share(minibatch_rows, parallel)
            logprobs_bT, router_logits_L = token_logprobs(
                model, batch.input_ids_BT[rows], batch.attention_mask_BT[rows], temperature
            )
            terms = grpo_loss(
                logprobs_bT,
                old_logprobs_BT[rows],
                advantages_B[rows],
                mask_BT[rows],
                clip_eps=algorithm.clip_eps,
                ref_logprobs_BT=ref_logprobs_BT[rows] if algorithm.kl_coef > 0 else None,
                kl_coef=algorithm.kl_coef,
                num_tokens=num_tokens,
            )
            aux_loss = load_balancing_loss(
                router_logits_L,
                batch.attention_mask_BT[rows],
                model_config.num_experts,
                model_config.num_experts_per_tok,
                parallel,
            )
            optimizer.zero_grad(set_to_none=True)
            (terms.loss + model_config.router_aux_loss_coef * aux_loss).backward()
            sync_gradients(model, experts, parallel)
            grad_norms.append(clip_gradients(model, experts, settings.max_grad_norm, parallel))
            optimizer.step()
            # The rank's loss is its part of the minibatch's token mean; its clip fraction is over its tokens.
            share_tokens = float(mask_BT[rows].sum())
            loss, clipped = all_reduce_sum([terms.loss.item(), float(terms.clip_fraction) * share_tokens], parallel)
            losses.append(loss)
            clip_fractions.append(clipped / num_tokens)
    return {
        "loss": sum(losses) / len(losses),
        "kl": kl_before,
        "clip_fraction": sum(clip_fractions) / len(clip_fractions),
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "logprob_mismatch": mismatch,
        "behavior_kl": behavior_kl,
        "advantage_abs_mean": float(advantages_B.abs().mean()),
        "optimizer_steps": len(losses),
        "response_tokens": int(mask_BT.sum()),
    }


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
    storage: RunStorage, iteration: int, scratch: Path, settings: TrainerConfig, parallel: Parallel
) -> tuple[Any, Any, dict | None]:
    """This rank's share of the previous trainer state if there is one, else of the checkpoint the rollouts used."""
    previous = storage.trainer_state(iteration - 1)
    optimizer_state = None
    if storage.is_committed(previous):
        storage.fetch_folder(previous, scratch / "previous")
        directory = scratch / "previous"
        optimizer_state = torch.load(directory / OPTIMIZER_FILE, weights_only=True)
    else:
        directory = fetch_checkpoint(storage, iteration - 1)
    model, tokenizer = load_policy_shard(
        directory, settings.dispatcher, settings.experts_impl, parallel.ep_group, parallel.device
    )
    return model, tokenizer, optimizer_state


def make_optimizer(model: torch.nn.Module, settings: TrainerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, betas=settings.betas, weight_decay=settings.weight_decay
    )


def update_policy(
    storage: RunStorage, config: MoeloopConfig, iteration: int, scratch: Path, parallel: Parallel = Parallel()
) -> tuple[Any, Any, Any, dict]:
    """The iteration's policy update in memory: (model, tokenizer, optimizer, report). Deterministic."""
    rollouts = read_rollouts(storage, iteration, config.rollout.num_shards).to_pydict()
    rewards = read_rewards(storage, iteration).to_pydict()
    rewards_by_sample = dict(zip(rewards["sample_id"], rewards["reward"], strict=False))
    seed = derive_seed(config.run_name, config.seed, "train", iteration)
    torch.manual_seed(seed)
    settings = config.trainer
    model, tokenizer, optimizer_state = load_trainer_start(storage, iteration, scratch, settings, parallel)
    reference, _ = load_policy_shard(
        fetch_checkpoint(storage, 0), settings.dispatcher, settings.experts_impl, parallel.ep_group, parallel.device
    )
    optimizer = make_optimizer(model, settings)
    if optimizer_state is not None:
        load_optimizer_state(model, optimizer, optimizer_state, parallel)
    batch = experience_batch(rollouts, rewards_by_sample, tokenizer.pad_token_id).to(parallel.device)
    started = time.perf_counter()
    report: dict[str, Any] = grpo_update(model, reference, optimizer, batch, config, seed, parallel)
    seconds = time.perf_counter() - started
    report["train_tokens_per_second"] = round(int(batch.attention_mask_BT.sum()) * settings.epochs / seconds, 1)
    return model, tokenizer, optimizer, report


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
            model, tokenizer, optimizer, report = update_policy(storage, config, iteration, scratch, parallel)
            if not save_trainer_state(model, tokenizer, optimizer, parallel, scratch / "state"):
                return None
            report["seconds"] = round(time.perf_counter() - started, 3)
            write_report(storage, iteration, "train", report)
            storage.commit_folder(output, scratch / "state", extra={"iteration": iteration})
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
