"""Which waiting tasks the local runner starts next, and on which long-lived worker: a pure function of the DAG's
tasks and what is running and done, so that the runner's order can be checked without a process."""

from __future__ import annotations

from moeloop.workflows.dag import ROLLOUT, Task


def worker_slot(task: Task) -> str | None:
    """The long-lived worker that runs the task: one per rollout shard (shard k of every iteration, so its engine
    stays loaded) and one per other step, so no iteration pays the imports again. None for a torchrun job of
    several processes, which starts its own."""
    if task.processes > 1:
        return None
    if task.step.daemon:  # one each: the trainer, each shard's rollout engine
        return task.name
    if task.step == ROLLOUT:
        return f"rollout-{dict(task.arguments)['shard']}"
    return task.step.name


def ready_tasks(
    waiting: list[Task], finished: set[str], running: list[Task], parallelism: int, workers: bool
) -> list[Task]:
    """The waiting tasks to start now, in the DAG's order: each whose dependencies have all finished, while fewer
    than `parallelism` run. With `workers`, one whose worker is busy (running a task, or taken by a task starting
    before it) waits: a worker runs one command at a time, e.g. ahead of training a shard's next iteration may be
    ready before its worker is free."""
    busy = {worker_slot(task) for task in running} if workers else set()
    starting: list[Task] = []  # the daemons first, beside the rest: they take no share of `parallelism`
    running = [task for task in running if not task.step.daemon]  # it works while a train task waits on it
    for task in waiting:
        if not all(dependency in finished for dependency in task.dependencies):
            continue
        if task.step.daemon:
            starting.append(task)
            continue
        if len(running) + len(starting) >= parallelism:
            break
        slot = worker_slot(task) if workers else None
        if slot and slot in busy:
            continue
        busy.add(slot)
        starting.append(task)
    return starting
