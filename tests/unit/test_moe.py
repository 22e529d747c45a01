"""moeloop.steps.model.moe at EP = 1 (local dispatcher) against transformers' own blocks and models of every family
(Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral, DeepSeek-V3 with its group-limited sigmoid routing, shared
expert and first dense layer), and the dispatcher selection. fp32 on CPU; gradients
are taken against a random upstream gradient unless a test says otherwise."""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import logging
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model import kernels
from moeloop.steps.model.dispatch import LocalDispatcher, make_dispatcher, sort_by_expert
from moeloop.steps.model.families import FAMILIES, family_of_block, family_of_config
from moeloop.steps.model.moe import GroupedExperts, MoeBlock, compile_decoder_layers, hf_state_dict, replace_moe_blocks
from tests.processes import run_command

NUM_EXPERTS, TOP_K, HIDDEN = 8, 2, 32
UNUSED_EXPERTS = [6, 7]  # the skewed router never picks them


FAMILY_NAMES = [family.model_type for family in FAMILIES]


def tiny_config(norm_topk_prob: bool = True, family: str = "qwen3_moe") -> PretrainedConfig:
    """A tiny HF config of the family (Mixtral always renormalises its top k: norm_topk_prob is Qwen's)."""
    shape: dict[str, Any] = {
        "vocab_size": 64, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts_per_tok": TOP_K, "router_aux_loss_coef": 0.01,
    }  # fmt: skip
    if family == "deepseek_v3":  # 3 layers, the first dense: 2 MoE layers as the others have; MLA (kv heads = heads)
        del shape["router_aux_loss_coef"]  # none: DeepSeek-V3 balances its load with the correction bias
        config = DeepseekV3Config(
            **{**shape, "num_hidden_layers": 3, "num_key_value_heads": 4}, intermediate_size=64,
            moe_intermediate_size=16, n_routed_experts=NUM_EXPERTS, n_shared_experts=1, n_group=2, topk_group=1,
            first_k_dense_replace=1, norm_topk_prob=norm_topk_prob, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        )  # fmt: skip
    elif family == "gpt_oss":  # biased router and experts, attention sinks; layers alternate a window of 4 and full
        config = GptOssConfig(
            **shape, intermediate_size=16, num_local_experts=NUM_EXPERTS, head_dim=8, sliding_window=4
        )
    elif family == "mixtral":
        config = MixtralConfig(**shape, intermediate_size=16, num_local_experts=NUM_EXPERTS, head_dim=8)
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(
            **shape, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts=NUM_EXPERTS, norm_topk_prob=norm_topk_prob,
        )  # fmt: skip
    else:
        config = Qwen3MoeConfig(
            **shape, intermediate_size=64, moe_intermediate_size=16, head_dim=8, num_experts=NUM_EXPERTS,
            norm_topk_prob=norm_topk_prob,
        )  # fmt: skip
    config._experts_implementation = "eager"  # HF's per-expert loop, the reference
    return config


def skewed_block(
    norm_topk_prob: bool = True, seed: int = 0, family: str = "qwen3_moe"
) -> tuple[torch.nn.Module, torch.Tensor]:
    """An HF sparse block of the family and inputs x_BSH whose tokens never route to UNUSED_EXPERTS.

    The inputs share a common offset (norm 4), and the router rows of the unused experts point against it (norm
    2), so their logits sit near -8, far below the others, for every token. A DeepSeek-V3 router gets a random
    correction bias (HF's is zeros), which changes the choice of experts but not their weights.
    """
    generator = torch.Generator().manual_seed(seed)
    config = tiny_config(norm_topk_prob, family)
    block = family_of_config(config).sparse_block(config)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
        offset_H = torch.randn(HIDDEN, generator=generator)
        offset_H *= 4 / offset_H.norm()
        router_of(block).weight[UNUSED_EXPERTS] = -2 * offset_H / offset_H.norm()
        if family == "deepseek_v3":
            block.gate.e_score_correction_bias.copy_(0.1 * torch.randn(NUM_EXPERTS, generator=generator))
    x_BSH = torch.randn(3, 40, HIDDEN, generator=generator) + offset_H
    return block, x_BSH


def router_of(block: torch.nn.Module) -> torch.nn.Module:
    """The router of an HF sparse block of any family (GPT-OSS calls it `router`, the others `gate`)."""
    return getattr(block, family_of_block(block).router_attribute)


