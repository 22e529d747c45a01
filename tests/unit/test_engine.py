"""The transformers engine kept between iterations serves each new checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from moeloop.steps.config_model import TinyQwen3Moe
from moeloop.steps.engines.engine import Sampling, TransformersEngine, engine_for, release_engine
from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy
from tests.conftest import small_config


def checkpoint(directory: Path, seed: int) -> Path:
    tokenizer = build_tokenizer(["abcdefgh="])
    save_policy(build_tiny_model(TinyQwen3Moe(), tokenizer, seed=seed), tokenizer, directory)
    return directory


def test_kept_transformers_engine_loads_the_next_checkpoint(tmp_path: Path) -> None:
    rollout = small_config().rollout.model_copy(update={"engine": "transformers"})
    first, second = checkpoint(tmp_path / "first", seed=1), checkpoint(tmp_path / "second", seed=2)
    greedy = Sampling(n=1, temperature=0.0, top_p=1.0, max_new_tokens=6, seed=0)
    prompts = [[2, 3, 4, 10], [5, 6, 7, 8, 10]]
    try:
        engine, reused = engine_for(first, rollout)
        assert not reused
        again, reused = engine_for(second, rollout)
        assert again is engine and reused and engine.checkpoint_dir == second
        got = engine.generate(prompts, greedy)
        expected = TransformersEngine(second).generate(prompts, greedy)
        assert [c[0].token_ids for c in got] == [c[0].token_ids for c in expected]
        with torch.no_grad():
            probe = torch.tensor([prompts[0]])
            torch.testing.assert_close(engine.model(probe).logits, TransformersEngine(second).model(probe).logits)
    finally:
        release_engine()


def test_transformers_engine_in_bf16_is_a_new_engine_that_stays_bf16_across_checkpoints(tmp_path: Path) -> None:
    """rollout.transformers_dtype: bfloat16 samples in bf16 on the CPU too (a bf16 engine against the fp32 trainer,
    benchmarks/replay_mismatch.md); an engine of another dtype is not reused for it."""
    rollout = small_config().rollout.model_copy(update={"engine": "transformers"})
    bf16 = rollout.model_copy(update={"transformers_dtype": "bfloat16"})
    first, second = checkpoint(tmp_path / "first", seed=1), checkpoint(tmp_path / "second", seed=2)
    try:
        fp32_engine, _ = engine_for(first, rollout)
        assert fp32_engine.model.dtype == torch.float32
        engine, reused = engine_for(first, bf16)
        assert not reused and engine is not fp32_engine and engine.model.dtype == torch.bfloat16
        again, reused = engine_for(second, bf16)
        assert again is engine and reused and engine.model.dtype == torch.bfloat16
    finally:
        release_engine()
