"""Triton kernels, imported by `moeloop.steps.model.kernels` on first CUDA use only (this module imports triton)."""

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
def expand_rows_kernel(x_ptr, row_of_ptr, out_ptr, num_rows, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[row_of[t, k], cols] = x[t, cols] for each k with row_of[t, k] < num_rows (the adjoint of gather_sum).

    One program per (token, BLOCK_H-column tile): reads the token once, writes its K rows. The rows are a
    permutation's, so no two programs write the same one.
    """
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    x = tl.load(x_ptr + token * hidden + cols, mask=in_row)
    for k in tl.static_range(K):
        row = tl.load(row_of_ptr + token * K + k).to(tl.int64)
        present = in_row & (cols * 0 + row < num_rows)  # broadcast first: Triton's interpreter wants a block mask
        tl.store(out_ptr + row * hidden + cols, x, mask=present)


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


@triton.jit
def grouped_mm_kernel(
    a_desc, b_desc, out_ptr, group_end_ptr, num_groups, N, K, B_TRANSPOSED: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):  # fmt: skip
    """out[r] = a[r] @ b[g] for the rows r of group g (rows grouped by group_end, each group's end row), with
    b[g] stored [N, K] (B_TRANSPOSED, an nn.Linear weight) or [K, N]; both operands through TMA descriptors.

    Persistent: NUM_PROGRAMS programs walk the (row tile, column tile) pairs of all groups, row tiles numbered in
    group order and each group's last one partial; a tile finds its group from the group sizes (no host sync).
    Rows past a group's end are loaded (TMA reads whole tiles) but never stored.
    """
    groups = tl.arange(0, BLOCK_G)
    ends = tl.load(group_end_ptr + groups, mask=groups < num_groups, other=0).to(tl.int32)
    starts = tl.load(group_end_ptr + groups - 1, mask=(groups > 0) & (groups < num_groups), other=0).to(tl.int32)
    row_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    row_tile_ends = tl.cumsum(row_tiles, 0)
    col_tiles = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tl.sum(row_tiles, 0) * col_tiles, NUM_PROGRAMS, flatten=True):
        row_tile = tile // col_tiles  # consecutive tiles share their rows of a, which stay in L2
        first_col = tile % col_tiles * BLOCK_N
        group = tl.sum((row_tile_ends <= row_tile).to(tl.int32), 0)
        in_group = groups == group
        first_row = tl.sum(tl.where(in_group, starts + (row_tile - row_tile_ends + row_tiles) * BLOCK_M, 0), 0)
        end_row = tl.sum(tl.where(in_group, ends, 0), 0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([first_row, k])
            if B_TRANSPOSED:
                b = b_desc.load([group * N + first_col, k]).T
            else:
                b = b_desc.load([group * K + k, first_col])
            acc = tl.dot(a, b, acc)
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = first_col + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < end_row) & (cols[None, :] < N))


@triton.jit
def router_probs(logits_ptr, tokens, cols, in_tokens, E: tl.constexpr):
    """The softmax (fp32) of the tokens' E logits, a [tokens, cols] block; zeros past E and past the last token."""
    mask = in_tokens[:, None] & (cols[None, :] < E)
    logits = tl.load(logits_ptr + tokens.to(tl.int64)[:, None] * E + cols[None, :], mask=mask, other=-float("inf"))
    logits = tl.where(in_tokens[:, None], logits.to(tl.float32), 0.0)  # rows past the end: no -inf - -inf
    exp = tl.exp(logits - tl.max(logits, 1)[:, None])
    return tl.where(mask, exp / tl.sum(exp, 1)[:, None], 0.0)


@triton.jit
def softmax_topk_kernel(
    logits_ptr, weights_ptr, experts_ptr, num_tokens, E: tl.constexpr, K: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Per token: softmax over its E logits (fp32), the K largest probabilities in descending order (the lower
    expert first on a tie), divided by their sum when NORMALIZE; weights in the logits' dtype, experts int64."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    in_tokens = tokens < num_tokens
    probs = router_probs(logits_ptr, tokens, cols, in_tokens, E)
    probs = tl.where(cols[None, :] < E, probs, -1.0)  # padding is never chosen
    values = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    experts = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.max(probs, 1)
        expert = tl.min(tl.where(probs == best[:, None], cols[None, :], BLOCK_E), 1)
        values = tl.where(slots[None, :] == k, best[:, None], values)
        experts = tl.where(slots[None, :] == k, expert[:, None], experts)
        probs = tl.where(cols[None, :] == expert[:, None], -1.0, probs)
    if NORMALIZE:
        values = values / tl.sum(values, 1)[:, None]  # the unused slots hold zeros
    out_offsets = tokens.to(tl.int64)[:, None] * K + slots[None, :]
    out_mask = in_tokens[:, None] & (slots[None, :] < K)
    tl.store(weights_ptr + out_offsets, values.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(experts_ptr + out_offsets, experts.to(tl.int64), mask=out_mask)


@triton.jit
def softmax_topk_backward_kernel(
    logits_ptr, experts_ptr, grad_weights_ptr, grad_logits_ptr, num_tokens, E: tl.constexpr, K: tl.constexpr,
    NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The logits' gradient of `softmax_topk_kernel`'s weights: through the renormalisation (when NORMALIZE),
    the selection and the softmax, in fp32, from the logits (softmax recomputed) and the chosen experts."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    in_tokens = tokens < num_tokens
    mask = in_tokens[:, None] & (cols[None, :] < E)
    probs = router_probs(logits_ptr, tokens, cols, in_tokens, E)
    slot_offsets = tokens.to(tl.int64)[:, None] * K + slots[None, :]
    slot_mask = in_tokens[:, None] & (slots[None, :] < K)
    experts = tl.load(experts_ptr + slot_offsets, mask=slot_mask, other=-1)
    grad = tl.load(grad_weights_ptr + slot_offsets, mask=slot_mask, other=0.0).to(tl.float32)
    chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)  # the chosen probabilities, slot by slot
    for k in tl.static_range(K):
        expert_k = tl.sum(tl.where(slots[None, :] == k, experts, 0), 1)
        chosen_k = tl.sum(tl.where(cols[None, :] == expert_k[:, None], probs, 0.0), 1)
        chosen = tl.where(slots[None, :] == k, chosen_k[:, None], chosen)
    if NORMALIZE:  # weights = chosen / total: d chosen_k = (grad_k - sum_j grad_j * weight_j) / total
        total = tl.sum(chosen, 1)
        grad = (grad - tl.sum(grad * chosen, 1)[:, None] / total[:, None]) / total[:, None]
    grad_probs = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k in tl.static_range(K):
        expert_k = tl.sum(tl.where(slots[None, :] == k, experts, 0), 1)
        grad_k = tl.sum(tl.where(slots[None, :] == k, grad, 0.0), 1)
        grad_probs = tl.where(cols[None, :] == expert_k[:, None], grad_k[:, None], grad_probs)
    grad_logits = probs * (grad_probs - tl.sum(grad_probs * probs, 1)[:, None])  # the softmax's backward
    grad_ptrs = grad_logits_ptr + tokens.to(tl.int64)[:, None] * E + cols[None, :]
    tl.store(grad_ptrs, grad_logits.to(grad_logits_ptr.dtype.element_ty), mask=mask)
