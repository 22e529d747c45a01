"""A rollout shard's samples as episodes of the run's `verifiers` environment (rollout.environment).

verifiers runs each episode (`Environment.rollout`: its turns, its tools, its stop conditions) against the policy
through `EngineClient`, and scores each prompt's group with the environment's rubric (`Rubric.score_group`). An
episode becomes one sample: its response is every token after the prompt, the policy's (sampled, with the engine's
logprobs) and the environment's (inserted, masked out of the loss), in order; `episode_columns` are what the
experience adds for it (steps/storage/experience.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import verifiers as vf

from moeloop.steps.config_task import EnvironmentConfig
from moeloop.steps.cores import usable_cores
from moeloop.steps.engines.engine import Completion, Engine, Sampling, route_start
from moeloop.steps.episodes.client import EPISODE, EngineClient, Turn
from moeloop.steps.episodes.tools import ToolWorkers
from moeloop.steps.errors import MoeloopError
from moeloop.steps.prompting import ChatSettings

MAX_TOOL_WORKERS = 4  # processes running a shard's tool calls (each loads the environment: about 100 MB)


@dataclass(frozen=True)
class Episode:
    completion: Completion  # the whole response: the policy's and the environment's tokens, its routes stitched
    columns: dict[str, Any]  # response_mask, turns, tool_results, environment_reward, episode_end


def generate_episodes(
    engine: Engine,
    environment: Any,
    settings: EnvironmentConfig,
    records: list[dict[str, Any]],
    prompt_ids: list[int],
    sampling: Sampling,
    chat: ChatSettings,
    context_tokens: int,
) -> list[list[Episode]]:
    """sampling.n episodes of the environment (a `vf.Environment`, loaded from settings) for each record's prompt
    (prompt_ids: their rows in the prompt set), scored; chat: with its tools (`ChatSettings.of`)."""
    refuse_unserved(environment, settings.name)
    client = EngineClient(engine, sampling, chat, context_tokens, settings.max_episode_tokens)
    workers = None
    if isinstance(environment, vf.ToolEnv) and environment.tool_map:
        workers = ToolWorkers(settings, min(MAX_TOOL_WORKERS, usable_cores()))
        workers.install(environment)
    try:
        groups = asyncio.run(run_groups(environment, client, records, prompt_ids, sampling.n))
    finally:
        if workers is not None:
            workers.close()
    return [[episode(client, state, sampling) for state in states] for states in groups]


def refuse_unserved(environment: Any, name: str) -> None:
    """Environments whose episodes need what moeloop does not configure: a sandbox service, a judge model's API."""
    if isinstance(environment, vf.SandboxEnv):
        raise MoeloopError(
            f"rollout.environment {name!r} runs its tools in Prime's sandboxes, which need their service and network"
            " access: moeloop configures none"
        )
    rubrics = getattr(environment.rubric, "rubrics", [environment.rubric])
    if any(isinstance(rubric, vf.JudgeRubric) for rubric in rubrics):
        raise MoeloopError(
            f"rollout.environment {name!r} rewards with a judge model (JudgeRubric), which needs a model API and"
            " network access: moeloop configures none"
        )


async def run_groups(
    environment: Any, client: EngineClient, records: list[dict[str, Any]], prompt_ids: list[int], samples: int
) -> list[list[Any]]:
    """Every episode at once (the client batches their turns), then each prompt's group scored by the rubric."""
    inputs = [
        {
            "prompt": record["prompt"],
            "answer": record.get("answer", ""),
            "info": record.get("info", {}),
            "example_id": prompt_id,
            **({"task": record["task"]} if "task" in record else {}),
        }
        for record, prompt_id in zip(records, prompt_ids, strict=True)
    ]
    for _ in range(len(inputs) * samples):
        client.episode_started()  # all of them before any asks: the first batch holds every first turn

    async def one(index: int) -> Any:
        try:
            return await environment.rollout(inputs[index // samples], client, client.engine.name, {EPISODE: index})
        finally:
            client.episode_ended()

    states = await asyncio.gather(*(one(index) for index in range(len(inputs) * samples)))
    groups = [list(states[start : start + samples]) for start in range(0, len(states), samples)]
    for group in groups:
        await environment.rubric.score_group(group)
        for state in group:
            await environment.rubric.cleanup(state)
    return groups


def episode(client: EngineClient, state: Any, sampling: Sampling) -> Episode:
    """One episode as one sample: its response tokens, their mask and logprobs, its routes stitched from its turns'."""
    error = state.get("error")
    if isinstance(error, vf.ModelError):  # the engine or this client failed, not the environment
        cause = error.__cause__ or error
        raise MoeloopError(f"an episode's turn failed: {type(cause).__name__}: {cause}") from None
    turns = [client.turn(step["response"].id) for step in state["trajectory"]]
    if not turns:
        raise MoeloopError(f"an episode ended before the policy's first turn: {error or state.get('stop_condition')}")
    response, mask, logprobs = [], [], []
    for turn in turns:
        if turn.prompt_ids != turns[0].prompt_ids + response + turn.environment_ids:
            raise MoeloopError("an episode's turn does not continue the tokens of the turns before it")
        response += turn.environment_ids + turn.completion.token_ids
        mask += [0] * len(turn.environment_ids) + [1] * len(turn.completion.token_ids)
        logprobs += [0.0] * len(turn.environment_ids) + list(turn.completion.logprobs)
    completion = Completion(response, logprobs, turns[-1].completion.finish_reason, stitched_routes(turns, sampling))
    tool_results = [str(m.content) for m in state.get("completion") or [] if m.role == "tool"]
    reward = state.get("reward")
    return Episode(
        completion,
        {
            "response_mask": mask,
            "turns": [
                {
                    "environment_tokens": len(t.environment_ids),
                    "policy_tokens": len(t.completion.token_ids),
                    "model_seconds": t.model_seconds,
                    "environment_seconds": t.environment_seconds,
                }
                for t in turns
            ],
            "tool_results": tool_results,
            "environment_reward": None if reward is None else float(reward),
            "episode_end": f"error: {type(error).__name__}: {error}" if error else state.get("stop_condition"),
        },
    )


def stitched_routes(turns: list[Turn], sampling: Sampling) -> np.ndarray | None:
    """The episode's routes, one row per position from its prompt's first (or last) to its response's second to
    last: each turn's own from where the turn before it ended (the environment's tokens routed by this turn's
    prefill, the policy's by the forwards that sampled them)."""
    if turns[0].completion.routed_experts is None:
        return None
    pieces, covered = [], None
    for turn in turns:
        start = route_start(turn.prompt_ids, sampling)  # the first position this turn's routes hold
        end = len(turn.prompt_ids) + len(turn.completion.token_ids) - 1
        first = start if covered is None else covered
        if first < start:
            raise MoeloopError(
                "an episode's later turn did not record its prompt's routes: set rollout.prompt_routes all"
            )
        pieces.append(turn.completion.routed_experts[first - start : end - start])
        covered = end
    return np.concatenate(pieces)
