"""evaluate: the held-out prompts decoded with checkpoint N, greedily (and, with eval.samples, sampled), scored by
the reward functions' worker pool; and the iteration's metrics file.

A response passes when its reward is at least eval.pass_threshold. The figures, overall and per data_source: the
greedy responses' mean reward and pass@1 (the share of prompts whose greedy response passes), and pass@k for each k of
eval.k over eval.samples responses sampled as the rollouts sample, by the unbiased estimator of Chen et al. 2021
("Evaluating Large Language Models Trained on Code"), averaged over the prompts.
metrics/iter-NNNNNN.json gathers them and what every step of the iteration reported. Iteration 0 is the SFT start:
its file carries the starting policy's figures, measured the same way.
"""

from __future__ import annotations

import math
import time
from typing import Any

from moeloop.steps.common import already_committed, open_iteration, print_json, quiet_libraries, step_parser
from moeloop.steps.config import MoeloopConfig, derive_seed, policy_version
from moeloop.steps.engines.engine import Engine, Sampling, TransformersEngine
from moeloop.steps.errors import run_cli
from moeloop.steps.observe.scalars import step_reports
from moeloop.steps.observe.trackers import record_iteration
from moeloop.steps.prompting import ChatSettings, render_prompt
from moeloop.steps.rewards.functions import by_source
from moeloop.steps.rewards.pool import RewardPool
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.metrics import read_metrics
from moeloop.steps.storage.prompt_set import prompt_count, read_prompts
from moeloop.steps.storage.reports import write_report
from moeloop.steps.storage.run import RunStorage


def evaluation(engine: Engine, records: list[dict], pool: RewardPool, config: MoeloopConfig) -> dict[str, Any]:
    """The eval figures of one checkpoint (module docstring): greedy, then sampled where eval.samples asks."""
    rollout = config.rollout
    stop = tuple(rollout.stop)
    greedy = Sampling(n=1, temperature=0.0, top_p=1.0, max_new_tokens=rollout.max_new_tokens, seed=0, stop=stop)
    names = [f"eval prompt {number}" for number in range(1, len(records) + 1)]
    greedy_rewards, failures = rewards(engine, records, greedy, pool, names, config)
    sampled_rewards = None
    if config.eval.samples:
        n = config.eval.samples
        # As the rollouts sample, from a seed of the run's own: the same at every iteration.
        seed = derive_seed(config.seed, "eval")
        sampling = Sampling(n, rollout.temperature, rollout.top_p, rollout.max_new_tokens, seed, stop=stop)
        flat, sampled_failures = rewards(engine, records, sampling, pool, names, config)
        sampled_rewards = [flat[i * n : (i + 1) * n] for i in range(len(records))]
        failures += sampled_failures
    overall, sources = eval_figures(
        records, greedy_rewards, sampled_rewards, config.eval.pass_threshold, config.eval.pass_ks()
    )
    return {
        "eval_reward_mean": overall["reward_mean"],
        "eval_pass_at_1": overall["pass_at_1"],
        "eval_pass_at_k": overall["pass_at_k"],
        "eval_by_source": sources,
        "eval_reward_failures": failures,
    }


