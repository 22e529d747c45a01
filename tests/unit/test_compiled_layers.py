"""The trainer's compiled decoder layers (`moeloop.steps.model.moe.compile_layers`) at EP = 1 in bf16, on the CPU:
each layer is one graph, its router logits among the graph's outputs (no graph break at the routers' recording
hook, nor in the packed attention), every family's layer traced whole (fullgraph), the same results as the eager
layers; and, with inductor, one compiled region per layer in the forward and one in the backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from moeloop.steps.model.attention import use_packed_attention
from moeloop.steps.model.dispatch import make_dispatcher
from moeloop.steps.model.logprobs import packed_token_logprobs, use_logprob_head
from moeloop.steps.model.microbatch import Microbatch, pack_rows
from moeloop.steps.model.moe import compile_layers, replace_moe_blocks
from moeloop.steps.model.sharding import checkpoint_decoder_layers
from tests.unit.test_moe import FAMILY_NAMES, NUM_EXPERTS, tiny_config


def trainer_model(family: str) -> torch.nn.Module:
    """A tiny bf16 model of the family as the trainer runs it at EP = 1: local dispatcher, grouped GEMMs, packed
    attention (the CPU's exact path), the logprob head."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family=family)).to(torch.bfloat16)
    replace_moe_blocks(model, make_dispatcher("local", NUM_EXPERTS), "grouped_mm")
    use_logprob_head(model)
    use_packed_attention(model, "sdpa")
    return model


def microbatch() -> Microbatch:
    """Three packed samples of different lengths, the longest under GPT-OSS's window of 4 for one and over it for two."""
    input_ids_BT = torch.randint(1, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    return pack_rows(input_ids_BT, [12, 3, 9], [0, 1, 2])


def update_pass(model: torch.nn.Module, micro: Microbatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Logprobs and router logits of a forward, and a backward through both (as the loss and the aux loss take
    them); the gradients land in the parameters."""
    logprobs_nT, _, router_logits_L = packed_token_logprobs(model, micro)
    (logprobs_nT.sum() + sum(logits.float().square().mean() for logits in router_logits_L)).backward()
    return logprobs_nT.detach(), tuple(logits.detach() for logits in router_logits_L)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_familys_layer_traces_whole_with_its_router_logits_as_outputs(family: str) -> None:
    """fullgraph=True (a break would raise), one graph for the layers of one kind, no break counted, and the
    logprobs, router logits and every gradient are the eager model's to the bit (dynamo's eager backend runs the
    traced graph as it is)."""
    eager = trainer_model(family)
    compiled = copy.deepcopy(eager)
    layers = compile_layers(compiled, backend="eager")
    assert layers == 2  # every tiny config has two MoE layers (DeepSeek-V3's first dense layer is not compiled)
    micro = microbatch()
    ours, reference = update_pass(compiled, micro), update_pass(eager, micro)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == (2 if family == "gpt_oss" else 1)  # GPT-OSS: one layer windowed
    assert len(ours[1]) == layers
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    for (name, parameter), eager_parameter in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, eager_parameter.grad, rtol=0, atol=0, msg=name)


def test_inductor_runs_one_compiled_region_per_layer_forward_and_backward() -> None:
    """Profiled after a warm-up: per forward, one `CompiledFunction` (AOTAutograd's compiled forward) per layer and
    no other compiled region; per backward, one `CompiledFunctionBackward` per layer; the router logits come out
    with gradients; results within bf16's rounding of eager's."""
    eager = trainer_model("qwen3_moe")
    compiled = copy.deepcopy(eager)
    assert compile_layers(compiled) == 2
    micro = microbatch()
    update_pass(compiled, micro)  # compiles
    compiled.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        logprobs_nT, router_logits_L = update_pass(compiled, micro)
    names = [event.name for event in profile.events()]
    assert names.count("CompiledFunction") == 2 and names.count("CompiledFunctionBackward") == 2, sorted(set(names))
    assert sum(name.startswith("Torch-Compiled Region") for name in names) == 2
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(router.weight.grad is not None for router in (layer.mlp.gate for layer in compiled.model.layers))
    reference = update_pass(eager, micro)
    torch.testing.assert_close((logprobs_nT, router_logits_L), reference, rtol=2e-2, atol=2e-2)


def test_varied_microbatches_compile_a_bounded_number_of_graphs() -> None:
    """Dynamic from the first compile: the packings an update meets (several samples of other lengths, one sample, an
    empty microbatch's one padding token), with and without gradients, take at most 6 graphs, under dynamo's limit of
    8 past which a fullgraph layer fails instead of running eager."""
    model = trainer_model("qwen3_moe")
    compile_layers(model, backend="eager")
    input_ids_BT = torch.randint(1, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    lengths = [12, 3, 9, 5]
    for rows in ([0, 1, 2], [2, 0], [3, 1, 2, 0], [1], [2], [], [0, 3]):
        micro = pack_rows(input_ids_BT, lengths, rows)
        with torch.no_grad():
            packed_token_logprobs(model, micro)
        update_pass(model, micro)
    assert counters["stats"]["unique_graphs"] <= 6, dict(counters["stats"])


def test_activation_checkpointed_layers_are_not_compiled_whole() -> None:
    """Dynamo does not trace into torch.utils.checkpoint's frame, so fullgraph would fail there: a checkpointed layer
    is compiled without it, and its results are still eager's."""
    eager = trainer_model("qwen3_moe")
    compiled = copy.deepcopy(eager)
    checkpoint_decoder_layers(compiled)
    compile_layers(compiled, backend="eager")
    micro = microbatch()
    torch.testing.assert_close(update_pass(compiled, micro), update_pass(eager, micro), rtol=0, atol=0)
