"""The trainer's and the rollout engines' lifetimes (`trainer.lifetime`, `rollout.lifetime`; `lifetime.py` resolves
them) and the policy's handoff: what each step pays every iteration for the trainer's state, the rollout engines'
start and the policy's way from the trainer to the rollouts; and how much of it lies on the critical path.

trainer lifetime iteration (a new trainer, pod or JobSet, every iteration):

    train   = overhead O + state GB x state s/GB / train nodes  + the update
    publish = checkpoint GB x publish s/GB                        (reads the state's weights, writes the checkpoint)

trainer lifetime chunk (one trainer for a chunk of C iterations, its state committed every k = state_every):

    train   = o + late start-up / C                               its start-up, once a chunk
            + late fetch / C                                      the state's fetch, once a chunk
            + B / C                                               the state's commit at the chunk's end
            + checkpoint GB x delta s/GB / train nodes            the delta, each rank its files' from memory
            + the update
            + the background commit's excess (below)
    publish = checkpoint GB x commit s/GB / train nodes           waits for the trainer's commit of the checkpoint

The trainer answers the train step once the delta is committed and commits the checkpoint after, in the background;
publish waits for it, then moves LATEST (its pod's start-up and the commit counted one after the other: an upper
bound, the commit starts as the pod does). Where the engines live for the chunk too, the rollouts hang off train
(workflows/dag.py `policy_by_delta`): the checkpoint's commit runs beside the next rollouts; with engines per
iteration they load the checkpoint, after publish.

with o = train_iteration_overhead_seconds (reading the experience, the reference model's pass), commit s/GB =
trainer_commit_seconds_per_gb (a train node's commit, the commit half of trainer_state_seconds_per_gb: every rank
uploads its share of the checkpoint's files), delta s/GB = delta_write_seconds_per_gb (a train node's ranks writing
the delta of their files, digests included, per GB of checkpoint; publish's rate holds its) and B = state
GB x commit s/GB / train nodes, one commit of the state. The chunk starts its trainer beside slot 1's rollouts
(workflows/render/chunk.py; locally beside start's successors), and it resumes at once: its start-up O - o and then
its state's fetch, state GB x (state s/GB - commit s/GB) / train nodes, hold train 1 up only by what outlasts slot 1's
generating W (on a cluster; locally they share the cores with it, W = 0): late start-up = max(0, O - o - W), late
fetch = max(0, O - o + fetch - W) - late start-up. The chunk ends only once the state of its last iteration is
committed (`trainer-state`), B on the path once a chunk. Every k iterations the state is committed in the background:
off the critical path while B <= k x the period; beyond that the trainer waits, and the train step carries the
excess, played again until the period is B / k.

rollout lifetime iteration (a new engine every iteration; Argo's rollout pods are new every iteration), a shard:

    rollout = E + W                                               + generating

with W what the engine's start leaves of the checkpoint's fetch, checkpoint GB x fetch s/GB: a new engine starts
beside it (`new_engines_fetch`).

rollout lifetime chunk (an engine per shard for the chunk, asked by a CPU pod each iteration), a shard:

    rollout = E / C + W / C                                       its engine's start and the whole checkpoint, once
            + max(fetch, apply) + min(fetch, apply) / F           the new policy's delta, fetched and written in
            + max(0, checkpoint GB x check s/GB - generating)     the weights' digest checked beside the generating
            + generating

    fetch   = delta GB x fetch s/GB,  apply = checkpoint GB x apply s/GB

with E = rollout_overhead_seconds, delta GB = checkpoint GB x 2 x delta_changed_fraction (`lifetime.py`), apply s/GB
= delta_apply_seconds_per_gb and check s/GB = delta_check_seconds_per_gb: the shard reads its weights' digest back
while it generates, after a delta or a full load, and keeps its rows only once it is the version's where a delta
brought it (steps/engines/shards.py). The engine fetches the
delta's F files (delta_files: a file per checkpoint file, `lifetime.py`) one after another and writes each in as it
arrives, the next downloading meanwhile (steps/engines/versions.py `DeltaFetches`): of files alike, the longer of the
two runs whole and the shorter hides behind it but for one file's share, the first file's fetch or the last one's
write: fetch + apply - min(fetch, apply) x (F - 1) / F. Its parts: `delta_fetch` the fetch that the writing does not
hide (fetch where it is the longer, else fetch / F) and `delta_apply` the writing that the fetch does not hide (apply
where it is the longer or as long, else apply / F). The chunk's first iteration fetches the whole checkpoint
instead of a delta: it is charged a delta's fetch and apply too (an upper bound, by one delta's fetch and in-place
write a chunk). Once-a-chunk costs, the trainer's and the engines', are amortized over the chunk, not played on its
first iteration: the schedule's steady state is one iteration's pattern repeated.
A shard whose Spot node is reclaimed starts a new engine: its retry pays E + W instead of
their chunk's share and the delta's fetch part (`Handoff.restart`, options.py's Spot retry).

The handoff's parts (issue 38's "state I/O, engine start and the policy handoff"): the state's I/O, publish or the
trainer's checkpoint commit, the engines' start and the checkpoint's fetch, and with engines per chunk the delta's
fetch and apply (what of each the other does not hide). The trainer's start-up and overhead (O, or o + (O - o) / C)
are the train step's compute and set-up: in its time, not in the handoff. On the critical path: the cycle that sets
the period (`schedule.critical_cycle`) holds each step's tasks some number of times over the iterations it spans; the
handoff on it is the parts its tasks pay, over those iterations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeloop.steps.errors import MoeloopError
from moeloop.workflows.capacity.schedule import Schedule

if TYPE_CHECKING:
    from moeloop.steps.config import MoeloopConfig
    from moeloop.workflows.capacity.options import Option, Setup

ITERATION, CHUNK = "iteration", "chunk"
# The parts, in the order they are printed, with what they are called there.
LABELS = {
    "trainer_state": "state I/O",
    "checkpoint_write": "checkpoint publish or commit",
    "delta_write": "delta write",
    "engine_start": "engine start",
    "checkpoint_fetch": "checkpoint fetch",
    "delta_fetch": "delta fetch",
    "delta_apply": "delta apply",
    "delta_check": "digest check beyond the generating",
}


@dataclass(frozen=True)
class Handoff:
    """An option's handoff: each part's seconds per iteration (the rollout's per shard) and the step paying it."""

    parts: dict[str, float]
    steps: dict[str, str]  # part -> step
    chunk_iterations: int | None  # C; None: neither the trainer nor the engines live for a chunk
    background_commit: float  # B: one background commit of the state, seconds (0: a trainer per iteration)
    # The trainer's start-up and overhead an iteration (torchrun, compiling, the reference pass, the experience):
    # the train step's compute and set-up, not the handoff's; none of the parts.
    trainer_overhead: float
    # What a shard restarted from scratch pays beyond its parts: a new engine's start and the whole checkpoint, less
    # their chunk's share and the delta's fetch (0: engines per iteration, whose parts are those already).
    restart: float = 0.0

    def label(self, part: str) -> str:
        if part == "checkpoint_write":  # a trainer per chunk commits it, and writes the delta: publish waits for it
            return "checkpoint commit" if "delta_write" in self.parts else "publish"
        return LABELS[part]

    def of(self, step: str) -> float:
        return sum(seconds for part, seconds in self.parts.items() if self.steps[part] == step)


def handoff(
    setup: Setup, option: Option, excess: float = 0.0, window: float = 0.0, generating: float = 0.0
) -> Handoff:
    """The option's handoff; `excess`: what the train step waits, per iteration, for the state's background
    commit; `window`: how long the chunk's first rollouts take at least, which a trainer per chunk's start-up and
    state fetch run beside (on a cluster; locally they share the cores: 0); `generating`: a shard's, which an engine
    per chunk's digest check runs beside."""
    v = setup.value
    nodes = max(1, option.train_nodes)
    state = 0.0  # a run's measured overhead and start-ups already hold the state's I/O where no rate splits it
    if "trainer_state_seconds_per_gb" in setup.figures:
        state = v("trainer_state_gb") * v("trainer_state_seconds_per_gb") / nodes
    chunk = chunk_iterations(setup, option) if CHUNK in (setup.lifetime, setup.rollout_lifetime) else None
    parts, restart = _rollout_parts(setup, chunk, generating)
    steps = dict.fromkeys(parts, "rollout") | {"trainer_state": "train"}
    if setup.lifetime == ITERATION:
        trainer = {"trainer_state": state, "checkpoint_write": v("checkpoint_gb") * v("publish_seconds_per_gb")}
        steps["checkpoint_write"] = "publish"
        return Handoff(trainer | parts, steps, chunk, 0.0, v("train_overhead_seconds"), restart)
    per_iteration = v("train_iteration_overhead_seconds")
    commit = v("trainer_commit_seconds_per_gb")
    background = v("trainer_state_gb") * commit / nodes  # a commit of the state, also the one at the chunk's end
    start_up, fetch = v("train_overhead_seconds") - per_iteration, state - background
    # The trainer starts beside slot 1's rollouts: its start-up, then its state's fetch, delay train 1 only beyond them.
    late_start_up = max(0.0, start_up - window)
    late_fetch = max(0.0, start_up + fetch - window) - late_start_up
    trainer = {
        "trainer_state": (late_fetch + background) / chunk + excess,
        "checkpoint_write": v("checkpoint_gb") * commit / nodes,
        "delta_write": v("checkpoint_gb") * v("delta_write_seconds_per_gb") / nodes,
    }
    overhead = per_iteration + late_start_up / chunk
    steps |= {"checkpoint_write": "publish", "delta_write": "train"}
    return Handoff(trainer | parts, steps, chunk, background, overhead, restart)


def _rollout_parts(setup: Setup, chunk: int | None, generating: float) -> tuple[dict[str, float], float]:
    """A rollout shard's parts of the handoff an iteration, and what its restart from scratch pays beyond them."""
    v = setup.value
    start, fetch = v("rollout_overhead_seconds"), v("checkpoint_gb") * v("fetch_seconds_per_gb")
    whole = fetch if setup.local else new_engines_fetch(start, fetch)  # a CPU's engine starts after its fetch
    if setup.rollout_lifetime == ITERATION:
        return {"engine_start": start, "checkpoint_fetch": whole}, 0.0
    check = v("checkpoint_gb") * v("delta_check_seconds_per_gb")
    fetch, apply = v("delta_gb") * v("fetch_seconds_per_gb"), v("checkpoint_gb") * v("delta_apply_seconds_per_gb")
    files = v("delta_files")  # fetched one after another, each written in as it arrives: the shorter side hidden
    parts = {
        "engine_start": start / chunk,
        "checkpoint_fetch": whole / chunk,  # its digest checked after the load beside the generating, as a delta's
        "delta_fetch": fetch if fetch > apply else fetch / files,  # the first file's, unless the fetch is the longer
        "delta_apply": apply if apply >= fetch else apply / files,  # the last file's, unless the write is the longer
        "delta_check": max(0.0, check - generating),
    }
    restart = start + whole - parts["engine_start"] - parts["checkpoint_fetch"] - parts["delta_fetch"]
    return parts, max(0.0, restart)


def new_engines_fetch(start: float, fetch: float) -> float:
    """W, what of a new engine's checkpoint fetch its start does not hide on a cluster's GPUs: the engine starts
    beside the fetch, on dummy weights, and loads the fetched weights after (steps/engines/engine.py
    `starts_beside_fetch`; locally, on CPUs, it starts after the fetch, and W is the fetch): max(E - L, fetch) + L,
    for the load L within E. L is not measured apart: it is taken at its longest, min(E, fetch) (the load reads from
    the pod's disk what the fetch has just written there, no slower), so E + max(0, fetch + min(E, fetch) - E): never
    more than the fetch, none where the start is at least twice the fetch."""
    return max(0.0, fetch + min(start, fetch) - start)


def chunk_iterations(setup: Setup, option: Option) -> int:
    """C: the whole run locally (what lives for a chunk lives for it); on Argo the chunk Workflow's iterations at this
    option's shards and the planned lifetimes (`workflows/render/chunk.py`: cluster.chunk_iterations, by default 20
    or as many as fit a Workflow's 200 tasks). An explicit cluster.chunk_iterations this option's iterations cannot
    fit: as many as do."""
    if setup.local:
        return setup.iterations
    from moeloop.workflows.render.chunk import chunk_size  # hera: only for a chunk plan on a cluster

    config = planned_config(setup, option)
    try:
        return chunk_size(config)
    except MoeloopError:
        cluster = config.cluster.model_copy(update={"chunk_iterations": None})
        return chunk_size(config.model_copy(update={"cluster": cluster}))


def planned_config(setup: Setup, option: Option) -> MoeloopConfig:
    """The run's config at the option's shards and staleness and the planned lifetimes: the DAG the option plays
    (rollouts hang off train where both lifetimes are chunk: workflows/dag.py `policy_by_delta`)."""
    rollout = setup.config.rollout.model_copy(
        update={
            "num_shards": option.rollout_shards,
            "max_staleness": option.staleness,
            "lifetime": setup.rollout_lifetime,
        }
    )
    trainer = setup.config.trainer.model_copy(update={"lifetime": setup.lifetime})
    return setup.config.model_copy(update={"rollout": rollout, "trainer": trainer})


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
