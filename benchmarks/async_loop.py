"""The asynchronous loop on the local runner: wall time per iteration with rollout.max_staleness 0 and 1.

    python benchmarks/async_loop.py [--iterations 6] [--skip 2] [--prompts 192] [--samples 16] [--epochs 1] [--smoke]
                                    [--no-pin-cores]

The demo's model and task (configs/tiny.yaml) with one rollout shard, two steps at a time (`local.parallelism`
2: on a 2-core machine each step runs on a core of its own, `local.pin_cores`, unless --no-pin-cores), and a
batch sized so that rollout and train take about as long. Each staleness runs the whole loop from scratch; the table gives the steady state, the iterations
after the first `--skip` ones: wall time per iteration (publish to publish, the metrics' iteration_seconds)
and the mean step times and waits of those iterations. Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import run_uri
from moeloop.workflows.local.runner import run_local

REPO = Path(__file__).resolve().parents[1]
COLUMNS = (
    ("iteration s", "iteration_seconds"),
    ("rollout s", "rollout_seconds"),
    ("train s", "train_seconds"),
    ("reward s", "reward_seconds"),
    ("rollout wait", "rollout_wait_seconds"),
    ("train wait", "train_wait_seconds"),
)


def benchmark_config(args: argparse.Namespace, staleness: int) -> MoeloopConfig:
    data = load_config(REPO / "configs" / "tiny.yaml").model_dump()
    data["run_name"] = f"async-bench-s{staleness}"
    data["iterations"] = args.iterations
    data["model"]["sft"]["steps"] = args.sft_steps  # the policy's quality does not matter, only the steps' lengths
    data["rollout"].update(
        engine=args.engine, num_shards=1, prompts_per_iteration=args.prompts, samples_per_prompt=args.samples
    )
    data["rollout"]["max_staleness"] = staleness
    data["trainer"].update(epochs=args.epochs)
    data["eval"]["max_prompts"] = args.eval_prompts
    data["local"].update(parallelism=2, pin_cores=args.pin_cores)
    return MoeloopConfig.model_validate(data)


def steady_state(storage: RunStorage, iterations: int, skip: int) -> dict[str, float]:
    metrics = [storage.read_json(storage.metrics(i)) for i in range(skip + 1, iterations + 1)]
    rows = [
        {
            **m,
            "train_seconds": m["step_seconds"]["train"],
            "reward_seconds": m["step_seconds"]["reward"],
            "train_wait_seconds": m["wait_seconds"]["train"],
        }
        for m in metrics
    ]
    return {field: statistics.mean(row[field] for row in rows) for _, field in COLUMNS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--skip", type=int, default=2, help="iterations left out of the steady state")
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--engine", default="vllm", choices=["transformers", "vllm"])
    parser.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--sft-steps", type=int, default=10)
    args = smoke.parse_args(parser, iterations=2, skip=1, prompts=4, samples=2, eval_prompts=2, engine="transformers",
                            sft_steps=1)  # fmt: skip

    results = {}
    with tempfile.TemporaryDirectory(prefix="moeloop-async-bench-") as folder:
        os.environ["MOELOOP_CACHE"] = f"{folder}/cache"
        for staleness in (0, 1):
            config = benchmark_config(args, staleness)
            uri = run_uri(config, f"{folder}/runs")
            started = time.perf_counter()
            run_local(config, uri, Path(folder) / "logs" / config.run_name, progress=False)
            wall = time.perf_counter() - started
            results[staleness] = {**steady_state(RunStorage(uri), args.iterations, args.skip), "wall": wall}

    print(
        f"{args.prompts} prompts x {args.samples} samples, trainer.epochs {args.epochs}, engine {args.engine},"
        f" 1 rollout shard, local.parallelism 2 on {os.cpu_count()} cores, pin_cores {args.pin_cores};"
        f" steady state = iterations {args.skip + 1}..{args.iterations} (seconds, means)\n"
    )
    print("| max_staleness | " + " | ".join(header for header, _ in COLUMNS) + " | whole run s |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for staleness, row in results.items():
        cells = [f"{row[field]:.1f}" for _, field in COLUMNS]
        print(f"| {staleness} | " + " | ".join(cells) + f" | {row['wall']:.0f} |")
    ratio = results[0]["iteration_seconds"] / results[1]["iteration_seconds"]
    print(f"\nwall time per iteration, staleness 0 / staleness 1: {ratio:.2f}x")


if __name__ == "__main__":
    main()
