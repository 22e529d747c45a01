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

Measured by the local runner, the steps shared the machine's cores (`moeloop.workflows.local.cores`): a step beside
another ran on part of them. There each figure is one core's (a rate over c ** a for the c cores' worth the step
held, seconds times c ** a, with a the step's core scaling fitted across the runs), the shares replayed over the
reports' stamps, so that a plan can play them on other shares.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Any

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.run import RunStorage, open_run
from moeloop.workflows.capacity.schedule import GraphTask, plan_dag
from moeloop.workflows.local.cores import held_cores

GB = 1e9
METRICS_NAME = re.compile(r"iter-(\d{6})\.json")
STEPS = ("rollout", "reward", "train", "publish", "evaluate")
PER_CORE = {"tokens/s": "tokens/s per core", "s": "core-s", "s/GB": "core-s/GB"}


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
    "rollout_overhead_seconds": ("s", "rollout-*.json seconds - generate_seconds - fetch_wait_seconds"),
    "fetch_seconds_per_gb": ("s/GB", "rollout-*.json fetch_seconds / fetched_bytes (the checkpoint's, or deltas')"),
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


def _iteration_samples(
    storage: RunStorage, config: MoeloopConfig, i: int, reports: dict[str, dict], effective: dict[str, float] | None
) -> dict:
    """One iteration's samples of every rate in MEASURES; `effective`: the cores' worth each report's step ran at
    (per core figures), None: per GPU."""
    where = storage.reports(i)
    samples: dict[str, list[float]] = {name: [] for name in MEASURES}

    def per(name: str, gpus: int) -> float:  # what a rate is divided by, seconds multiplied by
        return effective[f"{i}/{name}"] if effective is not None else gpus

    tokens = 0.0
    for name, r in sorted((n, r) for n, r in reports.items() if n.startswith("rollout-")):
        shard, cores = f"{where}/{name}.json", per(name, 1)
        fetched, count = _field(r, "fetch_seconds", shard), _field(r, "samples", shard)
        rate = _field(r, "tokens_per_second", shard)
        if rate <= 0:
            raise MoeloopError(f"{shard}: tokens_per_second is {rate:g}: a measured rate of zero, nothing to plan from")
        samples["rollout_tokens_per_second_per_gpu"].append(rate / per(name, config.rollout.vllm.tensor_parallel_size))
        # What the shard waited for its fetch: a delta's runs beside its writing (older reports: fetched, then written)
        waited = r.get("fetch_wait_seconds", fetched)
        samples["rollout_overhead_seconds"].append(
            cores * (r["seconds"] - _field(r, "generate_seconds", shard) - waited)
        )
        # What the shard fetched: its checkpoint, or the deltas its engine moved by (none: it held the version).
        fetched_gb = r["fetched_bytes"] / GB if "fetched_bytes" in r else None
        fetched_gb = _folder_gb(storage, storage.checkpoint(r["policy_version"])) if fetched_gb is None else fetched_gb
        if fetched_gb > 0:
            samples["fetch_seconds_per_gb"].append(cores * fetched / fetched_gb)
        samples["prompt_tokens"].append(_field(r, "prompt_tokens", shard) / count)
        samples["response_tokens"].append(_field(r, "response_tokens", shard) / count)
        tokens += r["prompt_tokens"] + r["response_tokens"]
    reward, train = reports["reward"], reports["train"]
    samples["reward_seconds_per_sample"].append(per("reward", 1) * reward["seconds"] / reward["samples"])
    rate = _field(train, "train_tokens_per_second", f"{where}/train.json")
    if rate <= 0:
        raise MoeloopError(f"{where}/train.json: train_tokens_per_second is {rate:g}: a measured rate of zero")
    samples["train_tokens_per_second_per_gpu"].append(rate / per("train", config.trainer.world_size))
    overhead = max(0.0, train["seconds"] - tokens * config.trainer.epochs / rate)
    samples["train_overhead_seconds"].append(per("train", 1) * overhead)
    publish_gb = _folder_gb(storage, storage.checkpoint(i))
    samples["publish_seconds_per_gb"].append(per("publish", 1) * reports["publish"]["seconds"] / publish_gb)
    samples["evaluate_seconds"].append(per("evaluate", 1) * reports["evaluate"]["seconds"])
    return samples


