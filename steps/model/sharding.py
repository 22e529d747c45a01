"""The trainer's models under FSDP2 over the (dp, ep) mesh: mixed precision, activation checkpointing, clipping.

`shard_trainer_model` applies `torch.distributed.fsdp.fully_shard` (torchtitan's layout, HSDP-style for the
experts):
- each decoder layer is one FSDP unit over all ranks (attention, norms, router): its weights are sharded over
  the world and all-gathered for its forward and backward;
- with EP > 1, each layer's experts are a unit of their own over the dp ranks that hold the same EP slice: the
  slice is sharded over them (`moeloop.steps.model.moe.GroupedExperts` already holds only this EP rank's experts);
- the model's body (embeddings, final norm) and its head (LM head or value head) are the last two units.
Each layer's unit all-gathers the next layer's weights as it starts its forward, and the previous layer's as it
starts its backward (FSDP2's explicit prefetch: the same overlap as its default, but queued from the host a layer
earlier, so a host that falls behind the GPU does not leave it waiting for the gather). The last layer and the
head keep their gathered weights from the forward to their backward, which follows at once.
Gradients are summed, not averaged, in the reduce-scatters: every loss is already divided by the whole
minibatch's counts (`moeloop.steps.rl.grpo.aggregate`), so the sum over the ranks is one process's gradient. The expert
gradients reach their EP rank through the all-to-all's backward and are summed over dp; dense ones over all.

`trainer.precision`:
- `bf16`: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`. The sharded parameters (the optimizer's
  master weights), their gradients and AdamW's moments are fp32; each unit computes with bf16 copies
  all-gathered for its forward and backward, so the experts take the bf16 grouped-GEMM and Triton path.
- `fp32`: everything fp32 (CPU, and the equality tests).

Activation checkpointing (`trainer.activation_checkpointing`, `checkpoint_decoder_layers`) keeps each decoder
layer's input and recomputes the rest in the backward. It wraps the layer's forward, inside FSDP's hooks and inside
the compiled call (`moeloop.steps.model.moe.compile_decoder_layers`): HF's own gradient checkpointing wraps the whole call,
hooks included, and with compiled layers under FSDP2 its recompute saved one tensor fewer than the forward on an
H200 (torch 2.11: `CheckpointError`, in benchmarks/policy_update.md).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from moeloop.steps.model.moe import MoeBlock

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def checkpoint_decoder_layers(model: nn.Module) -> None:
    """Recompute every decoder layer's forward in its backward (non-reentrant `torch.utils.checkpoint`), in place."""
    for layer in model.model.layers:
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_trainer_model(model: nn.Module, world_mesh: DeviceMesh, dp_mesh: DeviceMesh, precision: str) -> nn.Module:
    """model (an MoE causal LM or token classifier with `MoeBlock`s) under FSDP2, in place; see the module
    docstring. Returns model."""
    policy = mixed_precision(precision)
    units: list[FSDPModule] = []
    layer_units: list[list[FSDPModule]] = []  # per layer, its experts' unit (EP > 1) and its own
    for number, layer in enumerate(model.model.layers, start=1):
        keep = number == len(model.model.layers)  # its backward comes right after its forward
        block, own = layer.mlp, []
        if isinstance(block, MoeBlock):
            block.experts.compute_dtype = PRECISIONS[precision]
            if block.dispatcher.ep_size > 1:  # another mesh than the layer's: a unit of its own
                own.append(fully_shard(block.experts, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=not keep))
        own.append(fully_shard(layer, mesh=world_mesh, mp_policy=policy, reshard_after_forward=not keep))
        units += own
        layer_units.append(own)
    for before, after in zip(layer_units, layer_units[1:]):
        before[-1].set_modules_to_forward_prefetch(after)
        after[-1].set_modules_to_backward_prefetch(before)
    head = model.lm_head if hasattr(model, "lm_head") else model.score
    units.append(fully_shard(head, mesh=world_mesh, mp_policy=policy, reshard_after_forward=False))
    units.append(fully_shard(model.model, mesh=world_mesh, mp_policy=policy))
    for unit in units:  # a plain SUM (gloo has no PREMUL_SUM, which a divide factor of 1 would otherwise take)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def reshard(model: nn.Module) -> None:
    """Free every FSDP unit's gathered parameters. A root unit keeps them after a forward without a backward (the
    no-gradient passes), and its parameters then read as the gathered ones."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
