"""A rollout shard's samples: which prompts an iteration's shard takes, its rows, and the shard generated with the
process's kept engine and committed (what the rollout step and a shard's rollout engine run, steps/rollout.py and
steps/rollout_engine.py).

The batch is drawn deterministically from (run, iteration); shard k of K takes every K-th prompt, and its sampling
seed comes from (run, iteration, shard): generating a shard again gives the same samples.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from typing import Any

import pyarrow as pa
from transformers import AutoConfig

from moeloop.steps.config import MoeloopConfig, derive_seed
from moeloop.steps.engines.engine import FINISH_REASONS, Completion, Engine, Sampling
from moeloop.steps.engines.versions import DeltaUnusable, checked, committed_architecture, engine_at
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.families import num_experts
from moeloop.steps.prompting import ChatSettings, render_prompt
from moeloop.steps.storage.experience import EPISODE_COLUMNS, ROLLOUT_SCHEMA, rollout_schema, table_bytes
from moeloop.steps.storage.prompt_set import prompt_count, read_prompts
from moeloop.steps.storage.reports import write_report
from moeloop.steps.storage.run import RunStorage


def add_shard_arguments(parser: argparse.ArgumentParser) -> None:
    """The rollout step's and a shard's engine's --shard and --num-shards."""
    parser.add_argument("--shard", type=int, required=True, help="this shard's index, 0..K-1")
    parser.add_argument("--num-shards", type=int, required=True, help="K, the run's rollout.num_shards")


def check_shard(config: MoeloopConfig, shard: int, num_shards: int) -> None:
    if num_shards != config.rollout.num_shards:
        raise MoeloopError(
            f"--num-shards {num_shards} does not match the run's rollout.num_shards {config.rollout.num_shards}"
        )
    if not 0 <= shard < num_shards:
        raise MoeloopError(f"--shard {shard} is outside 0..{num_shards - 1}")


