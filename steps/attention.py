"""Causal attention over packed microbatches (`steps.packing`): no token attends across a sample boundary.

The trainer's model runs with `packed_attention(device, dtype)` as HF's attention implementation:
- CUDA, bf16/fp16: `varlen`, registered here in HF's `AttentionInterface`, is flash attention's varlen kernel
  (`torch.nn.attention.varlen.varlen_attn`, bundled with torch) over the samples' `cu_seqlens`, which HF passes
  from the model's keyword arguments down to the attention function. Its cost is the samples' own causal
  squares, not the microbatch's; HF builds no mask for an implementation it does not know.
- elsewhere (CPU; fp32, which the flash kernel does not take): HF's `sdpa`, exact. With no attention mask and
  packed `position_ids` (each sample counting from 0), HF builds the block-diagonal causal mask itself
  (`masking_utils.find_packed_sequence_indices`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface

VARLEN = "moeloop_varlen"
_VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters
# torch 2.10 and later say causal as a window (left unbounded, right 0); earlier releases as is_causal.
_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMETERS else {"is_causal": True}


def packed_attention(device: torch.device, dtype: torch.dtype) -> str:
    """The attention implementation for packed microbatches of a model computing in dtype on device."""
    return VARLEN if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "sdpa"


def varlen_attention(
    module: torch.nn.Module,
    query_1hND: torch.Tensor,
    key_1kND: torch.Tensor,
    value_1kND: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function interface over one packed row: q [1, h, N, D], k and v [1, k, N, D] (k KV heads);
    returns [1, N, h, D]. Letters: h query heads, k KV heads, N packed tokens, D head size."""
    if cu_seq_lens_q is None or max_length_q is None or query_1hND.shape[0] != 1:
        raise ValueError(f"{VARLEN} attention takes one packed row and its cu_seq_lens (steps.packing.Microbatch)")
    query_NhD, key_NkD, value_NkD = (t[0].transpose(0, 1) for t in (query_1hND, key_1kND, value_1kND))
    options: dict[str, Any] = {"scale": scaling, **_CAUSAL}
    groups = query_NhD.shape[1] // key_NkD.shape[1]
    if groups > 1:
        if "enable_gqa" in _VARLEN_PARAMETERS:
            options["enable_gqa"] = True
        else:  # a release without the flag: equal head counts, which every release takes
            key_NkD, value_NkD = key_NkD.repeat_interleave(groups, 1), value_NkD.repeat_interleave(groups, 1)
    out_NhD = varlen_attn(
        query_NhD, key_NkD, value_NkD, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, **options
    )
    return out_NhD.unsqueeze(0), None


AttentionInterface.register(VARLEN, varlen_attention)
