"""Rollout engines on the demo's tiny Qwen3-MoE: generation throughput, and engine reuse across iterations.

    python benchmarks/rollout_engines.py [--iterations 4] [--prompts 192] [--samples 16] [--engine vllm] [--smoke]

(a) tokens/s of vLLM and transformers `generate` on the same prompts and sampling settings, after one
    warm-up batch; (b) an iteration's engine cost with a new engine per checkpoint against one engine that
    loads each new checkpoint in place (`moeloop.steps.engines.engine.engine_for`). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke
import torch

from moeloop.steps.config import load_config
from moeloop.steps.engines.engine import Sampling, engine_for, make_engine, release_engine
from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy
from moeloop.steps.storage.prompts import read_prompt_set

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the table, not vLLM's start-up log


def make_checkpoints(directory: Path, count: int) -> list[Path]:
    """count checkpoints of the demo's architecture with different weights, like successive iterations."""
    config = load_config(REPO / "configs" / "tiny.yaml")
    records = read_prompt_set(config.task.train_prompts, config.task)[0]
    tokenizer = build_tokenizer(r["prompt"] + r["answer"] for r in records)
    checkpoints = []
    for index in range(count):
        model = build_tiny_model(config.model.tiny, tokenizer, seed=index)
        save_policy(model, tokenizer, directory / f"iter-{index}")
        checkpoints.append(directory / f"iter-{index}")
    return checkpoints


def throughput(engine_name: str, checkpoint: Path, prompts: list[list[int]], sampling: Sampling) -> float:
    config = load_config(REPO / "configs" / "tiny.yaml").rollout
    engine = make_engine(engine_name, checkpoint, config)
    try:
        engine.generate(prompts[:16], sampling)  # warm-up
        started = time.perf_counter()
        completions = engine.generate(prompts, sampling)
        seconds = time.perf_counter() - started
    finally:
        engine.close()
    return sum(len(c.token_ids) for samples in completions for c in samples) / seconds


def iteration_seconds(
    reuse: bool, checkpoints: list[Path], prompts: list[list[int]], sampling: Sampling, engine_name: str
) -> list[float]:
    """Wall time of each iteration: get an engine for that iteration's checkpoint, then generate."""
    rollout = load_config(REPO / "configs" / "tiny.yaml").rollout.model_copy(update={"engine": engine_name})
    times = []
    for checkpoint in checkpoints:
        if not reuse:
            release_engine()
        started = time.perf_counter()
        engine, _ = engine_for(checkpoint, rollout)
        engine.generate(prompts, sampling)
        times.append(time.perf_counter() - started)
    release_engine()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument(
        "--engine", default="vllm", help="the engine of (b); --smoke: transformers (vLLM starts in (a))"
    )
    args = smoke.parse_args(parser, iterations=2, prompts=4, samples=2, engine="transformers")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        checkpoints = make_checkpoints(Path(directory), args.iterations)
        config = load_config(REPO / "configs" / "tiny.yaml")
        records = read_prompt_set(config.task.train_prompts, config.task)[0]
        tokenizer = build_tokenizer(r["prompt"] + r["answer"] for r in records)
        records = records[: args.prompts]
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in records]
        sampling = Sampling(n=args.samples, temperature=1.0, top_p=1.0, max_new_tokens=10, seed=0)

        rates = {name: throughput(name, checkpoints[0], prompts, sampling) for name in ("transformers", "vllm")}
        fresh = iteration_seconds(False, checkpoints, prompts, sampling, args.engine)
        reused = iteration_seconds(True, checkpoints, prompts, sampling, args.engine)

    print(f"{args.prompts} prompts x {args.samples} samples, <= 10 new tokens, torch threads {torch.get_num_threads()}")
    print()
    print("| engine | tokens/s | vs transformers |")
    print("|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} | {rate / rates['transformers']:.2f}x |")
    print()
    print(f"| {args.engine} engine per iteration | first iteration s | later iterations, mean s |")
    print("|---|---|---|")
    later_fresh, later_reused = sum(fresh[1:]) / len(fresh[1:]), sum(reused[1:]) / len(reused[1:])
    print(f"| new engine each iteration | {fresh[0]:.1f} | {later_fresh:.2f} |")
    print(f"| one engine, weights reloaded in place | {reused[0]:.1f} | {later_reused:.2f} |")
    print(
        f"\nin-place reload saves {later_fresh - later_reused:.1f} s per iteration ({later_fresh / later_reused:.1f}x)"
    )


if __name__ == "__main__":
    main()
