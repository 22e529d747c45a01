"""A packed microbatch: samples of a right-padded batch as one row, and the way back to the padded layout.

The row is the samples' tokens end to end ([1, N], N the sum of their lengths), with each sample's positions
counting from 0 and the sample boundaries as `cu_seqlens` (what a varlen attention kernel takes;
`moeloop.steps.model.attention`). The packed forwards (`moeloop.steps.model.logprobs`) take it; the trainer plans
which samples share a row (`moeloop.steps.rl.packing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    indices are built on the CPU from the lengths and copied over from pinned memory (a copy from pageable memory
    waits for the GPU's queue to reach it), so packing never waits on the GPU.

    No rows is the empty microbatch: one token, so that the rank still runs every collective; its values
    are given no weight (its unpacked values have no rows)."""
    device, width = input_ids_BT.device, input_ids_BT.shape[1]
    lengths_n = torch.tensor([lengths[row] for row in rows] or [1], dtype=torch.long)
    row_N = torch.repeat_interleave(torch.arange(len(lengths_n)), lengths_n)
    column_N = torch.arange(len(row_N)) - (torch.cumsum(lengths_n, 0) - lengths_n)[row_N]
    cu_seqlens_n1 = F.pad(torch.cumsum(lengths_n, 0, dtype=torch.int32), (1, 0))
    host = (torch.tensor(rows, dtype=torch.long), row_N, column_N, cu_seqlens_n1)
    rows_n, row_N, column_N, cu_seqlens_n1 = (
        (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True) for t in host
    )
    # The empty microbatch's token: row 0, column 0 of the batch (any token would do).
    input_ids_1N = input_ids_BT[rows_n[row_N], column_N].unsqueeze(0) if rows else input_ids_BT[:1, :1]
    return Microbatch(
        rows_n, input_ids_1N, column_N.unsqueeze(0), cu_seqlens_n1, int(lengths_n.max()), row_N, column_N, width
    )
