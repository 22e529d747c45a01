"""Token dispatchers for the MoE layer: send each token's copies to the ranks holding its experts, and back.

One interface, selected by name (`make_dispatcher`):

    expert_x_NH, tokens_per_expert_e, meta = dispatcher.dispatch(x_TH, topk_idx_TK, topk_weights_TK)
    expert_y_NH = experts(expert_x_NH, tokens_per_expert_e)   # rows grouped by local expert, in expert order
    y_TH = dispatcher.combine(expert_y_NH, meta)               # sum over k of the (weighted) expert outputs

The experts apply the routing weights (`meta.weight_N`, one per expert row) themselves, folded into the SwiGLU;
dispatch and combine are adjoint through the inverse permutation: each token copied to its K rows, and each
token's K rows summed (no atomics, fp32 sums; on CUDA each is one Triton pass, `moeloop.steps.model.kernels.expand_rows` and
`moeloop.steps.model.kernels.gather_sum`).

Shape letters: steps/README.md (T the tokens on this rank, N the rows for its e local experts, R the tokens
received from the EP group). EP rank r holds experts [r * e, (r + 1) * e).

- `local` (EP = 1): a permutation by expert.
- `all_to_all`: `all_to_all_single` with uneven splits over the EP process group (gloo or NCCL), autograd-aware.
- `deepep`: DeepEP's high-throughput kernels (CUDA, >= 2 EP ranks, an NCCL group), in steps/model/deepep.py,
  the one module that imports `deep_ep`.
- `auto`: `local` at EP = 1, else `deepep` where it can run, else `all_to_all`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model import kernels

log = logging.getLogger(__name__)

DISPATCHERS = ("auto", "local", "all_to_all", "deepep")


@dataclass(frozen=True)
class ExpertRows:
    """Where each expert row came from: rows are (token, k) slots, sorted by expert.

    Dispatch and combine are adjoint gathers: rows are `x_TH[token_N]`, and a token's sum is over its K rows
    `row_of_TK` (the inverse permutation; a slot with no row here points one past the last row, at a zero row).
    """

    token_N: torch.Tensor  # the token (row of the dispatcher's token tensor) each row copies
    row_of_TK: torch.Tensor  # the row of each (token, k) slot; num_rows for a slot dropped here
    weight_N: torch.Tensor  # the routing weight of each expert row, as the experts see their rows
    num_tokens: int  # rows of the token tensor that combine sums into


MetaT = TypeVar("MetaT", bound=ExpertRows)


def sort_by_expert(
    topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, k) slots sorted by expert, stably (so by token within an expert).

    Slots with expert -1 (DeepEP's mark for an expert on another rank) sort last and are dropped; num_rows is
    the number of slots kept, which the caller knows without a device sync. The counts come from
    `searchsorted` on the sorted expert ids (no `bincount`, whose CUDA kernel syncs with the host).
    Returns token_N, row_of_TK (dropped slots: num_rows), weight_N and tokens_per_expert_E.
    """
    num_tokens, top_k = topk_idx_TK.shape
    expert_S = topk_idx_TK.flatten()
    key_S = narrow_keys(torch.where(expert_S >= 0, expert_S, num_experts), num_experts)
    order_S = torch.argsort(key_S, stable=True)
    row_of_S = torch.empty_like(order_S)
    row_of_S[order_S] = torch.arange(order_S.numel(), device=order_S.device, dtype=order_S.dtype)
    if num_rows < order_S.numel():
        row_of_S = row_of_S.clamp(max=num_rows)
    experts_E = torch.arange(1, num_experts + 1, device=key_S.device, dtype=key_S.dtype)
    ends_E = torch.searchsorted(key_S[order_S], experts_E)  # end row of each expert
    tokens_per_expert_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    slot_N = order_S[:num_rows]
    return slot_N // top_k, row_of_S.view(num_tokens, top_k), topk_weights_TK.flatten()[slot_N], tokens_per_expert_E


def narrow_keys(keys_S: torch.Tensor, max_key: int) -> torch.Tensor:
    """keys in [0, max_key] as the narrowest integer dtype that holds them, to sort by: a radix sort makes one pass
    per key byte (131072 keys on an H200: uint8 0.028 ms, int64 0.096)."""
    return keys_S.to(torch.uint8 if max_key < 2**8 else torch.int16 if max_key < 2**15 else torch.int64)


