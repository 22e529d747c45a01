"""Causal attention over packed microbatches (`moeloop.steps.model.microbatch`): no token attends across a sample boundary.

The trainer's model runs with `VARLEN`, registered here in HF's `AttentionInterface`, as its attention
implementation. HF passes the samples' `cu_seqlens` from the model's keyword arguments down to the attention
function, and builds no mask for an implementation it does not know. The cost is the samples' own causal squares,
not the microbatch's:
- CUDA, bf16/fp16: flash attention's varlen kernel (`torch.nn.attention.varlen.varlen_attn`, bundled with torch);
- elsewhere (CPU; fp32, which the flash kernel does not take): SDPA over the samples right-padded to the longest,
  causal (a real query sees no padding, which comes after it), exact.
A call without cu_seqlens (a right-padded batch, as `moeloop.steps.model.policy.token_logprobs` passes) is HF's causal SDPA
over each row, exact for the real tokens for the same reason.

Attention sinks (GPT-OSS: a learned logit per head that joins every query's softmax and is dropped after it) and
sliding windows (GPT-OSS's alternate layers: a query sees its last `sliding_window` keys) are no flash varlen
kernel's, nor SDPA's: a layer with either runs `sink_attention`, HF's eager computation over the padded rows, on
every device (exact; on CUDA it costs each sample's full score matrix, not flash attention's memory).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
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
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function interface over one packed row: q [1, h, N, D], k and v [1, k, N, D] (k KV heads);
    returns [1, N, h, D]. Letters: h query heads, k KV heads, N packed tokens, D head size. s_aux: the layer's
    attention sinks [h] (GPT-OSS), sliding_window: its window, if any."""
    exact = partial(sink_attention, sinks_h=s_aux, window=sliding_window)
    if cu_seq_lens_q is None:  # a right-padded batch: causal attention is exact for every row's real tokens
        if s_aux is not None or sliding_window is not None:
            return exact(query_1hND, key_1kND, value_1kND, scaling).transpose(1, 2), None
        return sdpa_attention_forward(module, query_1hND, key_1kND, value_1kND, None, dropout, scaling, is_causal=True)
    if max_length_q is None or query_1hND.shape[0] != 1:
        raise ValueError(f"{VARLEN} attention takes one packed row with its cu_seq_lens (moeloop.steps.model.microbatch.Microbatch)")
    query_NhD, key_NkD, value_NkD = (t[0].transpose(0, 1) for t in (query_1hND, key_1kND, value_1kND))
    if s_aux is not None or sliding_window is not None:
        return padded_attention(query_NhD, key_NkD, value_NkD, cu_seq_lens_q, scaling, exact).unsqueeze(0), None
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


def causal_sdpa(
    query_nhLD: torch.Tensor, key_nkLD: torch.Tensor, value_nkLD: torch.Tensor, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        query_nhLD, key_nkLD, value_nkLD, is_causal=True, scale=scale, enable_gqa=True
    )


def sink_attention(
    query_nhLD: torch.Tensor,
    key_nkLD: torch.Tensor,
    value_nkLD: torch.Tensor,
    scale: float,
    sinks_h: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """Causal attention over right-padded rows with attention sinks and a sliding window (either may be None), as
    HF's GPT-OSS eager attention computes it: the scores, each head's sink logit appended as one more column, the
    row maximum subtracted, softmax, the sink's column dropped. A query sees keys (i - window, i]. [n, h, L, D]."""
    groups = query_nhLD.shape[1] // key_nkLD.shape[1]
    key_nhLD, value_nhLD = (t.repeat_interleave(groups, dim=1) for t in (key_nkLD, value_nkLD))
    scores_nhLL = torch.matmul(query_nhLD, key_nhLD.transpose(2, 3)) * scale
    query_L1 = torch.arange(scores_nhLL.shape[-1], device=scores_nhLL.device).unsqueeze(1)
    seen_LL = query_L1 >= query_L1.T  # key j <= query i
    if window is not None:
        seen_LL &= query_L1.T > query_L1 - window
    scores_nhLL = scores_nhLL.masked_fill(~seen_LL, torch.finfo(scores_nhLL.dtype).min)
    if sinks_h is not None:
        sinks_nhL1 = sinks_h.reshape(1, -1, 1, 1).expand(*scores_nhLL.shape[:-1], 1).to(scores_nhLL.dtype)
        scores_nhLL = torch.cat([scores_nhLL, sinks_nhL1], dim=-1)
    scores_nhLL = scores_nhLL - scores_nhLL.max(dim=-1, keepdim=True).values
    probs_nhLL = F.softmax(scores_nhLL, dim=-1, dtype=scores_nhLL.dtype)[..., : key_nhLD.shape[2]]
    return torch.matmul(probs_nhLL.to(value_nhLD.dtype), value_nhLD)


def padded_attention(
    query_NhD: torch.Tensor,
    key_NkD: torch.Tensor,
    value_NkD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    attention: Callable[..., torch.Tensor] = causal_sdpa,
) -> torch.Tensor:
    """The exact path: each sample's tokens as a row of a right-padded batch [n, heads, L, D], causal attention
    (SDPA, or `sink_attention`), and the real tokens back in packed order [N, h, D]. Padding and unpadding are one
    index_copy and one index_select each: a per-sample pad and slice had a backward of one full-size zero tensor
    per sample (most of a tiny model's update on CPU)."""
    lengths_n = cu_seqlens.diff()
    num_samples, longest = len(lengths_n), int(lengths_n.max())
    sample_N = torch.repeat_interleave(torch.arange(num_samples, device=cu_seqlens.device), lengths_n)
    offset_N = torch.arange(len(sample_N), device=cu_seqlens.device) - cu_seqlens[sample_N]
    padded_row_N = sample_N * longest + offset_N  # each packed token's row of the padded [n * L] batch

    def pad(tokens_NxD: torch.Tensor) -> torch.Tensor:
        rows = tokens_NxD.new_zeros(num_samples * longest, *tokens_NxD.shape[1:])
        return rows.index_copy(0, padded_row_N, tokens_NxD).unflatten(0, (num_samples, longest)).transpose(1, 2)

    out_nhLD = attention(pad(query_NhD), pad(key_NkD), pad(value_NkD), scale)
    return out_nhLD.transpose(1, 2).flatten(0, 1).index_select(0, padded_row_N)
