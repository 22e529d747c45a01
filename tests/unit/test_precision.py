"""Checkpoints keep the dtype they came in: a bf16 HF checkpoint as model.checkpoint is a bf16 checkpoint 0. And start
refuses a trainer that cannot fit trainer.gpu_memory_bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy
from moeloop.steps.start import start
from moeloop.steps.storage.run import RunStorage
from tests.conftest import small_config


def test_start_keeps_a_bf16_checkpoint_bf16(run_root: Path, tmp_path: Path) -> None:
    source = tmp_path / "bf16"
    tokenizer = build_tokenizer(["abcdefghijklmnopqrstuvwxyz: "])
    save_policy(build_tiny_model(small_config().model.tiny, tokenizer, seed=1).to(torch.bfloat16), tokenizer, source)
    storage = RunStorage(str(run_root / "run"))
    start(storage.uri, small_config(model={"checkpoint": str(source)}))
    weights = Path(storage.uri) / storage.checkpoint(0) / "model.safetensors"
    with safe_open(weights, "pt") as file:
        assert {file.get_tensor(key).dtype for key in file.keys()} == {torch.bfloat16}
    assert weights.stat().st_size <= (source / "model.safetensors").stat().st_size * 1.01


def test_start_refuses_a_trainer_that_cannot_fit_its_gpu_memory_and_writes_nothing(run_root: Path) -> None:
    """trainer.gpu_memory_bytes below the memory model's prediction: a one-line error before any weight is built."""
    storage = RunStorage(str(run_root / "run"))
    config = small_config(trainer={"gpu_memory_bytes": 2**20})
    with pytest.raises(MoeloopError, match=r"^the train step needs about .* GiB per GPU .*trainer.gpu_memory_bytes"):
        start(storage.uri, config)
    assert not (run_root / "run").exists()
    start(storage.uri, small_config(trainer={"gpu_memory_bytes": 80 * 2**30}))  # the tiny model fits 80 GiB
    assert storage.is_committed(storage.checkpoint(0))