class _Permute(torch.autograd.Function):
    """rows_NH = x_TH[token_N]; backward: each token's K row gradients gathered through row_of_TK and summed."""

    @staticmethod
    def forward(ctx: Any, x_TH: torch.Tensor, token_N: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(row_of_TK)
        return kernels.expand_rows(x_TH, token_N, row_of_TK)

    @staticmethod
    def backward(ctx: Any, grad_NH: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (row_of_TK,) = ctx.saved_tensors
        return kernels.gather_sum(grad_NH, row_of_TK), None, None


class _Unpermute(torch.autograd.Function):
    """y_TH = sum over k of rows_NH[row_of_TK[:, k]]; backward: the gradient gathered back to rows by token_N."""

    @staticmethod
    def forward(ctx: Any, rows_NH: torch.Tensor, token_N: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(token_N, row_of_TK)
        return kernels.gather_sum(rows_NH, row_of_TK)

    @staticmethod
    def backward(ctx: Any, grad_TH: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        token_N, row_of_TK = ctx.saved_tensors
        return kernels.expand_rows(grad_TH.contiguous(), token_N, row_of_TK), None, None


def permute_rows(x_TH: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """The expert rows `x_TH[token_N]`, whose backward is a gather-sum (no atomics)."""
    return _Permute.apply(x_TH, rows.token_N, rows.row_of_TK)


def reorder_rows(rows_NH: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor) -> torch.Tensor:
    """`rows_NH[order_N]` for a permutation order_N whose inverse is inverse_N: both ways one pass over the rows
    (plain indexing would scatter its gradient with a sort and atomics)."""
    return _Permute.apply(rows_NH, order_N, inverse_N.unsqueeze(1))


def sum_by_token(expert_y_NH: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """Sum each token's expert outputs (already weighted by the experts), in fp32; backward is a gather."""
    return _Unpermute.apply(expert_y_NH, rows.token_N, rows.row_of_TK)


class TokenDispatcher(ABC, Generic[MetaT]):
    """Moves routed tokens to the local experts (dispatch) and their outputs back (combine)."""

    name: str
    # Whether torch.compile may trace dispatch and combine: no host sync, no collectives, shapes known from the input.
    traceable = False

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None) -> None:
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.ep_size = ep_group.size() if ep_group is not None else 1
        self.ep_rank = ep_group.rank() if ep_group is not None else 0
        if num_experts % self.ep_size:
            raise MoeloopError(f"{num_experts} experts do not split evenly over {self.ep_size} EP ranks")
        self.num_local_experts = num_experts // self.ep_size

    @abstractmethod
    def dispatch(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, MetaT]:
        """Returns expert_x_NH (rows grouped by local expert), tokens_per_expert_e, and the metadata for combine."""

    @abstractmethod
    def combine(self, expert_y_NH: torch.Tensor, meta: MetaT) -> torch.Tensor:
        """Returns y_TH: each token's expert outputs (the experts applied the routing weights), summed."""


class LocalDispatcher(TokenDispatcher[ExpertRows]):
    """EP = 1: every expert is here, so dispatch is a permutation by expert."""

    name = "local"
    traceable = True

    def dispatch(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ExpertRows]:
        token_N, row_of_TK, weight_N, tokens_per_expert_E = sort_by_expert(
            topk_idx_TK, topk_weights_TK, self.num_experts, topk_idx_TK.numel()
        )
        rows = ExpertRows(token_N, row_of_TK, weight_N, x_TH.shape[0])
        return permute_rows(x_TH, rows), tokens_per_expert_E, rows

    def combine(self, expert_y_NH: torch.Tensor, meta: ExpertRows) -> torch.Tensor:
        return sum_by_token(expert_y_NH, meta)


@dataclass(frozen=True)
class AllToAllMeta(ExpertRows):
    send_splits: list[int]  # rows this rank sends to each EP rank
    recv_splits: list[int]  # rows it receives from each EP rank
    expert_order_N: torch.Tensor  # received rows (rank by rank) reordered expert by expert
    recv_row_of_N: torch.Tensor  # its inverse: where each expert row goes back to, rank by rank


class AllToAllDispatcher(TokenDispatcher[AllToAllMeta]):
    """`all_to_all_single` with uneven splits over the EP group; gloo (CPU) or NCCL.

    Rows sorted by global expert are also sorted by destination rank, since rank r holds a contiguous block
    of experts. The row counts are exchanged first (one all-to-all of P * e integers and a host sync).
    """

    name = "all_to_all"

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup) -> None:
        super().__init__(num_experts, ep_group)
        self.group = ep_group

    def dispatch(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, AllToAllMeta]:
        token_N, row_of_TK, weight_N, tokens_per_expert_E = sort_by_expert(
            topk_idx_TK, topk_weights_TK, self.num_experts, topk_idx_TK.numel()
        )
        recv_counts_E = torch.empty_like(tokens_per_expert_E)  # [P * e]: rows from rank p for local expert j
        dist.all_to_all_single(recv_counts_E, tokens_per_expert_E, group=self.group)
        recv_counts_Pe = recv_counts_E.view(self.ep_size, self.num_local_experts)
        sent = ExpertRows(token_N, row_of_TK, weight_N, x_TH.shape[0])
        # Queued before the host sync below: one launch fewer after it, while the drained GPU waits for the host.
        send_x_NH = permute_rows(x_TH, sent)
        # The one host sync of the dispatch: the split sizes all_to_all_single takes as lists.
        send_splits, recv_splits = torch.stack(
            [tokens_per_expert_E.view(self.ep_size, -1).sum(1), recv_counts_Pe.sum(1)]
        ).tolist()
        recv_x_NH = all_to_all_single_autograd(send_x_NH, recv_splits, send_splits, self.group)
        # The routing weights travel with their rows, since the experts (on the receiving rank) apply them.
        recv_weight_N = all_to_all_single_autograd(weight_N.contiguous(), recv_splits, send_splits, self.group)
        # Received rows come rank by rank, each rank's in expert order; the grouped GEMM wants expert by expert.
        local_experts_Pe = torch.arange(self.num_local_experts, device=x_TH.device).repeat(self.ep_size)
        # output_size known on the host: no device sync to size the output
        expert_of_row_N = torch.repeat_interleave(local_experts_Pe, recv_counts_E, output_size=sum(recv_splits))
        expert_order_N = torch.argsort(narrow_keys(expert_of_row_N, self.num_local_experts - 1), stable=True)
        recv_row_of_N = torch.empty_like(expert_order_N)  # the inverse permutation: each received row's place
        recv_row_of_N[expert_order_N] = torch.arange(expert_order_N.numel(), device=x_TH.device)
        meta = AllToAllMeta(
            token_N,
            row_of_TK,
            recv_weight_N[expert_order_N],
            x_TH.shape[0],
            send_splits,
            recv_splits,
            expert_order_N,
            recv_row_of_N,
        )
        return reorder_rows(recv_x_NH, expert_order_N, recv_row_of_N), recv_counts_Pe.sum(0), meta

    def combine(self, expert_y_NH: torch.Tensor, meta: AllToAllMeta) -> torch.Tensor:
        recv_y_NH = reorder_rows(expert_y_NH, meta.recv_row_of_N, meta.expert_order_N)
        y_NH = all_to_all_single_autograd(recv_y_NH, meta.send_splits, meta.recv_splits, self.group)
        return sum_by_token(y_NH, meta)


def make_dispatcher(name: str, num_experts: int, ep_group: dist.ProcessGroup | None = None) -> TokenDispatcher[Any]:
    """The dispatcher called name for experts sharded over ep_group (None: EP = 1)."""
    from moeloop.steps.model.deepep import deepep_dispatcher  # it builds on this module's classes
    ep_size = ep_group.size() if ep_group is not None else 1
    if name == "auto":
        if ep_size == 1:
            dispatcher: TokenDispatcher[Any] = LocalDispatcher(num_experts, ep_group)
            reason = "EP = 1"
        else:
            try:
                dispatcher = deepep_dispatcher(num_experts, ep_group)
                reason = "CUDA, deep_ep imports"
            except MoeloopError as error:
                dispatcher = AllToAllDispatcher(num_experts, ep_group)  # type: ignore[arg-type]
                reason = str(error)
        log.info("MoE dispatcher: %s (EP %d; %s)", dispatcher.name, ep_size, reason)
        return dispatcher
    if name == "local":
        if ep_size > 1:
            raise MoeloopError(f"the local dispatcher is for EP = 1, and the EP group has {ep_size} ranks")
        return LocalDispatcher(num_experts, ep_group)
    if name == "all_to_all":
        if ep_group is None:
            raise MoeloopError("the all_to_all dispatcher needs an EP process group")
        return AllToAllDispatcher(num_experts, ep_group)
    if name == "deepep":
        return deepep_dispatcher(num_experts, ep_group)
    raise MoeloopError(f"unknown MoE dispatcher {name!r}; choose one of {', '.join(DISPATCHERS)}")
