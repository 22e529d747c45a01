"""Expert parallelism on CPU (gloo, processes spawned here): every rank holds its slice of the experts and a
different slice of the tokens, and the MoE block must give what one process gives on all tokens: outputs,
input gradients, expert, router and shared-expert gradients (fp32), and the gathered HF state dict; for every
family."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from moeloop.steps.model.deepep import DeepEPDispatcher
from moeloop.steps.model.dispatch import AllToAllDispatcher, make_dispatcher
from moeloop.steps.model.moe import MoeBlock, gather_over, hf_state_dict, replace_moe_blocks
from tests.processes import spawn_ranks
from tests.unit.test_moe import FAMILY_NAMES, NUM_EXPERTS, forward_backward, skewed_block, tiny_config

pytestmark = pytest.mark.slow

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@dataclass(frozen=True)
class Reference:
    """One process's block on all tokens: what every rank's share must reproduce."""

    family: str
    hf_block_state: dict[str, torch.Tensor]
    x_TH: torch.Tensor
    grad_TH: torch.Tensor
    out_TH: torch.Tensor
    grad_x_TH: torch.Tensor
    grads: dict[str, torch.Tensor]  # by parameter name (the router's, the experts', a shared expert's): all tokens


def reference(family: str = "qwen3_moe") -> Reference:
    hf_block, x_BSH = skewed_block(family=family)
    x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
    grad_TH = torch.randn(x_TH.shape, generator=torch.Generator().manual_seed(1))
    out_1TH, grad_x_1TH, grads = forward_backward(hf_block, x_TH[None], grad_TH[None])  # HF's block takes [B, S, H]
    return Reference(family, hf_block.state_dict(), x_TH, grad_TH, out_1TH[0], grad_x_1TH[0], grads)


def hf_block_of(ref: Reference) -> torch.nn.Module:
    hf_block, _ = skewed_block(family=ref.family)
    hf_block.load_state_dict(ref.hf_block_state)
    return hf_block


def assert_grads_close(
    grads: dict[str, torch.Tensor],
    ref: Reference,
    ep_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    assert_close: Callable[[torch.Tensor, torch.Tensor], None] = partial(torch.testing.assert_close, **TOLERANCE),
) -> None:
    """This rank's gradients, summed over the ranks as the trainer sums them, against one process's."""
    assert grads.keys() == ref.grads.keys()
    for name, grad in grads.items():
        if name.startswith("experts."):
            if dp_group is not None:
                dist.all_reduce(grad, group=dp_group)  # the DP replicas of an expert saw different tokens
            assert_close(gather_over(grad, ep_group), ref.grads[name])
        else:
            dist.all_reduce(grad)  # replicated on every rank: the router, a shared expert and its gate
            assert_close(grad, ref.grads[name])


def run_ranks(worker, world_size: int, tmp_path: Path, *args: object, backend: str = "gloo") -> None:
    """worker(rank, world_size, *args) in world_size processes; a failed assertion in any fails the test."""
    store = str(tmp_path / "store")
    spawn_ranks(_init_and_run, (world_size, store, backend, worker, args), world_size)


def _init_and_run(rank: int, world_size: int, store: str, backend: str, worker, args: tuple) -> None:
    torch.set_num_threads(1)  # several processes share 2 cores
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def check_block(rank: int, world_size: int, ref: Reference, dp_size: int, dispatcher_name: str) -> None:
    """This rank's tokens through its EP block; the DP groups' expert gradients are summed as DP would."""
    if dp_size == 1:
        ep_group, dp_group = dist.group.WORLD, None
    else:
        mesh = init_device_mesh("cpu", (dp_size, world_size // dp_size), mesh_dim_names=("dp", "ep"))
        ep_group, dp_group = mesh["ep"].get_group(), mesh["dp"].get_group()
    hf_block = hf_block_of(ref)
    dispatcher = make_dispatcher(dispatcher_name, NUM_EXPERTS, ep_group)
    assert isinstance(dispatcher, AllToAllDispatcher)  # auto: EP > 1 on a gloo group
    block = MoeBlock.from_hf_block(hf_block, dispatcher)
    assert block.experts.gate_up_proj.shape[0] == NUM_EXPERTS // ep_group.size()

    tokens = torch.arange(len(ref.x_TH)).tensor_split(world_size)[rank]
    out_TH, grad_x_TH, grads = forward_backward(block, ref.x_TH[tokens], ref.grad_TH[tokens])
    torch.testing.assert_close(out_TH, ref.out_TH[tokens], **TOLERANCE)
    torch.testing.assert_close(grad_x_TH, ref.grad_x_TH[tokens], **TOLERANCE)
    assert_grads_close(grads, ref, ep_group, dp_group)


def check_publish(rank: int, world_size: int, family: str) -> None:
    """A whole tiny model with its experts sharded: hf_state_dict() loads into HF and equals the original."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_config(family=family))
    model = copy.deepcopy(hf_model)
    replace_moe_blocks(model, make_dispatcher("all_to_all", NUM_EXPERTS, dist.group.WORLD))
    assert model.model.layers[-1].mlp.experts.down_proj.shape[0] == NUM_EXPERTS // world_size
    published = AutoModelForCausalLM.from_config(tiny_config(family=family))
    published.load_state_dict(hf_state_dict(model), strict=True)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(published.state_dict()[name], tensor), name


