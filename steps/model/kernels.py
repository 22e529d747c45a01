"""The MoE layer's kernels on CUDA, each with the plain torch version it must equal (the CPU path).

- `gather_sum(rows_NH, row_of_TK)`: each token's sum over its K expert rows (the combine, and the backward of
  the permutation). CUDA: one Triton pass that reads the K rows and writes the token (fp32 accumulation), with
  no [T, K, H] intermediate; elsewhere `index_select` then `sum`.
- `expand_rows(x_TH, token_N, row_of_TK)`: its adjoint, each token copied to its K rows (the permutation, and
  the backward of the combine). CUDA: one Triton pass that reads each token once; elsewhere `index_select`.
- `grouped_linear(x_NK, weight_eOK, offs_e)`: F.linear per group of rows (the experts' GEMMs; weights in
  nn.Linear's layout or transposed, as GPT-OSS holds them). Hopper GPUs, bf16: a persistent Triton grouped GEMM
  through TMA, forward and input gradient; elsewhere `F.grouped_mm`.
- `swiglu(gate_up_N2I, weight_N, act_fn)`: `act(gate) * up * weight`, the routing weight folded in. CUDA with
  SiLU: one Triton pass forward, and one backward that also sums the weight's gradient (fp32 inside, rounded
  once), instead of ~10 eager kernels each way; elsewhere (and for other activations) eager. GPT-OSS's clamped
  SwiGLU over interleaved gate and up columns: `clamped_swiglu`, eager.

The Triton kernels are custom ops (`moeloop::...`), which a `torch.compile`'d graph (the whole MoE block with
the local dispatcher) calls as they are. Triton (`moeloop.steps.model.triton_kernels`) is imported on first CUDA use only.
"""

from __future__ import annotations

import functools
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
        return gather_sum_triton(waited(rows_NH), row_of_TK)
    return gather_sum_torch(rows_NH, row_of_TK)


