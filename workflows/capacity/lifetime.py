"""The loop's shapes a plan takes, and the figures each adds to its inputs: how long the trainer lives
(`trainer.lifetime`, with `state_every`) and how long the rollout engines live (`rollout.lifetime`), each from the
target's `trainer:` and `rollout:` sections, else the planned run's or config's. `handoff.py` plans them.

A shape's figures are listed as inputs only where it is planned: the chunk's length C wherever something lives for
a chunk; a trainer per chunk's state_every, trainer_commit_seconds_per_gb, delta_write_seconds_per_gb and
train_iteration_overhead_seconds;
engines per chunk's delta_changed_fraction, delta_apply_seconds_per_gb, delta_check_seconds_per_gb, the delta's
size derived from them and its files (the checkpoint's).
"""

from __future__ import annotations

import math

from moeloop.steps.config import RolloutConfig, TrainerConfig
from moeloop.steps.errors import MoeloopError
from moeloop.workflows.capacity.handoff import CHUNK
from moeloop.workflows.capacity.rates import Figure
from moeloop.workflows.capacity.target import Rollout, Trainer

TRAINER_RATES = ("trainer_commit_seconds_per_gb", "delta_write_seconds_per_gb", "train_iteration_overhead_seconds")
ENGINE_RATES = ("delta_changed_fraction", "delta_apply_seconds_per_gb", "delta_check_seconds_per_gb")
# Unstated, an engine per chunk's rates are assumed as measured, each saying where:
ASSUMED_CHANGED_FRACTION = Figure(
    0.015,
    "fraction",
    "assumed: measured (issue 38): 1.0-1.5% of elements change a step at RL learning rate 1e-6 on one H100 (a ~1B"
    " Qwen3-MoE); 3-5% at 3e-6, 9-16% at 1e-5: state rates.delta_changed_fraction for another learning rate",
)
# Unstated, a trainer per chunk's delta write is assumed as measured on one rank, its node's ranks side by side:
ASSUMED_DELTA_WRITE_SECONDS_PER_GB = Figure(
    3.03 / 7.48 / 8,
    "s/GB",
    "assumed: benchmarks/handoff.md's write_delta as a train rank runs it, 3.03 s for its share of Qwen3-30B-A3B"
    " (6 of 48 layers, 7.48 GB) on one H100 machine's host (16 cores), a node's 8 ranks each writing its share's"
    " delta side by side (steps/rl/held.py; not measured at 8 ranks)",
)
ASSUMED_APPLY_SECONDS_PER_GB = Figure(
    1.73 / 61.06,
    "s/GB",
    "assumed: benchmarks/handoff.md's engine on a GPU at Qwen3-30B-A3B's 61.06 GB of bf16, the in-place write of a"
    " 1.5% delta 1.73 s, measured on one H100 with 16 host cores (benchmarks/engine_delta.py)",
)
ASSUMED_CHECK_SECONDS_PER_GB = Figure(
    2.99 / 61.06,
    "s/GB",
    "assumed: benchmarks/handoff.md's engine on a GPU at Qwen3-30B-A3B's 61.06 GB of bf16, the digest check after"
    " the write 2.99 s, measured alone on one H100 with 16 host cores (benchmarks/engine_delta.py)",
)


def trainer_lifetime(target: Trainer, config: TrainerConfig, where: str, source: str) -> tuple[str, str, Figure]:
    """The planned trainer's lifetime with where it comes from, and its state_every: the target's trainer section's,
    else the run's or config's (`source`: which)."""
    lifetime, said = target.lifetime, f"stated: {where} trainer.lifetime"
    if lifetime is None:
        lifetime, said = config.lifetime, f"config: {source}'s trainer.lifetime"
    every, every_said = target.state_every, f"stated: {where} trainer.state_every"
    if every is None:
        every = config.state_every if lifetime == CHUNK else 1
        every_said = f"config: {source}'s trainer.state_every" if lifetime == CHUNK else "a trainer per iteration"
    if every > 1 and lifetime != CHUNK:
        raise MoeloopError(
            f"trainer.state_every {every} needs trainer.lifetime chunk: a trainer per iteration commits every one"
        )
    return lifetime, said, Figure(every, "iterations", every_said)


def rollout_lifetime(target: Rollout, config: RolloutConfig, where: str, source: str) -> tuple[str, str]:
    """The planned rollout engines' lifetime with where it comes from: the target's rollout section's, else the
    run's or config's (`source`: which)."""
    if target.lifetime is not None:
        return target.lifetime, f"stated: {where} rollout.lifetime"
    return config.lifetime, f"config: {source}'s rollout.lifetime"