class GlooDeepEP:
    """DeepEP's dispatch/combine as its API documents them, done with gloo all-to-alls (fp32 sums, bf16 out).

    It lets DeepEPDispatcher's expansion and autograd wrappers run here; it checks that wrapping against the
    documented semantics, not DeepEP itself. A token goes once to each rank holding any of its experts, where
    the slots of other ranks' experts read expert -1 and weight 0; combine sums the rows back into their token.
    """

    topk_idx_dtype = torch.int64

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group, self.num_local_experts = group, num_experts // group.size()

    def _all_to_all(self, send_SX: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        recv_RX = send_SX.new_empty((sum(recv_splits), *send_SX.shape[1:]))
        dist.all_to_all_single(recv_RX, send_SX.contiguous(), recv_splits, send_splits, group=self.group)
        return recv_RX

    def dispatch(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], tuple]:
        rank_TK = topk_idx_TK // self.num_local_experts
        tokens_to = [torch.nonzero((rank_TK == rank).any(1)).flatten() for rank in range(self.group.size())]
        send_splits = [len(tokens) for tokens in tokens_to]
        recv_splits = self._all_to_all(torch.tensor(send_splits), [1] * len(send_splits), [1] * len(send_splits))
        routes = (torch.cat(tokens_to), send_splits, recv_splits.tolist(), x_TH.shape[0])
        here_SK = torch.cat([rank_TK[tokens] == rank for rank, tokens in enumerate(tokens_to)])
        local_idx_SK = torch.cat(
            [topk_idx_TK[tokens] - rank * self.num_local_experts for rank, tokens in enumerate(tokens_to)]
        )
        recv_idx_RK = self._all_to_all(local_idx_SK.where(here_SK, -1), *routes[1:3])
        recv_weights_RK = self._all_to_all(topk_weights_TK[routes[0]].where(here_SK, 0), *routes[1:3])
        tokens_per_local_expert = torch.bincount(recv_idx_RK[recv_idx_RK >= 0], minlength=self.num_local_experts)
        return (
            self.dispatch_cached(x_TH, routes),
            recv_idx_RK,
            recv_weights_RK,
            tokens_per_local_expert.tolist(),
            routes,
        )

    def combine(
        self, x_RH: torch.Tensor, routes: tuple, topk_weights_RK: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        token_S, send_splits, recv_splits, num_tokens = routes

        def sum_back(rows_RX: torch.Tensor) -> torch.Tensor:
            back_SX = self._all_to_all(rows_RX, recv_splits, send_splits).float()
            summed_TX = back_SX.new_zeros((num_tokens, *back_SX.shape[1:])).index_add(0, token_S, back_SX)
            return summed_TX.to(rows_RX.dtype)

        return sum_back(x_RH), None if topk_weights_RK is None else sum_back(topk_weights_RK)

    def dispatch_cached(self, x_TH: torch.Tensor, routes: tuple) -> torch.Tensor:
        token_S, send_splits, recv_splits, _ = routes
        return self._all_to_all(x_TH[token_S], send_splits, recv_splits)


def check_deepep_wrapping(rank: int, world_size: int, ref: Reference) -> None:
    """DeepEPDispatcher over GlooDeepEP: hidden states cross as bf16, so the tolerance is bf16's."""
    hf_block = hf_block_of(ref)
    group = dist.group.WORLD
    block = MoeBlock.from_hf_block(hf_block, DeepEPDispatcher(NUM_EXPERTS, group, GlooDeepEP(group, NUM_EXPERTS)))
    tokens = torch.arange(len(ref.x_TH)).tensor_split(world_size)[rank]
    out_TH, grad_x_TH, grads = forward_backward(block, ref.x_TH[tokens], ref.grad_TH[tokens])
    assert out_TH.dtype == torch.float32
    assert_bf16_close(out_TH, ref.out_TH[tokens])
    assert_bf16_close(grad_x_TH, ref.grad_x_TH[tokens])
    assert_grads_close(grads, ref, group, None, assert_close=assert_bf16_close)


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1% in norm: rounding to bf16 (8 bits of mantissa) is ~0.4% per element, and sums cancel."""
    error = float((actual - expected).norm() / expected.norm())
    assert error < 1e-2, f"relative error {error:.2e}"


def check_ep2(rank: int, world_size: int, ref: Reference) -> None:
    check_block(rank, world_size, ref, dp_size=1, dispatcher_name="all_to_all")
    check_publish(rank, world_size, ref.family)
    check_deepep_wrapping(rank, world_size, ref)


def check_ep4_and_dp2_ep2(rank: int, world_size: int, ref: Reference) -> None:
    check_block(rank, world_size, ref, dp_size=1, dispatcher_name="auto")
    check_block(rank, world_size, ref, dp_size=2, dispatcher_name="all_to_all")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_ep2_equals_one_process(tmp_path: Path, family: str) -> None:
    """2 processes: all_to_all, publishing, and the DeepEP wrapping over GlooDeepEP."""
    run_ranks(check_ep2, 2, tmp_path, reference(family))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_all_to_all_ep4_and_dp2_x_ep2_equal_one_process(tmp_path: Path, family: str) -> None:
    """4 processes (a spawn costs seconds): EP = 4, then a (dp, ep) = (2, 2) device mesh."""
    run_ranks(check_ep4_and_dp2_ep2, 4, tmp_path, reference(family))


def check_nccl_one_rank(rank: int, world_size: int, ref: Reference) -> None:
    """The all_to_all dispatcher's collectives on CUDA tensors over NCCL (one GPU: a group of one)."""
    torch.cuda.set_device(rank)
    dispatcher = make_dispatcher("all_to_all", NUM_EXPERTS, dist.group.WORLD)
    block = MoeBlock.from_hf_block(hf_block_of(ref).cuda(), dispatcher)
    out_TH, grad_x_TH, grads = forward_backward(block, ref.x_TH.cuda(), ref.grad_TH.cuda())
    torch.testing.assert_close(out_TH.cpu(), ref.out_TH, **TOLERANCE)
    torch.testing.assert_close(grad_x_TH.cpu(), ref.grad_x_TH, **TOLERANCE)
    for name, grad in ref.grads.items():
        torch.testing.assert_close(grads[name].cpu(), grad, **TOLERANCE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_all_to_all_over_nccl(tmp_path: Path) -> None:
    run_ranks(check_nccl_one_rank, 1, tmp_path, reference(), backend="nccl")
