"""The MoE layer's two fused kernels on CUDA, each with the plain torch version it must equal (the CPU path).

- `gather_sum(rows_NH, row_of_TK)`: each token's sum over its K expert rows (the combine, and the backward of
  the permutation). CUDA: one Triton pass that reads the K rows and writes the token (fp32 accumulation), with
  no [T, K, H] intermediate; elsewhere `index_select` then `sum`.
- `swiglu(gate_up_N2I, weight_N, act_fn)`: `act(gate) * up * weight`, the routing weight folded in. CUDA with
  SiLU: `torch.compile`'d, so forward and backward are a few fused kernels instead of ~10 eager ones;
  elsewhere (and for other activations) eager.

Triton (`steps.triton_kernels`) is imported, and `torch.compile` called, on first CUDA use only.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the gather-sum kernel accumulates in fp32


def gather_sum(rows_NH: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    """Each token's sum over its K rows: out_TH[t] = sum_k rows_NH[row_of_TK[t, k]], accumulated in fp32 (at least).

    An index equal to the number of rows (a slot dropped on this rank) reads a zero row.
    """
    if rows_NH.is_cuda and rows_NH.dtype in TRITON_DTYPES and importlib.util.find_spec("triton") is not None:
        return gather_sum_triton(rows_NH, row_of_TK)
    return gather_sum_torch(rows_NH, row_of_TK)


def gather_sum_torch(rows_NH: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    num_tokens, top_k = row_of_TK.shape
    rows_NH = rows_NH.contiguous()
    if rows_NH.shape[0] < row_of_TK.numel():  # some slots may be dropped: give them a zero row to read
        rows_NH = torch.cat([rows_NH, rows_NH.new_zeros(1, rows_NH.shape[1])])
    acc_dtype = torch.promote_types(rows_NH.dtype, torch.float32)
    gathered_TKH = rows_NH.index_select(0, row_of_TK.flatten()).view(num_tokens, top_k, rows_NH.shape[1])
    return gathered_TKH.sum(1, dtype=acc_dtype).to(rows_NH.dtype)


def gather_sum_triton(rows_NH: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    """`gather_sum` in one Triton pass: a program per (token, 1024-column tile) sums the token's K rows in fp32."""
    if isinstance(rows_NH, AsyncCollectiveTensor):
        # The output of a functional collective (all-to-all) is a wrapper with no storage of its own, and Triton
        # reads raw pointers: wait for the collective and take the tensor it wrote.
        rows_NH = rows_NH.wait()
    rows_NH, row_of_TK = rows_NH.contiguous(), row_of_TK.contiguous()
    num_tokens, top_k = row_of_TK.shape
    hidden = rows_NH.shape[1]
    out_TH = torch.empty(num_tokens, hidden, device=rows_NH.device, dtype=rows_NH.dtype)
    if num_tokens == 0 or hidden == 0:
        return out_TH
    block_h = min(1024, 1 << (hidden - 1).bit_length())
    grid = (num_tokens, -(-hidden // block_h))
    from steps.triton_kernels import gather_sum_kernel

    gather_sum_kernel[grid](rows_NH, row_of_TK, out_TH, rows_NH.shape[0], hidden, K=top_k, BLOCK_H=block_h, num_warps=4)
    return out_TH


def swiglu(
    gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None, act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu
) -> torch.Tensor:
    """act(gate) * up, times each row's weight when given; gate_up_N2I holds the gate columns, then the up ones."""
    if gate_up_N2I.is_cuda and is_silu(act_fn):
        # The row count changes with every batch (and every dispatch under EP): compile for any, not one per count.
        torch._dynamo.maybe_mark_dynamic(gate_up_N2I, 0)
        if weight_N is not None:
            torch._dynamo.maybe_mark_dynamic(weight_N, 0)
        return _compiled_swiglu()(gate_up_N2I, weight_N)
    return swiglu_eager(gate_up_N2I, weight_N, act_fn)


def swiglu_eager(
    gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None, act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu
) -> torch.Tensor:
    gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
    hidden_NI = act_fn(gate_NI) * up_NI
    return hidden_NI if weight_N is None else hidden_NI * weight_N.unsqueeze(1).to(hidden_NI.dtype)


@functools.cache
def _compiled_swiglu() -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    return torch.compile(swiglu_eager, fullgraph=True)


def is_silu(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """HF's "silu" activation (transformers' `SiLUActivation`, or `nn.SiLU` in older releases), or F.silu."""
    return act_fn is F.silu or isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"
