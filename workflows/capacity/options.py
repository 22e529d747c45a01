"""The plan: every option (pool sizes and staleness) played out on the loop's DAG, priced, checked against the
trainer's memory, and the best one under a budget or a deadline.

A step's time is its fixed overhead plus its work over its rate:

    rollout shard = overhead + W + ceil(prompts / shards) x G x response tokens
                    / (tokens/s per GPU x GPUs per shard)   [at least the longest answer / one sequence's speed]
                    + the expected Spot retry (below)
    reward        = prompts x G x s/sample [/ reward GPUs, with reward models]
    train         = overhead [+ trainer state GB x s/GB / train nodes]
                    + prompts x G x (prompt + response tokens) x epochs / (tokens/s per GPU x train GPUs)
    publish       = checkpoint GB x publish s/GB

with W what the engine's start leaves of checkpoint GB x fetch s/GB (handoff.py `new_engines_fetch`),
for a trainer and engines per iteration (trainer.lifetime, rollout.lifetime iteration); a trainer per chunk pays its
start-up and its state's I/O once a chunk and commits the delta itself, then the checkpoint while publish waits for it,
engines per chunk pay their start and
the whole checkpoint once a chunk and take each policy by its delta (`handoff.py`, where the state's I/O, the
engines' start, publish, the fetch and the delta are the handoff's parts). Every step also pays its start-up before
it. Locally the rates are per core and these are seconds on one core, which the schedule plays at c ** a times that
speed on the c cores' worth a step holds (`core_scaling`).

Spot: with r reclaims per instance-hour on n rollout nodes, an iteration's shards (R seconds each) lose one with
probability 1 - exp(-r n R / 3600); that shard restarts from scratch, so it ends (interrupted on average halfway)
R / 2 + the restart later (with engines per chunk, + the new engine's start and whole checkpoint beyond R's share of
them: `Handoff.restart`). The rollout time carries that expected value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.shape import ModelShape, ParameterCounts, parameter_counts
from moeloop.steps.rl.memory import GIB, TrainMemory, predict_train_peak_bytes
from moeloop.workflows.capacity.handoff import CHUNK, ITERATION, Handoff, handoff, on_path, planned_config
from moeloop.workflows.capacity.hardware import GPU
from moeloop.workflows.capacity.rates import STEPS, Figure
from moeloop.workflows.capacity.schedule import (
    GraphTask,
    Job,
    Schedule,
    busy_share,
    critical_cycle,
    period,
    plan_dag,
    play,
)
from moeloop.workflows.capacity.target import Instance, Search, Trainer


@dataclass(frozen=True)
class Setup:
    """What every option shares."""

    config: MoeloopConfig  # the run's (or the planned config's): its DAG, reward models, local runner
    model: str  # where the shape came from
    shape: ModelShape
    figures: dict[str, Figure]  # every input by name; start_seconds.<step> per step
    gpu: GPU | None  # None: the local runner
    instance: str | None
    prices: Instance | None
    prices_source: str | None  # the prices table's own note on where its figures come from
    gpus_per_shard: int
    trainer: Trainer
    iterations: int
    search: Search
    lifetime: str = ITERATION  # trainer.lifetime: iteration or chunk
    lifetime_source: str = "the default"
    rollout_lifetime: str = ITERATION  # rollout.lifetime: iteration or chunk
    rollout_lifetime_source: str = "the default"

    def value(self, name: str) -> float:
        return self.figures[name].value

    @property
    def local(self) -> bool:
        return self.gpu is None

    @property
    def counts(self) -> ParameterCounts:
        return parameter_counts(self.shape)

    @property
    def reward_on_gpu(self) -> bool:
        return bool(self.config.reward.models)

    @property
    def samples(self) -> int:
        return int(self.value("prompts_per_iteration") * self.value("samples_per_prompt"))

    @property
    def tokens(self) -> float:
        """Tokens of an iteration's batch, prompts and responses, each once (what $/M trained tokens counts)."""
        return self.samples * (self.value("prompt_tokens") + self.value("response_tokens"))


@dataclass(frozen=True)
class Option:
    rollout_shards: int
    rollout_nodes: int  # 0 locally
    train_nodes: int  # 0 locally
    train_gpus: int  # locally: the trainer's processes
    expert_parallel: int
    reward_nodes: int  # 0: rule rewards on CPU pods
    staleness: int


