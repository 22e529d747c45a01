"""Causal attention over packed microbatches (`steps.rl.packing`): no token attends across a sample boundary.

The trainer's model runs with `VARLEN`, registered here in HF's `AttentionInterface`, as its attention
implementation. HF passes the samples' `cu_seqlens` from the model's keyword arguments down to the attention
function, and builds no mask for an implementation it does not know. The cost is the samples' own causal squares,
not the microbatch's:
- CUDA, bf16/fp16: flash attention's varlen kernel (`torch.nn.attention.varlen.varlen_attn`, bundled with torch);
- elsewhere (CPU; fp32, which the flash kernel does not take): SDPA over the samples right-padded to the longest,
  causal (a real query sees no padding, which comes after it), exact.
A call without cu_seqlens (a right-padded batch, as `steps.model.policy.token_logprobs` passes) is HF's causal SDPA
over each row, exact for the real tokens for the same reason.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VARLEN = "moeloop_varlen"
_VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters
# torch 2.10 and later say causal as a window (left unbounded, right 0); earlier releases as is_causal.
_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMETERS else {"is_causal": True}


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
    if cu_seq_lens_q is None:  # a right-padded batch: causal attention is exact for every row's real tokens
        return sdpa_attention_forward(module, query_1hND, key_1kND, value_1kND, None, dropout, scaling, is_causal=True)
    if max_length_q is None or query_1hND.shape[0] != 1:
        raise ValueError(f"{VARLEN} attention takes one packed row with its cu_seq_lens (steps.rl.packing.Microbatch)")
    query_NhD, key_NkD, value_NkD = (t[0].transpose(0, 1) for t in (query_1hND, key_1kND, value_1kND))
    if not (query_NhD.is_cuda and query_NhD.dtype in (torch.bfloat16, torch.float16)):
        return padded_attention(query_NhD, key_NkD, value_NkD, cu_seq_lens_q, scaling).unsqueeze(0), None
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


def padded_attention(
    query_NhD: torch.Tensor, key_NkD: torch.Tensor, value_NkD: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The exact path: each sample's tokens as a row of a right-padded batch [n, heads, L, D], causal SDPA, and
    the real tokens back in packed order [N, h, D]."""
    lengths = cu_seqlens.diff().tolist()
    padded = [
        torch.nn.utils.rnn.pad_sequence(t.split(lengths), batch_first=True).transpose(1, 2)
        for t in (query_NhD, key_NkD, value_NkD)
    ]
    out_nhLD = F.scaled_dot_product_attention(*padded, is_causal=True, scale=scale, enable_gqa=True)
    out_nLhD = out_nhLD.transpose(1, 2)
    return torch.cat([out_nLhD[i, :length] for i, length in enumerate(lengths)])
