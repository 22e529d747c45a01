"""The trainer's (dp, ep) device mesh and the collectives the update needs over it.

The train step runs one process per GPU (under torchrun when `trainer.world_size` > 1; at 1 as one plain process
in a process group of its own), and holds its models under FSDP2 over the mesh (`moeloop.steps.model.sharding`): the dense
weights and routers sharded over all ranks, each EP slice of the experts over the dp ranks that hold it. Each
rank packs its share of every minibatch's samples into microbatches (`moeloop.steps.rl.packing`), and the reduce-scatters
sum the gradients, so the update equals one process's on the whole minibatch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moeloop.steps.config import TrainerConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.moe import MoeBlock
from moeloop.steps.model.sharding import local


@dataclass(frozen=True)
class Parallel:
    """This process's place in the (dp, ep) mesh. The default is one process without torch.distributed, whose
    models are not sharded (the equality tests' reference)."""

    rank: int = 0
    world_size: int = 1
    ep_group: dist.ProcessGroup | None = None  # the ranks that share one copy of the experts
    world_mesh: DeviceMesh | None = None  # all ranks: dense weights and routers are sharded over it
    dp_mesh: DeviceMesh | None = None  # the ranks holding the same experts: their EP slice is sharded over it
    expert_mesh: DeviceMesh | None = None  # (ep, dp): the experts' global layout (`moeloop.steps.rl.checkpoint`)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def init_parallel(settings: TrainerConfig) -> Parallel:
    """Join the torchrun job (env://), or at trainer.world_size 1 make a group of this one process, and build the
    mesh. Each process takes its GPU (LOCAL_RANK's) where there is CUDA."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != settings.world_size:
        raise MoeloopError(
            f"trainer.world_size is {settings.world_size} but {launched} processes were started;"
            f" run it under torchrun --nproc-per-node {settings.world_size}"
        )
    cuda = torch.cuda.is_available()
    if cuda:
        on_node, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
        if on_node > gpus:
            raise MoeloopError(
                f"trainer.world_size {settings.world_size} starts {on_node} processes on this node, which has"
                f" {gpus} GPU(s) visible: one process per GPU"
            )
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if cuda else "gloo"
    if launched == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    return mesh_parallel(settings.expert_parallel, "cuda" if cuda else "cpu")


def mesh_parallel(expert_parallel: int, device_type: str) -> Parallel:
    """The (dp, ep) mesh over the initialised default process group; EP ranks are neighbours (ep varies fastest).
    Also its transpose, (ep, dp), over which an expert tensor's EP slices, each sharded over dp, are one DTensor."""
    world_size = dist.get_world_size()
    shape = (world_size // expert_parallel, expert_parallel)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "ep"))
    expert_mesh = DeviceMesh(device_type, torch.arange(world_size).reshape(shape).T, mesh_dim_names=("ep", "dp"))
    world_mesh = DeviceMesh.from_group(dist.group.WORLD, device_type)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return Parallel(dist.get_rank(), world_size, mesh["ep"].get_group(), world_mesh, mesh["dp"], expert_mesh, device)


def all_reduce_sum(values: list[float], parallel: Parallel) -> list[float]:
    if parallel.world_size == 1:
        return values
    summed = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(summed)
    return summed.tolist()


def expert_parameters(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    return {p for module in model.modules() if isinstance(module, MoeBlock) for p in module.experts.parameters()}


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float, parallel: Parallel) -> torch.Tensor:
    """`clip_grad_norm_` over sharded gradients: each rank's squared norm of its shards, summed over all ranks;
    returns the norm before clipping (a tensor: reading it waits for the GPU).

    Every parameter's shards are disjoint across the world: a dense weight's over all ranks, an expert's over its
    dp ranks within each EP slice, and the EP slices hold different experts. So one all-reduce sums the whole
    model's squared norm, the experts' part summed over EP. The local squares are summed by one deterministic
    reduction: the same to the last bit in a re-run. A few launches whatever the number of parameters.
    """
    gradients = [local(p.grad) for p in parameters if p.grad is not None]
    norms = torch._foreach_norm(gradients, dtype=torch.float32)  # one fused pass, as clip_grad_norm_ does
    square = torch.stack(norms).square().sum()  # one deterministic reduction, in the parameters' order
    if parallel.world_size > 1:
        dist.all_reduce(square)
    total_norm = square.sqrt()
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # as clip_grad_norm_ computes it
    torch._foreach_mul_(gradients, scale.to(gradients[0].dtype))
    return total_norm
