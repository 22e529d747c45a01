"""A new rollout engine's start with its checkpoint on S3 (SeaweedFS): the checkpoint fetched, then vLLM started on it,
against vLLM started on dummy weights beside the fetch, the weights put in place after (issue 38).

    .venv/bin/python -m benchmarks.engine_start [--layers 8] [--experts 32] [--reps 3] [--smoke]

The baseline is what a shard did before and what a careful user writes: `fetch_checkpoint`, then `engine_for` (vLLM's
`LLM` on the folder). The product is `vllm_beside_fetch` on the checkpoint's config and tokenizer
(`checkpoint_settings`), as `engine_at` runs it for a new engine on a GPU (`starts_beside_fetch`). Neither checks the
weights' digest. Each start has a cache of its own, so every fetch downloads; the two alternate, after one start
that neither row pays (imports, first compiles), each engine released before the next. vLLM runs its engine core in
a process of its own, as on a pod. A Qwen3-MoE of the demo's family, random bf16 weights, --layers x --experts of
1024-wide experts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke
import torch

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.engines.engine import engine_for, release_engine, vllm_beside_fetch
from moeloop.steps.engines.versions import checkpoint_settings
from moeloop.steps.model.policy import build_tiny_model, save_policy
from moeloop.steps.start import demo_tokenizer, start
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.prompts import task_prompt_sets
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import run_uri
from tests.conftest import REPO
from tests.seaweed import start_seaweed

GB = 1e9
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the table, not vLLM's start-up log


def run_config(layers: int, experts: int, tiny: bool) -> MoeloopConfig:
    """configs/tiny.yaml, vLLM, at the benchmark's model shape (the demo's own at --smoke)."""
    config = load_config(REPO / "configs" / "tiny.yaml")
    data = config.model_dump()
    data["rollout"]["engine"] = "vllm"
    if not tiny:
        data["model"]["tiny"] |= {"hidden_size": 1024, "moe_intermediate_size": 1024, "num_hidden_layers": layers,
                                  "num_attention_heads": 8, "num_experts": experts}  # fmt: skip
    return MoeloopConfig.model_validate(data)


def started_run(config: MoeloopConfig, work: Path, uri: str) -> RunStorage:
    """A run on S3 whose checkpoint 0 is a random bf16 policy of the config's shape, committed by start."""
    tokenizer = demo_tokenizer(task_prompt_sets(config), config)
    model = build_tiny_model(config.model.tiny, tokenizer, seed=config.seed).to(torch.bfloat16)
    save_policy(model, tokenizer, work / "model")
    del model
    model_section = config.model.model_copy(update={"checkpoint": str(work / "model")})
    start(uri, config.model_copy(update={"model": model_section}))
    return RunStorage(uri)


def fetch_then_start(storage: RunStorage, config: MoeloopConfig) -> dict[str, float]:
    started = time.perf_counter()
    folder = fetch_checkpoint(storage, 0)
    fetched = time.perf_counter() - started
    engine_for(folder, config.rollout)
    return {"seconds": time.perf_counter() - started, "fetch": fetched, "waited": fetched}


def start_beside_fetch(storage: RunStorage, config: MoeloopConfig) -> dict[str, float]:
    started = time.perf_counter()
    settings_dir = checkpoint_settings(storage, 0, storage.manifest(storage.checkpoint(0)))
    fetch = partial(fetch_checkpoint, storage, 0)
    _, _, fetched, waited = vllm_beside_fetch(settings_dir, fetch, config.rollout)
    return {"seconds": time.perf_counter() - started, "fetch": fetched, "waited": waited}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the demo's model shape")
    args = smoke.parse_args(parser, tiny=True, reps=1)

    work = Path(tempfile.mkdtemp(prefix="moeloop-engine-start-"))
    server = start_seaweed(work / "seaweedfs")
    os.environ.update(server.environment())
    config = run_config(args.layers, args.experts, args.tiny)
    times: dict[str, list[dict[str, float]]] = {"fetch, then start": [], "start beside the fetch": []}
    try:
        storage = started_run(config, work, run_uri(config, f"s3://{server.bucket}/runs"))
        size = sum(entry["size"] for entry in storage.manifest(storage.checkpoint(0))["files"].values())
        print(f"checkpoint: {size / GB:.2f} GB on SeaweedFS; {os.cpu_count()} cores", file=sys.stderr, flush=True)
        if not args.smoke:  # vLLM's imports and first compiles, paid by neither row
            os.environ["MOELOOP_CACHE"] = str(work / "cache-warm-up")
            fetch_then_start(storage, config)
            release_engine()
        for rep in range(args.reps):
            for name, run in (("fetch, then start", fetch_then_start), ("start beside the fetch", start_beside_fetch)):
                os.environ["MOELOOP_CACHE"] = str(work / f"cache-{rep}-{len(times[name])}-{run.__name__}")
                times[name].append(run(storage, config))
                release_engine()
                shutil.rmtree(os.environ["MOELOOP_CACHE"], ignore_errors=True)
    finally:
        release_engine()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"A new vLLM engine on a {size / GB:.2f} GB checkpoint, fetched from SeaweedFS; {args.reps} alternating"
        f" runs each, median (all); {torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.2f}"
    )
    print("| start | to an engine ready to generate, s | the fetch, s | of it waited for, s |")
    print("|---|---:|---:|---:|")
    for name, runs in times.items():
        cells = [f"{statistics.median(run[key] for run in runs):.2f} ({', '.join(f'{run[key]:.2f}' for run in runs)})"
                 for key in ("seconds", "fetch", "waited")]  # fmt: skip
        print(f"| {name} | {' | '.join(cells)} |")
    before, after = (statistics.median(run["seconds"] for run in runs) for runs in times.values())
    print(f"\nstart beside the fetch: {before / after:.2f}x, {before - after:.2f} s less")


if __name__ == "__main__":
    main()
