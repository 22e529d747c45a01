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
