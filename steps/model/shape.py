"""A decoder-only MoE model's shape, read from its HF config.json, and its parameter counts: what the trainer's
memory model (`moeloop.steps.rl.memory`) and the capacity planner (`workflows/capacity/`) size it by.

Counts are computed from the shape and equal `sum(p.numel())` of the HF model built from the same config
(tests/unit/test_capacity.py checks every family of the planner's table on the meta device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeloop.steps.errors import MoeloopError

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "kimi_k2", "gpt_oss")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only MoE transformer as the planner and the memory model see it."""

    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    tie_embeddings: bool
    num_heads: int
    num_kv_heads: int
    qk_head_dim: int  # per head, rotary part included (MLA: nope + rope)
    v_head_dim: int
    q_lora_rank: int | None  # MLA (DeepSeek-V3): the query's low rank; None: a full q_proj
    kv_lora_rank: int | None  # MLA: the compressed KV's rank; None: grouped-query attention
    qk_rope_head_dim: int  # MLA: the rotary part of q and k, shared by all heads in k
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k
    sliding_window: int | None
    sliding_layers: int  # layers of windowed attention (GPT-OSS alternates)
    dense_layers: int  # layers with a dense MLP instead of experts (DeepSeek-V3's first k)
    dense_intermediate: int
    num_experts: int
    experts_per_token: int
    expert_intermediate: int
    shared_experts: int  # always-active experts beside the routed ones
    shared_intermediate: int  # of each shared expert
    qkv_bias: bool  # Qwen2-MoE, GPT-OSS
    output_bias: bool  # GPT-OSS: o_proj, router and expert biases, attention sinks
    shared_expert_gate: bool  # Qwen2-MoE: a sigmoid gate on the shared expert

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers


