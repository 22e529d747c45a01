"""FlashAttention-4's varlen kernels (PyPI `flash-attn-4`, `flash_attn.cute.interface`) as a torch custom op with its
own backward, `torch.ops.moeloop.fa4_varlen`: causal attention over packed samples, GQA by the kernels themselves.
A compiled decoder layer calls it as one opaque node (no graph break; the fake implementation gives its shapes).

Taken from the library directly, not through torch's FA4 registration (`torch.nn.attention._fa4`): torch 2.11's
refuses every causal backward (it passes causal attention as a window, and "windowed attention not supported"), and
unpacks the forward as (out, lse) where flash-attn-4 4.0.0b36 returns five tensors; both seen on an H100. Imported
only where flash4 runs (`moeloop.steps.model.attention`).
"""

from __future__ import annotations

import torch
from flash_attn.cute import interface


@torch.library.custom_op("moeloop::fa4_varlen", mutates_args=())
def fa4_varlen(
    query_NhD: torch.Tensor,
    key_NkD: torch.Tensor,
    value_NkD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    longest: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each sample (cu_seqlens int32 [n + 1]; longest: its longest) over itself: out [N, h, D]
    and the softmax's log-sum-exp [h, N] (float32), which the backward takes."""
    out_NhD, lse_hN = interface._flash_attn_fwd(
        query_NhD, key_NkD, value_NkD, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=longest,
        max_seqlen_k=longest, softmax_scale=scale, causal=True, return_lse=True,
    )[:2]  # fmt: skip
    return out_NhD, lse_hN


@fa4_varlen.register_fake
def _(query_NhD, key_NkD, value_NkD, cu_seqlens, longest, scale):  # noqa: ANN001, ANN202
    out_NhD = query_NhD.new_empty(*query_NhD.shape[:2], value_NkD.shape[2])
    return out_NhD, query_NhD.new_empty(query_NhD.shape[1], query_NhD.shape[0], dtype=torch.float32)


@torch.library.custom_op("moeloop::fa4_varlen_backward", mutates_args=())
def fa4_varlen_backward(
    grad_NhD: torch.Tensor,
    query_NhD: torch.Tensor,
    key_NkD: torch.Tensor,
    value_NkD: torch.Tensor,
    out_NhD: torch.Tensor,
    lse_hN: torch.Tensor,
    cu_seqlens: torch.Tensor,
    longest: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `fa4_varlen`'s out for query, key and value."""
    grad_q, grad_k, grad_v = interface._flash_attn_bwd(
        query_NhD, key_NkD, value_NkD, out_NhD, grad_NhD, lse_hN, scale, True, cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest,
    )[:3]  # fmt: skip
    return grad_q, grad_k, grad_v


@fa4_varlen_backward.register_fake
def _(grad_NhD, query_NhD, key_NkD, value_NkD, out_NhD, lse_hN, cu_seqlens, longest, scale):  # noqa: ANN001, ANN202
    return torch.empty_like(query_NhD), torch.empty_like(key_NkD), torch.empty_like(value_NkD)


def _save(ctx, inputs, output) -> None:  # noqa: ANN001
    query_NhD, key_NkD, value_NkD, cu_seqlens, longest, scale = inputs
    out_NhD, lse_hN = output
    ctx.save_for_backward(query_NhD, key_NkD, value_NkD, out_NhD, lse_hN, cu_seqlens)
    ctx.longest, ctx.scale = longest, scale


def _backward(ctx, grad_NhD, grad_lse):  # noqa: ANN001, ANN202
    # grad_lse: none flows back, the model reads out alone (the log-sum-exp is the backward's)
    query_NhD, key_NkD, value_NkD, out_NhD, lse_hN, cu_seqlens = ctx.saved_tensors
    grads = fa4_varlen_backward(
        grad_NhD.contiguous(), query_NhD, key_NkD, value_NkD, out_NhD, lse_hN, cu_seqlens, ctx.longest, ctx.scale
    )
    return *grads, None, None, None


fa4_varlen.register_autograd(_backward, setup_context=_save)
