"""steps.moe at EP = 1 (local dispatcher) against transformers' own Qwen3-MoE block and model, and the
dispatcher selection. fp32 on CPU; gradients are taken against a random upstream gradient unless a test says
otherwise."""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from steps import kernels
from steps.dispatch import LocalDispatcher, make_dispatcher
from steps.errors import MoeloopError
from steps.moe import GroupedExperts, MoeBlock, compile_decoder_layers, hf_state_dict, replace_moe_blocks

NUM_EXPERTS, TOP_K, HIDDEN = 8, 2, 32
UNUSED_EXPERTS = [6, 7]  # the skewed router never picks them


def tiny_config(norm_topk_prob: bool = True) -> Qwen3MoeConfig:
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
        router_aux_loss_coef=0.01,
    )
    config._experts_implementation = "eager"  # HF's per-expert loop, the reference
    return config


def skewed_block(norm_topk_prob: bool = True, seed: int = 0) -> tuple[Qwen3MoeSparseMoeBlock, torch.Tensor]:
    """An HF block and inputs x_BSH whose tokens never route to UNUSED_EXPERTS.

    The inputs share a common offset (norm 4), and the router rows of the unused experts point against it (norm
    2), so their logits sit near -8, far below the others, for every token.
    """
    generator = torch.Generator().manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(tiny_config(norm_topk_prob))
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
        offset_H = torch.randn(HIDDEN, generator=generator)
        offset_H *= 4 / offset_H.norm()
        block.gate.weight[UNUSED_EXPERTS] = -2 * offset_H / offset_H.norm()
    x_BSH = torch.randn(3, 40, HIDDEN, generator=generator) + offset_H
    return block, x_BSH


