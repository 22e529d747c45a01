"""Triton kernels, imported by `steps.kernels` on first CUDA use only (this module imports triton)."""

import triton
import triton.language as tl


@triton.jit
def gather_sum_kernel(rows_ptr, row_of_ptr, out_ptr, num_rows, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, cols] = sum over k of rows[row_of[t, k], cols] in fp32; a row index >= num_rows reads zeros.

    One program per (token, BLOCK_H-column tile); reads the K rows once, writes the token once.
    """
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(row_of_ptr + token * K + k).to(tl.int64)
        present = in_row & (cols * 0 + row < num_rows)  # broadcast first: Triton's interpreter wants a block mask
        acc += tl.load(rows_ptr + row * hidden + cols, mask=present, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def swiglu_forward_kernel(
    gate_up_ptr, weight_ptr, out_ptr, num_rows, INTER: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
):  # fmt: skip
    """out[n, i] = silu(gate[n, i]) * up[n, i] (* weight[n]), in fp32, rounded once; gate_up rows are [gate | up].

    One program per (BLOCK_M rows, BLOCK_I columns) tile.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    in_rows = rows < num_rows
    mask = in_rows[:, None] & (cols[None, :] < INTER)
    gate_offsets = rows.to(tl.int64)[:, None] * (2 * INTER) + cols[None, :]
    gate = tl.load(gate_up_ptr + gate_offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + gate_offsets + INTER, mask=mask, other=0.0).to(tl.float32)
    hidden = gate * tl.sigmoid(gate) * up
    if HAS_WEIGHT:
        hidden = hidden * tl.load(weight_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)[:, None]
    out_offsets = rows.to(tl.int64)[:, None] * INTER + cols[None, :]
    tl.store(out_ptr + out_offsets, hidden.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(
    gate_up_ptr, weight_ptr, grad_out_ptr, grad_gate_up_ptr, grad_weight_ptr, num_rows, INTER: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    """The gradients of `swiglu_forward_kernel` in one pass over each row: grad_gate_up [n, 2I] and, with weights,
    grad_weight[n] = sum over i of grad_out * silu(gate) * up, accumulated in fp32.

    One program per BLOCK_M rows, walking their columns BLOCK_I at a time (the weight's gradient needs the row).
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < num_rows
    weight = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    grad_weight = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, INTER, BLOCK_I):
        cols = start + tl.arange(0, BLOCK_I)
        mask = in_rows[:, None] & (cols[None, :] < INTER)
        gate_offsets = rows.to(tl.int64)[:, None] * (2 * INTER) + cols[None, :]
        out_offsets = rows.to(tl.int64)[:, None] * INTER + cols[None, :]
        gate = tl.load(gate_up_ptr + gate_offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + gate_offsets + INTER, mask=mask, other=0.0).to(tl.float32)
        grad_out = tl.load(grad_out_ptr + out_offsets, mask=mask, other=0.0).to(tl.float32)
        sigmoid = tl.sigmoid(gate)
        silu = gate * sigmoid
        grad_weight += tl.sum(grad_out * silu * up, axis=1)
        grad_hidden = grad_out * weight[:, None]
        grad_gate = grad_hidden * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))  # d silu / d gate
        tl.store(grad_gate_up_ptr + gate_offsets, grad_gate.to(grad_gate_up_ptr.dtype.element_ty), mask=mask)
        tl.store(
            grad_gate_up_ptr + gate_offsets + INTER,
            (grad_hidden * silu).to(grad_gate_up_ptr.dtype.element_ty),
            mask=mask,
        )
    if HAS_WEIGHT:
        tl.store(grad_weight_ptr + rows, grad_weight.to(grad_weight_ptr.dtype.element_ty), mask=in_rows)