def waited(t: torch.Tensor) -> torch.Tensor:
    """The output of a functional collective (all-to-all) is a wrapper with no storage of its own, and Triton reads
    raw pointers: wait for the collective and take the tensor it wrote."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


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
    block_h = min(1024, triton_block(hidden))
    grid = (num_tokens, -(-hidden // block_h))
    from moeloop.steps.model.triton_kernels import gather_sum_kernel

    gather_sum_kernel[grid](rows_NH, row_of_TK, out_TH, rows_NH.shape[0], hidden, K=top_k, BLOCK_H=block_h, num_warps=4)
    return out_TH


@gather_sum_triton.register_fake
def _(rows_NH: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    return rows_NH.new_empty(row_of_TK.shape[0], rows_NH.shape[1])


def expand_rows(x_TH: torch.Tensor, token_N: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    """The expert rows x_TH[token_N], where row_of_TK is token_N's inverse: the K rows of each token (a slot
    with no row here holds the number of rows). The adjoint of `gather_sum`.

    CUDA: one Triton pass that reads each token once and writes its K rows, where `index_select` reads a token
    once per row (K times, mostly from HBM once the tokens outgrow L2); elsewhere `index_select`.
    """
    if x_TH.is_cuda and x_TH.dtype in TRITON_DTYPES and HAS_TRITON:
        return expand_rows_triton(waited(x_TH), row_of_TK, token_N.shape[0])
    return x_TH.index_select(0, token_N)


@torch.library.custom_op("moeloop::expand_rows_triton", mutates_args=())
def expand_rows_triton(x_TH: torch.Tensor, row_of_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`expand_rows` in one Triton pass: a program per (token, 1024-column tile) writes the token's K rows."""
    x_TH, row_of_TK = x_TH.contiguous(), row_of_TK.contiguous()
    num_tokens, top_k = row_of_TK.shape
    hidden = x_TH.shape[1]
    out_NH = x_TH.new_empty(num_rows, hidden)
    if num_tokens == 0 or hidden == 0 or num_rows == 0:
        return out_NH
    block_h = min(1024, triton_block(hidden))
    from moeloop.steps.model.triton_kernels import expand_rows_kernel

    expand_rows_kernel[(num_tokens, -(-hidden // block_h))](
        x_TH, row_of_TK, out_NH, num_rows, hidden, K=top_k, BLOCK_H=block_h, num_warps=4
    )
    return out_NH


@expand_rows_triton.register_fake
def _(x_TH: torch.Tensor, row_of_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    return x_TH.new_empty(num_rows, x_TH.shape[1])


def swiglu(
    gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None, act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu
) -> torch.Tensor:
    """act(gate) * up, times each row's weight when given; gate_up_N2I holds the gate columns, then the up ones."""
    if gate_up_N2I.is_cuda and gate_up_N2I.dtype in TRITON_DTYPES and is_silu(act_fn) and HAS_TRITON:
        return swiglu_triton(gate_up_N2I, weight_N)
    return swiglu_eager(gate_up_N2I, weight_N, act_fn)


def clamped_swiglu(
    gate_up_N2I: torch.Tensor, weight_N: torch.Tensor | None, alpha: float, limit: float
) -> torch.Tensor:
    """GPT-OSS's activation, as HF's `GptOssExperts._apply_gate`: gate and up columns interleaved, the gate clamped
    above at limit, the up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate); times each row's weight
    when given. Eager (torch.compile fuses it where the block is compiled)."""
    gate_NI = gate_up_N2I[..., ::2].clamp(max=limit)
    up_NI = gate_up_N2I[..., 1::2].clamp(min=-limit, max=limit)
    hidden_NI = (up_NI + 1) * (gate_NI * torch.sigmoid(gate_NI * alpha))
    return hidden_NI if weight_N is None else hidden_NI * weight_N.unsqueeze(1).to(hidden_NI.dtype)


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
        from moeloop.steps.model.triton_kernels import swiglu_forward_kernel

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
        from moeloop.steps.model.triton_kernels import swiglu_backward_kernel

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


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the Triton grouped GEMM. On an H200 at the MoE layer's
# shapes (benchmarks/moe_h200.md) this one was the fastest of six for all four row-grouped GEMMs of a layer.
GROUPED_MM_CONFIG = (128, 256, 64, 8, 3)
# The Triton grouped GEMM costs more host time than grouped_mm (a Python launch with two TMA descriptors, and the
# custom op's autograd), so it only pays where a call's GPU time hides that. On an H200, at 4.1e11 and 8.2e11
# FLOPs a call (Qwen3-30B-A3B's experts, 16384 tokens) the layer ran 2 to 5% faster with it; at 2.1e11 (the
# benchmarks' 1B model) the layer is bound by host time, and ran 19% slower with it (benchmarks/moe_h200.md).
GROUPED_MM_TRITON_MIN_FLOPS = 3e11


def grouped_linear(
    x_NK: torch.Tensor, weight_eXY: torch.Tensor, offs_e: torch.Tensor, linear_layout: bool = True
) -> torch.Tensor:
    """F.linear per group of rows: out_NO[r] = x_NK[r] @ weight[g]^T for the rows r of group g, where offs_e
    holds each group's end row (int32, as grouped_mm's offs; empty groups allowed). weight_eXY holds nn.Linear
    weights [e, O, K] (linear_layout) or their transposes [e, K, O] (GPT-OSS's experts: x @ weight[g]).

    On Hopper GPUs in bf16, for calls large enough (`grouped_mm_triton_runs`): the Triton grouped GEMM
    (`grouped_mm_triton`, its weight gradient through grouped_mm); elsewhere `F.grouped_mm`.
    """
    if grouped_mm_triton_runs(x_NK, weight_eXY if linear_layout else weight_eXY.transpose(1, 2)):
        return grouped_mm_triton(x_NK, weight_eXY, offs_e, linear_layout)
    return grouped_linear_torch(x_NK, weight_eXY, offs_e, linear_layout)


def grouped_linear_torch(
    x_NK: torch.Tensor, weight_eXY: torch.Tensor, offs_e: torch.Tensor, linear_layout: bool = True
) -> torch.Tensor:
    """`grouped_linear` by `F.grouped_mm` alone, on every device (the same arguments)."""
    return F.grouped_mm(x_NK, weight_eXY.transpose(1, 2) if linear_layout else weight_eXY, offs=offs_e)


def grouped_mm_triton_runs(x_NK: torch.Tensor, weight_eOK: torch.Tensor) -> bool:
    """Whether `grouped_linear` takes the Triton grouped GEMM: bf16 (its weight gradient is grouped_mm's, which
    takes bf16 only on CUDA), on a Hopper GPU or newer (TMA), dimensions that are whole K steps, and a call large
    enough to pay for its host time (`GROUPED_MM_TRITON_MIN_FLOPS`)."""
    rows, (_, width, depth) = x_NK.shape[0], weight_eOK.shape
    return (  # the device query last: this runs on every call, and small calls stop before it
        HAS_TRITON and x_NK.is_cuda and x_NK.dtype == weight_eOK.dtype == torch.bfloat16
        and width % GROUPED_MM_CONFIG[2] == 0 and depth % GROUPED_MM_CONFIG[2] == 0
        and 2 * rows * width * depth >= GROUPED_MM_TRITON_MIN_FLOPS
        and torch.cuda.get_device_capability(x_NK.device) >= (9, 0)
    )  # fmt: skip


@torch.library.custom_op("moeloop::grouped_mm_triton", mutates_args=())
def grouped_mm_triton(
    a_NK: torch.Tensor, b_eXY: torch.Tensor, offs_e: torch.Tensor, b_transposed: bool
) -> torch.Tensor:
    """out[r] = a_NK[r] @ b[g] for the rows r of group g, where b[g] is b_eXY[g]^T (b_transposed: b_eXY holds
    nn.Linear weights [e, N, K]) or b_eXY[g] ([e, K, N]); fp32 accumulation, one persistent Triton kernel."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moeloop.steps.model.triton_kernels import grouped_mm_kernel

    a_NK, b_eXY, offs_e = tma_operand(a_NK), tma_operand(b_eXY), offs_e.contiguous()
    num_groups, depth, width = b_eXY.shape[0], a_NK.shape[1], b_eXY.shape[1 if b_transposed else 2]
    out_NN = a_NK.new_empty(a_NK.shape[0], width)
    if out_NN.numel() == 0:
        return out_NN
    block_m, block_n, block_k, num_warps, num_stages = GROUPED_MM_CONFIG
    b_rows = b_eXY.view(-1, b_eXY.shape[2])  # groups stacked: a tile's rows are offset by its group's
    b_desc = TensorDescriptor.from_tensor(b_rows, [block_n, block_k] if b_transposed else [block_k, block_n])
    # One program per multiprocessor; off CUDA only Triton's interpreter runs this (the tests), with a few.
    num_programs = torch.cuda.get_device_properties(a_NK.device).multi_processor_count if a_NK.is_cuda else 3
    grouped_mm_kernel[(num_programs,)](
        TensorDescriptor.from_tensor(a_NK, [block_m, block_k]), b_desc, out_NN, offs_e, num_groups, width, depth,
        B_TRANSPOSED=b_transposed, BLOCK_G=triton_block(num_groups), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_PROGRAMS=num_programs, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out_NN


def tma_operand(t: torch.Tensor) -> torch.Tensor:
    """t contiguous, at a 16-byte aligned address (a view's offset may not be), as TMA descriptors need."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


@grouped_mm_triton.register_fake
def _(a_NK: torch.Tensor, b_eXY: torch.Tensor, offs_e: torch.Tensor, b_transposed: bool) -> torch.Tensor:
    return a_NK.new_empty(a_NK.shape[0], b_eXY.shape[1 if b_transposed else 2])


def _grouped_mm_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a_NK, b_eXY, offs_e, ctx.b_transposed = inputs
    ctx.save_for_backward(a_NK, b_eXY, offs_e)


def _grouped_mm_backward(ctx: Any, grad_NN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The input gradient is the same kernel with b the other way round; the weight gradient, a grouped GEMM
    over the rows (K = a group's rows), is grouped_mm's."""
    a_NK, b_eXY, offs_e = ctx.saved_tensors
    grad_NN = grad_NN.contiguous()
    grad_a_NK = grouped_mm_triton(grad_NN, b_eXY, offs_e, not ctx.b_transposed) if ctx.needs_input_grad[0] else None
    grad_b_eXY = None
    if ctx.needs_input_grad[1]:  # per group left^T @ right: [N, K] for nn.Linear weights, else [K, N]
        left, right = (grad_NN, a_NK) if ctx.b_transposed else (a_NK, grad_NN)
        grad_b_eXY = F.grouped_mm(left.t(), right, offs=offs_e)
    return grad_a_NK, grad_b_eXY, None, None


grouped_mm_triton.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup_context)


ROUTER_BLOCK_T = 16  # tokens per program of the router kernels


def softmax_topk(logits_TE: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's softmax routing (Qwen3-MoE, Qwen2-MoE, Mixtral) from the router logits: softmax in fp32, the top_k
    probabilities (descending) and their experts, divided by their sum when normalize, the weights cast back to the
    logits' dtype.

    CUDA: one Triton pass each way (`torch.topk` alone took 0.11 ms for 16384 tokens over 128 experts on an H200);
    elsewhere HF's own operations.
    """
    if logits_TE.is_cuda and logits_TE.dtype in TRITON_DTYPES and HAS_TRITON:
        return softmax_topk_triton(logits_TE, top_k, normalize)
    return softmax_topk_torch(logits_TE, top_k, normalize)


def softmax_topk_torch(logits_TE: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs_TE = F.softmax(logits_TE, dtype=torch.float, dim=-1)
    weights_TK, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype), experts_TK


def _router_launch(logits_TE: torch.Tensor, top_k: int) -> tuple[tuple[int], dict[str, int]]:
    num_tokens, num_experts = logits_TE.shape
    blocks = {"E": num_experts, "K": top_k, "BLOCK_T": ROUTER_BLOCK_T, "BLOCK_E": triton_block(num_experts)}
    return (-(-num_tokens // ROUTER_BLOCK_T),), blocks | {"BLOCK_K": triton_block(top_k)}


def triton_block(size: int) -> int:
    """The power of two Triton blocks a dimension of this size into."""
    return 1 << max(size - 1, 0).bit_length()


@torch.library.custom_op("moeloop::softmax_topk_triton", mutates_args=())
def softmax_topk_triton(logits_TE: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk` in one Triton pass (a program per 16 tokens, all experts in registers)."""
    logits_TE = logits_TE.contiguous()
    weights_TK = logits_TE.new_empty(logits_TE.shape[0], top_k)
    experts_TK = torch.empty(logits_TE.shape[0], top_k, dtype=torch.int64, device=logits_TE.device)
    if logits_TE.shape[0]:
        from moeloop.steps.model.triton_kernels import softmax_topk_kernel

        grid, blocks = _router_launch(logits_TE, top_k)
        softmax_topk_kernel[grid](logits_TE, weights_TK, experts_TK, logits_TE.shape[0], NORMALIZE=normalize, **blocks)
    return weights_TK, experts_TK


@softmax_topk_triton.register_fake
def _(logits_TE: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    experts_TK = torch.empty(logits_TE.shape[0], top_k, dtype=torch.int64, device=logits_TE.device)
    return logits_TE.new_empty(logits_TE.shape[0], top_k), experts_TK


@torch.library.custom_op("moeloop::softmax_topk_backward_triton", mutates_args=())
def softmax_topk_backward_triton(
    logits_TE: torch.Tensor, experts_TK: torch.Tensor, grad_weights_TK: torch.Tensor, normalize: bool
) -> torch.Tensor:
    """The logits' gradient of `softmax_topk_triton`'s weights, in one Triton pass."""
    logits_TE, experts_TK, grad_weights_TK = (
        logits_TE.contiguous(),
        experts_TK.contiguous(),
        grad_weights_TK.contiguous(),
    )
    grad_logits_TE = torch.empty_like(logits_TE)
    if logits_TE.shape[0]:
        from moeloop.steps.model.triton_kernels import softmax_topk_backward_kernel

        grid, blocks = _router_launch(logits_TE, experts_TK.shape[1])
        softmax_topk_backward_kernel[grid](
            logits_TE, experts_TK, grad_weights_TK, grad_logits_TE, logits_TE.shape[0], NORMALIZE=normalize, **blocks
        )
    return grad_logits_TE


@softmax_topk_backward_triton.register_fake
def _(
    logits_TE: torch.Tensor, experts_TK: torch.Tensor, grad_weights_TK: torch.Tensor, normalize: bool
) -> torch.Tensor:
    return torch.empty_like(logits_TE)


def _softmax_topk_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    logits_TE, _, ctx.normalize = inputs
    ctx.save_for_backward(logits_TE, output[1])
    ctx.mark_non_differentiable(output[1])


def _softmax_topk_backward(ctx: Any, grad_weights_TK: torch.Tensor, _: Any) -> tuple[torch.Tensor, None, None]:
    logits_TE, experts_TK = ctx.saved_tensors
    return softmax_topk_backward_triton(logits_TE, experts_TK, grad_weights_TK, ctx.normalize), None, None


softmax_topk_triton.register_autograd(_softmax_topk_backward, setup_context=_softmax_topk_setup_context)


def fused_on_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, compiled by inductor (dynamic shapes: one graph for every size) when its first argument is a CUDA tensor,
    eager otherwise: for the trainer's pointwise and reduction passes outside the compiled decoder layers (the LM
    head's chunks, the routers' loss), which eager runs as one kernel per operation over large fp32 tensors."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        return (compiled if args[0].is_cuda else fn)(*args)

    return call
