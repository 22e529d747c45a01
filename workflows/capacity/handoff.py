"""The trainer's lifetime (`trainer.lifetime`) and the policy's handoff: what each step pays every iteration for the
trainer's start-up and state, the rollout engines' start and the checkpoint's way from the trainer to the rollouts;
and how much of it lies on the critical path.

lifetime iteration (a new trainer, pod or JobSet, every iteration):

    train   = overhead O + state GB x state s/GB / train nodes  + the update
    publish = checkpoint GB x publish s/GB                        (reads the state's weights, writes the checkpoint)

lifetime chunk (one trainer for a chunk of C iterations, its state committed every k = state_every):

    train   = o + (O - o) / C                                     its start-up, once a chunk
            + state GB x state s/GB / train nodes / C             the state's fetch, and its commit at the chunk's end
            + checkpoint GB x commit s/GB                         the checkpoint, written from memory and committed
            + the update
            + the background commit's excess (below)
    publish = 0                                                   a pointer; its pod's start-up stays

with o = train_iteration_overhead_seconds (reading the experience, the reference model's pass) and commit s/GB =
trainer_commit_seconds_per_gb (a train node's commit, the commit half of trainer_state_seconds_per_gb). Every k
iterations the state, state GB x commit s/GB / train nodes = B seconds, is committed in the background: off the
critical path while B <= k x the period; beyond that the trainer waits, and the train step carries the excess, played
again until the period is B / k. Both shapes: each rollout shard pays its engine's start (rollout_overhead_seconds)
and the whole checkpoint's fetch every iteration (Argo's rollout pods are new every iteration).

The handoff's parts (issue 38's "state I/O, engine start and the policy handoff"): the state's I/O, publish or the
trainer's checkpoint commit, the engines' start and the checkpoint's fetch. The trainer's start-up and overhead (O,
or o + (O - o) / C) are the train step's compute and set-up: in its time, not in the handoff. On the critical path:
the cycle that sets the period (`schedule.critical_cycle`) holds each step's tasks some number of times over the
iterations it spans; the handoff on it is the parts its tasks pay, over those iterations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeloop.steps.config import TrainerConfig
from moeloop.steps.errors import MoeloopError
from moeloop.workflows.capacity.rates import Figure
from moeloop.workflows.capacity.schedule import Schedule
from moeloop.workflows.capacity.target import Trainer

if TYPE_CHECKING:
    from moeloop.workflows.capacity.options import Option, Setup

ITERATION, CHUNK = "iteration", "chunk"
# The parts, in the order they are printed, with what they are called there.
LABELS = {
    "trainer_state": "state I/O",
    "checkpoint_write": "checkpoint publish or commit",
    "engine_start": "engine start",
    "checkpoint_fetch": "checkpoint fetch",
}
# The chunk shape's figures, listed as inputs only when planned: they say nothing to a trainer per iteration.
CHUNK_RATES = ("trainer_commit_seconds_per_gb", "train_iteration_overhead_seconds")


@dataclass(frozen=True)
class Handoff:
    """An option's handoff: each part's seconds per iteration (the rollout's per shard) and the step paying it."""

    parts: dict[str, float]
    steps: dict[str, str]  # part -> step
    chunk_iterations: int | None  # C; None: a trainer per iteration
    background_commit: float  # B: one background commit of the state, seconds (0: a trainer per iteration)
    # The trainer's start-up and overhead an iteration (torchrun, compiling, the reference pass, the experience):
    # the train step's compute and set-up, not the handoff's; none of the parts.
    trainer_overhead: float

    def label(self, part: str) -> str:
        if part == "checkpoint_write":
            return "publish" if self.steps[part] == "publish" else "checkpoint commit"
        return LABELS[part]

    def of(self, step: str) -> float:
        return sum(seconds for part, seconds in self.parts.items() if self.steps[part] == step)


def handoff(setup: Setup, option: Option, excess: float = 0.0) -> Handoff:
    """The option's handoff; `excess`: what the train step waits, per iteration, for the state's background
    commit (lifetime chunk)."""
    v = setup.value
    nodes = max(1, option.train_nodes)
    state = 0.0  # a run's measured overhead and start-ups already hold the state's I/O where no rate splits it
    if "trainer_state_seconds_per_gb" in setup.figures:
        state = v("trainer_state_gb") * v("trainer_state_seconds_per_gb") / nodes
    rollout = {
        "engine_start": v("rollout_overhead_seconds"),
        "checkpoint_fetch": v("checkpoint_gb") * v("fetch_seconds_per_gb"),
    }
    steps = {
        "trainer_state": "train",
        "engine_start": "rollout",
        "checkpoint_fetch": "rollout",
    }
    if setup.lifetime == ITERATION:
        parts = {"trainer_state": state, "checkpoint_write": v("checkpoint_gb") * v("publish_seconds_per_gb")}
        overhead = v("train_overhead_seconds")
        return Handoff(parts | rollout, steps | {"checkpoint_write": "publish"}, None, 0.0, overhead)
    chunk = chunk_iterations(setup, option)
    per_iteration = v("train_iteration_overhead_seconds")
    commit = v("trainer_commit_seconds_per_gb")
    parts = {"trainer_state": state / chunk + excess, "checkpoint_write": v("checkpoint_gb") * commit}
    overhead = per_iteration + (v("train_overhead_seconds") - per_iteration) / chunk
    background = v("trainer_state_gb") * commit / nodes
    return Handoff(parts | rollout, steps | {"checkpoint_write": "train"}, chunk, background, overhead)


def chunk_iterations(setup: Setup, option: Option) -> int:
    """C: the whole run locally (its trainer lives for it); on Argo the chunk Workflow's iterations at this option's
    shards (`workflows/render/chunk.py`: cluster.chunk_iterations, by default 20 or as many as fit a Workflow's
    200 tasks). An explicit cluster.chunk_iterations this option's iterations cannot fit: as many as do."""
    if setup.local:
        return setup.iterations
    from moeloop.workflows.render.chunk import chunk_size  # hera: only for a chunk plan on a cluster

    rollout = setup.config.rollout.model_copy(
        update={"num_shards": option.rollout_shards, "max_staleness": option.staleness}
    )
    config = setup.config.model_copy(update={"rollout": rollout})
    try:
        return chunk_size(config)
    except MoeloopError:
        cluster = config.cluster.model_copy(update={"chunk_iterations": None})
        return chunk_size(config.model_copy(update={"cluster": cluster}))


def on_path(schedule: Schedule, cycle: list[str], span: int, h: Handoff, local: bool) -> dict[str, float]:
    """Each part's seconds per iteration on the critical cycle: the parts its tasks pay, over the iterations it
    spans. Locally a step runs at the pace of the cores it holds, and its parts with it."""
    found = dict.fromkeys(h.parts, 0.0)
    for name in cycle:
        job = schedule.jobs[name]
        pace = 1.0
        if local and job.seconds > 0:
            pace = (schedule.ends[name] - schedule.begins[name] - job.start_seconds) / job.seconds
        for part, step in h.steps.items():
            if step == job.task.step:
                found[part] += h.parts[part] * pace / span
    return found


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


def chunk_figures(
    figures: dict[str, Figure], every: Figure, local: bool, iterations: int, configured: int | None
) -> dict[str, Figure]:
    """The chunk shape's figures: its state_every, its chunk, and the per-iteration overhead (stated, else assumed
    all of train_overhead_seconds: the planner cannot tell start-up from per-iteration work); refused where the
    state's I/O is not stated apart from the overhead."""
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
    found = {"state_every": every}
    if local:
        found["chunk_iterations"] = Figure(iterations, "iterations", "the run: locally one trainer lives for it all")
    elif configured is not None:
        found["chunk_iterations"] = Figure(
            configured, "iterations", "config: cluster.chunk_iterations (fewer where an option's tasks do not fit)"
        )
    else:
        found["chunk_iterations"] = Figure(
            20, "iterations", "at most: workflows/render/chunk.py's 20, fewer where an option's tasks fill 200 first"
        )
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
    return found | {"train_iteration_overhead_seconds": stated}