def shape_from_hf_config(config: dict[str, Any], source: str) -> ModelShape:
    """The shape of an HF config of a supported family; one-line error for anything else."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise MoeloopError(
            f"model {source}: model_type {kind!r} is not a supported MoE family ({', '.join(MODEL_TYPES)})"
        )
    try:
        return _shape(config, kind)
    except KeyError as error:
        raise MoeloopError(f"model {source}: config has no {error.args[0]!r}") from None


def _shape(c: dict[str, Any], kind: str) -> ModelShape:
    hidden, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    mla = kind in ("deepseek_v3", "kimi_k2")
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
    if mla:  # DeepSeek-V3: dense MLPs in the first k layers, then experts every moe_layer_freq-th layer
        first, every = c.get("first_k_dense_replace", 0), c.get("moe_layer_freq", 1)
        moe = sum(1 for i in range(layers) if experts and i >= first and i % every == 0)
    elif kind in ("qwen3_moe", "qwen2_moe"):  # a layer is dense if listed, or off the sparse step
        step, listed = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
        moe = sum(1 for i in range(layers) if experts and i not in listed and (i + 1) % step == 0)
    else:
        moe = layers
    head_dim = c.get("head_dim") or hidden // heads
    window = c.get("sliding_window") if kind == "gpt_oss" else None
    return ModelShape(
        model_type=kind,
        hidden_size=hidden,
        num_layers=layers,
        vocab_size=c["vocab_size"],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        qk_head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"] if mla else head_dim,
        v_head_dim=c["v_head_dim"] if mla else head_dim,
        q_lora_rank=c.get("q_lora_rank") if mla else None,
        kv_lora_rank=c["kv_lora_rank"] if mla else None,
        qk_rope_head_dim=c["qk_rope_head_dim"] if mla else 0,
        qk_norm=kind == "qwen3_moe",
        sliding_window=window,
        sliding_layers=sum(1 for t in c.get("layer_types") or [] if t == "sliding_attention") if window else 0,
        dense_layers=layers - moe,
        dense_intermediate=c.get("intermediate_size", 0),
        num_experts=experts,
        experts_per_token=c["num_experts_per_tok"],
        # Mixtral and GPT-OSS name the experts' width intermediate_size; the others have a separate key.
        expert_intermediate=c["intermediate_size"] if kind in ("mixtral", "gpt_oss") else c["moe_intermediate_size"],
        shared_experts=c.get("n_shared_experts") or (1 if c.get("shared_expert_intermediate_size") else 0),
        shared_intermediate=c.get("shared_expert_intermediate_size") or (c["moe_intermediate_size"] if mla else 0),
        qkv_bias=kind in ("qwen2_moe", "gpt_oss"),
        output_bias=kind == "gpt_oss",
        shared_expert_gate=kind == "qwen2_moe",
    )


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    active: int  # what one token's forward pass uses: the top-k routed experts, everything else whole
    embedding: int  # the input embedding: a lookup, no matmul
    experts: int  # all routed experts' parameters, what expert parallelism divides
    layer_dense: int  # the largest layer's parameters other than routed experts (what FSDP gathers whole)
    layer_experts: int  # one MoE layer's routed experts

    @property
    def matmul_active(self) -> int:
        """Active parameters that multiply: the FLOPs of a token are ~2x this forward, 6x with backward."""
        return self.active - self.embedding


def attention_parameters(s: ModelShape) -> int:
    h, n = s.hidden_size, s.num_heads
    if s.kv_lora_rank is not None:  # MLA: low-rank q, compressed kv plus a shared rotary key, per-head up-projections
        nope = s.qk_head_dim - s.qk_rope_head_dim
        q = (
            h * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * n * s.qk_head_dim
            if s.q_lora_rank
            else h * n * s.qk_head_dim
        )
        kv = h * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank + s.kv_lora_rank * n * (nope + s.v_head_dim)
        return q + kv + n * s.v_head_dim * h
    q, kv = n * s.qk_head_dim, s.num_kv_heads * s.qk_head_dim
    weights = h * (q + 2 * kv) + n * s.v_head_dim * h
    biases = (q + 2 * kv if s.qkv_bias else 0) + (h + n if s.output_bias else 0)  # o_proj bias and one sink per head
    return weights + biases + (2 * s.qk_head_dim if s.qk_norm else 0)


def expert_parameters(s: ModelShape, intermediate: int) -> int:
    """One SwiGLU expert: gate and up (hidden -> intermediate), down (intermediate -> hidden), GPT-OSS's biases."""
    return 3 * s.hidden_size * intermediate + (2 * intermediate + s.hidden_size if s.output_bias else 0)


def parameter_counts(s: ModelShape) -> ParameterCounts:
    h = s.hidden_size
    norms = 2 * h  # the two RMSNorms of a layer
    attention = attention_parameters(s) + norms
    router = s.num_experts * h + (s.num_experts if s.output_bias else 0)
    shared = s.shared_experts * expert_parameters(s, s.shared_intermediate) + (h if s.shared_expert_gate else 0)
    routed_one = expert_parameters(s, s.expert_intermediate)
    dense_layer = attention + expert_parameters(s, s.dense_intermediate)
    moe_layer_dense = attention + router + shared  # a MoE layer without its routed experts
    embedding = s.vocab_size * h
    outside = embedding + h + (0 if s.tie_embeddings else embedding)  # embeddings, final norm, LM head
    experts = s.moe_layers * s.num_experts * routed_one
    total = outside + s.dense_layers * dense_layer + s.moe_layers * moe_layer_dense + experts
    active = (
        outside + s.dense_layers * dense_layer + s.moe_layers * (moe_layer_dense + s.experts_per_token * routed_one)
    )
    return ParameterCounts(
        total=total,
        active=active,
        embedding=embedding,
        experts=experts,
        layer_dense=max(dense_layer if s.dense_layers else 0, moe_layer_dense if s.moe_layers else 0),
        layer_experts=s.num_experts * routed_one if s.moe_layers else 0,
    )
