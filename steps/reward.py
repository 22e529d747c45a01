"""reward: score every sample of the iteration with the configured reward functions and reward models.

A reward function (a rule or verifier reward) is named by import path `package.module:function` and called as
function(prompt_record, response_text, **args) -> float, in worker processes (steps/rewards/pool.py); which functions
score a sample depends on its record's data_source. A reward model is an HF sequence-classification model that the
start step committed into the run (`steps/rewards/models.py`). The reward is the weighted sum over all of them.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from moeloop.steps.common import already_committed, open_iteration, print_json, quiet_libraries, step_parser
from moeloop.steps.errors import MoeloopError, run_cli
from moeloop.steps.prompting import ChatSettings
from moeloop.steps.rewards.functions import by_source
from moeloop.steps.rewards.pool import RewardPool
from moeloop.steps.rl.overlong import overlong_penalty
from moeloop.steps.storage.experience import (
    REWARD_SCHEMA,
    commit_experience,
    committed_experience,
    read_written_rollouts,
)
from moeloop.steps.storage.prompt_set import read_prompts
from moeloop.steps.storage.reports import write_report

FLOAT32_MAX = 3.4028234663852886e38  # rewards.parquet's column: a larger weighted sum would be stored as inf


def reward(run_uri: str, iteration: int) -> dict[str, Any]:
    started = time.perf_counter()
    storage, config = open_iteration(run_uri, iteration)
    if committed_experience(storage, iteration, config.rollout.num_shards) is not None:
        return already_committed(storage, storage.experience(iteration))
    rollouts, shards = read_written_rollouts(storage, iteration, config.rollout.num_shards)
    prompt_ids = rollouts["prompt_id"].to_pylist()
    records = read_prompts(storage, "train", prompt_ids)
    sample_records = [records[p] for p in prompt_ids]
    responses = rollouts["response_text"].to_pylist()
    sample_ids = rollouts["sample_id"].to_pylist()
    with RewardPool(config.reward, f"the reward step of iteration {iteration}") as pool:
        scores = pool.score(sample_records, responses, [f"sample {s}" for s in sample_ids])
    rewards = scores.rewards
    report: dict[str, Any] = {"reward_failures": scores.failures}
    if config.rollout.environment is not None:  # episodes: their rubric's reward, scored where they ran
        found = rollouts["environment_reward"].to_pylist()
        if (bad := next((i for i, r in enumerate(found) if r is None or not math.isfinite(r)), None)) is not None:
            raise MoeloopError(f"sample {sample_ids[bad]} has no finite environment reward ({found[bad]})")
        weight = config.rollout.environment.reward_weight
        rewards = [reward + weight * found_reward for reward, found_reward in zip(rewards, found, strict=True)]
        report["environment_reward_mean"] = sum(found) / len(found)
    if config.algorithm.overlong.mode == "penalty":
        lengths = pc.list_value_length(rollouts["response_token_ids"]).to_pylist()
        penalties = [overlong_penalty(n, config.rollout.max_new_tokens, config.algorithm.overlong) for n in lengths]
        rewards = [reward + penalty for reward, penalty in zip(rewards, penalties, strict=True)]
        report["overlong_penalty_mean"] = sum(penalties) / len(penalties)
    if config.reward.models:
        from moeloop.steps.rewards.models import (
            load_reward_models,  # torch and transformers: only when a model is configured
        )

        model_started = time.perf_counter()
        samples = [(r["prompt"], response) for r, response in zip(sample_records, responses, strict=True)]
        for index, (scorer, weight) in enumerate(load_reward_models(storage, config.reward.models)):
            try:
                scores = scorer.score(samples, ChatSettings.of(config))
            except MoeloopError as error:
                raise MoeloopError(f"reward.models.{index} ({config.reward.models[index].path}): {error}") from None
            if (bad := next((i for i, s in enumerate(scores) if not math.isfinite(s)), None)) is not None:
                raise MoeloopError(
                    f"reward.models.{index} ({config.reward.models[index].path}) scored {scores[bad]} on sample"
                    f" {sample_ids[bad]}: a reward must be a finite number"
                )
            report[f"reward_model_{index}_mean"] = sum(scores) / len(scores)
            rewards = [reward + weight * model_score for reward, model_score in zip(rewards, scores, strict=True)]
        report["reward_model_seconds"] = round(time.perf_counter() - model_started, 3)
    if (bad := next((i for i, r in enumerate(rewards) if abs(r) > FLOAT32_MAX), None)) is not None:
        raise MoeloopError(f"the reward of sample {sample_ids[bad]}, {rewards[bad]}, overflows the float32 rewards")
    table = pa.table(
        {"sample_id": rollouts["sample_id"], "prompt_id": rollouts["prompt_id"], "reward": rewards},
        schema=REWARD_SCHEMA,
    )
    report.update(
        samples=len(rewards),
        reward_mean=sum(rewards) / len(rewards),
        # the mean reward of each data_source's samples
        reward_by_source={
            source: sum(rewards[i] for i in indices) / len(indices)
            for source, indices in by_source(sample_records).items()
        },
        seconds=round(time.perf_counter() - started, 3),
    )
    write_report(storage, iteration, "reward", report)
    commit_experience(storage, iteration, shards, table)
    return report


def main() -> None:
    args = step_parser(__doc__).parse_args()
    quiet_libraries()
    print_json(reward(args.run, args.iteration))


if __name__ == "__main__":
    run_cli(main)
