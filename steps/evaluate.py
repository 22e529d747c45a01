"""evaluate: greedy decoding of the held-out prompts with checkpoint N, and the iteration's metrics file.

metrics/iter-NNNNNN.json gathers what every step of the iteration reported. Iteration 0 is the SFT start:
its file carries the starting policy's eval_reward_mean, measured the same way.
"""

from __future__ import annotations

import time
from typing import Any

from steps.common import (
    already_committed,
    eval_prompts,
    fetch_checkpoint,
    open_iteration,
    print_json,
    quiet_libraries,
    step_parser,
)
from steps.engine import Engine, Sampling, TransformersEngine
from steps.errors import run_cli
from steps.reward import reward_functions, score
from steps.storage import RunStorage


def greedy_reward_mean(engine: Engine, records: list[dict], functions: list, max_new_tokens: int) -> float:
    prompts = [engine.tokenizer(r["prompt"])["input_ids"] for r in records]
    sampling = Sampling(n=1, temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    completions = engine.generate(prompts, sampling)
    responses = [engine.tokenizer.decode(c[0].token_ids, skip_special_tokens=True) for c in completions]
    return sum(score(functions, r, text) for r, text in zip(records, responses, strict=False)) / len(records)


def iteration_metrics(storage: RunStorage, iteration: int, eval_reward_mean: float) -> dict[str, Any]:
    folder = storage.reports(iteration)
    reports = {name.removesuffix(".json"): storage.read_json(f"{folder}/{name}") for name in storage.list(folder)}
    rollouts = [r for name, r in reports.items() if name.startswith("rollout-")]
    train, reward = reports.get("train", {}), reports.get("reward", {})
    return {
        "iteration": iteration,
        "eval_reward_mean": eval_reward_mean,
        "reward_mean": reward.get("reward_mean"),
        "kl": train.get("kl"),
        "loss": train.get("loss"),
        "logprob_mismatch": train.get("logprob_mismatch"),
        "behavior_kl": train.get("behavior_kl"),
        "clip_fraction": train.get("clip_fraction"),
        # Shards generate side by side, so their rates add up.
        "tokens_per_second": sum(r["tokens_per_second"] for r in rollouts) if rollouts else None,
        "step_seconds": {name: report["seconds"] for name, report in sorted(reports.items())},
    }


def evaluate(run_uri: str, iteration: int) -> dict[str, Any]:
    started = time.perf_counter()
    storage, config = open_iteration(run_uri, iteration, first=0)
    output = storage.metrics(iteration)
    if storage.exists(output):
        return already_committed(storage, output)
    # The measuring stick stays the same whatever the rollout engine: transformers, greedy.
    engine = TransformersEngine(fetch_checkpoint(storage, iteration))
    records = eval_prompts(storage)[: config.eval.max_prompts]
    eval_reward = greedy_reward_mean(engine, records, reward_functions(config.reward), config.rollout.max_new_tokens)
    storage.write_json(storage.report(iteration, "evaluate"), {"seconds": round(time.perf_counter() - started, 3)})
    metrics = iteration_metrics(storage, iteration, eval_reward)
    storage.write_json(output, metrics)
    return metrics


def main() -> None:
    args = step_parser(__doc__).parse_args()
    quiet_libraries()
    print_json(evaluate(args.run, args.iteration))


if __name__ == "__main__":
    run_cli(main)