def rewards(
    engine: Engine, records: list[dict], sampling: Sampling, pool: RewardPool, names: list[str], config: MoeloopConfig
) -> tuple[list[float], int]:
    """(the rewards of sampling.n responses to each record, record by record, and the reward calls that failed). With
    rollout.environment the responses are episodes, their rubric's reward added with its weight, as the rollouts'."""
    chat = ChatSettings.of(config)
    if config.rollout.environment is None:
        prompts = [render_prompt(engine.tokenizer, r["prompt"], chat)[1] for r in records]
        completions = [c for group in engine.generate(prompts, sampling) for c in group]
        found = [0.0] * len(completions)
    else:
        from moeloop.steps.episodes.environment import cached_environment
        from moeloop.steps.episodes.episodes import generate_episodes  # verifiers: an extra, imported where used

        settings = config.rollout.environment
        positions = engine.model.config.max_position_embeddings
        groups = generate_episodes(engine, cached_environment(settings.model_dump_json()), settings, records,
                                   list(range(len(records))), sampling, chat, positions)  # fmt: skip
        completions = [e.completion for group in groups for e in group]
        found = [settings.reward_weight * e.columns["environment_reward"] for group in groups for e in group]
    texts = [engine.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    greedy = sampling.temperature == 0
    n = 1 if greedy else sampling.n
    labels = names if greedy else [f"{name} sample {j}" for name in names for j in range(n)]
    scores = pool.score([r for r in records for _ in range(n)], texts, labels)
    return [score + extra for score, extra in zip(scores.rewards, found, strict=True)], scores.failures


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k responses drawn without replacement from n, c of which pass, passes:
    1 - C(n-c, k) / C(n, k), Chen et al. 2021's unbiased estimator of pass@k."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_figures(
    records: list[dict], greedy: list[float], sampled: list[list[float]] | None, threshold: float, ks: list[int]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the figures over all prompts, {data_source: the figures over its prompts}). The figures: prompts, the greedy
    responses' reward_mean and pass_at_1, and pass_at_k {k: ...} over the sampled responses (None without them)."""

    def figures(indices: list[int]) -> dict[str, Any]:
        passing = [sum(r >= threshold for r in sampled[i]) for i in indices] if sampled is not None else None
        return {
            "prompts": len(indices),
            "reward_mean": sum(greedy[i] for i in indices) / len(indices),
            "pass_at_1": sum(greedy[i] >= threshold for i in indices) / len(indices),
            "pass_at_k": None
            if passing is None
            else {str(k): sum(pass_at_k(len(sampled[0]), c, k) for c in passing) / len(indices) for k in ks},
        }

    return figures(list(range(len(records)))), {name: figures(indices) for name, indices in by_source(records).items()}


def router_health(train: dict[str, Any]) -> dict[str, float] | None:
    """The train report's router health (steps/rl/router_health.py) as the metrics' `router` dict: `load_imbalance`,
    `load_imbalance_layer_<l>`, `entropy`, `routing_agreement` (None before a train report has them)."""
    health = {key.removeprefix("router_"): v for key, v in train.items() if key.startswith(("router_", "routing_"))}
    return health or None


def iteration_metrics(storage: RunStorage, iteration: int, eval_figures: dict[str, Any]) -> dict[str, Any]:
    reports = step_reports(storage, iteration)
    rollouts = [r for name, r in reports.items() if name.startswith("rollout-")]
    train, reward = reports.get("train", {}), reports.get("reward", {})
    return {
        "iteration": iteration,
        **eval_figures,
        "reward_mean": reward.get("reward_mean"),
        "reward_failures": reward.get("reward_failures"),  # calls counted as 0 under reward.on_error zero
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
        # The share of the rollouts' samples cut by rollout.max_new_tokens (None for shards from before it was counted).
        "truncated_fraction": (
            sum(r["finish_length"] for r in rollouts) / sum(r["samples"] for r in rollouts)
            if rollouts and all("finish_length" in r for r in rollouts) else None
        ),  # fmt: skip
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
    count = min(config.eval.max_prompts, prompt_count(storage, "eval"))
    records = list(read_prompts(storage, "eval", range(count)).values())
    with RewardPool(config.reward, f"the evaluate step of iteration {iteration}") as pool:
        figures = evaluation(engine, records, pool, config)
    write_report(storage, iteration, "evaluate", {"seconds": round(time.perf_counter() - started, 3)})
    metrics = iteration_metrics(storage, iteration, figures)
    storage.write_json(output, metrics)
    record_iteration(storage, config, iteration)
    return metrics


def main() -> None:
    args = step_parser(__doc__).parse_args()
    quiet_libraries()
    print_json(evaluate(args.run, args.iteration))


if __name__ == "__main__":
    run_cli(main)
