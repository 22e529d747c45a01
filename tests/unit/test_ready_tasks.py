"""Which tasks the local runner starts next (workflows/local/ready.py): a pure function of the DAG's tasks and of
what runs and has finished, checked here on the loop's own DAG without a process."""

from __future__ import annotations

from moeloop.workflows.dag import Task, loop_tasks
from moeloop.workflows.local.ready import ready_tasks, worker_slot
from tests.conftest import small_config


def tasks_of(staleness: int = 0, world_size: int = 1) -> dict[str, Task]:
    """The DAG of 2 iterations of 2 shards, by name."""
    config = small_config(2, rollout={"max_staleness": staleness}, trainer={"world_size": world_size})
    return {task.name: task for task in loop_tasks(config)}


def names(tasks: list[Task]) -> list[str]:
    return [task.name for task in tasks]


def test_only_tasks_whose_dependencies_finished_start_in_the_dags_order() -> None:
    tasks = tasks_of()
    waiting = list(tasks.values())
    assert names(ready_tasks(waiting, set(), [], 8, workers=False)) == ["start"]
    after_start = [t for t in waiting if t.name != "start"]
    ready = ready_tasks(after_start, {"start"}, [], 8, workers=False)
    assert names(ready) == ["eval-0", "it1-rollout-0", "it1-rollout-1"]


def test_no_more_than_parallelism_run_at_once_counting_those_running() -> None:
    tasks = tasks_of()
    waiting = [t for name, t in tasks.items() if name not in ("start", "eval-0")]
    assert names(ready_tasks(waiting, {"start"}, [], 1, workers=False)) == ["it1-rollout-0"]
    running = [tasks["eval-0"]]
    assert names(ready_tasks(waiting, {"start"}, running, 2, workers=False)) == ["it1-rollout-0"]
    assert ready_tasks(waiting, {"start"}, [tasks["eval-0"], tasks["it1-rollout-0"]], 2, workers=False) == []


def test_a_task_whose_worker_is_busy_waits_and_those_behind_it_start() -> None:
    """Ahead of training (staleness 1) both iterations' shards are ready after start: shard k of iteration 2 waits
    for shard k's worker, whether a running task or one starting before it holds it."""
    tasks = tasks_of(staleness=1)
    waiting = [t for name, t in tasks.items() if name != "start"]
    ready = ready_tasks(waiting, {"start"}, [], 8, workers=True)
    assert names(ready) == ["eval-0", "it1-rollout-0", "it1-rollout-1"]
    without_workers = ready_tasks(waiting, {"start"}, [], 8, workers=False)
    assert names(without_workers) == ["eval-0", "it1-rollout-0", "it1-rollout-1", "it2-rollout-0", "it2-rollout-1"]
    running = [tasks["it1-rollout-0"]]
    waiting = [t for t in waiting if t.name != "it1-rollout-0"]
    assert names(ready_tasks(waiting, {"start"}, running, 8, workers=True)) == ["eval-0", "it1-rollout-1"]
    running = [tasks["it1-rollout-0"], tasks["it1-rollout-1"], tasks["eval-0"]]
    waiting = [t for t in waiting if t.name not in ("it1-rollout-1", "eval-0")]
    assert ready_tasks(waiting, {"start"}, running, 8, workers=True) == []


def test_a_worker_per_shard_and_per_step_and_none_for_a_torchrun_job() -> None:
    tasks = tasks_of()
    assert [worker_slot(tasks[name]) for name in ("start", "it1-rollout-1", "it2-rollout-1", "it1-train")] == [
        "start",
        "rollout-1",
        "rollout-1",
        "train",
    ]
    torchrun = tasks_of(world_size=2)
    assert torchrun["it1-train"].processes == 2 and worker_slot(torchrun["it1-train"]) is None
    # Without a worker, one torchrun job does not keep another from starting.
    ready = ready_tasks([torchrun["it2-train"]], {"it2-reward"}, [torchrun["it1-train"]], 2, workers=True)
    assert names(ready) == ["it2-train"]


def test_long_lived_processes_start_after_start_beside_the_rest_each_on_a_worker_of_its_own() -> None:
    """lifetime chunk: the trainer and each shard's engine start as soon as start has finished, whatever
    `parallelism` says (they work while a task that asks them waits), and never hold a slot of it."""
    config = small_config(2, trainer={"lifetime": "chunk"}, rollout={"lifetime": "chunk"})
    tasks = {task.name: task for task in loop_tasks(config)}
    waiting = [t for name, t in tasks.items() if name != "start"]
    ready = names(ready_tasks(waiting, {"start"}, [], 1, workers=True))
    assert ready == ["eval-0", "trainer", "rollout-engine-0", "rollout-engine-1"]
    daemons = [tasks[name] for name in ("trainer", "rollout-engine-0", "rollout-engine-1")]
    waiting = [t for t in waiting if t not in daemons and t.name != "eval-0"]
    assert names(ready_tasks(waiting, {"start"}, daemons, 1, workers=True)) == ["it1-rollout-0"]
    assert [worker_slot(t) for t in daemons] == ["trainer", "rollout-engine-0", "rollout-engine-1"]