@dataclass(frozen=True)
class Evaluated:
    option: Option
    step_seconds: dict[str, float]  # each step's run, start-up excluded; rollout with its Spot retry
    spot_retry_seconds: float  # of that, the expected Spot retry
    period: float  # seconds per iteration, steady state
    critical_path: str
    utilisation: dict[str, float]  # pool -> share of its GPUs (locally: slots) busy
    cost_per_iteration: float | None
    train_memory: TrainMemory | None  # None locally (no GPU to fit)
    handoff: dict[str, float]  # part -> seconds an iteration on the critical path (handoff.py)
    paid: Handoff  # what the steps pay for it every iteration, wherever the path goes

    @property
    def handoff_seconds(self) -> float:
        return sum(self.handoff.values())


def pick_expert_parallel(setup: Setup, world: int) -> tuple[int, TrainMemory] | None:
    """The smallest EP size (a power of two dividing the world and the experts) whose trainer fits the GPU,
    with its predicted memory; None if none does."""
    ep = 1
    while ep <= world:
        if not world % ep and not setup.shape.num_experts % ep:
            memory = train_memory(setup, world, ep)
            if memory.total <= setup.gpu.memory_bytes:
                return ep, memory
        ep *= 2
    return None


def train_memory(setup: Setup, world: int, ep: int) -> TrainMemory:
    t = setup.trainer
    return predict_train_peak_bytes(
        setup.shape,
        world,
        ep,
        t.max_tokens_per_microbatch,
        t.precision,
        t.activation_checkpointing,
        t.offload_optimizer,
        t.reference,
        routing_imbalance=t.routing_imbalance,
        workspace_bytes=int(t.workspace_gib * GIB),
    )


def step_seconds(setup: Setup, option: Option, paid: Handoff) -> tuple[dict[str, float], float]:
    """Each step's run (start-up excluded) for this option with its handoff `paid`, and the rollout's expected Spot
    retry within it."""
    v = setup.value
    rollout = paid.of("rollout") + generate_seconds(setup, option)
    spot = 0.0
    if setup.prices is not None:
        shard = v("start_seconds.rollout") + rollout
        lost = 1 - math.exp(-v("spot_interruptions_per_hour") * option.rollout_nodes * shard / 3600)
        spot = lost * (shard / 2 + v("spot_restart_seconds") + paid.restart)
    reward_gpus = option.reward_nodes * setup.prices.gpus if setup.reward_on_gpu and setup.prices else 1
    train_gpus = 1 if setup.local else option.train_gpus  # locally: per core, the cores played by the schedule
    update = setup.tokens * v("epochs") / (v("train_tokens_per_second_per_gpu") * train_gpus)
    train = paid.trainer_overhead + update + paid.of("train")  # a trainer per chunk commits the delta itself
    seconds = {
        "start": 0.0,
        "rollout": rollout + spot,
        "reward": setup.samples * v("reward_seconds_per_sample") / reward_gpus,
        "train": train,
        "publish": paid.of("publish"),
        "evaluate": v("evaluate_seconds"),
    }
    return seconds, spot


def generate_seconds(setup: Setup, option: Option) -> float:
    """A rollout shard's generating, at least its longest answer at one sequence's speed."""
    v = setup.value
    shard_samples = math.ceil(v("prompts_per_iteration") / option.rollout_shards) * v("samples_per_prompt")
    generate = shard_samples * v("response_tokens") / (v("rollout_tokens_per_second_per_gpu") * setup.gpus_per_shard)
    if "rollout_sequence_tokens_per_second" in setup.figures:  # no shard is faster than its longest answer
        generate = max(generate, v("max_response_tokens") / v("rollout_sequence_tokens_per_second"))
    return generate


def first_rollouts(setup: Setup, option: Option) -> float:
    """What a trainer per chunk starts beside at the chunk's start: slot 1's rollouts' generating (on a cluster;
    locally 0: it shares their cores)."""
    return 0.0 if setup.local or setup.lifetime != CHUNK else generate_seconds(setup, option)


def resources(setup: Setup, task: GraphTask) -> tuple[str, ...]:
    """What a task holds while it runs. Locally: one of local.parallelism slots, and its long-lived worker (one
    per rollout shard, one per other step; none for a torchrun job). On a cluster: its GPU pool; CPU and
    memory pods (start, rule rewards, publish, evaluate) are not limited."""
    if setup.local:
        if not setup.config.local.workers or task.processes > 1:
            return ("slots",)
        return ("slots", f"worker:{task.report if task.step == 'rollout' else task.step}")
    if task.step == "reward" and not setup.reward_on_gpu:
        return ()
    return (task.step,) if task.step in ("rollout", "reward", "train") else ()


# How many times the DAG is played again to find the train step's wait for the state's background commit.
MAX_REPLAYS = 50


