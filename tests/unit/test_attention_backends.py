"""`trainer.attention`: which kernel runs packed attention where (`moeloop.steps.model.attention`), and the one-line
errors for a backend selected where it cannot run (the flash kernels themselves: tests/gpu/test_cuda.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from pydantic import ValidationError
from transformers import Qwen3MoeForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from moeloop.steps.config import TrainerConfig, load_config
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.attention import (
    PACKED_ATTENTION,
    attention_backend,
    flash4_missing,
    padded_attention,
    use_packed_attention,
)
from moeloop.steps.model.policy import build_tokenizer, tiny_model_config
from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.rl.state import trainer_attention
from tests.conftest import REPO

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_is_the_padded_exact_path_off_cuda(dtype: torch.dtype) -> None:
    assert attention_backend("auto", CPU, dtype) == "sdpa"
    assert attention_backend("sdpa", CPU, dtype) == "sdpa"


@pytest.mark.parametrize("backend", ["flash4", "flash2"])
def test_a_flash_backend_off_cuda_is_one_line_naming_what_it_needs(backend: str) -> None:
    with pytest.raises(MoeloopError) as raised:
        attention_backend(backend, CPU, torch.bfloat16)
    message = str(raised.value)
    assert "\n" not in message and f"trainer.attention {backend}" in message and "CUDA" in message, message
    with pytest.raises(MoeloopError, match="auto or sdpa"):  # the train step's check, before any weight is loaded
        trainer_attention(TrainerConfig(attention=backend), Parallel())


def test_flash4_is_refused_by_the_config_with_fp32_and_missing_says_how_to_install() -> None:
    with pytest.raises(ValidationError, match="attention flash4 computes in bf16"):
        TrainerConfig(precision="fp32", attention="flash4")
    assert TrainerConfig(precision="fp32", attention="sdpa").attention == "sdpa"
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("a flash_attn package is installed here")
    assert "pip install flash-attn-4" in flash4_missing(torch.device("cuda"))


def test_each_backend_is_a_registered_attention_implementation_of_its_own() -> None:
    """The HF names avoid "flash" and "sdpa", which transformers reads as its own implementations."""
    assert len(set(PACKED_ATTENTION.values())) == len(PACKED_ATTENTION) == 3
    for name in PACKED_ATTENTION.values():
        assert name in ALL_ATTENTION_FUNCTIONS.valid_keys() and "flash" not in name and "sdpa" not in name

    tiny = load_config(REPO / "configs" / "tiny.yaml").model.tiny
    model = Qwen3MoeForCausalLM(tiny_model_config(tiny, build_tokenizer(["abc"])))
    use_packed_attention(model, "sdpa")
    assert model.config._attn_implementation == PACKED_ATTENTION["sdpa"]


def stand_in_flash_attn_4(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn-4 runs on CUDA only: a module of 4.0.0b36's interface stands in for it here, its two functions
    taking b36's arguments and returning what b36 returns (five tensors forward, out and the log-sum-exp [h, N] first;
    three gradients backward), computed by SDPA per sample."""
    import sys
    import types

    def samples(cu_seqlens_q: torch.Tensor) -> list[tuple[int, int]]:
        bounds = cu_seqlens_q.tolist()
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def probabilities(q, k, scale):  # noqa: ANN001, ANN202
        """A sample's causal softmax [h, L, L] and log-sum-exp [h, L]: q [h, L, D], k [h, L, D]."""
        scores = (q @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        return scores.softmax(-1), scores.logsumexp(-1)

    def per_sample(q_NhD, k_NkD, v_NkD, cu_seqlens_q):  # noqa: ANN001, ANN202
        for start, end in samples(cu_seqlens_q):
            q, k, v = (t[start:end].transpose(0, 1).double() for t in (q_NhD, k_NkD, v_NkD))
            groups = q.shape[0] // k.shape[0]
            yield q, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0), groups

    def forward(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, *, softmax_scale, causal, return_lse, **_):  # noqa: ANN001, ANN202, E501
        assert causal and return_lse and torch.equal(cu_seqlens_q, cu_seqlens_k)
        outs, lses = [], []
        for q_, k_, v_, _groups in per_sample(q, k, v, cu_seqlens_q):
            probs, lse = probabilities(q_, k_, softmax_scale)
            outs.append((probs @ v_).transpose(0, 1))
            lses.append(lse)
        return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1).float(), None, None, None

    def backward(q, k, v, out, dout, lse, softmax_scale, causal, *, cu_seqlens_q, **_):  # noqa: ANN001, ANN202
        """Attention's gradients by hand (a custom op runs its implementation below autograd)."""
        grads = {"q": [], "k": [], "v": []}
        for (start, end), (q_, k_, v_, groups) in zip(samples(cu_seqlens_q), per_sample(q, k, v, cu_seqlens_q)):
            probs, _ = probabilities(q_, k_, softmax_scale)
            d_out = dout[start:end].transpose(0, 1).double()
            d_probs = d_out @ v_.transpose(1, 2)
            d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * softmax_scale
            d_k, d_v = d_scores.transpose(1, 2) @ q_, probs.transpose(1, 2) @ d_out
            grads["q"].append(d_scores @ k_)
            for name, d in (("k", d_k), ("v", d_v)):  # a KV head's gradient sums its query heads'
                grads[name].append(d.unflatten(0, (-1, groups)).sum(1))
        return tuple(torch.cat([g.transpose(0, 1) for g in grads[n]]).to(q.dtype) for n in ("q", "k", "v"))

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = forward, backward
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    for name, module in {"flash_attn": types.ModuleType("flash_attn"), "flash_attn.cute": cute,
                         "flash_attn.cute.interface": interface}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    from moeloop.steps.model import fa4_kernels  # registers the op, once a process

    monkeypatch.setattr(fa4_kernels, "interface", interface)