@dataclass(frozen=True)
class _Run:
    uri: str
    storage: RunStorage
    config: MoeloopConfig
    tasks: list[GraphTask]
    steady: list[int]
    reports: dict[int, dict[str, dict[str, Any]]]  # the steady iterations' and what they waited for
    held: dict[str, float] | None  # "iteration/report" -> the cores' worth its step held (local runs)


def _load_run(uri: str, cores: int | None) -> _Run:
    storage, config = open_run(uri)
    done = committed_iterations(storage)
    if not done:
        raise MoeloopError(f"run {uri} has no committed iteration yet (no metrics/iter-N.json with N >= 1)")
    skip = 1 + config.rollout.max_staleness
    steady = done[skip:] if len(done) > skip else done
    tasks = plan_dag(config, config.rollout.num_shards, config.rollout.max_staleness, config.iterations)
    by_name = {task.name: task for task in tasks}
    # The steady iterations' reports, and those of everything they waited for (with staleness s, a rollout
    # waits for the publish s + 1 iterations back).
    needed = {by_name[d].iteration for t in tasks if t.iteration in steady for d in t.dependencies} | set(steady)
    reports = {i: _reports(storage, i) for i in needed}
    held = _held_cores(storage, config.iterations, cores) if cores else None
    return _Run(uri, storage, config, tasks, steady, reports, held)


def measure_run(uri: str, cores: int | None = None, also: tuple[str, ...] = ()) -> Measured:
    """The run's rates; its DAG (`plan_dag`) says what each step of the run waited for.
    `cores`: the run's steps shared that many cores under the local runner; its figures are then per core, each
    step's scaling with its cores fitted where the runs have it at different shares (`core_scaling`). `also`:
    more runs of the same model on the same machine, whose samples are pooled with the run's."""
    runs = [_load_run(u, cores) for u in (uri, *also)]
    first = runs[0]
    model_config = first.storage.read_json(f"{first.storage.checkpoint(0)}/config.json")
    for run in runs[1:]:
        if run.storage.read_json(f"{run.storage.checkpoint(0)}/config.json") != model_config:
            raise MoeloopError(f"run {run.uri} trains another model than {uri}: plan from runs of one model")
    steady = first.steady
    span = f"reports/iter-{steady[0]:06d}" + (f"..{steady[-1]:06d}" if len(steady) > 1 else "")
    of = f"of {sum(len(r.steady) for r in runs)} iterations" + (f" of {len(runs)} runs" if also else "")
    figures: dict[str, Figure] = {}
    effective: list[dict[str, float] | None] = [None] * len(runs)
    if cores:
        figures = core_scaling(runs)
        exponent = {step: figures[f"core_scaling.{step}"].value for step in STEPS}
        effective = [
            {key: held ** exponent[_step(key)] for key, held in run.held.items() if _step(key) in exponent}
            for run in runs
        ]
    samples: dict[str, list[float]] = {name: [] for name in MEASURES}
    for run, cores_worth in zip(runs, effective, strict=True):
        for i in run.steady:
            for name, values in _iteration_samples(run.storage, run.config, i, run.reports[i], cores_worth).items():
                samples[name] += values
    for name, (unit, what) in MEASURES.items():
        source = f"measured: {span}/{what} (median {of})"
        if cores and unit != "tokens":
            unit, source = PER_CORE[unit], f"{source}, per core: the local runner's shares of {cores} replayed"
        figures[name] = Figure(statistics.median(samples[name]), unit, source)
    last = steady[-1]
    for name, folder in (
        ("checkpoint_gb", first.storage.checkpoint(last)),
        ("trainer_state_gb", first.storage.trainer_state(last)),
    ):
        figures[name] = Figure(_folder_gb(first.storage, folder), "GB", f"measured: {folder}/COMMIT sizes")
    gaps: dict[str, list[float]] = {}
    for run in runs:
        for step, gap in _start_gaps(run.tasks, run.reports, set(run.steady)).items():
            gaps.setdefault(step, []).append(gap)
    for step, values in gaps.items():
        source = f"measured: {span}/*.json started_at - the last dependency's ended_at (least {of})"
        figures[f"start_seconds.{step}"] = Figure(min(values), "s", source)
    periods = [first.storage.read_json(first.storage.metrics(i)).get("iteration_seconds") for i in steady]
    periods = [p for p in periods if p is not None]
    iteration_seconds = Figure(
        statistics.mean(periods) if periods else 0.0,
        "s",
        f"measured: metrics/iter-*.json iteration_seconds (mean of {len(steady)} iterations)",
    )
    return Measured(first.config, model_config, figures, iteration_seconds)


