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
from moeloop.steps.model.attention import PACKED_ATTENTION, attention_backend, flash4_missing, use_packed_attention
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


def test_torchs_fa4_registration_takes_out_and_lse_of_flash_attn_4s_forward_through_fa4_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's FA4 registration (`torch.nn.attention._fa4`, its own code, called as its CUDA kernel calls it) unpacks
    `_flash_attn_fwd` as (out, lse); flash-attn-4 4.0.0b36, the trainer image's, returns five tensors, which failed
    every forward on an H100 (ValueError: too many values to unpack). flash-attn-4 runs on CUDA only, so a module of
    b36's return shape stands in for its interface here: through `fa4_kernels` torch gets (out, lse); given the
    library's module itself, it fails as the GPU did."""
    import sys
    import types

    from torch.nn.attention import _fa4

    out, lse = torch.randn(3, 2, 4), torch.randn(2, 3)
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = lambda *args, **kwargs: (out, lse, None, None, None)  # 4.0.0b36's five
    interface._flash_attn_bwd = lambda *args, **kwargs: (out, out, out)
    for name, module in {"flash_attn": types.ModuleType("flash_attn"), "flash_attn.cute": types.ModuleType("c"),
                         "flash_attn.cute.interface": interface}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "moeloop.steps.model.fa4_kernels", raising=False)
    _fa4._fa4_import_module.cache_clear()
    q = k = v = torch.zeros(3, 2, 4)
    arguments = (q, k, v, None, None, None, None, 0.5, True, None, None, None)
    try:
        monkeypatch.setattr(_fa4, "_FA4_MODULE_PATH", "moeloop.steps.model.fa4_kernels")
        got_out, got_lse = _fa4._fa4_run_forward(*arguments)
        assert got_out is out and torch.equal(got_lse, lse)
        monkeypatch.setattr(_fa4, "_FA4_MODULE_PATH", "flash_attn.cute.interface")
        with pytest.raises(ValueError, match="too many values to unpack"):
            _fa4._fa4_run_forward(*arguments)
    finally:
        _fa4._fa4_import_module.cache_clear()
        sys.modules.pop("moeloop.steps.model.fa4_kernels", None)


def test_flash4_is_missing_with_a_torch_whose_fa4_registration_refuses_causal_backwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's FA4 registration took the forward and refused every causal backward ("windowed attention not
    supported": torch passes causal as a window), seen on an H100; auto then takes flash2."""
    found = importlib.util.find_spec
    installed = lambda name: object() if name.startswith("flash_attn") else found(name)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", installed)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    reason = flash4_missing(torch.device("cuda"))
    assert reason == "torch 2.11.0+cu130's FA4 registration refuses causal attention's backward (torch 2.13 runs it)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert attention_backend("auto", torch.device("cuda"), torch.bfloat16) == "flash2"
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    assert flash4_missing(torch.device("cuda")) is None
    assert attention_backend("auto", torch.device("cuda"), torch.bfloat16) == "flash4"
