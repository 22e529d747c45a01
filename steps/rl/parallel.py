"""The trainer's (dp, ep) device mesh and the collectives the update needs over it.

With `trainer.world_size` > 1 the trainer runs under torchrun: each rank holds the dense weights and routers whole
and its EP slice of the experts, and takes a distinct share of every minibatch's samples. Gradients are summed
over the ranks that hold a parameter, so the update equals one process's on the whole minibatch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from steps.config import TrainerConfig
from steps.errors import MoeloopError
from steps.model.moe import MoeBlock


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


def rank_share(rows_b: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """This rank's distinct, contiguous share of rows_b (sizes differ by at most one). Every rank takes one,
    EP ranks included: the all-to-all moves their tokens to the experts and back."""
    return rows_b.tensor_split(parallel.world_size)[parallel.rank]


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


def all_reduce_sum(values: list[float], parallel: Parallel) -> list[float]:
    if parallel.world_size == 1:
        return values
    summed = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(summed)
    return summed.tolist()


def expert_parameters(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    return {p for module in model.modules() if isinstance(module, MoeBlock) for p in module.experts.parameters()}


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the update trains: all but frozen ones (`trainer.freeze_router`)."""
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


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


def clip_gradients(
    model: torch.nn.Module, experts: set[torch.nn.Parameter], max_norm: float, parallel: Parallel
) -> float:
    """`clip_grad_norm_` over the whole model: the expert part of the squared norm is summed over the EP group."""
    trained = trained_parameters(model)
    dense_square = sum(p.grad.pow(2).sum() for p in trained if p not in experts)
    # Summed in the model's order, not the set's (which follows memory addresses): the same norm to the last bit
    # in every process, so a re-run or a long-lived worker trains exactly the same weights.
    expert_square = sum((p.grad.pow(2).sum() for p in trained if p in experts), torch.zeros((), device=parallel.device))
    if parallel.ep_group is not None:
        dist.all_reduce(expert_square, group=parallel.ep_group)
    total_norm = (dense_square + expert_square).sqrt()
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # as clip_grad_norm_ computes it
    for parameter in trained:
        parameter.grad.mul_(scale)
    return float(total_norm)
