"""The local runner, the embedded default: the loop's DAG run on this machine, step by step, as processes.

It runs exactly the pod commands of the Argo render (from the same `loop_tasks`), in dependency order,
up to `local.parallelism` at a time. Started again on an interrupted run, it continues from LATEST: every
task of iterations before LATEST is done, and every step skips work whose output is already committed.
Each round it picks the tasks ready to start (`ready.py`), starts them (`launch.py`), polls what runs, and shows
its progress (`progress.py`).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.observe.trackers import check_trackers, end_trackers
from moeloop.steps.rewards.functions import check_reward_routes
from moeloop.steps.rewards.pool import RewardPool
from moeloop.steps.storage.lease import RunLease
from moeloop.steps.storage.prompts import check_prompts, set_name, task_prompt_sets
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import DAEMON_RESTARTS, EVALUATE, START, Task, loop_tasks, run_values
from moeloop.workflows.local.launch import Launcher
from moeloop.workflows.local.progress import ProgressDisplay
from moeloop.workflows.local.ready import ready_tasks
from moeloop.workflows.local.workers import StepWorker

POLL_SECONDS = 0.05
EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]: )?[\w.]+(Error|Exception|Interrupt): ")


@dataclass(frozen=True)
class ExecutedTask:
    name: str
    step: str
    iteration: int
    dependencies: tuple[str, ...]
    argv: tuple[str, ...]
    started_at: float  # wall clock (Unix seconds) when the runner started the task's process
    seconds: float


def preflight(config: MoeloopConfig) -> None:
    """Check the inputs every step will need before anything is written or spent."""
    if config.records_routing:  # the check imports torch, which the runner itself does not need
        from moeloop.steps.engines.engine import check_routes_recordable

        check_routes_recordable(config.rollout.engine, record_routing=True)
    if config.rollout.engine == "vllm" and config.model.checkpoint is None:  # the tiny model's fields are HF's
        from moeloop.steps.engines.engine import vllm_refusal

        if (refusal := vllm_refusal({"model_type": config.model.tiny.family, **config.model.tiny.model_dump()})):
            raise MoeloopError(refusal)
    sources = task_prompt_sets(config)
    check_prompts(config, sources["train"][0], set_name(config, "train"))
    records = [record for split_records, _ in sources.values() for record in split_records]
    rubric = config.rollout.environment is not None
    check_reward_routes(config.reward, records, "the train and eval records", rubric)
    with RewardPool(config.reward, "moeloop run's check of the config") as pool:
        pool.check()  # the functions import, each takes its args: in a worker process, as the steps will run them
    check_trackers(config)


def pending_tasks(tasks: list[Task], latest_iteration: int | None) -> list[Task]:
    """Tasks still to run on a run that has a LATEST: start (it adopts a longer config and finds checkpoint 0
    committed), LATEST's evaluation (it may have been cut short) and everything after LATEST.

    What came before LATEST is done; the tasks that depended on it wait for start instead.
    """
    if latest_iteration is None:
        return tasks
    kept = [
        t
        for t in tasks
        if t.step == START or t.step.daemon  # a long-lived process finds where the run stands itself
        or t.iteration > latest_iteration
        or (t.iteration == latest_iteration and t.step == EVALUATE)
    ]
    names = {t.name for t in kept}
    return [
        replace(
            t, dependencies=tuple(d for d in t.dependencies if d in names) or ((START.name,) if t.step != START else ())
        )
        for t in kept
    ]


def run_local(config: MoeloopConfig, run_uri: str, log_dir: Path, progress: bool = True) -> list[ExecutedTask]:
    """Check the inputs, take the run's lease (steps/storage/lease.py: one driver at a time), and drive the run.
    A run that stops short (a failed step: FAILED; Ctrl-C or a signal: KILLED) ends its trackers' runs so."""
    preflight(config)
    with RunLease(run_uri) as lease:
        try:
            return drive(config, run_uri, log_dir, progress, lease.renew_if_due)
        except BaseException as stopped:
            end_tracker_runs(config, run_uri, "FAILED" if isinstance(stopped, Exception) else "KILLED")
            raise


def end_tracker_runs(config: MoeloopConfig, run_uri: str, status: str) -> None:
    """End the trackers' runs with status, without hiding why the run stopped: that stays the line to print."""
    try:
        end_trackers(RunStorage(run_uri), config, status)
    except Exception as error:
        reason = " ".join(str(error).split())
        print(f"warning: the trackers' runs could not be ended {status}: {reason}", file=sys.stderr)


def drive(
    config: MoeloopConfig, run_uri: str, log_dir: Path, progress: bool, heartbeat: Callable[[], None]
) -> list[ExecutedTask]:
    """Run the pending tasks; heartbeat() is called as the runner polls (it renews the lease)."""
    storage = RunStorage(run_uri)
    latest = storage.latest() if storage.exists(RunStorage.CONFIG) else None
    tasks = pending_tasks(loop_tasks(config), latest["iteration"] if latest else None)
    values = run_values(config, run_uri)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MoeloopError(f"cannot create the log folder {log_dir}: {error.strerror or error}") from None
    launcher = Launcher(config, tasks, values, log_dir)
    waiting = list(tasks)
    # name -> (task, its process, when it started)
    running: dict[str, tuple[Task, subprocess.Popen | StepWorker, float]] = {}
    finished: set[str] = set()
    restarts: dict[str, int] = {}  # a daemon's starts after its first
    executed: list[ExecutedTask] = []
    display = ProgressDisplay(tasks, progress, log_dir)
    try:
        while waiting or running:
            busy = [task for task, _, _ in running.values()]
            starting = ready_tasks(waiting, finished, busy, config.local.parallelism, config.local.workers)
            for task, process in launcher.start(starting):
                waiting.remove(task)
                running[task.name] = (task, process, time.time())
            display.running(list(running))
            time.sleep(POLL_SECONDS)
            heartbeat()
            for name, (task, process, started) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[name]
                launcher.finished(name)
                if process.poll() != 0 and task.step.daemon and restarts.get(name, 0) < DAEMON_RESTARTS:
                    restarts[name] = restarts.get(name, 0) + 1  # as its Job starts a new pod on Argo
                    with open(log_dir / f"{name}.log", "a") as log:
                        log.write(f"moeloop run: {name} exited with {process.poll()}: started again\n")
                    waiting.insert(0, task)
                    continue
                if process.poll() != 0:
                    raise MoeloopError(
                        f"step {name} failed: {failure_line(log_dir / f'{name}.log')} (log: {log_dir / f'{name}.log'})"
                    )
                finished.add(name)
                executed.append(
                    ExecutedTask(
                        name,
                        task.step.name,
                        task.iteration,
                        task.dependencies,
                        tuple(task.argv(values)),
                        started,
                        time.time() - started,
                    )
                )
                metrics = storage.read_json(storage.metrics(task.iteration)) if task.step == EVALUATE else None
                display.finished(task, metrics)
    except BaseException:
        # A failed or interrupted run ends its warming workers too, without waiting for their imports.
        launcher.terminate_workers()
        raise
    finally:
        for _, process, _ in running.values():
            process.terminate()
        launcher.close_workers()
        display.close()
    return executed


def failure_line(log: Path) -> str:
    """Why a step failed, from its log: its own last `error: ...` line (without the prefix, which the runner's
    line has already), else a crash's exception line, else the last line. Under torchrun each rank prints its
    line (`[rank0]:` before a traceback's), and torchrun a summary block after them that says nothing."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    crashes = [line for line in lines if EXCEPTION_LINE.match(line)]
    return (errors or crashes or lines or ["no output"])[-1]
