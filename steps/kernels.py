"""The MoE layer's two fused kernels on CUDA, each with the plain torch version it must equal (the CPU path).

- `gather_sum(rows_NH, row_of_TK)`: each token's sum over its K expert rows (the combine, and the backward of
  the permutation). CUDA: one Triton pass that reads the K rows and writes the token (fp32 accumulation), with
  no [T, K, H] intermediate; elsewhere `index_select` then `sum`.
- `swiglu(gate_up_N2I, weight_N, act_fn)`: `act(gate) * up * weight`, the routing weight folded in. CUDA with
  SiLU: one Triton pass forward, and one backward that also sums the weight's gradient (fp32 inside, rounded
  once), instead of ~10 eager kernels each way; elsewhere (and for other activations) eager.

The Triton kernels are custom ops (`moeloop::...`), which a `torch.compile`'d graph (the whole MoE block with
the local dispatcher) calls as they are. Triton (`steps.triton_kernels`) is imported on first CUDA use only.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the gather-sum kernel accumulates in fp32
HAS_TRITON = importlib.util.find_spec("triton") is not None


def gather_sum(rows_NH: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    """Each token's sum over its K rows: out_TH[t] = sum_k rows_NH[row_of_TK[t, k]], accumulated in fp32 (at least).

    An index equal to the number of rows (a slot dropped on this rank) reads a zero row.
    """
    if rows_NH.is_cuda and rows_NH.dtype in TRITON_DTYPES and HAS_TRITON:
        if isinstance(rows_NH, AsyncCollectiveTensor):
            # The output of a functional collective (all-to-all) is a wrapper with no storage of its own, and
            # Triton reads raw pointers: wait for the collective and take the tensor it wrote.
            rows_NH = rows_NH.wait()
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


# A custom op, so that a torch.compile'd graph (the whole MoE block) calls this kernel as it is: inductor's own
# fusion of gather_sum_torch ran 4.5x slower on an H200 (0.63 against 0.14 ms at T = 16384, K = 8, H = 2048).
@torch.library.custom_op("moeloop::gather_sum_triton", mutates_args=())
def gather_sum_triton(rows_NH: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    """`gather_sum` in one Triton pass: a program per (token, 1024-column tile) sums the token's K rows in fp32."""
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


@gather_sum_triton.register_fake
def _(rows_NH: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    return rows_NH.new_empty(row_of_TK.shape[0], rows_NH.shape[1])


def swiglu(
    gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None, act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu
) -> torch.Tensor:
    """act(gate) * up, times each row's weight when given; gate_up_N2I holds the gate columns, then the up ones."""
    if gate_up_N2I.is_cuda and gate_up_N2I.dtype in TRITON_DTYPES and is_silu(act_fn) and HAS_TRITON:
        return swiglu_triton(gate_up_N2I, weight_N)
    return swiglu_eager(gate_up_N2I, weight_N, act_fn)


def swiglu_eager(
    gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None, act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu
) -> torch.Tensor:
    gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
    hidden_NI = act_fn(gate_NI) * up_NI
    return hidden_NI if weight_N is None else hidden_NI * weight_N.unsqueeze(1).to(hidden_NI.dtype)


SWIGLU_BLOCK_M, SWIGLU_BLOCK_I = 8, 256  # rows and columns per Triton program


# Custom ops, so that torch.compile'd graphs call these kernels as they are. Inductor's own fusion of the
# backward is two kernels, the weight's gradient a separate reduction: 0.67 ms on an H200 at the MoE layer
# benchmark's shape (N = 131072, I = 768), where this one-pass backward takes 0.24 ms.
@torch.library.custom_op("moeloop::swiglu_triton", mutates_args=())
def swiglu_triton(gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None) -> torch.Tensor:
    """`swiglu` with SiLU in one Triton pass (fp32 inside, rounded once); its backward is one pass too."""
    gate_up_N2I = gate_up_N2I.contiguous()
    num_rows, inter = gate_up_N2I.shape[0], gate_up_N2I.shape[1] // 2
    out_NI = gate_up_N2I.new_empty(num_rows, inter)
    if num_rows and inter:
        from steps.triton_kernels import swiglu_forward_kernel

        grid = (-(-num_rows // SWIGLU_BLOCK_M), -(-inter // SWIGLU_BLOCK_I))
        weight = weight_N.contiguous() if weight_N is not None else gate_up_N2I  # (not read without a weight)
        swiglu_forward_kernel[grid](
            gate_up_N2I, weight, out_NI, num_rows, INTER=inter, HAS_WEIGHT=weight_N is not None,
            BLOCK_M=SWIGLU_BLOCK_M, BLOCK_I=SWIGLU_BLOCK_I, num_warps=4,
        )  # fmt: skip
    return out_NI


@swiglu_triton.register_fake
def _(gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None) -> torch.Tensor:
    return gate_up_N2I.new_empty(gate_up_N2I.shape[0], gate_up_N2I.shape[1] // 2)


@torch.library.custom_op("moeloop::swiglu_backward_triton", mutates_args=())
def swiglu_backward_triton(
    gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None, grad_NI: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `swiglu_triton`: grad_gate_up_N2I, and grad_weight_N (empty without a weight)."""
    gate_up_N2I, grad_NI = gate_up_N2I.contiguous(), grad_NI.contiguous()
    num_rows, inter = grad_NI.shape
    grad_gate_up_N2I = torch.empty_like(gate_up_N2I)
    grad_weight_N = weight_N.new_empty(num_rows) if weight_N is not None else gate_up_N2I.new_empty(0)
    if num_rows and inter:
        from steps.triton_kernels import swiglu_backward_kernel

        weight = weight_N.contiguous() if weight_N is not None else gate_up_N2I  # (not read without a weight)
        swiglu_backward_kernel[(-(-num_rows // SWIGLU_BLOCK_M),)](
            gate_up_N2I, weight, grad_NI, grad_gate_up_N2I, grad_weight_N, num_rows, INTER=inter,
            HAS_WEIGHT=weight_N is not None, BLOCK_M=SWIGLU_BLOCK_M, BLOCK_I=SWIGLU_BLOCK_I, num_warps=4,
        )  # fmt: skip
    return grad_gate_up_N2I, grad_weight_N


@swiglu_backward_triton.register_fake
def _(
    gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None, grad_NI: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_weight_N = weight_N.new_empty(gate_up_N2I.shape[0]) if weight_N is not None else gate_up_N2I.new_empty(0)
    return torch.empty_like(gate_up_N2I), grad_weight_N


def _swiglu_setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor | None], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx: Any, grad_NI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    gate_up_N2I, weight_N = ctx.saved_tensors
    grad_gate_up_N2I, grad_weight_N = swiglu_backward_triton(gate_up_N2I, weight_N, grad_NI)
    return grad_gate_up_N2I, grad_weight_N if weight_N is not None else None


swiglu_triton.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)


def is_silu(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """HF's "silu" activation (transformers' `SiLUActivation`, or `nn.SiLU` in older releases), or F.silu."""
    return act_fn is F.silu or isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"