def forward_backward(
    block: torch.nn.Module, x_BSH: torch.Tensor, grad_BSH: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Output, input gradient and parameter gradients (by name) for upstream gradient grad_BSH (None: sum)."""
    x_BSH = x_BSH.clone().requires_grad_(True)
    out_BSH = block(x_BSH)
    if isinstance(out_BSH, tuple):  # GPT-OSS's block returns its routing weights beside its output
        out_BSH = out_BSH[0]
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


@pytest.mark.parametrize(
    ("family", "norm_topk_prob"),
    [
        ("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", True), ("qwen2_moe", False), ("mixtral", True),
        ("deepseek_v3", True), ("deepseek_v3", False), ("gpt_oss", True),
    ],  # fmt: skip
)
@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_block_equals_hf_with_empty_experts(impl: str, family: str, norm_topk_prob: bool) -> None:
    """Forward and backward (input and every parameter gradient: router, experts, a shared expert and its gate)."""
    hf_block, x_BSH = skewed_block(norm_topk_prob, family=family)
    experts_TK = router_of(hf_block)(x_BSH.reshape(-1, HIDDEN))[2]
    tokens_per_expert_E = torch.bincount(experts_TK.flatten(), minlength=NUM_EXPERTS)
    assert tokens_per_expert_E[UNUSED_EXPERTS].tolist() == [0, 0] and tokens_per_expert_E.sum() == 3 * 40 * TOP_K
    block = MoeBlock.from_hf_block(copy.deepcopy(hf_block), LocalDispatcher(NUM_EXPERTS, None), impl)
    grad_BSH = torch.randn(x_BSH.shape, generator=torch.Generator().manual_seed(1))

    ours = forward_backward(block, x_BSH, grad_BSH)
    assert_same(ours, forward_backward(hf_block, x_BSH, grad_BSH))
    assert ours[2]["experts.gate_up_proj"][UNUSED_EXPERTS].abs().max() == 0
    assert ours[2]["experts.down_proj"][UNUSED_EXPERTS].abs().max() == 0
    if family == "gpt_oss":  # the experts' biases, indexed by each row's expert
        assert ours[2]["experts.down_proj_bias"][UNUSED_EXPERTS].abs().max() == 0
        assert ours[2]["experts.down_proj_bias"].abs().min(1).values[:6].min() > 0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_weights_of_its_own_choice_are_the_routers_weights(family: str) -> None:
    """Routing replay's weights (`weights_of`) of the experts the router chose are the weights it gave them, to the
    bit (DeepSeek-V3: with a correction bias that chooses but does not weigh, and its routed scaling factor)."""
    hf_block, x_BSH = skewed_block(family=family)
    gate = MoeBlock.from_hf_block(hf_block, LocalDispatcher(NUM_EXPERTS, None)).top_k_router
    with torch.no_grad():
        router_logits_TE, weights_TK, experts_TK = gate(x_BSH.reshape(-1, HIDDEN))
        replayed_TK = gate.weights_of(router_logits_TE, experts_TK)
    assert torch.equal(replayed_TK.to(weights_TK.dtype), weights_TK)
    if family == "deepseek_v3":  # groups and bias change some choices from the top k; the weights are unbiased
        scores_TE = router_logits_TE.sigmoid()
        assert not torch.equal(experts_TK.sort(1).values, scores_TE.topk(TOP_K).indices.sort(1).values)
        chosen_TK = scores_TE.gather(1, experts_TK)
        expected_TK = chosen_TK / (chosen_TK.sum(1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
        assert torch.equal(weights_TK, expected_TK) and gate.routed_scaling_factor == 2.5


def test_a_block_of_no_family_and_mixtral_jitter_are_refused() -> None:
    with pytest.raises(MoeloopError, match="^Linear is no sparse MoE block of a known family$"):
        MoeBlock.from_hf_block(torch.nn.Linear(2, 2), LocalDispatcher(NUM_EXPERTS, None))
    config = tiny_config(family="mixtral")
    config.router_jitter_noise = 0.1  # HF multiplies the block's input by noise in training
    jittery = family_of_config(config).sparse_block(config)
    with pytest.raises(MoeloopError, match="^router_jitter_noise 0.1 is not supported; set it to 0$"):
        MoeBlock.from_hf_block(jittery, LocalDispatcher(NUM_EXPERTS, None))


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


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_local_block_compiles_into_one_graph(family: str) -> None:
    """With the local dispatcher, torch.compile takes the whole block (a shared expert too) as one graph
    (fullgraph: no host sync, no graph break), and that graph computes what eager does to the last bit (aot_eager
    runs the traced ops as they are; bf16, since grouped_mm's meta function accepts only bf16)."""
    hf_block, x_BSH = skewed_block(family=family)
    hf_block, x_BSH = hf_block.to(torch.bfloat16), x_BSH.to(torch.bfloat16)
    grad_BSH = torch.randn(x_BSH.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    block = MoeBlock.from_hf_block(hf_block, LocalDispatcher(NUM_EXPERTS, None), "grouped_mm")
    compiled = copy.deepcopy(block)
    compiled.compile(fullgraph=True, backend="aot_eager")
    assert_same(forward_backward(compiled, x_BSH, grad_BSH), forward_backward(block, x_BSH, grad_BSH), rtol=0, atol=0)


def test_block_with_untraceable_dispatcher_stays_out_of_compile() -> None:
    """A dispatcher that syncs with the host or calls collectives (traceable False) keeps the block eager inside a
    compiled caller: no captured graph holds the block's grouped GEMMs, and the result is eager's."""

    class HostSyncingDispatcher(LocalDispatcher):
        traceable = False

    hf_block, x_BSH = skewed_block()
    hf_block, x_BSH = hf_block.to(torch.bfloat16), x_BSH.to(torch.bfloat16)
    block = MoeBlock.from_hf_block(hf_block, HostSyncingDispatcher(NUM_EXPERTS, None), "grouped_mm")
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        graphs.append(graph)
        return graph

    torch._dynamo.reset()
    caller = torch.compile(lambda x: 2 * block(x + 1), backend=recording_backend)
    torch.testing.assert_close(caller(x_BSH), 2 * block(x_BSH + 1), rtol=0, atol=0)
    assert graphs, "the caller's own ops were captured"
    assert not any("grouped_mm" in str(graph.graph) for graph in graphs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_block_equals_hf_on_cuda(dtype: torch.dtype) -> None:
    hf_block, x_BSH = skewed_block()
    hf_block, x_BSH = hf_block.to("cuda", dtype), x_BSH.to("cuda", dtype)
    grad_BSH = torch.randn(x_BSH.shape, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    block = MoeBlock.from_hf_block(copy.deepcopy(hf_block), LocalDispatcher(NUM_EXPERTS, None), "grouped_mm")
    # bf16: the Triton SwiGLU rounds once where the eager one rounds after each multiply
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


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_model_with_swapped_blocks_equals_hf(family: str) -> None:
    """Logits, router logits, aux loss (DeepSeek-V3's HF model has none), loss and every gradient of a tiny causal LM
    of the family; DeepSeek-V3's dense first layer stays HF's MLP.

    HF hooks the routers the first time router logits are asked for; here that happens before the swap, so the
    swapped blocks must keep the hooked router modules.
    """
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_config(family=family))
    model = copy.deepcopy(hf_model)
    input_ids_BT = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert len(model(input_ids=input_ids_BT, output_router_logits=True).router_logits) == 2
    assert replace_moe_blocks(model, make_dispatcher("local", NUM_EXPERTS)) == 2
    dense = model.config.first_k_dense_replace if family == "deepseek_v3" else 0
    assert [isinstance(layer.mlp, MoeBlock) for layer in model.model.layers] == [False] * dense + [True] * 2
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
    assert (reference.aux_loss is None) == (family == "deepseek_v3") and len(reference.router_logits) == 2
    torch.testing.assert_close(ours.logits, reference.logits)
    for layer_logits, reference_logits in zip(ours.router_logits, reference.router_logits, strict=True):
        torch.testing.assert_close(layer_logits, reference_logits)
    if reference.aux_loss is not None:
        torch.testing.assert_close(ours.aux_loss, reference.aux_loss)
    torch.testing.assert_close(ours.loss, reference.loss)
    reference_parameters = dict(hf_model.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, reference_parameters[name].grad, msg=name)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_expert_slices_and_hf_state_dict(family: str) -> None:
    """EP rank r of 4 holds experts [2r, 2r + 2) as copies; at EP = 1 the state dict loads into HF as it was."""
    hf_block, _ = skewed_block(family=family)
    rank1_of_4 = GroupedExperts.from_hf(hf_block.experts, family_of_block(hf_block), ep_rank=1, ep_size=4)
    for name, tensor in hf_block.experts.named_parameters():  # GPT-OSS's biases too
        assert torch.equal(getattr(rank1_of_4, name), tensor[2:4]), name
    assert rank1_of_4.gate_up_proj.data_ptr() != hf_block.experts.gate_up_proj.data_ptr()

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_config(family=family))
    model = copy.deepcopy(hf_model)
    replace_moe_blocks(model, make_dispatcher("local", NUM_EXPERTS))
    published = AutoModelForCausalLM.from_config(tiny_config(family=family))
    published.load_state_dict(hf_state_dict(model), strict=True)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(published.state_dict()[name], tensor), name


def test_auto_picks_local_at_ep1(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="moeloop.steps.model.dispatch"):
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


@pytest.mark.parametrize("num_experts", [8, 255, 256, 300])  # uint8 keys up to 255 (the drop key), then int16
def test_sort_by_expert_with_narrow_keys(num_experts: int) -> None:
    """Rows sorted by expert, stably, with dropped slots (-1) last, whichever key dtype the sort uses."""
    generator = torch.Generator().manual_seed(5)
    num_tokens, top_k = 50, 4
    topk_idx_TK = torch.randint(-1, num_experts, (num_tokens, top_k), generator=generator)
    topk_idx_TK[0] = torch.tensor([num_experts - 1, 0, -1, num_experts - 1])  # the largest key is sorted too
    weights_TK = torch.rand(num_tokens, top_k, generator=generator)
    kept = int((topk_idx_TK >= 0).sum())
    token_N, row_of_TK, weight_N, tokens_per_expert_E = sort_by_expert(topk_idx_TK, weights_TK, num_experts, kept)

    slots = sorted((int(e), s) for s, e in enumerate(topk_idx_TK.flatten().tolist()) if e >= 0)  # stable by slot
    assert token_N.tolist() == [s // top_k for _, s in slots]
    assert torch.equal(weight_N, weights_TK.flatten()[[s for _, s in slots]])
    assert torch.equal(tokens_per_expert_E, torch.bincount(topk_idx_TK[topk_idx_TK >= 0], minlength=num_experts))
    expected_row_of_S = torch.full((num_tokens * top_k,), kept)
    expected_row_of_S[[s for _, s in slots]] = torch.arange(kept)
    assert torch.equal(row_of_TK.flatten(), expected_row_of_S)


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


def interpreted(script: str, inputs: tuple[Any, ...], tmp_path: Path) -> Any:
    """What script saves to argv[2] from the inputs it loads from argv[1], run under Triton's interpreter (on CPU
    tensors) in a fresh process, since TRITON_INTERPRET must be set before triton is first imported."""
    torch.save(inputs, tmp_path / "in.pt")
    run_command(
        [sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env={"TRITON_INTERPRET": "1"},
        check=True,
    )
    return torch.load(tmp_path / "out.pt")


INTERPRET_GATHER_SUM = """
import sys, torch
from moeloop.steps.model.kernels import gather_sum_triton
rows_NH, row_of_TK = torch.load(sys.argv[1])
torch.save(gather_sum_triton(rows_NH, row_of_TK), sys.argv[2])
torch.library.opcheck(gather_sum_triton, (rows_NH, row_of_TK))  # its fake (for torch.compile) agrees with it
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sum_torch_and_triton_interpreted_equal_float64(dtype: torch.dtype, tmp_path: Path) -> None:
    """The CPU path, and the CUDA path's Triton kernel run by Triton's interpreter on CPU tensors, against float64.

    Both accumulate in fp32 and round once to the rows' dtype (in different orders, so bf16 results may differ
    from each other by one unit in the last place). In the interpreter's process `torch.library.opcheck` also
    checks the kernel's custom-op registration (schema, and the fake tensor torch.compile traces with).
    """
    pytest.importorskip("triton")
    rows_NH, row_of_TK, expected_TH = gather_sum_case(dtype)
    tolerance = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(kernels.gather_sum(rows_NH, row_of_TK).double(), expected_TH, **tolerance)
    interpreted_TH = interpreted(INTERPRET_GATHER_SUM, (rows_NH, row_of_TK), tmp_path)
    assert interpreted_TH.dtype == dtype
    torch.testing.assert_close(interpreted_TH.double(), expected_TH, **tolerance)


INTERPRET_EXPAND_ROWS = """
import sys, torch
from moeloop.steps.model.kernels import expand_rows_triton
x_TH, row_of_TK, num_rows = torch.load(sys.argv[1])
torch.save(expand_rows_triton(x_TH, row_of_TK, num_rows), sys.argv[2])
torch.library.opcheck(expand_rows_triton, (x_TH, row_of_TK, num_rows))
"""


def expand_rows_case(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_TH, token_N and its inverse row_of_TK, from gather_sum_case's rows (20 slots dropped, H = 1100)."""
    rows_NH, row_of_TK, _ = gather_sum_case(dtype)
    x_TH = torch.randn(row_of_TK.shape[0], rows_NH.shape[1], generator=torch.Generator().manual_seed(8)).to(dtype)
    token_N = torch.empty(rows_NH.shape[0], dtype=torch.int64)
    kept_TK = row_of_TK < rows_NH.shape[0]
    token_N[row_of_TK[kept_TK]] = torch.arange(row_of_TK.shape[0]).unsqueeze(1).expand_as(row_of_TK)[kept_TK]
    return x_TH.to(device), token_N.to(device), row_of_TK.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_rows_triton_interpreted_equals_index_select(dtype: torch.dtype, tmp_path: Path) -> None:
    """The CUDA path's expand-rows kernel (each token written to its K rows, dropped slots skipped), run by
    Triton's interpreter on CPU tensors, copies exactly what `index_select` gathers; opcheck checks its custom-op
    registration."""
    pytest.importorskip("triton")
    x_TH, token_N, row_of_TK = expand_rows_case(dtype)
    expanded_NH = interpreted(INTERPRET_EXPAND_ROWS, (x_TH, row_of_TK, token_N.shape[0]), tmp_path)
    assert torch.equal(expanded_NH, x_TH.index_select(0, token_N))


INTERPRET_SOFTMAX_TOPK = """
import sys, torch
from moeloop.steps.model.kernels import softmax_topk_triton
logits_TE, top_k, normalize, grad_TK = torch.load(sys.argv[1])
logits_TE.requires_grad_(True)
weights_TK, experts_TK = softmax_topk_triton(logits_TE, top_k, normalize)
weights_TK.backward(grad_TK)
torch.save((weights_TK.detach(), experts_TK, logits_TE.grad), sys.argv[2])
torch.library.opcheck(softmax_topk_triton, (logits_TE.detach().requires_grad_(True), top_k, normalize))
"""


@pytest.mark.parametrize(
    ("experts", "top_k", "normalize", "dtype"),
    [(128, 8, True, torch.bfloat16), (12, 3, False, torch.float32), (7, 2, True, torch.float32)],
)
def test_softmax_topk_triton_interpreted_equals_float64(
    experts: int, top_k: int, normalize: bool, dtype: torch.dtype, tmp_path: Path
) -> None:
    """The router's Triton kernels (softmax, top-k, renormalisation; the logits' gradient), run by Triton's
    interpreter on CPU tensors, against HF's operations in float64: the same experts in the same order, weights
    and gradient within the dtype's rounding, with expert counts that do not fill the kernel's blocks and a
    token count that does not fill its 16 rows. Logits are distinct (a permutation of k / 16, exact in bf16), so
    no tie makes the choice implementation-defined."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(9)
    logits_TE = torch.stack([torch.randperm(experts, generator=generator) for _ in range(37)]) / 16 - 4
    logits_TE = logits_TE.to(dtype)
    grad_TK = torch.randn(37, top_k, generator=generator).to(dtype)
    weights_TK, experts_TK, grad_logits_TE = interpreted(
        INTERPRET_SOFTMAX_TOPK, (logits_TE, top_k, normalize, grad_TK), tmp_path
    )

    logits_64 = logits_TE.double().requires_grad_(True)
    expected_weights_TK, expected_experts_TK = kernels.softmax_topk_torch(logits_64, top_k, normalize)
    expected_weights_TK.backward(grad_TK.double())
    assert torch.equal(experts_TK, expected_experts_TK)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-3}
    assert weights_TK.dtype == grad_logits_TE.dtype == dtype
    torch.testing.assert_close(weights_TK.double(), expected_weights_TK.detach(), **tolerance)
    torch.testing.assert_close(grad_logits_TE.double(), logits_64.grad, **tolerance)


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


INTERPRET_SWIGLU = """
import sys, torch
from moeloop.steps.model.kernels import swiglu_triton
gate_up_N2I, weight_N, grad_NI = torch.load(sys.argv[1])
gate_up_N2I.requires_grad_(True)
if weight_N is not None:
    weight_N.requires_grad_(True)
out_NI = swiglu_triton(gate_up_N2I, weight_N)
out_NI.backward(grad_NI)
torch.save((out_NI.detach(), gate_up_N2I.grad, weight_N.grad if weight_N is not None else None), sys.argv[2])
torch.library.opcheck(swiglu_triton, (gate_up_N2I.detach().requires_grad_(True), weight_N))
"""


@pytest.mark.parametrize(
    ("rows", "inter", "weighted", "dtype"),
    [(37, 300, True, torch.float32), (16, 256, False, torch.float32), (9, 40, True, torch.bfloat16)],
)
def test_swiglu_triton_interpreted_equals_float64(
    rows: int, inter: int, weighted: bool, dtype: torch.dtype, tmp_path: Path
) -> None:
    """The CUDA path's SwiGLU kernels (forward; backward with the weight's gradient), run by Triton's interpreter on
    CPU tensors, against float64, with rows and columns that do not fill the kernels' blocks (8 rows, 256
    columns), and without weights. `torch.library.opcheck` checks the custom ops' registration (schema, fake
    tensors, autograd)."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(5)
    gate_up_N2I = torch.randn(rows, 2 * inter, generator=generator).to(dtype)
    weight_N = torch.rand(rows, generator=generator).to(dtype) if weighted else None
    grad_NI = torch.randn(rows, inter, generator=generator).to(dtype)
    out_NI, grad_gate_up_N2I, grad_weight_N = interpreted(INTERPRET_SWIGLU, (gate_up_N2I, weight_N, grad_NI), tmp_path)

    gate_up_64 = gate_up_N2I.double().requires_grad_(True)
    weight_64 = weight_N.double().requires_grad_(True) if weight_N is not None else None
    expected_NI = kernels.swiglu_eager(gate_up_64, weight_64)
    expected_NI.backward(grad_NI.double())
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    assert out_NI.dtype == grad_gate_up_N2I.dtype == dtype
    torch.testing.assert_close(out_NI.double(), expected_NI.detach(), **tolerance)
    torch.testing.assert_close(grad_gate_up_N2I.double(), gate_up_64.grad, **tolerance)
    if weighted:
        assert weight_64 is not None and grad_weight_N.dtype == dtype
        torch.testing.assert_close(grad_weight_N.double(), weight_64.grad, **tolerance)
    else:
        assert grad_weight_N is None


INTERPRET_GROUPED_MM = """
import sys, torch
from moeloop.steps.model import kernels
kernels.GROUPED_MM_CONFIG = (16, 32, 16, 4, 2)  # small blocks: partial row, column and group tiles
a_NK, b_eXY, offs_e, b_transposed, grad_NN = torch.load(sys.argv[1])
a_NK.requires_grad_(True)
b_eXY.requires_grad_(True)
out_NN = kernels.grouped_mm_triton(a_NK, b_eXY, offs_e, b_transposed)
out_NN.backward(grad_NN)
torch.save((out_NN.detach(), a_NK.grad, b_eXY.grad), sys.argv[2])
# Not test_aot_dispatch_*: the weight gradient is grouped_mm's, whose meta function takes bf16 only, and
# Triton's interpreter computes bf16 dot products wrongly (it runs them in numpy, which has no bf16).
torch.library.opcheck(
    kernels.grouped_mm_triton, (a_NK.detach().requires_grad_(True), b_eXY.detach().requires_grad_(True), offs_e,
    b_transposed), test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
)
"""


def triton_release() -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)