def _play(setup: Setup, option: Option, seconds: dict[str, float], last: int) -> tuple[Schedule, dict[str, int]]:
    """The option's DAG played out with these step times, and its pools (name -> size)."""
    config = planned_config(setup, option)
    tasks = plan_dag(config, option.rollout_shards, option.staleness, last + option.staleness + 1)
    jobs = [
        Job(
            task,
            0.0 if task.iteration == 0 else setup.value(f"start_seconds.{task.step}"),
            seconds[task.step],
            resources(setup, task),
        )
        for task in tasks
    ]
    if setup.local:
        capacity = {r: 1 for job in jobs for r in job.needs} | {"slots": setup.config.local.parallelism}
        pools = {"slots": setup.config.local.parallelism}
        scaling = {step: setup.value(f"core_scaling.{step}") for step in STEPS}
        return play(jobs, capacity, int(setup.value("local_cores")), scaling), pools
    pools = {"rollout": option.rollout_shards, "train": 1} | ({"reward": 1} if setup.reward_on_gpu else {})
    return play(jobs, pools), pools


def evaluate_option(setup: Setup, option: Option, memory: TrainMemory | None) -> Evaluated:
    # The steady state: from the middle of the iterations to the last one whose successors (rollouts running
    # ahead) are played out too.
    first = max(8, 4 * (option.staleness + 1))
    last = 2 * first
    window, generating = first_rollouts(setup, option), generate_seconds(setup, option)
    paid = handoff(setup, option, window=window, generating=generating)
    seconds, spot = step_seconds(setup, option, paid)
    schedule, pools = _play(setup, option, seconds, last)
    if setup.lifetime == CHUNK:
        # The state's background commit (B seconds every state_every iterations) keeps up while B / state_every <=
        # the period; beyond that the trainer waits for it: the train step carries the wait, played again until the
        # period is B / state_every (each replay adds the shortfall, the period grows by a share of it).
        need, excess = paid.background_commit / setup.value("state_every"), 0.0
        for _ in range(MAX_REPLAYS):
            short = need - period(schedule, first, last)
            if short <= 1e-9 * need:
                break
            excess += short
            paid = handoff(setup, option, excess, window, generating)
            seconds, spot = step_seconds(setup, option, paid)
            schedule, pools = _play(setup, option, seconds, last)
    busy = {pool: busy_share(schedule, pool, size, first, last) for pool, size in pools.items()}
    cost = None
    if setup.prices is not None:
        # Whole nodes are paid for, busy or not: a rollout pool of shards that leave GPUs free pays for them too.
        busy["rollout"] *= option.rollout_shards * setup.gpus_per_shard / (option.rollout_nodes * setup.prices.gpus)
        hourly = option.rollout_nodes * setup.prices.spot_per_hour
        hourly += (option.train_nodes + option.reward_nodes) * setup.prices.on_demand_per_hour
        cost = hourly * period(schedule, first, last) / 3600
    path, cycle, span = critical_cycle(schedule, last)
    return Evaluated(
        option,
        {step: value for step, value in seconds.items() if step != "start"},
        spot,
        period(schedule, first, last),
        path,
        busy,
        cost,
        memory,
        on_path(schedule, cycle, span, paid, setup.local),
        paid,
    )


