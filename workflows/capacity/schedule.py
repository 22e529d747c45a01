"""The loop's steady state: its DAG played out with predicted step times on pools of limited size.

Each task starts once its dependencies are done and every resource it needs (a pool's GPUs, the local runner's
slots, a long-lived worker) has room, first come first served in the DAG's order, as the local runner and Argo
start them. A task holds its resources for its start-up (pod start, the predecessor's commit) and its run.

Where every pool has room for one iteration's tasks, this is a timed event graph, and its period is the
largest cycle mean (max-plus algebra): with staleness s the policy's round trip spans s + 1 iterations, and
each pool serves one iteration at a time, so

    period = max((start-ups + rollout + reward + train + publish) / (s + 1), rollout, reward, train, publish)

(each term with its own start-up). Playing the DAG out gives the same figure there and also covers what the
formula does not: the local runner's few slots and cores, shared by rollouts, evaluation and training. The critical path
is the cycle that sets the period, found by following from the last publish back to whatever each task waited
for last, until a step repeats.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.workflows.dag import ROLLOUT, loop_tasks
from moeloop.workflows.local.cores import SharedCores

EPSILON = 1e-9


@dataclass(frozen=True)
class GraphTask:
    """One task of the loop's DAG (workflows/dag.py), as plain data."""

    name: str
    step: str  # start | rollout | reward | train | publish | evaluate
    iteration: int
    dependencies: tuple[str, ...]
    report: str  # the name of its report in reports/iter-N/: rollout-<k>, reward, train, ...
    processes: int = 1  # torchrun's processes: several have no long-lived worker locally


def plan_dag(config: MoeloopConfig, shards: int, staleness: int, iterations: int) -> list[GraphTask]:
    """The loop's DAG at another shard count and staleness, as the planner's plain data: its iterations' tasks (the
    long-lived processes of `lifetime: chunk` are not tasks the iterations wait on; their costs are the steps')."""
    rollout = config.rollout.model_copy(update={"num_shards": shards, "max_staleness": staleness})
    return [
        GraphTask(
            t.name,
            t.step.name,
            t.iteration,
            t.dependencies,
            f"rollout-{dict(t.arguments)['shard']}" if t.step is ROLLOUT else t.step.name,
            t.processes,
        )
        for t in loop_tasks(config.model_copy(update={"rollout": rollout}), iterations)
        if not t.step.daemon
    ]


@dataclass(frozen=True)
class Job:
    task: GraphTask
    start_seconds: float  # before its function runs: pod start, the predecessor's commit
    seconds: float  # its function's run
    needs: tuple[str, ...]  # resources it holds meanwhile


@dataclass(frozen=True)
class Schedule:
    jobs: dict[str, Job]
    begins: dict[str, float]  # when the job took its resources
    ends: dict[str, float]
    waited_for: dict[str, tuple[str, str]]  # job -> (what it waited on last: "after" or a resource, that job)


def play(
    jobs: list[Job], capacity: dict[str, int], cores: int | None = None, scaling: dict[str, float] | None = None
) -> Schedule:
    """Run the jobs (a DAG in topological order) on resources of the given capacity; a resource not in
    `capacity` has room for everyone. `cores`: the jobs share that many cores as the local runner shares them
    (`moeloop.workflows.local.cores`): a job's `seconds` are then one core's seconds, run at c ** a times that pace
    on the c cores' worth it holds (a: its step's `scaling`, default 1), c shrinking when a job starts beside it;
    its start-up runs at the wall clock's pace. None: every job at its own pace."""
    order = {job.task.name: index for index, job in enumerate(jobs)}
    by_name = {job.task.name: job for job in jobs}
    waiting_on = {job.task.name: len(job.task.dependencies) for job in jobs}
    dependents = defaultdict(list)
    for job in jobs:
        for dependency in job.task.dependencies:
            dependents[dependency].append(job.task.name)
    ready = sorted((name for name, count in waiting_on.items() if not count), key=order.get)
    held: dict[str, int] = defaultdict(int)
    released: dict[str, tuple[float, str]] = {}  # resource -> (when, by whom) it was last freed
    shared = SharedCores(list(range(cores))) if cores else None
    exponent = scaling or {}
    left: dict[str, list[float]] = {}  # running job -> [start-up left, seconds of its run left]
    begins, ends, waited_for = {}, {}, {}
    now = 0.0
    while ready or left:
        starting = []
        for name in list(ready):
            job = by_name[name]
            if any(held[r] >= capacity[r] for r in job.needs if r in capacity):
                continue
            ready.remove(name)
            for resource in job.needs:
                held[resource] += 1
            begins[name] = now
            left[name] = [job.start_seconds, job.seconds]
            starting.append(name)
            after = max(job.task.dependencies, key=lambda d: ends[d], default=None)
            if after is not None and ends[after] >= now - EPSILON:
                waited_for[name] = ("after", after)
            else:  # it was ready before and waited for room: on whichever resource was freed just now
                freed = [(r, released[r][1]) for r in job.needs if r in released and released[r][0] >= now - EPSILON]
                if freed:
                    waited_for[name] = freed[0]
        if shared and starting:
            shared.start(starting)
        if not left:
            raise MoeloopError(f"the schedule is stuck: {ready[0]} never gets {by_name[ready[0]].needs}")
        pace = {
            name: shared.speed(name) ** exponent.get(by_name[name].task.step, 1.0) if shared else 1.0 for name in left
        }
        until = {name: start + run / pace[name] for name, (start, run) in left.items()}
        step = min(until.values())
        now += step
        finished = [name for name in sorted(left, key=order.get) if until[name] <= step + EPSILON]
        for name, (start, run) in left.items():
            startup = min(start, step)
            left[name] = [start - startup, run - (step - startup) * pace[name]]
        for name in finished:
            del left[name]
            ends[name] = now
            if shared:
                shared.finished(name)
            for resource in by_name[name].needs:
                held[resource] -= 1
                released[resource] = (now, name)
            for dependent in dependents[name]:
                waiting_on[dependent] -= 1
                if not waiting_on[dependent]:
                    ready.append(dependent)
        ready.sort(key=order.get)
    return Schedule(by_name, begins, ends, waited_for)


