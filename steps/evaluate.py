"""evaluate: greedy decoding of the held-out prompts with checkpoint N, and the iteration's metrics file.

metrics/iter-NNNNNN.json gathers what every step of the iteration reported. Iteration 0 is the SFT start:
its file carries the starting policy's eval_reward_mean, measured the same way.
"""

from __future__ import annotations

import time
from typing import Any

from moeloop.steps.common import already_committed, open_iteration, print_json, quiet_libraries, step_parser, write_report
from moeloop.steps.config import policy_version
from moeloop.steps.engines.engine import Engine, Sampling, TransformersEngine
from moeloop.steps.errors import run_cli
from moeloop.steps.observe.scalars import step_reports
from moeloop.steps.observe.trackers import record_iteration
from moeloop.steps.rewards.functions import reward_functions, score
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.metrics import read_metrics
from moeloop.steps.storage.prompts import eval_prompts
from moeloop.steps.storage.run import RunStorage


def greedy_reward_mean(engine: Engine, records: list[dict], functions: list, max_new_tokens: int) -> float:
    prompts = [engine.tokenizer(r["prompt"])["input_ids"] for r in records]
    sampling = Sampling(n=1, temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    completions = engine.generate(prompts, sampling)
    responses = [engine.tokenizer.decode(c[0].token_ids, skip_special_tokens=True) for c in completions]
    scores = [
        score(functions, record, text, f"eval prompt {number}")
        for number, (record, text) in enumerate(zip(records, responses, strict=False), start=1)
    ]
    return sum(scores) / len(records)


def router_health(train: dict[str, Any]) -> dict[str, float] | None:
    """The train report's router health (steps/rl/router_health.py) as the metrics' `router` dict: `load_imbalance`,
    `load_imbalance_layer_<l>`, `entropy`, `routing_agreement` (None before a train report has them)."""
    health = {key.removeprefix("router_"): v for key, v in train.items() if key.startswith(("router_", "routing_"))}
    return health or None


def iteration_metrics(storage: RunStorage, iteration: int, eval_reward_mean: float) -> dict[str, Any]:
    reports = step_reports(storage, iteration)
    rollouts = [r for name, r in reports.items() if name.startswith("rollout-")]
    train, reward = reports.get("train", {}), reports.get("reward", {})
    return {
        "iteration": iteration,
        "eval_reward_mean": eval_reward_mean,
        "reward_mean": reward.get("reward_mean"),
        "kl": train.get("kl"),
        "kl_samples": train.get("kl_samples"),  # how many of the batch's samples kl is measured on
        "loss": train.get("loss"),
        "logprob_mismatch": train.get("logprob_mismatch"),
        "behavior_kl": train.get("behavior_kl"),
        "entropy": train.get("entropy"),  # the policy's mean token entropy over the update's forwards
        "clip_fraction_binding": train.get("clip_fraction_binding"),
        "clip_fraction_out_of_range": train.get("clip_fraction_out_of_range"),
        "mismatch_masked": train.get("mismatch_masked"),  # algorithm.mismatch's share of response tokens dropped
        "router": router_health(train),
        # Shards generate side by side, so their rates add up.
        "tokens_per_second": sum(r["tokens_per_second"] for r in rollouts) if rollouts else None,
        # The stalest sample's: how far the policy version the rollouts stamped on their rows is behind the
        # synchronous loop's.
        "staleness": policy_version(iteration, 0) - min(r["policy_version"] for r in rollouts) if rollouts else None,
        "step_seconds": {name: report["seconds"] for name, report in sorted(reports.items())},
        **balance(iteration, reports, step_reports(storage, iteration - 1) if iteration else {}),
    }


def balance(iteration: int, reports: dict[str, dict], previous: dict[str, dict]) -> dict[str, Any]:
    """How long the steps took and how long they stood idle waiting on each other, from their reports'
    wall-clock stamps. A step's wait runs from the end of its own run one iteration earlier (the same shard's,
    for a rollout; the start's, for iteration 1) to its start: the rollouts wait on the policy, reward on
    the rollouts, train on the experience. None where a report has no stamps, and at iteration 0."""
    if not iteration:
        return dict.fromkeys(("rollout_seconds", "wait_seconds", "rollout_wait_seconds", "iteration_seconds"))

    def before(name: str) -> dict[str, Any] | None:
        return previous.get("start" if iteration == 1 else name)

    rollouts = [name for name in sorted(reports) if name.startswith("rollout-")]
    waits = {name: elapsed(before(name), reports.get(name), "started_at") for name in [*rollouts, "reward", "train"]}
    rollout_waits = [waits[name] for name in rollouts if waits[name] is not None]
    return {
        "rollout_seconds": max(reports[name]["seconds"] for name in rollouts) if rollouts else None,  # the slowest
        "wait_seconds": waits,
        # What every shard waited (a shard that finished early waits longer on the same policy).
        "rollout_wait_seconds": min(rollout_waits) if rollout_waits else None,
        # The loop's period: from one publish to the next.
        "iteration_seconds": elapsed(before("publish"), reports.get("publish")),
    }


def elapsed(earlier: dict[str, Any] | None, later: dict[str, Any] | None, until: str = "ended_at") -> float | None:
    """Seconds from `earlier`'s end to `later`'s start or end; never below 0 (pods of one role may overlap)."""
    if not earlier or not later or "ended_at" not in earlier or until not in later:
        return None
    return round(max(0.0, later[until] - earlier["ended_at"]), 3)


def evaluate(run_uri: str, iteration: int) -> dict[str, Any]:
    started = time.perf_counter()
    storage, config = open_iteration(run_uri, iteration, first=0)
    output = storage.metrics(iteration)
    if storage.exists(output):
        read_metrics(storage, iteration)  # this iteration's, or foreign data: an error
        record_iteration(storage, config, iteration)  # a retry after the commit still records it
        return already_committed(storage, output)
    # The measuring stick stays the same whatever the rollout engine: transformers, greedy.
    engine = TransformersEngine(fetch_checkpoint(storage, iteration))
    records = eval_prompts(storage)[: config.eval.max_prompts]
    eval_reward = greedy_reward_mean(engine, records, reward_functions(config.reward), config.rollout.max_new_tokens)
    write_report(storage, iteration, "evaluate", {"seconds": round(time.perf_counter() - started, 3)})
    metrics = iteration_metrics(storage, iteration, eval_reward)
    storage.write_json(output, metrics)
    record_iteration(storage, config, iteration)
    return metrics


def main() -> None:
    args = step_parser(__doc__).parse_args()
    quiet_libraries()
    print_json(evaluate(args.run, args.iteration))


if __name__ == "__main__":
    run_cli(main)
