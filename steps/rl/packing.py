"""Padding-free microbatches: a minibatch's samples bin-packed into rows of at most a token budget.

A microbatch is one row of its samples' tokens end to end ([1, N], N the sum of their lengths), with each
sample's positions counting from 0 and the sample boundaries as `cu_seqlens` (what a varlen attention kernel
takes; `moeloop.steps.model.attention`). Gradients accumulate over a rank's microbatches to one optimizer step, and the losses
take the whole minibatch's token and sequence counts as denominators, so packing changes no number.

Every rank plans every microbatch of the minibatch (the plan is a pure function of the sample lengths), so the
ranks agree on how many forwards each runs: the MoE layers' all-to-alls and FSDP's all-gathers are collectives
that every rank joins equally often.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def plan_microbatches(lengths: list[int], max_tokens: int, world_size: int) -> list[list[list[int]]]:
    """Indices into lengths, packed into world_size x k microbatches of at most max_tokens tokens, k the same for
    every rank: the plan of each rank, its k microbatches. Deterministic.

    k is the fewest that first-fit decreasing needs, spread over the ranks; the samples then go, longest first, to
    the least-filled microbatch that has room (so the microbatches, and the ranks, carry similar token counts). A
    sample longer than max_tokens takes an empty microbatch of its own. A microbatch can be empty (an empty list)
    when there are fewer samples than microbatches; its rank then runs a forward of no weight
    (`Microbatch.empty`).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank = -(-len(first_fit_decreasing([lengths[i] for i in order], max_tokens)) // world_size)
    while (bins := least_filled([lengths[i] for i in order], max_tokens, per_rank * world_size)) is None:
        per_rank += 1
    loads = [sum(lengths[order[j]] for j in members) for members in bins]
    ranked = sorted(range(len(bins)), key=lambda b: (-loads[b], b))
    plans: list[list[list[int]]] = [[] for _ in range(world_size)]
    for position, b in enumerate(ranked):  # dealt in snake order, heaviest first: the ranks' totals stay close
        lap, offset = divmod(position, world_size)
        plans[offset if lap % 2 == 0 else world_size - 1 - offset].append(sorted(order[j] for j in bins[b]))
    return plans


def first_fit_decreasing(sorted_lengths: list[int], max_tokens: int) -> list[int]:
    """Bin loads of first-fit over lengths sorted longest first."""
    loads: list[int] = []
    for length in sorted_lengths:
        for b, load in enumerate(loads):
            if load + length <= max_tokens:
                loads[b] += length
                break
        else:
            loads.append(length)
    return loads


def least_filled(sorted_lengths: list[int], max_tokens: int, num_bins: int) -> list[list[int]] | None:
    """Each length (longest first) into the least-filled of num_bins bins, by position in sorted_lengths; None if
    one does not fit there (an empty bin takes any length)."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for position, length in enumerate(sorted_lengths):
        b = min(range(num_bins), key=lambda b: (loads[b], b))
        if loads[b] and loads[b] + length > max_tokens:
            return None
        bins[b].append(position)
        loads[b] += length
    return bins


@dataclass(frozen=True)
class Microbatch:
    """Samples of a right-padded batch packed into one row, and the way back to the padded layout.

    Letters: n samples of this microbatch, N = the sum of their lengths, T the padded batch's width.
    """

    rows_n: torch.Tensor  # the samples, rows of the padded batch
    input_ids_1N: torch.Tensor
    position_ids_1N: torch.Tensor  # each sample's positions from 0: RoPE, and HF's packed-sequence mask
    cu_seqlens_n1: torch.Tensor  # int32 [n + 1], sample i is tokens [cu[i], cu[i + 1])
    max_length: int
    row_N: torch.Tensor  # each token's sample, 0..n-1
    column_N: torch.Tensor  # each token's position in its padded row (= its position id)
    width: int  # T

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_1N.shape[1])

    @property
    def empty(self) -> bool:
        return len(self.rows_n) == 0

    def real_tokens(self) -> torch.Tensor:
        """1 for each token of a sample, [N]: all of them, or none in the empty microbatch."""
        return torch.full((self.num_tokens,), 0.0 if self.empty else 1.0, device=self.input_ids_1N.device)

    def unpack(self, values_N: torch.Tensor) -> torch.Tensor:
        """Per-token values [N] as the padded layout [n, T], zero at the padding (no rows for the empty one)."""
        if self.empty:  # no rows, but in the graph: the rank's backward still reaches every parameter
            return values_N[:0].unsqueeze(1).expand(0, self.width)
        padded_nT = values_N.new_zeros((len(self.rows_n), self.width))
        return padded_nT.index_put((self.row_N, self.column_N), values_N)

    def pack(self, values_BT: torch.Tensor) -> torch.Tensor:
        """The padded batch's per-token values [B, T] at this microbatch's tokens, [N]."""
        if self.empty:  # its one token: the batch's first
            return values_BT[:1, 0]
        return values_BT[self.rows_n[self.row_N], self.column_N]

    def attention_kwargs(self) -> dict[str, object]:
        """The sample boundaries as HF passes them down to the attention function (its FlashAttentionKwargs)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens_n1,
            "cu_seq_lens_k": self.cu_seqlens_n1,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }


def pack_rows(input_ids_BT: torch.Tensor, lengths: list[int], rows: list[int]) -> Microbatch:
    """The samples `rows` of a right-padded batch (sample b is its first lengths[b] tokens) as one microbatch. The
    indices are built on the CPU from the lengths and copied over once, so packing never waits on the GPU.

    No rows is the empty microbatch: one token, so that the rank still runs every collective; its values
    are given no weight (its unpacked values have no rows)."""
    device, width = input_ids_BT.device, input_ids_BT.shape[1]
    lengths_n = torch.tensor([lengths[row] for row in rows] or [1], dtype=torch.long)
    row_N = torch.repeat_interleave(torch.arange(len(lengths_n)), lengths_n)
    column_N = torch.arange(len(row_N)) - (torch.cumsum(lengths_n, 0) - lengths_n)[row_N]
    cu_seqlens_n1 = F.pad(torch.cumsum(lengths_n, 0, dtype=torch.int32), (1, 0))
    rows_n, row_N, column_N, cu_seqlens_n1 = (
        t.to(device, non_blocking=True) for t in (torch.tensor(rows, dtype=torch.long), row_N, column_N, cu_seqlens_n1)
    )
    # The empty microbatch's token: row 0, column 0 of the batch (any token would do).
    input_ids_1N = input_ids_BT[rows_n[row_N], column_N].unsqueeze(0) if rows else input_ids_BT[:1, :1]
    return Microbatch(
        rows_n, input_ids_1N, column_N.unsqueeze(0), cu_seqlens_n1, int(lengths_n.max()), row_N, column_N, width
    )