def period(schedule: Schedule, first: int, last: int) -> float:
    """Seconds per iteration from publish `first` to publish `last`."""
    return (schedule.ends[_publish(schedule, last)] - schedule.ends[_publish(schedule, first)]) / (last - first)


def critical_path(schedule: Schedule, last: int) -> str:
    """The cycle that sets the period, e.g. `train -> train` or `publish -> rollout -> reward -> train ->
    publish`; `~>` marks a wait for room on a resource instead of a dependency."""
    return critical_cycle(schedule, last)[0]


def critical_cycle(schedule: Schedule, last: int) -> tuple[str, list[str], int]:
    """The critical path as text, its tasks and the iterations it spans: from the last publish back to whatever each
    task waited for last, until a step repeats; the tasks from after its earlier run to its later one. Where the
    chain reaches the beginning first: the chain, latest first, its tasks all of it, over the iterations it covers."""
    jobs = schedule.jobs
    chain = [_publish(schedule, last)]  # from the last publish back in time
    links: list[str] = []  # links[i]: how chain[i] waited for chain[i + 1]
    seen = {jobs[chain[0]].task.step: 0}  # step -> where in the chain it last came
    while chain[-1] in schedule.waited_for:
        how, earlier = schedule.waited_for[chain[-1]]
        links.append("->" if how == "after" else "~>")
        chain.append(earlier)
        step, iteration = jobs[earlier].task.step, jobs[earlier].task.iteration
        if step in seen and iteration < jobs[chain[seen[step]]].task.iteration:
            # The cycle: from this step's run in an earlier iteration forward to its later one.
            names, arrows = chain[seen[step] :][::-1], links[seen[step] :][::-1]
            text = jobs[names[0]].task.step + "".join(
                f" {arrow} {jobs[name].task.step}" for arrow, name in zip(arrows, names[1:], strict=True)
            )
            spans = jobs[names[-1]].task.iteration - jobs[names[0]].task.iteration
            return text + (f" (over {spans} iterations)" if spans > 1 else ""), names[1:], spans
        seen[step] = len(chain) - 1  # within one iteration (a shard waiting for another), the earlier one
    iterations = [jobs[name].task.iteration for name in chain]
    return " <- ".join(jobs[name].task.step for name in chain), chain, max(1, max(iterations) - min(iterations))


def busy_share(schedule: Schedule, resource: str, capacity: int, first: int, last: int) -> float:
    """Share of the resource's capacity in use from publish `first` to publish `last`."""
    start, end = schedule.ends[_publish(schedule, first)], schedule.ends[_publish(schedule, last)]
    busy = sum(
        max(0.0, min(schedule.ends[name], end) - max(schedule.begins[name], start))
        for name, job in schedule.jobs.items()
        if resource in job.needs
    )
    return busy / (capacity * (end - start))


def _publish(schedule: Schedule, iteration: int) -> str:
    return next(n for n, job in schedule.jobs.items() if job.task.step == "publish" and job.task.iteration == iteration)
