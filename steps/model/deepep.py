"""The `deepep` token dispatcher: DeepEP's high-throughput kernels behind steps/model/dispatch.py's interface
(CUDA, >= 2 EP ranks, an NCCL group). `deep_ep` is imported only here, when the dispatcher is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.dispatch import ExpertRows, TokenDispatcher, permute_rows, sort_by_expert, sum_by_token


class DeepEPBackend(Protocol):
    """One DeepEP buffer generation behind the three calls the autograd wrappers need. Handles are opaque."""

    topk_idx_dtype: torch.dtype

    def dispatch(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], Any]:
        """Returns recv_x_RH, recv_topk_idx_RK (local experts, -1 elsewhere), recv_topk_weights_RK,
        tokens per local expert, and the handle."""
        ...

    def combine(
        self, x_RH: torch.Tensor, handle: Any, topk_weights_RK: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sums each received row back into its source token, unweighted; likewise topk_weights_RK if given."""
        ...

    def dispatch_cached(self, x_TH: torch.Tensor, handle: Any) -> torch.Tensor:
        """Sends x_TH along the routes of an earlier dispatch."""
        ...


class LegacyBufferBackend:
    """`deep_ep.Buffer` (DeepEP 1.x; 2.x keeps it as legacy): normal kernels, NVLink within a node.

    The buffer size depends only on the hidden size and the number of ranks, so it is allocated once.
    """

    def __init__(self, deep_ep: ModuleType, group: dist.ProcessGroup, num_experts: int) -> None:
        self.deep_ep, self.group, self.num_experts = deep_ep, group, num_experts
        self.topk_idx_dtype: torch.dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.buffer: Any = None

    def _buffer_for(self, hidden_bytes: int) -> Any:
        buffer_class, num_ranks = self.deep_ep.Buffer, self.group.size()
        configs = (buffer_class.get_dispatch_config(num_ranks), buffer_class.get_combine_config(num_ranks))
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for config in configs)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) for config in configs)
        if (
            self.buffer is None
            or self.buffer.num_nvl_bytes < num_nvl_bytes
            or self.buffer.num_rdma_bytes < num_rdma_bytes
        ):
            self.buffer = buffer_class(self.group, num_nvl_bytes, num_rdma_bytes)
        return self.buffer

    def dispatch(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], Any]:
        buffer = self._buffer_for(x_TH.shape[1] * x_TH.element_size())
        tokens_per_rank, tokens_per_rdma_rank, tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
            topk_idx_TK, self.num_experts
        )
        recv_x_RH, recv_topk_idx_RK, recv_topk_weights_RK, tokens_per_local_expert, handle, _ = buffer.dispatch(
            x_TH,
            num_tokens_per_rank=tokens_per_rank,
            num_tokens_per_rdma_rank=tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=tokens_per_expert,
            topk_idx=topk_idx_TK,
            topk_weights=topk_weights_TK,
        )
        return recv_x_RH, recv_topk_idx_RK, recv_topk_weights_RK, tokens_per_local_expert, handle

    def combine(
        self, x_RH: torch.Tensor, handle: Any, topk_weights_RK: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        combined_x_TH, combined_topk_weights_TK, _ = self.buffer.combine(x_RH, handle, topk_weights=topk_weights_RK)
        return combined_x_TH, combined_topk_weights_TK

    def dispatch_cached(self, x_TH: torch.Tensor, handle: Any) -> torch.Tensor:
        recv_x_RH, *_ = self.buffer.dispatch(x_TH, handle=handle)
        return recv_x_RH


class ElasticBufferBackend:
    """`deep_ep.ElasticBuffer` (DeepEP 2.x, over NCCL's GPU-initiated networking; NCCL >= 2.30.4).

    Its size depends on the most tokens any rank dispatches, which all ranks must agree on: every dispatch
    all-reduces the token count (max) over the EP group, and the buffer is rebuilt, by all ranks at once, when
    that outgrows its capacity (rounded up to a power of two, so rebuilds are rare).
    """

    def __init__(self, deep_ep: ModuleType, group: dist.ProcessGroup, num_experts: int) -> None:
        self.deep_ep, self.group, self.num_experts = deep_ep, group, num_experts
        self.topk_idx_dtype: torch.dtype = deep_ep.topk_idx_t
        self.buffer: Any = None
        self.max_tokens_per_rank = 0

    def _buffer_for(self, x_TH: torch.Tensor, num_topk: int) -> Any:
        most_tokens = torch.tensor([x_TH.shape[0]], device=x_TH.device)
        dist.all_reduce(most_tokens, op=dist.ReduceOp.MAX, group=self.group)
        if self.buffer is None or int(most_tokens) > self.max_tokens_per_rank:
            self.max_tokens_per_rank = 1 << max(int(most_tokens) - 1, 1).bit_length()
            self.buffer = self.deep_ep.ElasticBuffer(
                self.group, num_max_tokens_per_rank=self.max_tokens_per_rank, hidden=x_TH.shape[1], num_topk=num_topk
            )
        return self.buffer

    def dispatch(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], Any]:
        buffer = self._buffer_for(x_TH, topk_idx_TK.shape[1])
        recv_x_RH, recv_topk_idx_RK, recv_topk_weights_RK, handle, _ = buffer.dispatch(
            x_TH,
            topk_idx=topk_idx_TK,
            topk_weights=topk_weights_TK,
            num_experts=self.num_experts,
            num_max_tokens_per_rank=self.max_tokens_per_rank,
        )
        return recv_x_RH, recv_topk_idx_RK, recv_topk_weights_RK, handle.num_recv_tokens_per_expert_list, handle

    def combine(
        self, x_RH: torch.Tensor, handle: Any, topk_weights_RK: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        combined_x_TH, combined_topk_weights_TK, _ = self.buffer.combine(x_RH, handle, topk_weights=topk_weights_RK)
        return combined_x_TH, combined_topk_weights_TK

    def dispatch_cached(self, x_TH: torch.Tensor, handle: Any) -> torch.Tensor:
        # num_experts is passed because the SM count is estimated from it before the handle is read.
        recv_x_RH, *_ = self.buffer.dispatch(x_TH, handle=handle, num_experts=handle.num_experts)
        return recv_x_RH


class _DeepEPDispatch(torch.autograd.Function):
    """Dispatch whose backward is a combine: a token sent to several ranks gets the sum of their gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x_TH: torch.Tensor, topk_weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor, backend: DeepEPBackend
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], Any]:
        recv_x_RH, recv_topk_idx_RK, recv_topk_weights_RK, tokens_per_local_expert, handle = backend.dispatch(
            x_TH, topk_idx_TK, topk_weights_TK
        )
        ctx.backend, ctx.handle = backend, handle
        ctx.mark_non_differentiable(recv_topk_idx_RK)
        return recv_x_RH, recv_topk_weights_RK, recv_topk_idx_RK, tokens_per_local_expert, handle

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_recv_x_RH: torch.Tensor, grad_recv_topk_weights_RK: torch.Tensor, *_: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
        grad_x_TH, grad_topk_weights_TK = ctx.backend.combine(
            grad_recv_x_RH.contiguous(), ctx.handle, grad_recv_topk_weights_RK.float().contiguous()
        )
        return grad_x_TH, grad_topk_weights_TK, None, None


class _DeepEPCombine(torch.autograd.Function):
    """Combine whose backward is a dispatch of the gradient along the same routes."""

    @staticmethod
    def forward(ctx: Any, x_RH: torch.Tensor, handle: Any, backend: DeepEPBackend) -> torch.Tensor:  # type: ignore[override]
        ctx.backend, ctx.handle = backend, handle
        combined_x_TH, _ = backend.combine(x_RH, handle, None)
        return combined_x_TH

    @staticmethod
    def backward(ctx: Any, grad_TH: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return ctx.backend.dispatch_cached(grad_TH.contiguous(), ctx.handle), None, None


@dataclass(frozen=True)
class DeepEPMeta(ExpertRows):
    handle: Any  # the backend's handle from dispatch, which combine follows back
    dtype: torch.dtype  # the caller's hidden-state dtype


class DeepEPDispatcher(TokenDispatcher[DeepEPMeta]):
    """DeepEP dispatch/combine (CUDA, >= 2 EP ranks), wrapped for autograd.

    DeepEP sends a token once to each rank holding any of its experts; the received tokens are expanded here
    into one row per local expert, and combine first reduces them back to one row per received token (in fp32).
    Hidden states travel as bf16, because DeepEP's combine kernels reduce bf16 only; weights travel as fp32.
    """

    name = "deepep"

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup, backend: DeepEPBackend) -> None:
        super().__init__(num_experts, ep_group)
        self.backend = backend

    def dispatch(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DeepEPMeta]:
        recv_x_RH, recv_topk_weights_RK, recv_topk_idx_RK, tokens_per_local_expert, handle = _DeepEPDispatch.apply(
            x_TH.to(torch.bfloat16).contiguous(),
            topk_weights_TK.float().contiguous(),
            topk_idx_TK.to(self.backend.topk_idx_dtype).contiguous(),
            self.backend,
        )
        token_N, row_of_RK, weight_N, tokens_per_expert_e = sort_by_expert(
            recv_topk_idx_RK, recv_topk_weights_RK, self.num_local_experts, sum(tokens_per_local_expert)
        )
        meta = DeepEPMeta(token_N, row_of_RK, weight_N, recv_x_RH.shape[0], handle, x_TH.dtype)
        # Cast before expanding, so that a token's gradients from its several local experts add up in x_TH's dtype.
        return permute_rows(recv_x_RH.to(x_TH.dtype), meta), tokens_per_expert_e, meta

    def combine(self, expert_y_NH: torch.Tensor, meta: DeepEPMeta) -> torch.Tensor:
        per_token_RH = sum_by_token(expert_y_NH, meta).to(torch.bfloat16)  # summed in fp32
        return _DeepEPCombine.apply(per_token_RH, meta.handle, self.backend).to(meta.dtype)


def deepep_dispatcher(num_experts: int, ep_group: dist.ProcessGroup | None) -> DeepEPDispatcher:
    """DeepEP over ep_group: ElasticBuffer where the installed DeepEP has it (2.x), else Buffer."""
    ep_size = ep_group.size() if ep_group is not None else 1
    if not torch.cuda.is_available():
        raise MoeloopError("the deepep dispatcher needs CUDA, and torch.cuda.is_available() is False")
    if ep_group is None or ep_size < 2:
        raise MoeloopError(f"the deepep dispatcher needs at least 2 EP ranks, and the EP group has {ep_size}")
    try:
        deep_ep = importlib.import_module("deep_ep")
    # Not installed, a library that does not load, DeepEP's NCCL version assertion, its JIT setup.
    except (ImportError, OSError, AssertionError, RuntimeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise MoeloopError(f"the deepep dispatcher cannot run: deep_ep does not import ({reason})") from None
    if "nccl" not in (backend := dist.get_backend(ep_group)):  # DeepEP works on CUDA tensors
        raise MoeloopError(f"the deepep dispatcher needs an NCCL EP group, and this one is {backend}")
    backend_class = ElasticBufferBackend if hasattr(deep_ep, "ElasticBuffer") else LegacyBufferBackend
    return DeepEPDispatcher(num_experts, ep_group, backend_class(deep_ep, ep_group, num_experts))