def test_flash4s_custom_op_equals_the_exact_path_and_compiles_without_a_graph_break(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`torch.ops.moeloop.fa4_varlen` (steps/model/fa4_kernels.py) over a stand-in of flash-attn-4's interface: the
    forward and the query, key and value gradients equal the padded exact path's (GQA, 4 query heads over 2 KV heads,
    samples of 3, 1 and 6 tokens); compiled with fullgraph (its fake shapes, one opaque node forward and backward) it
    gives the same. The kernels themselves: tests/gpu/test_cuda.py."""
    stand_in_flash_attn_4(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    cu_seqlens = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    query, key, value = (torch.randn(10, heads, 8, generator=generator) for heads in (4, 2, 2))
    grad = torch.randn(10, 4, 8, generator=generator)

    def attention(fn) -> list[torch.Tensor]:  # noqa: ANN001
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        out = fn(*inputs)
        return [out, *torch.autograd.grad(out, inputs, grad)]

    def flash4(q, k, v):  # noqa: ANN001, ANN202
        return torch.ops.moeloop.fa4_varlen(q, k, v, cu_seqlens, 6, 0.25)[0]

    want = attention(lambda q, k, v: padded_attention(q, k, v, cu_seqlens, 6, 0.25))
    for got in (attention(flash4), attention(torch.compile(flash4, backend="aot_eager", fullgraph=True))):
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(g, w, msg=name)


def test_flash4_runs_with_the_package_on_hopper_or_blackwell_whatever_the_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's own FA4 registration refused every causal backward on an H100; the custom op does not go
    through it, so flash4 needs the package and compute capability 9.x or 10.x alone, and auto takes it there."""
    found = importlib.util.find_spec
    installed = lambda name: object() if name.startswith("flash_attn") else found(name)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", installed)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert flash4_missing(torch.device("cuda")) is None
    assert attention_backend("auto", torch.device("cuda"), torch.bfloat16) == "flash4"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert "compute capability 9.x and 10.x" in flash4_missing(torch.device("cuda"))
    assert attention_backend("auto", torch.device("cuda"), torch.bfloat16) == "flash2"