@pytest.mark.skipif(
    triton_release() < (3, 9),
    reason="needs Triton >= 3.9, whose interpreter runs loops bounded by a tensor (3.6's fails)",
)
@pytest.mark.parametrize(("b_transposed", "dtype"), [(True, torch.float16), (False, torch.float32)])
def test_grouped_mm_triton_interpreted_equals_float64(b_transposed: bool, dtype: torch.dtype, tmp_path: Path) -> None:
    """The Triton grouped GEMM (TMA descriptors, persistent), forward and both gradients, run by Triton's
    interpreter on CPU tensors against float64: empty groups, groups that end inside a row tile, a column tile
    past the last column, and b either way round (nn.Linear weights [e, N, K], or [e, K, N])."""
    generator = torch.Generator().manual_seed(6)
    depth, width = 48, 40
    offs_e = torch.tensor([0, 37, 42, 42, 92], dtype=torch.int32)  # 0, 37, 5, 0 and 50 rows
    a_NK = torch.randn(92, depth, generator=generator).to(dtype)
    b_eXY = torch.randn((5, width, depth) if b_transposed else (5, depth, width), generator=generator).to(dtype)
    grad_NN = torch.randn(92, width, generator=generator).to(dtype)
    out_NN, grad_a_NK, grad_b_eXY = interpreted(
        INTERPRET_GROUPED_MM, (a_NK, b_eXY, offs_e, b_transposed, grad_NN), tmp_path
    )

    a_64, b_64 = a_NK.double().requires_grad_(True), b_eXY.double().requires_grad_(True)
    starts = [0, *offs_e[:-1].tolist()]
    expected_NN = torch.cat(
        [
            a_64[s:e] @ (b_64[g].t() if b_transposed else b_64[g])
            for g, (s, e) in enumerate(zip(starts, offs_e.tolist()))
        ]
    )
    expected_NN.backward(grad_NN.double())
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    for got, expected in ((out_NN, expected_NN.detach()), (grad_a_NK, a_64.grad), (grad_b_eXY, b_64.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, **tolerance)
    assert grad_b_eXY[[0, 3]].abs().max() == 0  # empty groups: zero weight gradients


def test_compile_decoder_layers_leaves_cpu_models_alone() -> None:
    model = Qwen3MoeForCausalLM(tiny_config())
    replace_moe_blocks(model, make_dispatcher("local", NUM_EXPERTS))
    assert compile_decoder_layers(model) == 0
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_equal_torch_on_cuda(dtype: torch.dtype) -> None:
    """Triton gather-sum, expand-rows, router top-k and SwiGLU (forward and backward) against the torch versions."""
    rows_NH, row_of_TK, expected_TH = gather_sum_case(dtype, "cuda")
    tolerance = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    fused_TH = kernels.gather_sum(rows_NH, row_of_TK)
    torch.testing.assert_close(fused_TH.double().cpu(), expected_TH, **tolerance)
    torch.testing.assert_close(kernels.gather_sum_torch(rows_NH, row_of_TK).double().cpu(), expected_TH, **tolerance)
    x_TH, token_N, row_of_TK = expand_rows_case(dtype, "cuda")
    assert torch.equal(kernels.expand_rows(x_TH, token_N, row_of_TK), x_TH.index_select(0, token_N))
    logits_TE = (torch.stack([torch.randperm(128) for _ in range(300)]) / 16 - 4).to("cuda", dtype)  # no ties
    routed = []
    for fn in (kernels.softmax_topk, kernels.softmax_topk_torch):
        logits = logits_TE.clone().requires_grad_(True)
        weights_TK, experts_TK = fn(logits, 8, True)
        weights_TK.backward(torch.linspace(-1, 1, 300 * 8, device="cuda").view(300, 8).to(dtype))
        routed.append((weights_TK.detach(), experts_TK, logits.grad))
    assert torch.equal(routed[0][1], routed[1][1])
    torch.testing.assert_close(routed[0][0], routed[1][0], **tolerance)
    torch.testing.assert_close(routed[0][2], routed[1][2], **tolerance)

    generator = torch.Generator().manual_seed(4)
    for rows in (300, 301):  # a multiple of the kernel's row block, and not
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
            else:  # the Triton SwiGLU rounds to bf16 once, the eager one after every operation
                error = float((fused.float() - eager.float()).norm() / eager.float().norm())
                assert error < 1e-2, f"relative error {error:.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_linear_equals_grouped_mm_on_cuda() -> None:
    """The Triton grouped GEMM (on Hopper) against torch's grouped_mm in bf16, output and both gradients, with
    empty groups, groups that end inside a row tile and a column tile past the last column; and `grouped_linear`
    takes it only for calls as large as a Qwen3-30B-A3B layer's."""
    bf16_cuda: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    generator = torch.Generator().manual_seed(7)
    offs_e = torch.tensor([0, 300, 301, 301, 818, 948], dtype=torch.int32, device="cuda")
    x_NK = torch.randn(948, 192, generator=generator).to("cuda", torch.bfloat16)
    weight_eOK = (0.1 * torch.randn(6, 320, 192, generator=generator)).to("cuda", torch.bfloat16)
    grad_NO = torch.randn(948, 320, generator=generator).to("cuda", torch.bfloat16)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert not kernels.grouped_mm_triton_runs(x_NK, weight_eOK)  # too small to pay for its host time
    rows_NK = torch.empty(131072, 2048, **bf16_cuda)  # 16384 tokens, top-8
    assert kernels.grouped_mm_triton_runs(rows_NK, torch.empty(128, 768, 2048, **bf16_cuda)) == hopper  # 30B-A3B
    assert not kernels.grouped_mm_triton_runs(rows_NK[:, :1024], torch.empty(64, 768, 1024, **bf16_cuda))  # 1B
    del rows_NK
    if not hopper:
        pytest.skip("the Triton grouped GEMM needs TMA (Hopper or newer)")
    # nn.Linear weights [e, O, K] and their transposes [e, K, O] (GPT-OSS's experts), each against grouped_mm.
    triton_linear = partial(kernels.grouped_mm_triton, b_transposed=True)
    triton_transposed = partial(kernels.grouped_mm_triton, b_transposed=False)
    for layout, triton_fn, weight_in in [
        ("linear", triton_linear, weight_eOK),
        ("transposed", triton_transposed, weight_eOK.transpose(1, 2).contiguous()),
    ]:
        results = []
        for fn, start in ((triton_fn, weight_in), (kernels.grouped_linear_torch, weight_eOK)):
            x, weight = x_NK.clone().requires_grad_(True), start.clone().requires_grad_(True)
            out_NO = fn(x, weight, offs_e)
            out_NO.backward(grad_NO)
            weight_grad = weight.grad if start is weight_eOK else weight.grad.transpose(1, 2)
            results.append((out_NO.detach(), x.grad, weight_grad))
        for what, ours, reference in zip(("out", "x.grad", "weight.grad"), *results, strict=True):
            error = float((ours.float() - reference.float()).norm() / reference.float().norm())
            assert error < 1e-2, f"{layout} {what}: relative error {error:.1e}"
        assert results[0][2][[0, 3]].abs().max() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_decoder_layers_equal_eager_on_cuda() -> None:
    """compile_decoder_layers keeps logits, router logits, loss and every gradient (fp32, where the MoE blocks stay
    eager: grouped_mm traces in bf16 only), also when the batch shape changes, and HF's router-logit hooks keep
    recording."""
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_block_compiled_whole_equals_eager_on_cuda(family: str) -> None:
    """Every family's bf16 block compiled whole by inductor (what compile_decoder_layers compiles at EP = 1) against
    the same block eager, on the skewed inputs whose unused experts make empty groups: output, input and parameter
    gradients within bf16 rounding (relative error < 1e-2; both run the same Triton kernels and grouped GEMMs,
    inductor fuses the router and the permutation), and exactly zero gradients for the unused experts."""
    hf_block, x_BSH = skewed_block(family=family)
    hf_block, x_BSH = hf_block.to("cuda", torch.bfloat16), x_BSH.to("cuda", torch.bfloat16)
    grad_BSH = torch.randn(x_BSH.shape, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    block = MoeBlock.from_hf_block(hf_block, LocalDispatcher(NUM_EXPERTS, None), "grouped_mm")
    compiled = copy.deepcopy(block)
    compiled.compile(fullgraph=True)
    ours, reference = forward_backward(compiled, x_BSH, grad_BSH), forward_backward(block, x_BSH, grad_BSH)
    for what, got, expected in [("out", ours[0], reference[0]), ("x.grad", ours[1], reference[1])] + [
        (name, ours[2][name], grad) for name, grad in reference[2].items()
    ]:
        error = float((got.float() - expected.float()).norm() / expected.float().norm())
        # GPT-OSS's bias gradients are sums over all of a router's or an expert's rows of terms that largely cancel,
        # so a bf16 summation in another order moves them further (measured on an H200: router 1.1e-2, gate_up 1.4e-2).
        bound = 3e-2 if what.endswith("bias") else 1e-2
        assert error < bound, f"{what}: relative error {error:.1e}"
    assert ours[2]["experts.gate_up_proj"][UNUSED_EXPERTS].abs().max() == 0
    assert ours[2]["experts.down_proj"][UNUSED_EXPERTS].abs().max() == 0
    if family == "gpt_oss":  # the experts' biases, indexed by each row's expert
        assert ours[2]["experts.down_proj_bias"][UNUSED_EXPERTS].abs().max() == 0
        assert ours[2]["experts.down_proj_bias"].abs().min(1).values[:6].min() > 0