def shape_figures(
    figures: dict[str, Figure],
    trainer: str,
    every: Figure,
    rollout: str,
    local: bool,
    iterations: int,
    configured: int | None,
    shard_bytes: int,
) -> dict[str, Figure]:
    """The figures with the planned shapes' added and the rates of shapes not planned left out (they say nothing
    to them). `configured`: the config's cluster.chunk_iterations; `shard_bytes`: its trainer.checkpoint_shard_bytes."""
    found = {
        name: figure
        for name, figure in figures.items()
        if (trainer == CHUNK or name not in TRAINER_RATES) and (rollout == CHUNK or name not in ENGINE_RATES)
    }
    if CHUNK in (trainer, rollout):
        found["chunk_iterations"] = _chunk_length(local, iterations, configured)
    if trainer == CHUNK:
        found |= _trainer_figures(found, every)
    if rollout == CHUNK:
        found |= _engine_figures(found, shard_bytes)
    return found


def _chunk_length(local: bool, iterations: int, configured: int | None) -> Figure:
    if local:
        return Figure(iterations, "iterations", "the run: locally what lives for a chunk lives for all of it")
    if configured is not None:
        return Figure(
            configured, "iterations", "config: cluster.chunk_iterations (fewer where an option's tasks do not fit)"
        )
    return Figure(
        20, "iterations", "at most: workflows/render/chunk.py's 20, fewer where an option's tasks fill 200 first"
    )


def _trainer_figures(figures: dict[str, Figure], every: Figure) -> dict[str, Figure]:
    """A trainer per chunk's figures: its state_every, the per-iteration overhead (stated, else assumed all of
    train_overhead_seconds: the planner cannot tell start-up from per-iteration work) and the delta's write (stated,
    else assumed as measured); refused where the state's I/O is not stated apart from the overhead."""
    missing = [
        name for name in ("trainer_state_seconds_per_gb", "trainer_commit_seconds_per_gb") if name not in figures
    ]
    if missing:
        raise MoeloopError(
            f"trainer.lifetime chunk needs the trainer state's I/O apart from its overhead: state {', '.join(missing)}"
            " in the target's rates:"
        )
    if figures["trainer_commit_seconds_per_gb"].value > figures["trainer_state_seconds_per_gb"].value:
        raise MoeloopError(
            "rates.trainer_commit_seconds_per_gb is the commit half of trainer_state_seconds_per_gb: not more"
        )
    overhead = figures["train_overhead_seconds"]
    stated = figures.get("train_iteration_overhead_seconds")
    if stated is None:
        stated = Figure(
            overhead.value,
            "s",
            "assumed: all of train_overhead_seconds (the planner cannot tell start-up from per-iteration work:"
            " state rates.train_iteration_overhead_seconds)",
        )
    if stated.value > overhead.value:
        raise MoeloopError(
            f"rates.train_iteration_overhead_seconds {stated.value:g} is more than train_overhead_seconds"
            f" {overhead.value:g}: it is the part of it that recurs every iteration"
        )
    delta_write = figures.get("delta_write_seconds_per_gb", ASSUMED_DELTA_WRITE_SECONDS_PER_GB)
    return {"state_every": every, "train_iteration_overhead_seconds": stated, "delta_write_seconds_per_gb": delta_write}


def _engine_figures(figures: dict[str, Figure], shard_bytes: int) -> dict[str, Figure]:
    """Engines per chunk: the changed fraction and the engine's write and check rates (stated, else assumed as
    measured), the delta's size: 2 x the changed fraction x the checkpoint's bytes (steps/model/delta.py's blocks
    layout: a bf16 value and a uint16 offset, 4 bytes, per changed element of 2; the blocks' counts, 4 bytes per
    65,536 elements, left out); at most the checkpoint (publish leaves a delta no smaller out: the engines take the
    whole checkpoint); and its files F, a delta file per checkpoint file, which an engine fetches and writes in one
    beside the other (handoff.py): the checkpoint's bytes over publish's files of at most shard_bytes, rounded up
    (at least 1; the tensors, never split, may make a file or two more, a smaller overlap planned than played)."""
    fraction = figures.get("delta_changed_fraction", ASSUMED_CHANGED_FRACTION)
    apply = figures.get("delta_apply_seconds_per_gb", ASSUMED_APPLY_SECONDS_PER_GB)
    check = figures.get("delta_check_seconds_per_gb", ASSUMED_CHECK_SECONDS_PER_GB)
    checkpoint = figures["checkpoint_gb"].value
    said = "derived: checkpoint_gb x 2 x delta_changed_fraction (a bf16 value and a uint16 offset a changed element)"
    if 2 * fraction.value >= 1:
        said = "derived: the checkpoint's, a delta of 2 x delta_changed_fraction >= 1 of it is left out"
    delta = Figure(checkpoint * min(1.0, 2 * fraction.value), "GB", said)
    rates = {"delta_apply_seconds_per_gb": apply, "delta_check_seconds_per_gb": check}
    files = Figure(
        max(1, math.ceil(checkpoint * 1e9 / shard_bytes)),
        "files",
        f"derived: checkpoint_gb / trainer.checkpoint_shard_bytes ({shard_bytes / 2**30:g} GiB), rounded up: publish's"
        " safetensors files, a delta file each (Qwen3-30B-A3B's 61.06 GB: 15; its HF checkpoint has 16)",
    )
    return {"delta_changed_fraction": fraction, **rates, "delta_gb": delta, "delta_files": files}
