"""What a run measured, per unit of work, from its committed reports.

An iteration counts once its metrics file is committed (evaluate writes it last, so all its reports are in).
The first 1 + max_staleness iterations are left out where there are more: they pay the engines' start and
imports, and rollouts ahead of training there start together. Each rate is the median over the rest
(over shards too), the least noisy middle on a shared machine. Rates are per unit of work so that another
batch, shard count or train size can be planned from them:

- rollout: generated tokens/s of one shard, over its GPUs (tensor parallelism); the rest of the shard's
  `seconds` after generating and fetching the checkpoint is its overhead (engine reload, tokenising, writing);
  the fetch per GB of the checkpoint it loaded;
- reward: seconds per sample;
- train: tokens/s of the update per GPU (tokens x epochs / the update's seconds, as the report's
  `train_tokens_per_second`); the rest of the step is its overhead (loading and saving its state, the
  reference model, reading the experience);
- publish: seconds per GB of the checkpoint; evaluate: seconds;
- start-up per step: the least gap between a step's start and its last dependency's end (the predecessor's
  commit, the process or pod start). The least, not the median: waiting for a free slot or worker is the
  schedule's to predict, not the step's.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from steps.capacity.schedule import GraphTask
from steps.common import open_run
from steps.config import MoeloopConfig
from steps.errors import MoeloopError
from steps.storage.run import RunStorage

GB = 1e9
METRICS_NAME = re.compile(r"iter-(\d{6})\.json")
STEPS = ("rollout", "reward", "train", "publish", "evaluate")


@dataclass(frozen=True)
class Figure:
    """A number the plan rests on, with where it came from: measured (which files), stated (which file),
    assumed (why), or derived from other figures."""

    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class Measured:
    config: MoeloopConfig
    model_config: dict[str, Any]  # checkpoint 0's config.json
    figures: dict[str, Figure]
    iteration_seconds: Figure  # the run's own period over them, to hold the plan of its own setup against


def committed_iterations(storage: RunStorage) -> list[int]:
    found = [int(m[1]) for name in storage.list("metrics") if (m := METRICS_NAME.fullmatch(name))]
    return sorted(i for i in found if i >= 1)


# Each rate: its unit and what it is made of, per shard or step and iteration; the figure is the median.
MEASURES = {
    "rollout_tokens_per_second_per_gpu": ("tokens/s", "rollout-*.json tokens_per_second / GPUs a shard"),
    "rollout_overhead_seconds": ("s", "rollout-*.json seconds - generate_seconds - fetch_seconds"),
    "fetch_seconds_per_gb": ("s/GB", "rollout-*.json fetch_seconds / the checkpoint's GB"),
    "prompt_tokens": ("tokens", "rollout-*.json prompt_tokens / samples"),
    "response_tokens": ("tokens", "rollout-*.json response_tokens / samples"),
    "reward_seconds_per_sample": ("s", "reward.json seconds / samples"),
    "train_tokens_per_second_per_gpu": ("tokens/s", "train.json train_tokens_per_second / world_size"),
    "train_overhead_seconds": ("s", "train.json seconds - tokens x epochs / train_tokens_per_second"),
    "publish_seconds_per_gb": ("s/GB", "publish.json seconds / the checkpoint's GB"),
    "evaluate_seconds": ("s", "evaluate.json seconds"),
}


def _field(report: dict[str, Any], name: str, where: str) -> float:
    if name not in report:
        raise MoeloopError(f"{where} has no {name!r} (written by an older moeloop): plan from a newer run")
    return float(report[name])


def _folder_gb(storage: RunStorage, folder: str) -> float:
    manifest = storage.manifest(folder)
    if manifest is None:
        raise MoeloopError(f"{storage.display(folder)} is not committed")
    return sum(entry["size"] for entry in manifest["files"].values()) / GB


def _iteration_samples(storage: RunStorage, config: MoeloopConfig, i: int, reports: dict[str, dict]) -> dict:
    """One iteration's samples of every rate in MEASURES."""
    where = storage.reports(i)
    samples: dict[str, list[float]] = {name: [] for name in MEASURES}
    tokens = 0.0
    for name, r in sorted((n, r) for n, r in reports.items() if n.startswith("rollout-")):
        shard = f"{where}/{name}.json"
        fetched, count = _field(r, "fetch_seconds", shard), _field(r, "samples", shard)
        rate = _field(r, "tokens_per_second", shard)
        if rate <= 0:
            raise MoeloopError(f"{shard}: tokens_per_second is {rate:g}: a measured rate of zero, nothing to plan from")
        samples["rollout_tokens_per_second_per_gpu"].append(rate / config.rollout.vllm.tensor_parallel_size)
        samples["rollout_overhead_seconds"].append(r["seconds"] - _field(r, "generate_seconds", shard) - fetched)
        samples["fetch_seconds_per_gb"].append(fetched / _folder_gb(storage, storage.checkpoint(r["policy_version"])))
        samples["prompt_tokens"].append(_field(r, "prompt_tokens", shard) / count)
        samples["response_tokens"].append(_field(r, "response_tokens", shard) / count)
        tokens += r["prompt_tokens"] + r["response_tokens"]
    reward, train = reports["reward"], reports["train"]
    samples["reward_seconds_per_sample"].append(reward["seconds"] / reward["samples"])
    rate = _field(train, "train_tokens_per_second", f"{where}/train.json")
    if rate <= 0:
        raise MoeloopError(f"{where}/train.json: train_tokens_per_second is {rate:g}: a measured rate of zero")
    samples["train_tokens_per_second_per_gpu"].append(rate / config.trainer.world_size)
    samples["train_overhead_seconds"].append(max(0.0, train["seconds"] - tokens * config.trainer.epochs / rate))
    samples["publish_seconds_per_gb"].append(reports["publish"]["seconds"] / _folder_gb(storage, storage.checkpoint(i)))
    samples["evaluate_seconds"].append(reports["evaluate"]["seconds"])
    return samples


