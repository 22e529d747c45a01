"""One sparse MoE block with grouped-GEMM experts and expert parallelism, a drop-in for every family's HF block.

`MoeBlock` replaces the HF sparse block of a family in `moeloop.steps.model.families` (and bypasses its
`_experts_implementation`):
- routing is HF's: the block keeps the HF router module, its class swapped for the family's fused router (the
  same computation, one Triton pass on CUDA), so `output_router_logits=True` records the same router logits
  through HF's `OutputRecorder` hook and the model's load-balancing aux loss is unchanged;
- tokens are permuted by expert (and, with expert parallelism, moved to the rank holding the expert) by a
  dispatcher from `moeloop.steps.model.dispatch`, the experts run as grouped GEMMs (or a per-expert loop), and the outputs are
  summed per token (the routing weight folded into the SwiGLU output, before the linear down projection);
- a family's expert biases (GPT-OSS's) are each row's expert's, added in the grouped path; its shared expert
  (Qwen2-MoE's, DeepSeek-V3's) stays HF's module, replicated like the dense weights, its output (through
  its sigmoid gate, if gated) added to the routed experts';
- parameters keep HF's names and fused layout, `experts.gate_up_proj` [e, 2I, H] and `experts.down_proj`
  [e, H, I] (GPT-OSS: transposed, with biases), holding only this EP rank's e = E / EP experts, so loading and
  publishing are slicing and gathering.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model import kernels
from moeloop.steps.model.dispatch import TokenDispatcher
from moeloop.steps.model.families import Activation, FusedRouter, MoeFamily, decoder_layer, family_of_block

ExpertsImpl = Literal["grouped_mm", "loop"]


class GroupedExperts(nn.Module):
    """One EP rank's e experts in HF's fused layout of the family, run on rows grouped by expert (grouped GEMMs or a
    loop).

    The layout is the HF experts module's own (its `is_transposed` and `has_bias`): nn.Linear's, gate_up_proj
    [e, 2I, H] and down_proj [e, H, I]; or GPT-OSS's transposed one, gate_up_proj [e, H, 2I] and down_proj
    [e, I, H], with biases gate_up_proj_bias [e, 2I] and down_proj_bias [e, H]. The family's activation reads the
    gate and up columns where the family puts them (`MoeFamily.activation`).
    """

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        activation: Activation,
        impl: ExpertsImpl,
        transposed: bool = False,
        biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        gate_up_bias, down_bias = (nn.Parameter(b) for b in biases) if biases is not None else (None, None)
        self.gate_up_proj_bias, self.down_proj_bias = gate_up_bias, down_bias  # [e, 2I], [e, H]; or None
        self.activation = activation
        self.transposed = transposed
        self.impl = impl
        # The dtype the GEMMs run in when it is not the parameters' own: FSDP2's mixed precision computes with bf16
        # copies of fp32 parameters (moeloop.steps.model.sharding); None: the parameters' dtype.
        self.compute_dtype: torch.dtype | None = None

    @classmethod
    def from_hf(
        cls, experts: nn.Module, family: MoeFamily, ep_rank: int, ep_size: int, impl: ExpertsImpl = "grouped_mm"
    ) -> GroupedExperts:
        """EP rank ep_rank of ep_size takes experts [r * E / ep_size, (r + 1) * E / ep_size), copied."""
        num_local = experts.num_experts // ep_size
        local = slice(ep_rank * num_local, (ep_rank + 1) * num_local)
        names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")[: 4 if experts.has_bias else 2]
        gate_up, down, *biases = (getattr(experts, name).detach()[local].clone() for name in names)
        return cls(gate_up, down, family.activation(experts), impl, experts.is_transposed, (*biases,) or None)

    @property
    def traceable(self) -> bool:
        """Whether torch.compile traces these experts into one graph: grouped GEMMs (the loop syncs with the host for
        its splits) in bf16 (the one dtype grouped_mm's meta function accepts, in torch 2.11 to 2.13)."""
        return self.impl == "grouped_mm" and (self.compute_dtype or self.gate_up_proj.dtype) == torch.bfloat16

    def forward(
        self, x_NH: torch.Tensor, tokens_per_expert_e: torch.Tensor, weight_N: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows grouped by expert through their experts; with weight_N, each row's output scaled by its weight.

        The weight multiplies the SwiGLU output (I wide) before the down projection, which is linear, so this is
        the weighted expert output without an H-wide multiply; a down projection's bias is weighted on its own. On
        CUDA the SwiGLU is a Triton kernel, and so are the grouped GEMMs' forward and input gradient on Hopper in
        bf16 for large calls (`moeloop.steps.model.kernels`). Biases are each row's expert's, indexed by row.
        """
        expert_N = None if self.gate_up_proj_bias is None else expert_of_rows(tokens_per_expert_e, x_NH.shape[0])
        if self.impl == "grouped_mm":
            offs_e = torch.cumsum(tokens_per_expert_e, 0, dtype=torch.int32)  # end row of each expert; empty groups ok
            gate_up_N2I = kernels.grouped_linear(x_NH, self.gate_up_proj, offs_e, not self.transposed)
            if self.gate_up_proj_bias is not None and expert_N is not None:
                gate_up_N2I = gate_up_N2I + self.gate_up_proj_bias[expert_N]
            hidden_NI = self.activation(gate_up_N2I, weight_N)
            y_NH = kernels.grouped_linear(hidden_NI, self.down_proj, offs_e, not self.transposed)
        else:
            splits = tokens_per_expert_e.tolist()
            weights = weight_N.split(splits) if weight_N is not None else [None] * len(splits)
            outputs = []
            for expert, (x_nH, weight_n) in enumerate(zip(x_NH.split(splits), weights, strict=True)):
                gate_up_n2I = self.linear(x_nH, self.gate_up_proj[expert])
                if self.gate_up_proj_bias is not None:
                    gate_up_n2I = gate_up_n2I + self.gate_up_proj_bias[expert]
                outputs.append(self.linear(self.activation(gate_up_n2I, weight_n), self.down_proj[expert]))
            y_NH = torch.cat(outputs)
        if self.down_proj_bias is None or expert_N is None:
            return y_NH
        bias_NH = self.down_proj_bias[expert_N]
        return y_NH + (bias_NH if weight_N is None else bias_NH * weight_N.unsqueeze(1).to(bias_NH.dtype))

    def linear(self, x_nK: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One expert's projection: F.linear for nn.Linear's layout, x @ weight for the transposed one."""
        return x_nK @ weight if self.transposed else F.linear(x_nK, weight)


def expert_of_rows(tokens_per_expert_e: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The local expert of each row of rows grouped by expert (num_rows of them: no device sync to size it)."""
    experts_e = torch.arange(tokens_per_expert_e.numel(), device=tokens_per_expert_e.device)
    return torch.repeat_interleave(experts_e, tokens_per_expert_e, output_size=num_rows)


class MoeBlock(nn.Module):
    """Drop-in for a family's HF sparse block: HF's router, then dispatch, grouped experts, combine; plus the
    family's shared expert, if it has one."""

    def __init__(
        self,
        family: MoeFamily,
        gate: FusedRouter,
        experts: GroupedExperts,
        dispatcher: TokenDispatcher[Any],
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.family = family
        # Under the family's own attribute names, so their parameters keep HF's names (and HF's order: router first).
        self.add_module(family.router_attribute, gate)
        self.experts = experts
        self.dispatcher = dispatcher
        if family.shared_expert is not None:
            self.add_module(family.shared_expert, shared_expert)
        if family.shared_expert_gate is not None:
            self.add_module(family.shared_expert_gate, shared_expert_gate)
        self.replay_TK: torch.Tensor | None = None  # recorded experts to route each token to (-1: its own); `replaying`

    @classmethod
    def from_hf_block(
        cls, block: nn.Module, dispatcher: TokenDispatcher[Any], experts_impl: ExpertsImpl = "grouped_mm"
    ) -> MoeBlock:
        """This EP rank's block, with the EP rank and size of the dispatcher's group, for HF's sparse block of any
        family.

        The router module is taken over as it is (same parameter, and an already installed router-logit hook
        keeps recording), its class swapped in place for the family's fused router, so HF's block routes with our
        kernel from now on too; the experts are this rank's slice of the fused tensors, copied; a shared expert
        and its gate are taken over as they are.
        """
        family = family_of_block(block)
        if family is None:
            raise MoeloopError(f"{type(block).__name__} is no sparse MoE block of a known family")
        if getattr(block, "jitter_noise", 0.0):  # Mixtral's training-time input noise, off in its released configs
            raise MoeloopError(f"router_jitter_noise {block.jitter_noise} is not supported; set it to 0")
        experts = GroupedExperts.from_hf(block.experts, family, dispatcher.ep_rank, dispatcher.ep_size, experts_impl)
        gate = getattr(block, family.router_attribute)
        gate.__class__ = family.fused_router
        shared = [getattr(block, name) if name else None for name in (family.shared_expert, family.shared_expert_gate)]
        return cls(family, gate, experts, dispatcher, *shared)

    @property
    def top_k_router(self) -> FusedRouter:
        """The family's router module, registered under its HF attribute name (`gate`; GPT-OSS's `router`)."""
        return getattr(self, self.family.router_attribute)

    @property
    def traceable(self) -> bool:
        """Whether torch.compile takes the whole block: its dispatcher and its experts trace."""
        return self.dispatcher.traceable and self.experts.traceable

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output; with the top-k routing weights beside it where HF's block returns them (GPT-OSS)."""
        if self.traceable:
            y, weights_TK = self.route_and_run(hidden_states)
        else:
            y, weights_TK = self.route_and_run_eager(hidden_states)
        return (y, weights_TK) if self.family.returns_router_scores else y

    def route_and_run(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
        router_logits_TE, topk_weights_TK, topk_idx_TK = self.top_k_router(x_TH)
        if self.replay_TK is not None:
            topk_weights_TK, topk_idx_TK = replay_routing(
                self.top_k_router, router_logits_TE, topk_weights_TK, topk_idx_TK, self.replay_TK
            )
        expert_x_NH, tokens_per_expert_e, meta = self.dispatcher.dispatch(x_TH, topk_idx_TK, topk_weights_TK)
        expert_y_NH = self.experts(expert_x_NH, tokens_per_expert_e, meta.weight_N)  # weighted in the SwiGLU
        y_TH = self.dispatcher.combine(expert_y_NH, meta)
        if self.family.shared_expert is not None:
            y_TH = y_TH + self.shared_output(x_TH)
        return y_TH.reshape(hidden_states.shape), topk_weights_TK

    def shared_output(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, every token's, scaled by its sigmoid gate where the family has one."""
        shared_TH = getattr(self, self.family.shared_expert)(x_TH)
        if self.family.shared_expert_gate is None:
            return shared_TH
        return F.sigmoid(getattr(self, self.family.shared_expert_gate)(x_TH)) * shared_TH

    # Out of torch.compile (a compiled layer graph-breaks around the block): EP dispatchers, which sync with the host
    # for split sizes and call collectives or DeepEP; and experts that do not trace (fp32 grouped_mm, the loop).
    @torch.compiler.disable
    def route_and_run_eager(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_and_run(hidden_states)

    def gather_experts(self) -> dict[str, torch.Tensor]:
        """All E experts' tensors by name in the block (`experts.gate_up_proj` ...), as HF holds them in memory.

        Collective over the EP group (and, under FSDP2, over the dp ranks that shard this EP slice): every rank must
        call it.
        """
        group = self.dispatcher.ep_group
        return {
            f"experts.{name}": gather_over(unsharded(p.detach()), group) for name, p in self.experts.named_parameters()
        }


def unsharded(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (an FSDP2 shard) made whole on every rank of its mesh (collective); a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def replay_routing(
    gate: FusedRouter,
    router_logits_TE: torch.Tensor,
    weights_TK: torch.Tensor,
    experts_TK: torch.Tensor,
    recorded_TK: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout routing replay: each token with recorded experts (row not -1) goes to them, with the gate weights
    the family's routing gives those experts from this router's logits (`weights_of`), so the router still learns;
    the other tokens keep their own routing. Recorded in the router's own order, the same experts give the same
    weights to the bit."""
    recorded_TK = recorded_TK.to(experts_TK.device, experts_TK.dtype)
    has_T1 = recorded_TK[:, :1] >= 0
    experts_TK = torch.where(has_T1, recorded_TK, experts_TK)
    replayed_TK = gate.weights_of(router_logits_TE, experts_TK)
    return torch.where(has_T1, replayed_TK.to(weights_TK.dtype), weights_TK), experts_TK


@dataclass(frozen=True)
class Routes:
    """The engine's recorded routing of a batch's (or a packed microbatch's) rows: the K experts at each position and
    MoE layer (-1 where none was recorded), keyed by decoder layer, and which positions' forwards sampled a response
    token (the others are the prompt's)."""

    experts_bTLK: torch.Tensor
    layers: tuple[int, ...]  # the decoder layer of each L column, as `moe_layers` numbers a model's MoE layers
    sampled_bT: torch.Tensor


def check_route_layers(recorded: tuple[int, ...], model: tuple[int, ...]) -> None:
    """Routes recorded for other decoder layers than the model's MoE layers are refused, in one line."""
    if tuple(recorded) != tuple(model):
        raise MoeloopError(
            f"the recorded routes are of decoder layers {list(recorded)}, the model's MoE layers are {list(model)}"
        )


@contextmanager
def replaying(model: nn.Module, routes: Routes | None) -> Iterator[None]:
    """Within it, model's forward routes token t of row b in the MoE block of decoder layer routes.layers[l] to
    routes.experts_bTLK[b, t, l] (K experts; -1 for the token's own choice): the engine's recorded routing. None
    replays nothing. A layer's tokens are the forward's [b, T] flattened, as every MoE block flattens them."""
    named = [(name, module) for name, module in model.named_modules() if isinstance(module, MoeBlock)]
    blocks = [block for _, block in named]
    if routes is not None:
        check_route_layers(routes.layers, tuple(decoder_layer(name) for name, _ in named))
    for layer, block in enumerate(blocks):
        experts_bTK = routes.experts_bTLK[:, :, layer] if routes is not None else None
        block.replay_TK = experts_bTK.reshape(-1, experts_bTK.shape[-1]) if experts_bTK is not None else None
    try:
        yield
    finally:
        for block in blocks:
            block.replay_TK = None


def gather_over(local_eXY: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's equally shaped slice along dim 0 (all_gather over group; None: one rank)."""
    if group is None or group.size() == 1:
        return local_eXY.clone()
    slices = [torch.empty_like(local_eXY) for _ in range(group.size())]
    dist.all_gather(slices, local_eXY.contiguous(), group=group)
    return torch.cat(slices)


def replace_moe_blocks(
    model: nn.Module, dispatcher: TokenDispatcher[Any], experts_impl: ExpertsImpl = "grouped_mm"
) -> int:
    """Swap every family's HF sparse block in model for this EP rank's `MoeBlock`, in place; returns how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if family_of_block(child) is not None
    ]
    for parent, name, child in swaps:
        setattr(parent, name, MoeBlock.from_hf_block(child, dispatcher, experts_impl))
    return len(swaps)


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model's state dict as the HF model has it: unsharded (FSDP2), every MoE block's experts gathered over its EP
    group. Collective: every rank must call it. The HF model's `load_state_dict` takes the result, and
    `save_pretrained` writes the HF checkpoint from there.
    """
    state = {key: unsharded(value) for key, value in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, MoeBlock):
            state.update({f"{name}.{key}": value for key, value in module.gather_experts().items()})
    return state


def compile_decoder_layers(model: nn.Module) -> int:
    """On CUDA, `compile_layers(model)`; on CPU nothing (returns 0): there the eager layers are the reference the
    compiled ones are tested against."""
    return compile_layers(model) if next(model.parameters()).device.type == "cuda" else 0


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """`torch.compile` in place every module that holds a `MoeBlock` (HF's decoder layers); returns how many.
    backend: torch.compile's (tests trace every family with dynamo's quick `eager` one).

    Compiled: each layer's RMSNorms (fp32), attention with q/k norms and RoPE, residual adds, whose many small
    elementwise kernels dominate the policy update once the MoE block is fast. Where the MoE block traces as one
    graph (`MoeBlock.forward`: the `local` dispatcher and bf16 grouped-GEMM experts) the layer is one graph in its
    forward and one in its backward, compiled with fullgraph=True so that a break is an error: inductor fuses the
    router's and the sort's small kernels, calls `moeloop.steps.model.kernels`' Triton ops as they are, and the
    router logits leave the graph as an output (`moeloop.steps.model.logprobs.RouterLogits`). Otherwise (EP
    dispatchers, fp32) the block stays eager and the layer graph-breaks around it. Layers of one class share their
    compiled code. Shapes are dynamic from the first compile: the packings an update meets then take a few graphs
    (with and without gradients; one sample, an empty microbatch), where specialising first and generalising on
    each new kind of shape reached dynamo's limit of 8, past which a fullgraph layer fails. A layer whose forward
    activation checkpointing wraps (`moeloop.steps.model.sharding.checkpoint_decoder_layers`) is not fullgraph:
    dynamo does not trace into torch.utils.checkpoint's frame, and that layer runs eager (torch 2.13).
    """
    layers = [parent for parent in model.modules() if any(isinstance(c, MoeBlock) for c in parent.children())]
    for layer in layers:
        block = next(child for child in layer.children() if isinstance(child, MoeBlock))
        checkpointed = "forward" in vars(layer)  # the wrapper is set on the instance
        layer.compile(backend=backend, fullgraph=block.traceable and not checkpointed, dynamic=True)
    return len(layers)