def forward_backward(
    block: torch.nn.Module, x_BSH: torch.Tensor, grad_BSH: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Output, input gradient and parameter gradients (by name) for upstream gradient grad_BSH (None: sum)."""
    x_BSH = x_BSH.clone().requires_grad_(True)
    out_BSH = block(x_BSH)
    if grad_BSH is None:
        out_BSH.sum().backward()
    else:
        out_BSH.backward(grad_BSH)
    return out_BSH.detach(), x_BSH.grad, {name: p.grad for name, p in block.named_parameters()}


def assert_same(
    ours: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    reference: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    **tolerance: float,
) -> None:
    """Outputs and gradients equal within tolerance (torch's defaults for the dtype: fp32 rtol 1.3e-6, atol 1e-5)."""
    torch.testing.assert_close(ours[0], reference[0], **tolerance)
    torch.testing.assert_close(ours[1], reference[1], **tolerance)
    assert ours[2].keys() == reference[2].keys()
    for name, grad in reference[2].items():
        torch.testing.assert_close(ours[2][name], grad, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_block_equals_hf_with_empty_experts(impl: str, norm_topk_prob: bool) -> None:
    hf_block, x_BSH = skewed_block(norm_topk_prob)
    tokens_per_expert_E = torch.bincount(hf_block.gate(x_BSH)[2].flatten(), minlength=NUM_EXPERTS)
    assert tokens_per_expert_E[UNUSED_EXPERTS].tolist() == [0, 0] and tokens_per_expert_E.sum() == 3 * 40 * TOP_K
    block = MoeBlock.from_hf_block(copy.deepcopy(hf_block), LocalDispatcher(NUM_EXPERTS, None), impl)
    grad_BSH = torch.randn(x_BSH.shape, generator=torch.Generator().manual_seed(1))

    ours = forward_backward(block, x_BSH, grad_BSH)
    assert_same(ours, forward_backward(hf_block, x_BSH, grad_BSH))
    assert ours[2]["experts.gate_up_proj"][UNUSED_EXPERTS].abs().max() == 0
    assert ours[2]["experts.down_proj"][UNUSED_EXPERTS].abs().max() == 0


def test_grouped_mm_and_loop_agree_in_bf16() -> None:
    hf_block, x_BSH = skewed_block()
    hf_block, x_BSH = hf_block.to(torch.bfloat16), x_BSH.to(torch.bfloat16)
    grad_BSH = torch.randn(x_BSH.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grouped, loop = (
        forward_backward(
            MoeBlock.from_hf_block(copy.deepcopy(hf_block), LocalDispatcher(NUM_EXPERTS, None), impl), x_BSH, grad_BSH
        )
        for impl in ("grouped_mm", "loop")
    )
    assert grouped[0].dtype == torch.bfloat16
    assert_same(grouped, loop, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_block_equals_hf_on_cuda(dtype: torch.dtype) -> None:
    hf_block, x_BSH = skewed_block()
    hf_block, x_BSH = hf_block.to("cuda", dtype), x_BSH.to("cuda", dtype)
    grad_BSH = torch.randn(x_BSH.shape, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    block = MoeBlock.from_hf_block(copy.deepcopy(hf_block), LocalDispatcher(NUM_EXPERTS, None), "grouped_mm")
    # bf16: the compiled SwiGLU rounds once where the eager one rounds after each multiply
    tolerance = {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {}
    assert_same(forward_backward(block, x_BSH, grad_BSH), forward_backward(hf_block, x_BSH, grad_BSH), **tolerance)


def test_broadcast_upstream_gradient() -> None:
    """out.sum().backward() feeds a broadcast gradient, on which CPU grouped_mm's own backward fails."""
    hf_block, x_BSH = skewed_block()
    assert_same(
        forward_backward(
            MoeBlock.from_hf_block(copy.deepcopy(hf_block), LocalDispatcher(NUM_EXPERTS, None)), x_BSH, None
        ),
        forward_backward(hf_block, x_BSH, None),
    )


def test_model_with_swapped_blocks_equals_hf() -> None:
    """Logits, router logits, aux loss, loss and every gradient of a tiny Qwen3MoeForCausalLM.

    HF hooks the routers the first time router logits are asked for; here that happens before the swap, so the
    swapped blocks must keep the hooked router modules.
    """
    torch.manual_seed(0)
    hf_model = Qwen3MoeForCausalLM(tiny_config())
    model = copy.deepcopy(hf_model)
    input_ids_BT = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert len(model(input_ids=input_ids_BT, output_router_logits=True).router_logits) == 2
    assert replace_moe_blocks(model, make_dispatcher("local", NUM_EXPERTS)) == 2
    assert all(isinstance(layer.mlp, MoeBlock) for layer in model.model.layers)
    assert dict(model.named_parameters()).keys() == dict(hf_model.named_parameters()).keys()

    attention_mask_BT = torch.ones_like(input_ids_BT)
    attention_mask_BT[1, 9:] = 0  # padding is left out of the aux loss
    outputs = []
    for candidate in (model, hf_model):
        output = candidate(
            input_ids=input_ids_BT, attention_mask=attention_mask_BT, labels=input_ids_BT, output_router_logits=True
        )
        output.loss.backward()
        outputs.append(output)
    ours, reference = outputs
    assert reference.aux_loss is not None and len(reference.router_logits) == 2
    torch.testing.assert_close(ours.logits, reference.logits)
    for layer_logits, reference_logits in zip(ours.router_logits, reference.router_logits, strict=True):
        torch.testing.assert_close(layer_logits, reference_logits)
    torch.testing.assert_close(ours.aux_loss, reference.aux_loss)
    torch.testing.assert_close(ours.loss, reference.loss)
    reference_parameters = dict(hf_model.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, reference_parameters[name].grad, msg=name)


def test_expert_slices_and_hf_state_dict() -> None:
    """EP rank r of 4 holds experts [2r, 2r + 2) as copies; at EP = 1 the state dict loads into HF as it was."""
    hf_block, _ = skewed_block()
    rank1_of_4 = GroupedExperts.from_hf(hf_block.experts, ep_rank=1, ep_size=4)
    assert torch.equal(rank1_of_4.gate_up_proj, hf_block.experts.gate_up_proj[2:4])
    assert torch.equal(rank1_of_4.down_proj, hf_block.experts.down_proj[2:4])
    assert rank1_of_4.gate_up_proj.data_ptr() != hf_block.experts.gate_up_proj.data_ptr()

    torch.manual_seed(0)
    hf_model = Qwen3MoeForCausalLM(tiny_config())
    model = copy.deepcopy(hf_model)
    replace_moe_blocks(model, make_dispatcher("local", NUM_EXPERTS))
    published = Qwen3MoeForCausalLM(tiny_config())
    published.load_state_dict(hf_state_dict(model), strict=True)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(published.state_dict()[name], tensor), name


def test_auto_picks_local_at_ep1(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="steps.dispatch"):
        dispatcher = make_dispatcher("auto", NUM_EXPERTS)
    assert isinstance(dispatcher, LocalDispatcher)
    assert [record.getMessage() for record in caplog.records] == ["MoE dispatcher: local (EP 1; EP = 1)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_deepep_on_cpu_is_a_one_line_error() -> None:
    with pytest.raises(MoeloopError) as error:
        make_dispatcher("deepep", NUM_EXPERTS)
    assert str(error.value) == "the deepep dispatcher needs CUDA, and torch.cuda.is_available() is False"


def two_rank_group() -> SimpleNamespace:
    """Stands in for a 2-rank process group where only its size and rank are read."""
    return SimpleNamespace(size=lambda: 2, rank=lambda: 0)


@pytest.mark.parametrize(
    ("name", "group", "cuda", "message"),
    [
        ("deepep", None, True, "the deepep dispatcher needs at least 2 EP ranks, and the EP group has 1"),
        pytest.param(
            "deepep",
            two_rank_group(),
            True,
            "the deepep dispatcher cannot run: deep_ep does not import (No module named 'deep_ep')",
            marks=pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="deep_ep is installed"),
        ),
        ("local", two_rank_group(), False, "the local dispatcher is for EP = 1, and the EP group has 2 ranks"),
        ("all_to_all", None, False, "the all_to_all dispatcher needs an EP process group"),
        ("nccl", None, False, "unknown MoE dispatcher 'nccl'; choose one of auto, local, all_to_all, deepep"),
    ],
)
def test_unusable_dispatcher_is_a_one_line_error(
    name: str, group: SimpleNamespace | None, cuda: bool, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(MoeloopError) as error:
        make_dispatcher(name, NUM_EXPERTS, group)  # type: ignore[arg-type]
    assert str(error.value) == message


def test_experts_must_split_evenly() -> None:
    with pytest.raises(MoeloopError, match="^7 experts do not split evenly over 2 EP ranks$"):
        make_dispatcher("all_to_all", 7, two_rank_group())  # type: ignore[arg-type]


def gather_sum_case(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows_NH, row_of_TK with some slots dropped (index N: a zero row), and the float64 sums they must give.

    H = 1100 spans two 1024-column tiles of the Triton kernel, the second one partial.
    """
    generator = torch.Generator().manual_seed(3)
    num_tokens, top_k, hidden = 37, 4, 1100
    row_of_TK = torch.randperm(num_tokens * top_k, generator=generator).view(num_tokens, top_k)
    num_rows = num_tokens * top_k - 20
    row_of_TK = row_of_TK.clamp(max=num_rows)  # the 20 highest slots are dropped on this rank
    rows_NH = torch.randn(num_rows, hidden, generator=generator).to(dtype)
    padded_NH = torch.cat([rows_NH.double(), torch.zeros(1, hidden, dtype=torch.float64)])
    expected_TH = padded_NH[row_of_TK].sum(1)
    return rows_NH.to(device), row_of_TK.to(device), expected_TH


INTERPRET_GATHER_SUM = """
import sys, torch
from steps.kernels import gather_sum_triton
rows_NH, row_of_TK = torch.load(sys.argv[1])
torch.save(gather_sum_triton(rows_NH, row_of_TK), sys.argv[2])
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sum_torch_and_triton_interpreted_equal_float64(dtype: torch.dtype, tmp_path: Path) -> None:
    """The CPU path, and the CUDA path's Triton kernel run by Triton's interpreter on CPU tensors, against float64.

    Both accumulate in fp32 and round once to the rows' dtype (in different orders, so bf16 results may differ
    from each other by one unit in the last place). The interpreter runs in a fresh process, since
    TRITON_INTERPRET must be set before triton is first imported.
    """
    pytest.importorskip("triton")
    rows_NH, row_of_TK, expected_TH = gather_sum_case(dtype)
    tolerance = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(kernels.gather_sum(rows_NH, row_of_TK).double(), expected_TH, **tolerance)
    torch.save((rows_NH, row_of_TK), tmp_path / "in.pt")
    subprocess.run(
        [sys.executable, "-c", INTERPRET_GATHER_SUM, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        check=True,
    )
    interpreted_TH = torch.load(tmp_path / "out.pt")
    assert interpreted_TH.dtype == dtype
    torch.testing.assert_close(interpreted_TH.double(), expected_TH, **tolerance)


def test_swiglu_equals_float64() -> None:
    generator = torch.Generator().manual_seed(4)
    gate_up_N2I = torch.randn(50, 2 * 16, generator=generator, requires_grad=True)
    weight_N = torch.rand(50, generator=generator, requires_grad=True)
    out_NI = kernels.swiglu(gate_up_N2I, weight_N)
    out_NI.backward(grad_NI := torch.randn(out_NI.shape, generator=generator))
    gate_up_64 = gate_up_N2I.detach().double().requires_grad_(True)
    weight_64 = weight_N.detach().double().requires_grad_(True)
    expected_NI = torch.sigmoid(gate_up_64[:, :16]) * gate_up_64[:, :16] * gate_up_64[:, 16:] * weight_64[:, None]
    expected_NI.backward(grad_NI.double())
    torch.testing.assert_close(out_NI, expected_NI.detach().float())  # fp32's tolerances
    torch.testing.assert_close(gate_up_N2I.grad, gate_up_64.grad.float())
    torch.testing.assert_close(weight_N.grad, weight_64.grad.float())


def test_compile_decoder_layers_leaves_cpu_models_alone() -> None:
    model = Qwen3MoeForCausalLM(tiny_config())
    replace_moe_blocks(model, make_dispatcher("local", NUM_EXPERTS))
    assert compile_decoder_layers(model) == 0
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_equal_torch_on_cuda(dtype: torch.dtype) -> None:
    """Triton gather-sum and compiled SwiGLU (forward and backward) against the eager torch versions."""
    rows_NH, row_of_TK, expected_TH = gather_sum_case(dtype, "cuda")
    tolerance = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    fused_TH = kernels.gather_sum(rows_NH, row_of_TK)
    torch.testing.assert_close(fused_TH.double().cpu(), expected_TH, **tolerance)
    torch.testing.assert_close(kernels.gather_sum_torch(rows_NH, row_of_TK).double().cpu(), expected_TH, **tolerance)

    generator = torch.Generator().manual_seed(4)
    for rows in (300, 301):  # two row counts: the compiled function is compiled for any (dim 0 dynamic)
        gate_up_N2I = torch.randn(rows, 2 * 96, generator=generator).to("cuda", dtype)
        weight_N = torch.rand(rows, generator=generator).to("cuda", dtype)
        grad_NI = torch.randn(rows, 96, generator=generator).to("cuda", dtype)
        results = []
        for fn in (kernels.swiglu, kernels.swiglu_eager):
            inputs = gate_up_N2I.clone().requires_grad_(True), weight_N.clone().requires_grad_(True)
            out_NI = fn(*inputs)
            out_NI.backward(grad_NI)
            results.append((out_NI.detach(), inputs[0].grad, inputs[1].grad))
        for fused, eager in zip(*results, strict=True):
            if dtype == torch.float32:
                torch.testing.assert_close(fused, eager)
            else:  # the compiled SwiGLU rounds to bf16 once, the eager one after every operation
                error = float((fused.float() - eager.float()).norm() / eager.float().norm())
                assert error < 1e-2, f"relative error {error:.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_decoder_layers_equal_eager_on_cuda() -> None:
    """compile_decoder_layers keeps logits, router logits, loss and every gradient (fp32), also when the batch shape
    changes; the MoE blocks stay eager, so HF's router-logit hooks keep recording."""
    torch.manual_seed(0)
    eager = Qwen3MoeForCausalLM(tiny_config()).cuda()
    replace_moe_blocks(eager, make_dispatcher("local", NUM_EXPERTS))
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled) == 2
    for batch, length in ((4, 12), (3, 17)):
        input_ids_BT = torch.randint(0, 64, (batch, length), device="cuda")
        outputs = []
        for model in (compiled, eager):
            model.zero_grad(set_to_none=True)
            output = model(input_ids=input_ids_BT, labels=input_ids_BT, output_router_logits=True)
            (output.loss + output.aux_loss).backward()
            outputs.append((output.logits, {name: p.grad for name, p in model.named_parameters()}, output))
        torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=1e-4, atol=1e-4)
        assert len(outputs[0][2].router_logits) == 2
        for ours, reference in zip(outputs[0][2].router_logits, outputs[1][2].router_logits, strict=True):
            torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outputs[0][2].aux_loss, outputs[1][2].aux_loss, rtol=1e-4, atol=1e-4)
        for name, grad in outputs[1][1].items():
            torch.testing.assert_close(
                outputs[0][1][name], grad, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