def iteration_prompt_ids(config: MoeloopConfig, num_prompts: int, iteration: int) -> list[int]:
    """The prompts of iteration's batch (rows of the train prompt set, data/train/): its slice of its epoch's seeded
    permutation of all prompts, as a shuffling data loader's epochs, so no prompt comes twice before every prompt has
    come once (drawn afresh for every iteration, 10% of the demo's 24 batches' prompts were repeats). The last
    num_prompts % batch of each permutation are left to the next epoch's. A function of (run, seed, iteration)."""
    batch = min(config.rollout.prompts_per_iteration, num_prompts)
    epoch, slot = divmod(iteration - 1, num_prompts // batch)
    order = list(range(num_prompts))
    random.Random(derive_seed(config.run_name, config.seed, "prompts", epoch)).shuffle(order)
    return order[slot * batch : (slot + 1) * batch]


def shard_prompt_ids(prompt_ids: list[int], shard: int, num_shards: int) -> list[int]:
    return prompt_ids[shard::num_shards]


def rollout_rows(
    iteration: int,
    shard: int,
    policy_version: int,
    engine_name: str,
    prompt_ids: list[int],
    rendered: list[tuple[str, list[int]]],
    completions: list[list[Completion]],
    decode: Any,
    routed_layers: tuple[int, ...] = (),
    episodes: list[list[dict[str, Any]]] | None = None,
) -> dict[str, list]:
    """The shard's columns; routed_layers: the decoder layer of each layer of the samples' routes; episodes: each
    sample's episode columns where the samples are episodes (`moeloop.steps.episodes.episodes.Episode`)."""
    columns: dict[str, list] = {name: [] for name in ROLLOUT_SCHEMA.names}
    rows = zip(prompt_ids, rendered, completions, strict=True)
    for position, (prompt_id, (text, tokens), samples) in enumerate(rows):
        for index, sample in enumerate(samples):
            row = dict.fromkeys(EPISODE_COLUMNS) if episodes is None else episodes[position][index]
            row |= {
                "sample_id": f"{iteration}-{prompt_id}-{index}",
                "iteration": iteration,
                "shard": shard,
                "prompt_id": prompt_id,
                "sample_index": index,
                "prompt_text": text,
                "prompt_token_ids": tokens,
                "response_token_ids": sample.token_ids,
                "response_text": decode(sample.token_ids),
                "behavior_logprobs": sample.logprobs,
                "finish_reason": sample.finish_reason,
                "policy_version": policy_version,
                "engine": engine_name,
                "routed_experts": None if sample.routed_experts is None else sample.routed_experts.reshape(-1),
                "routed_layers": None if sample.routed_experts is None else list(routed_layers),
            }
            for name, value in row.items():
                columns[name].append(value)
    return columns


def generate_shard(
    storage: RunStorage, config: MoeloopConfig, iteration: int, shard: int, num_shards: int, step_started: float
) -> dict[str, Any]:
    """Generate the shard with this process's engine at the iteration's policy version, and commit it (its report
    first: the shard is the commit point, and a re-run after a crash rewrites both). The report. An engine that moved
    by deltas has its weights' digest checked beside the generating, before any row is kept: where it is not the
    version's, the rows are dropped and the shard generated again after a full load."""
    output = storage.rollout_shard(iteration, shard, num_shards)
    policy_version = config.rollout.policy_version(iteration)  # iteration - 1 unless running ahead of training
    at_version = (storage, policy_version, config.rollout, config.records_routing)
    engine, policy_update = engine_at(*at_version, check_later=True)
    batch = iteration_prompt_ids(config, prompt_count(storage, "train"), iteration)
    prompt_ids = shard_prompt_ids(batch, shard, num_shards)
    records = read_prompts(storage, "train", prompt_ids)
    chat = ChatSettings.of(config)
    rendered = [render_prompt(engine.tokenizer, records[i]["prompt"], chat) for i in prompt_ids]
    sampling = Sampling(
        n=config.rollout.samples_per_prompt,
        temperature=config.rollout.temperature,
        top_p=config.rollout.top_p,
        max_new_tokens=config.rollout.max_new_tokens,
        seed=derive_seed(config.run_name, config.seed, "rollout", iteration, shard),
        record_routing=config.records_routing,
        prompt_routes=config.rollout.prompt_routes,
        stop=tuple(config.rollout.stop),
    )
    architecture = AutoConfig.for_model(**committed_architecture(storage, policy_version)[2])

    def sample(engine: Engine) -> tuple[list[list[Completion]], list[list[dict[str, Any]]] | None]:
        """The shard's completions, and its episodes where the samples are episodes."""
        if config.rollout.environment is None:
            return engine.generate([tokens for _, tokens in rendered], sampling), None
        from moeloop.steps.episodes.environment import cached_environment
        from moeloop.steps.episodes.episodes import generate_episodes  # verifiers: an extra, imported where used

        environment = cached_environment(config.rollout.environment.model_dump_json())
        positions = min(architecture.max_position_embeddings, config.rollout.vllm.max_model_len or 1 << 62)
        found = generate_episodes(engine, environment, config.rollout.environment, [records[i] for i in prompt_ids],
                                  prompt_ids, sampling, chat, positions)  # fmt: skip
        return [[e.completion for e in group] for group in found], [[e.columns for e in group] for group in found]

    started = time.perf_counter()
    completions, episodes = sample(engine)
    try:
        policy_update["digest_wait_seconds"] = round(checked(engine), 3)
    except DeltaUnusable as why:  # sampled with other weights than the version's: no row is kept
        engine, policy_update = engine_at(*at_version)
        policy_update["fallback"] = f"{why}, found beside the generating: the shard generated again"
        started = time.perf_counter()
        completions, episodes = sample(engine)
    generate_seconds = time.perf_counter() - started
    columns = rollout_rows(
        iteration,
        shard,
        policy_version,
        engine.name,
        prompt_ids,
        rendered,
        completions,
        lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True),
        engine.routed_layers,
        episodes,
    )
    tokens = sum(len(ids) for ids in columns["response_token_ids"])
    report = {
        "policy_version": policy_version,  # the version stamped on every row: evaluate derives the staleness
        "engine": engine.name,
        # How the engine took the policy (moeloop.steps.engines.versions.engine_at): policy_update kept, delta or
        # full (fallback: why not by delta), engine_reused, fetch_seconds (the verified fetch of the checkpoint, from
        # the cache: its check; or of the deltas, on a thread beside their writing), fetched_bytes,
        # fetch_wait_seconds (how long the update waited for the fetch: a checkpoint's whole fetch, or what the
        # deltas' writing waited for their files), engine_seconds (the update's time less fetch_wait_seconds:
        # building the engine and checking its weights, or writing the new weights into it), digest_wait_seconds (how
        # long the step waited, after generating, for a delta's digest check that ran beside it).
        **policy_update,
        "samples": len(columns["sample_id"]),
        "prompt_tokens": sum(len(ids) for ids in columns["prompt_token_ids"]),  # counted once per sample
        "response_tokens": tokens,
        # Why the samples ended (FINISH_REASONS): "length" counts those cut by max_new_tokens.
        **{f"finish_{reason}": columns["finish_reason"].count(reason) for reason in FINISH_REASONS},
        "generate_seconds": round(generate_seconds, 3),
        "tokens_per_second": round(tokens / max(generate_seconds, 1e-9), 1),
        "seconds": round(time.perf_counter() - step_started, 3),
    }
    # The report goes first: the shard is the commit point, and a re-run after a crash rewrites both.
    write_report(storage, iteration, f"rollout-{shard}", report)
    schema = rollout_schema(num_experts(architecture))
    storage.write_bytes(output, table_bytes(pa.table(columns, schema=schema)))
    return report


def exit_on_sigterm() -> None:
    """Spot reclaim: Kubernetes sends SIGTERM, then SIGKILL after the grace period. Stop at once: the shard
    is written in one atomic put at the end, so stopping leaves nothing behind and a retry starts clean."""

    def stop(signum: int, frame: object) -> None:
        print("rollout: SIGTERM, stopping without writing", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
