"""The models the planner plans for: the supported MoE families' published shapes, by name, an HF config.json
by path, and the training FLOPs per token of a shape (`moeloop.steps.model.shape`).

The family table holds each published checkpoint's config.json numbers, nothing derived.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.shape import ModelShape, parameter_counts

# Published checkpoints' config.json numbers (the keys transformers reads), by the name `moeloop plan` takes.
# fmt: off
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "intermediate_size": 12288,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "vocab_size": 129280, "tie_word_embeddings": False, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
        "intermediate_size": 18432, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    },
    "kimi-k2": {  # DeepSeek-V3's architecture: 384 experts, 64 heads, one dense layer
        "model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64,
        "num_key_value_heads": 64, "vocab_size": 163840, "tie_word_embeddings": False, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
        "intermediate_size": 18432, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    },
    "qwen2-57b-a14b": {
        "model_type": "qwen2_moe", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 151936, "tie_word_embeddings": False, "num_experts": 64,
        "num_experts_per_tok": 8, "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480,
        "intermediate_size": 18944, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False, "num_local_experts": 8,
        "num_experts_per_tok": 2, "intermediate_size": 14336,
    },
    "gpt-oss-120b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "tie_word_embeddings": False,
        "num_local_experts": 128, "num_experts_per_tok": 4, "intermediate_size": 2880, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
    },
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "tie_word_embeddings": False,
        "num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 2880, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    },
}
# fmt: on


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """An HF config.json (or the folder holding one) as a dict."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise MoeloopError(f"model config not found: {path}") from None
    except json.JSONDecodeError as error:
        raise MoeloopError(f"model config {path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise MoeloopError(f"model config {path}: expected a JSON object")
    return config


def model_config(name_or_path: str) -> tuple[dict[str, Any], str]:
    """A family name of FAMILIES, or a path to an HF config.json (or its folder): the config and where it came from."""
    if name_or_path.lower() in FAMILIES:
        return FAMILIES[name_or_path.lower()], f"family table: {name_or_path.lower()}"
    if not Path(name_or_path).exists():
        raise MoeloopError(
            f"model {name_or_path!r} is neither a known family ({', '.join(FAMILIES)}) nor an HF config.json path"
        )
    return read_hf_config(name_or_path), str(name_or_path)


def attention_context(s: ModelShape, sample_tokens: float) -> float:
    """Sum over layers of the mean number of keys a token attends to, in a causal sample of this many tokens."""
    full = (sample_tokens + 1) / 2
    windowed = min(full, s.sliding_window or full)
    return (s.num_layers - s.sliding_layers) * full + s.sliding_layers * windowed


def train_flops_per_token(s: ModelShape, sample_tokens: float) -> float:
    """Forward and backward FLOPs of one token: 6 x the active matmul parameters, plus causal attention
    (q.k and the weighted sum of v, 2 FLOPs a multiply-add, x3 for the backward)."""
    attention = 6 * s.num_heads * (s.qk_head_dim + s.v_head_dim) * attention_context(s, sample_tokens)
    return 6 * parameter_counts(s).matmul_active + attention
