"""The capacity planner against the loop: from a short calibration, predict the iteration period of three longer
runs whose shards, staleness and batch differ, then run them and compare.

    python benchmarks/planner_validation.py [--calibration-iterations 5] [--iterations 10] [--engine vllm] [--keep DIR] [--smoke]

Every run is the demo (configs/tiny.yaml) through `moeloop run`, with 10 SFT steps, 64 eval prompts and the
local runner's defaults (2 slots on pinned cores, long-lived workers). The calibration is two short runs of one
batch and shard, one synchronous and one at staleness 1: the local runner gives the train step both cores in the
first and one in the second (it starts beside publish), and how a step's speed grows with its cores is measured
only where it ran at both (`workflows/capacity/rates.py:core_scaling`). The prediction is `moeloop plan CALIBRATION
--also CALIBRATION-AHEAD --target T --format json`, T stating only the other run's batch, shards and staleness;
the measured period is the mean of `iteration_seconds` over each run's iterations after its first 2 +
max_staleness. Prints Markdown. The run folders live in a temporary directory removed at the end (`--keep DIR`:
in DIR, kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke
import yaml

REPO = Path(__file__).resolve().parents[1]
# (name, rollout shards, max_staleness, prompts per iteration, samples per prompt)
CALIBRATION = ("calibration", 1, 0, 192, 16)
CALIBRATION_AHEAD = ("calibration-ahead", 1, 1, 192, 16)
VALIDATION = (
    ("two-shards", 2, 0, 256, 16),
    ("ahead-by-one", 1, 1, 384, 8),
    ("two-shards-ahead", 2, 1, 128, 16),
)


def write_config(folder: Path, run: tuple, iterations: int, engine: str, tiny: bool = False) -> Path:
    """The run's config; tiny (--smoke): 4 prompts x 2 samples, 4 eval prompts, 1 SFT step."""
    name, shards, staleness, prompts, samples = run
    if tiny:
        prompts, samples = 4, 2
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config.update(run_name=f"plan-{name}", iterations=iterations)
    config["task"] = {key: str(REPO / "configs" / path) for key, path in config["task"].items()}
    config["model"]["sft"]["steps"] = 1 if tiny else 10  # the policy's quality does not matter, the steps' lengths do
    config["rollout"].update(
        engine=engine,
        num_shards=shards,
        max_staleness=staleness,
        prompts_per_iteration=prompts,
        samples_per_prompt=samples,
    )
    config["eval"]["max_prompts"] = 4 if tiny else 64
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def moeloop(*args: str, environment: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "moeloop.workflows.cli", *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=REPO,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"moeloop {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def measured_period(run: Path, iterations: int, staleness: int) -> float:
    metrics = [json.loads((run / "metrics" / f"iter-{i:06d}.json").read_text()) for i in range(1, iterations + 1)]
    return statistics.mean(m["iteration_seconds"] for m in metrics[2 + staleness :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calibration-iterations", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--engine", default="vllm", choices=["transformers", "vllm"])
    parser.add_argument("--keep", type=Path, help="run in this (new) folder and keep the runs, to plan from again")
    args = smoke.parse_args(parser, calibration_iterations=2, iterations=3, engine="transformers")
    validation = VALIDATION[:1] if args.smoke else VALIDATION
    if args.keep:
        args.keep.mkdir(parents=True)  # new: a folder with runs in it would be resumed, not measured

    with tempfile.TemporaryDirectory(prefix="moeloop-plan-validation-") as temporary:
        folder = args.keep.resolve() if args.keep else Path(temporary)
        environment = {**os.environ, "MOELOOP_CACHE": str(folder / "cache"), "PYTHONPATH": str(REPO)}
        load = os.getloadavg()[0]
        started = time.perf_counter()
        short = args.calibration_iterations
        for run, iterations in ((CALIBRATION, short), (CALIBRATION_AHEAD, short + 1)):  # staleness 1 skips one more
            calibration = write_config(folder, run, iterations, args.engine, args.smoke)
            moeloop("run", str(calibration), "--root", str(folder / "runs"), "--no-progress", environment=environment)
        calibration_run = folder / "runs" / f"plan-{CALIBRATION[0]}"
        also = ("--also", str(folder / "runs" / f"plan-{CALIBRATION_AHEAD[0]}"))
        own = json.loads(moeloop("plan", str(calibration_run), *also, "--format", "json", environment=environment))
        rows = []
        for run in validation:
            name, shards, staleness, prompts, samples = run
            target = folder / f"{name}-target.yaml"
            target.write_text(
                yaml.safe_dump(
                    {
                        "batch": {"prompts_per_iteration": prompts, "samples_per_prompt": samples},
                        "search": {"rollout_shards": [shards], "staleness": [staleness]},
                    }
                )
            )
            plan = json.loads(
                moeloop(
                    "plan",
                    str(calibration_run),
                    *also,
                    "--target",
                    str(target),
                    "--format",
                    "json",
                    environment=environment,
                )
            )
            config = write_config(folder, run, args.iterations, args.engine, args.smoke)
            moeloop("run", str(config), "--root", str(folder / "runs"), "--no-progress", environment=environment)
            measured = measured_period(folder / "runs" / f"plan-{name}", args.iterations, staleness)
            rows.append((run, plan["best"]["period_seconds"], plan["best"]["critical_path"], measured))
        wall = time.perf_counter() - started

    scaling = {name.removeprefix("core_scaling."): f["value"] for name, f in own["inputs"].items() if "scaling" in name}
    print(
        f"calibration: {CALIBRATION[3]} prompts x {CALIBRATION[4]}, 1 shard, staleness 0 and 1,"
        f" {args.calibration_iterations} and {args.calibration_iterations + 1} iterations; core scaling fitted"
        f" {', '.join(f'{step} {value:.2f}' for step, value in scaling.items())};"
        " the synchronous run's own period predicted"
        f" {own['calibration']['predicted_period_seconds']:.2f} s, measured"
        f" {own['calibration']['measured_period_seconds']:.2f} s. Engine {args.engine}, {os.cpu_count()} cores,"
        f" 1-minute load {load:.1f} before and {os.getloadavg()[0]:.1f} after, {wall / 60:.1f} min in all.\n"
    )
    print("| run | shards | staleness | batch | predicted s | critical path | measured s | error |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, shards, staleness, prompts, samples), predicted, path, measured in rows:
        error = (predicted - measured) / measured
        print(
            f"| {name} | {shards} | {staleness} | {prompts} x {samples} | {predicted:.2f} | {path} | {measured:.2f}"
            f" | {error:+.1%} |"
        )


if __name__ == "__main__":
    main()
