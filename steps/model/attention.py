"""Causal attention over packed microbatches (`moeloop.steps.model.microbatch`): no token attends across a sample boundary.

The trainer's model runs with one of the implementations registered here in HF's `AttentionInterface`
(`use_packed_attention`, by `trainer.attention`). HF passes the samples' `cu_seqlens` from the model's keyword
arguments down to the attention function, and builds no mask for an implementation it does not know. Every
backend is exact for packed samples:
- `flash4`: FlashAttention-4 (PyPI `flash-attn-4`, CuTe DSL kernels for Hopper and Blackwell, compute capability
  9.x and 10.x), its varlen kernels as a torch custom op with their own backward (`moeloop.steps.model.fa4_kernels`:
  a compiled layer calls it without a graph break; not through torch's FA4 registration, which torch 2.11 has
  refuse causal backwards);
- `flash2`: the FlashAttention-2 varlen kernel bundled with torch (`torch.nn.attention.varlen.varlen_attn`);
  both cost the samples' own causal squares, not the microbatch's, and take bf16 or fp16 on CUDA;
- `sdpa`: SDPA over the samples right-padded to the longest, causal (a real query sees no padding, which comes
  after it): the CPU's path and fp32's, on any device.
`auto` (`attention_backend`) takes the fastest that runs: flash4 where it is installed and the GPU takes it, else
flash2 on CUDA in bf16/fp16, else sdpa. A backend selected where it cannot run is a one-line error.
A call without cu_seqlens (a right-padded batch, as `moeloop.steps.model.policy.token_logprobs` passes) is HF's
causal SDPA over each row, exact for the real tokens for the same reason.

Attention sinks (GPT-OSS: a learned logit per head that joins every query's softmax and is dropped after it) and
sliding windows (GPT-OSS's alternate layers: a query sees its last `sliding_window` keys) are no flash varlen
kernel's, nor SDPA's: a layer with either runs `sink_attention`, HF's eager computation over the padded rows,
whatever the backend (exact; on CUDA it costs each sample's full score matrix, not flash attention's memory).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from moeloop.steps.errors import MoeloopError

# trainer.attention's backends, fastest first, and the HF attention implementation registered for each (named
# without "flash" or "sdpa", which HF's own code reads as its implementations of those names).
PACKED_ATTENTION = {"flash4": "moeloop_fa4", "flash2": "moeloop_fa2", "sdpa": "moeloop_padded"}
FLASH_DTYPES = (torch.bfloat16, torch.float16)
_VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters
# torch 2.10 and later say causal as a window (left unbounded, right 0); earlier releases as is_causal.
_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMETERS else {"is_causal": True}


def flash4_missing(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on device (a CUDA device), or None where it can."""
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return "the flash-attn-4 package is not installed (pip install flash-attn-4; the trainer image has it)"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"it runs on compute capability 9.x and 10.x (Hopper, Blackwell); this GPU's is {major}.{minor}"
    return None


def attention_backend(setting: str, device: torch.device, dtype: torch.dtype) -> str:
    """`trainer.attention` resolved for a model computing in dtype on device: auto as the module docstring says; a
    backend named that cannot run here is a MoeloopError saying why."""
    flash_runs = device.type == "cuda" and dtype in FLASH_DTYPES
    if setting == "auto":
        if flash_runs:
            return "flash4" if flash4_missing(device) is None else "flash2"
        return "sdpa"
    if setting in ("flash4", "flash2") and not flash_runs:
        raise MoeloopError(
            f"trainer.attention {setting} runs on a CUDA GPU in bf16 (trainer.precision bf16), not on {device.type} in"
            f" {str(dtype).removeprefix('torch.')}: set it to auto or sdpa"
        )
    if setting == "flash4" and (reason := flash4_missing(device)) is not None:
        raise MoeloopError(f"trainer.attention flash4: {reason}")
    return setting


def use_packed_attention(model: nn.Module, backend: str) -> None:
    """The model's attention over packed samples by backend (resolved by `attention_backend`), in place; flash4
    registers FlashAttention-4's custom op first."""
    if backend == "flash4":
        import moeloop.steps.model.fa4_kernels  # noqa: F401  (flash-attn-4: only where it runs)
    model.config._attn_implementation = PACKED_ATTENTION[backend]


def packed_attention(
    backend: str,
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
    attention sinks [h] (GPT-OSS), sliding_window: its window, if any. backend: flash4 (FA4's custom op), flash2
    (torch's varlen FA2 kernel) or sdpa (the padded exact path)."""
    exact = partial(sink_attention, sinks_h=s_aux, window=sliding_window)
    sinks_or_window = s_aux is not None or sliding_window is not None
    if cu_seq_lens_q is None:  # a right-padded batch: causal attention is exact for every row's real tokens
        if sinks_or_window:
            return exact(query_1hND, key_1kND, value_1kND, scaling).transpose(1, 2), None
        return sdpa_attention_forward(module, query_1hND, key_1kND, value_1kND, None, dropout, scaling, is_causal=True)
    if max_length_q is None or query_1hND.shape[0] != 1:
        raise ValueError("packed attention takes one packed row with its cu_seq_lens (moeloop.steps.model.microbatch)")
    query_NhD, key_NkD, value_NkD = (t[0].transpose(0, 1) for t in (query_1hND, key_1kND, value_1kND))
    if sinks_or_window or backend == "sdpa":
        attention = exact if sinks_or_window else causal_sdpa
        out_NhD = padded_attention(query_NhD, key_NkD, value_NkD, cu_seq_lens_q, max_length_q, scaling, attention)
        return out_NhD.unsqueeze(0), None
    if backend == "flash4":
        out_NhD, _ = torch.ops.moeloop.fa4_varlen(query_NhD, key_NkD, value_NkD, cu_seq_lens_q, max_length_q, scaling)
        return out_NhD.unsqueeze(0), None
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


for backend, implementation in PACKED_ATTENTION.items():
    AttentionInterface.register(implementation, partial(packed_attention, backend))


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
    longest: int,
    scale: float,
    attention: Callable[..., torch.Tensor] = causal_sdpa,
) -> torch.Tensor:
    """The exact path: each sample's tokens (the longest has longest) as a row of a right-padded batch
    [n, heads, L, D], causal attention (SDPA, or `sink_attention`), and the real tokens back in packed order
    [N, h, D]. Padding and unpadding are one index_copy and one index_select each: a per-sample pad and slice had a
    backward of one full-size zero tensor per sample (most of a tiny model's update on CPU). Every size is known on
    the host (no read of cu_seqlens), so a compiled layer traces it without a break."""
    lengths_n = cu_seqlens.diff()
    num_samples, num_tokens = len(lengths_n), len(query_NhD)
    sample_N = torch.repeat_interleave(
        torch.arange(num_samples, device=cu_seqlens.device), lengths_n, output_size=num_tokens
    )
    offset_N = torch.arange(len(sample_N), device=cu_seqlens.device) - cu_seqlens[sample_N]
    padded_row_N = sample_N * longest + offset_N  # each packed token's row of the padded [n * L] batch

    def pad(tokens_NxD: torch.Tensor) -> torch.Tensor:
        rows = tokens_NxD.new_zeros(num_samples * longest, *tokens_NxD.shape[1:])
        return rows.index_copy(0, padded_row_N, tokens_NxD).unflatten(0, (num_samples, longest)).transpose(1, 2)

    out_nhLD = attention(pad(query_NhD), pad(key_NkD), pad(value_NkD), scale)
    return out_nhLD.transpose(1, 2).flatten(0, 1).index_select(0, padded_row_N)