def _step(key: str) -> str:
    """The step of an "iteration/report" key: rollout-3 -> rollout."""
    return key.split("/", 1)[1].split("-", 1)[0]


def core_scaling(runs: list[_Run]) -> dict[str, Figure]:
    """Per step, the exponent a of its speed on c cores, c ** a (1: linear; 0: one core's speed whatever it
    holds), fitted by least squares of log(seconds per unit of work) on log(cores held) over the steady
    samples; 1, assumed, where the samples held about one share (the runs cannot tell). Units: generated tokens
    (rollout), samples (reward), trained tokens (train), checkpoint GB (publish), one evaluation."""
    points: dict[str, list[tuple[float, float]]] = {step: [] for step in STEPS}
    for run in runs:
        for i in run.steady:
            reports = run.reports[i]
            shards = [r for name, r in reports.items() if name.startswith("rollout-")]
            tokens = sum(r["prompt_tokens"] + r["response_tokens"] for r in shards)
            units = {
                "reward": reports["reward"]["samples"],
                "train": tokens * run.config.trainer.epochs,
                "publish": _folder_gb(run.storage, run.storage.checkpoint(i)),
                "evaluate": 1.0,
            }
            for name, report in reports.items():
                step = _step(f"{i}/{name}")
                unit = report["response_tokens"] if step == "rollout" else units.get(step)
                if unit and report.get("seconds", 0) > 0 and f"{i}/{name}" in run.held:
                    points[step].append((math.log(run.held[f"{i}/{name}"]), math.log(report["seconds"] / unit)))
    return {f"core_scaling.{step}": fit_core_scaling(step, xy) for step, xy in points.items()}


def fit_core_scaling(step: str, points: list[tuple[float, float]]) -> Figure:
    """The exponent from (log cores held, log seconds per unit) points; 1, assumed, if they span less than 1.25x
    in cores."""
    xs = [x for x, _ in points]
    if not xs or max(xs) - min(xs) < math.log(1.25):
        held = f"about {math.exp(statistics.median(xs)):.2f}" if xs else "no"
        return Figure(1.0, "exponent", f"assumed: linear in cores (its samples all held {held} cores' worth)")
    mean_x, mean_y = statistics.mean(xs), statistics.mean(y for _, y in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return Figure(
        min(1.0, max(0.0, -slope)),
        "exponent",
        f"fitted: {len(points)} {step} samples at {math.exp(min(xs)):.2f}-{math.exp(max(xs)):.2f} cores' worth"
        " (log seconds per unit on log cores, least squares; within 0..1)",
    )


def _held_cores(storage: RunStorage, iterations: int, cores: int) -> dict[str, float]:
    """The cores' worth each step of the run had, "iteration/report" -> cores, from every report's stamps
    (iteration 0's and those of iterations not committed yet included: they ran beside the others)."""
    spans = {
        f"{i}/{name}": (report["started_at"], report["ended_at"])
        for i in range(iterations + 1)
        for name, report in _reports(storage, i).items()
        if "started_at" in report
    }
    return held_cores(spans, cores)


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