def candidate_options(setup: Setup) -> tuple[list[tuple[Option, TrainMemory | None]], list[Option]]:
    """The options to weigh, each with its trainer's predicted memory, and those whose trainer fits no EP size.

    Locally: the rollout shards and the staleness (the trainer's processes are the config's). On a cluster: whole
    rollout nodes of Spot, whole train nodes on demand (EP: the smallest that fits), reward nodes with reward
    models, and the staleness."""
    search, config = setup.search, setup.config
    # Staleness beyond 1 is weighed only when asked for: it changes what the loop learns (the README's "Learning
    # at staleness 1"), which no period or price says.
    staleness = search.staleness or sorted({config.rollout.max_staleness, 0, 1})
    if setup.local:
        shards = search.rollout_shards or sorted({config.rollout.num_shards, 1, 2, 4})
        world, ep = config.trainer.world_size, config.trainer.expert_parallel
        return [(Option(k, 0, 0, world, ep, 0, s), None) for k in shards for s in staleness], []
    per_node = setup.prices.gpus
    shards = search.rollout_shards or [max(1, n * per_node // setup.gpus_per_shard) for n in (1, 2, 4, 8, 16)]
    reward_nodes = (search.reward_nodes or [1]) if setup.reward_on_gpu else [0]
    fitting, unfit = [], []
    for nodes in search.train_nodes or [1, 2, 4, 8, 16]:
        fit = pick_expert_parallel(setup, nodes * per_node)
        for k in shards:
            for s in staleness:
                for r in reward_nodes:
                    rollout_nodes = math.ceil(k * setup.gpus_per_shard / per_node)
                    option = Option(k, rollout_nodes, nodes, nodes * per_node, fit[0] if fit else 0, r, s)
                    (fitting.append((option, fit[1])) if fit else unfit.append(option))
    return fitting, unfit


def pareto(evaluated: list[Evaluated]) -> list[Evaluated]:
    """The options no other beats on both period and cost (all of them where there are no prices)."""
    if any(e.cost_per_iteration is None for e in evaluated):
        return evaluated
    return [
        e
        for e in evaluated
        if not any(
            o.period <= e.period
            and o.cost_per_iteration <= e.cost_per_iteration
            and (o.period, o.cost_per_iteration) != (e.period, e.cost_per_iteration)
            for o in evaluated
        )
    ]


def best_option(evaluated: list[Evaluated], iterations: int, budget: float | None, deadline: float | None) -> Evaluated:
    """Under a deadline (hours for the run's iterations): the cheapest that meets it. Under a budget (dollars
    for them): the fastest within it. Neither: the cheapest per trained token, or locally the fastest."""
    priced = all(e.cost_per_iteration is not None for e in evaluated)
    if (budget is not None or deadline is not None) and not priced:
        raise MoeloopError("--budget and --deadline need prices: plan for a GPU target with a prices table")
    if deadline is not None:
        meets = [e for e in evaluated if e.period * iterations / 3600 <= deadline]
        if not meets:
            fastest = min(e.period for e in evaluated) * iterations / 3600
            raise MoeloopError(
                f"no option runs {iterations} iterations within {deadline:g} h: the fastest takes {fastest:.1f} h"
            )
        return min(meets, key=lambda e: (e.cost_per_iteration, e.period))
    if budget is not None:
        within = [e for e in evaluated if e.cost_per_iteration * iterations <= budget]
        if not within:
            cheapest = min(e.cost_per_iteration for e in evaluated) * iterations
            raise MoeloopError(
                f"no option runs {iterations} iterations within ${budget:,.0f}: the cheapest costs ${cheapest:,.0f}"
            )
        return min(within, key=lambda e: (e.period, e.cost_per_iteration))
    if priced:
        return min(evaluated, key=lambda e: (e.cost_per_iteration, e.period))
    return min(evaluated, key=lambda e: e.period)


@dataclass(frozen=True)
class Plan:
    setup: Setup
    evaluated: list[Evaluated]  # every option that fits, fastest first
    unfit: list[Option]  # options whose trainer fits no EP size on the GPU
    best: Evaluated
    constraint: str  # what `best` is best under
    calibration: tuple[Evaluated, Figure] | None  # the run's own setup: predicted, and the run's measured period


def make_plan(
    setup: Setup, budget: float | None, deadline: float | None, own: Option | None, measured_period: Figure | None
) -> Plan:
    """Weigh every option. `own`: the run's own option, planned beside its measured period (when the target is
    the run's own model and hardware)."""
    fitting, unfit = candidate_options(setup)
    if not fitting:
        world = max(o.train_gpus for o in unfit)  # the most GPUs tried, with the widest EP they allow
        ep = max(
            e for e in (2**i for i in range(world.bit_length())) if not world % e and not setup.shape.num_experts % e
        )
        least = train_memory(setup, world, ep).total / GIB
        raise MoeloopError(
            f"model {setup.model}: its trainer fits no option on {setup.gpu.name}"
            f" ({setup.gpu.memory_bytes / GIB:.0f} GiB per GPU): at {world} GPUs and EP {ep} it needs {least:.0f} GiB"
            " per GPU; try more train nodes (search.train_nodes), trainer.offload_optimizer or a smaller"
            " trainer.max_tokens_per_microbatch"
        )
    evaluated = sorted(
        (evaluate_option(setup, o, m) for o, m in fitting), key=lambda e: (e.period, e.cost_per_iteration or 0)
    )
    best = best_option(evaluated, setup.iterations, budget, deadline)
    constraint = (
        f"the cheapest within {deadline:g} h for {setup.iterations} iterations"
        if deadline is not None
        else f"the fastest within ${budget:,.0f} for {setup.iterations} iterations"
        if budget is not None
        else "the cheapest per trained token"
        if best.cost_per_iteration is not None
        else "the fastest"
    )
    calibration = None
    if own is not None and measured_period is not None:
        match = [e for e in evaluated if e.option == own]
        calibration = (match[0] if match else evaluate_option(setup, own, None), measured_period)
    return Plan(setup, evaluated, unfit, best, constraint, calibration)