def measure_run(uri: str, dag: Callable[[MoeloopConfig], list[GraphTask]]) -> Measured:
    """The run's rates. `dag`: a config's DAG (workflows/dag.py), which says what each step of the run waited for."""
    storage, config = open_run(uri)
    done = committed_iterations(storage)
    if not done:
        raise MoeloopError(f"run {uri} has no committed iteration yet (no metrics/iter-N.json with N >= 1)")
    skip = 1 + config.rollout.max_staleness
    steady = done[skip:] if len(done) > skip else done
    tasks = dag(config)
    by_name = {task.name: task for task in tasks}
    # The steady iterations' reports, and those of everything they waited for (with staleness s, a rollout
    # waits for the publish s + 1 iterations back).
    needed = {by_name[d].iteration for t in tasks if t.iteration in steady for d in t.dependencies} | set(steady)
    reports = {i: _reports(storage, i) for i in needed}
    span = f"reports/iter-{steady[0]:06d}" + (f"..{steady[-1]:06d}" if len(steady) > 1 else "")
    of = f"of {len(steady)} iterations"
    samples: dict[str, list[float]] = {name: [] for name in MEASURES}
    for i in steady:
        for name, values in _iteration_samples(storage, config, i, reports[i]).items():
            samples[name] += values
    figures = {
        name: Figure(statistics.median(samples[name]), unit, f"measured: {span}/{what} (median {of})")
        for name, (unit, what) in MEASURES.items()
    }
    last = steady[-1]
    for name, folder in (
        ("checkpoint_gb", storage.checkpoint(last)),
        ("trainer_state_gb", storage.trainer_state(last)),
    ):
        figures[name] = Figure(_folder_gb(storage, folder), "GB", f"measured: {folder}/COMMIT sizes")
    for step, gap in _start_gaps(tasks, reports, set(steady)).items():
        source = f"measured: {span}/*.json started_at - the last dependency's ended_at (least {of})"
        figures[f"start_seconds.{step}"] = Figure(gap, "s", source)
    periods = [storage.read_json(storage.metrics(i)).get("iteration_seconds") for i in steady]
    periods = [p for p in periods if p is not None]
    iteration_seconds = Figure(
        statistics.mean(periods) if periods else 0.0,
        "s",
        f"measured: metrics/iter-*.json iteration_seconds (mean {of})",
    )
    model_config = storage.read_json(f"{storage.checkpoint(0)}/config.json")
    return Measured(config, model_config, figures, iteration_seconds)


def _reports(storage: RunStorage, iteration: int) -> dict[str, dict[str, Any]]:
    folder = storage.reports(iteration)
    return {name.removesuffix(".json"): storage.read_json(f"{folder}/{name}") for name in storage.list(folder)}


def _start_gaps(tasks: list[GraphTask], reports: dict[int, dict[str, dict]], steady: set[int]) -> dict[str, float]:
    by_name = {task.name: task for task in tasks}
    gaps: dict[str, list[float]] = {step: [] for step in STEPS}
    for task in tasks:
        if task.iteration not in steady or task.step not in gaps:
            continue
        report = reports[task.iteration].get(task.report)
        ends = [reports[by_name[d].iteration].get(by_name[d].report, {}).get("ended_at") for d in task.dependencies]
        if report and "started_at" in report and ends and None not in ends:
            gaps[task.step].append(max(0.0, report["started_at"] - max(ends)))
    return {step: min(values) for step, values in gaps.items() if values}
