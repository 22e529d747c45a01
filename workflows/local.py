"""The local runner, the embedded default: the loop's DAG run on this machine, step by step, as processes.

It runs exactly the pod commands of the Argo render (from the same `loop_tasks`), in dependency order,
up to `local.parallelism` at a time. Started again on an interrupted run, it continues from LATEST: every
task of iterations before LATEST is done, and every step skips work whose output is already committed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.cores import SharedCores, available_cores
from moeloop.steps.errors import MoeloopError
from moeloop.steps.observe.trackers import check_trackers
from moeloop.steps.rewards.functions import check_reward_routes
from moeloop.steps.rewards.pool import RewardPool
from moeloop.steps.storage.lease import RunLease
from moeloop.steps.storage.prompts import check_prompts, task_records, train_source
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import EVALUATE, ROLLOUT, START, Task, loop_tasks, run_values

POLL_SECONDS = 0.05
EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]: )?[\w.]+(Error|Exception|Interrupt): ")


@dataclass(frozen=True)
class ExecutedTask:
    name: str
    dependencies: tuple[str, ...]
    argv: tuple[str, ...]
    started_at: float  # wall clock (Unix seconds) when the runner started the task's process
    seconds: float


def local_argv(task: Task, run_values: dict[str, str]) -> list[str]:
    """The task's pod command, with this interpreter as `python` (torchrun's launcher included)."""
    return [sys.executable, *task.argv(run_values)[1:]]


def preflight(config: MoeloopConfig) -> None:
    """Check the inputs every step will need before anything is written or spent."""
    if config.records_routing:  # the check imports torch, which the runner itself does not need
        from moeloop.steps.engines.engine import check_routes_recordable

        check_routes_recordable(config.rollout.engine, record_routing=True)
    if config.rollout.engine == "vllm" and config.model.checkpoint is None:  # the tiny model's fields are HF's
        from moeloop.steps.engines.engine import vllm_refusal

        if (refusal := vllm_refusal({"model_type": config.model.tiny.family, **config.model.tiny.model_dump()})):
            raise MoeloopError(refusal)
    train, evaluation = task_records(config.task)
    check_prompts(config, train, train_source(config.task))
    check_reward_routes(config.reward, train + evaluation, "the train and eval records")
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
        if t.step == START or t.iteration > latest_iteration or (t.iteration == latest_iteration and t.step == EVALUATE)
    ]
    names = {t.name for t in kept}
    return [
        replace(
            t, dependencies=tuple(d for d in t.dependencies if d in names) or ((START.name,) if t.step != START else ())
        )
        for t in kept
    ]


def run_local(config: MoeloopConfig, run_uri: str, log_dir: Path, progress: bool = True) -> list[ExecutedTask]:
    """Check the inputs, take the run's lease (steps/storage/lease.py: one driver at a time), and drive the run."""
    preflight(config)
    with RunLease(run_uri) as lease:
        return drive(config, run_uri, log_dir, progress, lease.renew_if_due)


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
    cores = CoreShares(available_cores(), config.local.pin_cores and hasattr(os, "sched_setaffinity"))  # Linux only
    workers: dict[str, StepWorker] = {}
    if config.local.workers:
        workers = warm_workers(config, tasks, values, log_dir, step_environment(len(cores.cores), cores.pinned))
    waiting = list(tasks)
    # name -> (task, its process, when it started)
    running: dict[str, tuple[Task, subprocess.Popen | StepWorker, float]] = {}
    finished: set[str] = set()
    executed: list[ExecutedTask] = []
    bar = tqdm(total=len(tasks), unit="step", disable=not progress, dynamic_ncols=True)
    description = ""
    iterations_left = len({t.iteration for t in tasks if t.step == EVALUATE and t.iteration > 0})
    loop_started, iterations_done = time.time(), 0
    try:
        while waiting or running:
            starting = []
            for task in [t for t in waiting if all(d in finished for d in t.dependencies)]:
                if len(running) + len(starting) >= config.local.parallelism:
                    break
                slot = worker_slot(task) if config.local.workers else None
                if slot and any(workers.get(slot) is p for _, p, _ in running.values()):
                    # A worker runs one command at a time: e.g. ahead of training, a shard's next iteration may
                    # be ready before its worker is free.
                    continue
                if slot and slot in (worker_slot(t) for t in starting):
                    continue
                starting.append(task)
            for task, share in zip(starting, cores.start([t.name for t in starting]), strict=True):
                waiting.remove(task)
                argv = local_argv(task, values)
                log_path = log_dir / f"{task.name}.log"
                log_path.write_bytes(b"")
                threads = max(1, len(share) // task.processes)  # a torchrun job's ranks split the share
                environment = step_environment(threads, cores.pinned)
                slot = worker_slot(task) if config.local.workers else None
                if slot:
                    if slot not in workers or workers[slot].process.poll() is not None:
                        workers[slot] = StepWorker(environment)
                    process = workers[slot].start(argv, log_path, share if cores.pinned else None, threads)
                    cores.started(task.name, workers[slot].process.pid, worker=True)
                else:
                    with open(log_path, "wb") as log:
                        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=environment)
                    # Pinned before its imports are done: torch's threads and torchrun's ranks inherit it.
                    cores.started(task.name, process.pid)
                    if cores.pinned:
                        pin_process_tree(process.pid, share)
                running[task.name] = (task, process, time.time())
            if description != ", ".join(running):
                description = ", ".join(running)
                bar.set_description(description)
            time.sleep(POLL_SECONDS)
            heartbeat()
            for name, (task, process, started) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[name]
                cores.finished(name)
                if process.poll() != 0:
                    raise MoeloopError(
                        f"step {name} failed: {failure_line(log_dir / f'{name}.log')} (log: {log_dir / f'{name}.log'})"
                    )
                finished.add(name)
                executed.append(
                    ExecutedTask(name, task.dependencies, tuple(task.argv(values)), started, time.time() - started)
                )
                bar.update()
                if task.step == EVALUATE:
                    bar.write(describe_metrics(storage.read_json(storage.metrics(task.iteration))))
                    if task.iteration > 0:
                        iterations_done += 1
                        eta = overall_eta(time.time() - loop_started, iterations_done, iterations_left)
                        bar.set_postfix_str(f"ETA {eta}")
    except BaseException:
        # A failed or interrupted run ends its warming workers too, without waiting for their imports.
        for worker in workers.values():
            worker.terminate()
        raise
    finally:
        for _, process, _ in running.values():
            process.terminate()
        close_workers(list(workers.values()))
        bar.close()
    return executed


def overall_eta(elapsed: float, done: int, total: int) -> str:
    """The run's time left at the measured pace so far: seconds per finished iteration, steps overlapping as they
    did (tqdm's own estimate counts steps, and an iteration's steps take very different times)."""
    seconds = round(elapsed / done * (total - done))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class CoreShares(SharedCores):
    """The runner's core shares, applied: when a step starting beside others takes some of their cores, their
    process trees are moved onto the rest, and a worker told to fit its torch threads to them (SIGWINCH,
    `moeloop.workflows.worker`); a plain process keeps the threads it started with. pinned False (`local.pin_cores` off,
    or not Linux): shares size the thread counts only."""

    def __init__(self, cores: list[int], pinned: bool):
        super().__init__(cores)
        self.pinned = pinned
        self.pids: dict[str, int] = {}
        self.workers: set[str] = set()  # the steps that run in a StepWorker

    def start(self, names: list[str]) -> list[set[int]]:
        before = dict(self.shares)
        shares = super().start(names)
        for name, share in before.items():
            if share != self.shares[name]:
                self.move(name)
        return shares

    def started(self, name: str, pid: int, worker: bool = False) -> None:
        self.pids[name] = pid
        if worker:
            self.workers.add(name)

    def finished(self, name: str) -> None:
        super().finished(name)
        self.pids.pop(name, None)
        self.workers.discard(name)

    def move(self, name: str) -> None:
        if self.pinned and name in self.pids:
            pin_process_tree(self.pids[name], self.shares[name])
            if name in self.workers:
                os.kill(self.pids[name], signal.SIGWINCH)


def step_environment(threads: int, pin_cores: bool) -> dict[str, str]:
    """The steps' environment: as many threads as a step has cores. Pinned, vLLM leaves its threads where the
    runner puts them (its own binding would place them by the machine's layout, over another step's cores).
    A rollout shard's process holds nothing but its engine, so vLLM runs its engine core and model worker in it
    (unless the environment says otherwise): not two processes more that each import torch and vLLM again (the
    demo's engine on one core: 4.1 s to build instead of 13.4 s; iteration 1 from an SFT checkpoint published at
    24.3 s instead of 36.7 s, benchmarks/trl_grpo.md)."""
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    environment.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if pin_cores:
        environment["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return environment


def pin_process_tree(pid: int, cores: set[int]) -> None:
    """Every thread of pid and of its descendants onto cores (a worker's engine keeps processes and threads
    of its own, started under an earlier command's cores)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, of in parents.items() if of == parent and child not in tree]
        tree.update(children)
        frontier += children
    for process in tree:
        try:
            threads = [int(t.name) for t in Path(f"/proc/{process}/task").iterdir()]
        except OSError:
            continue
        for thread in threads:
            try:
                os.sched_setaffinity(thread, cores)
            except OSError:
                continue  # exited meanwhile


def warm_workers(
    config: MoeloopConfig, tasks: list[Task], values: dict[str, str], log_dir: Path, environment: dict[str, str]
) -> dict[str, StepWorker]:
    """A worker for every slot but start's, each told at once to import what its first command will (its log:
    warm-SLOT.log), so that the imports run while start and the SFT do, not on the first iteration's critical path."""
    workers: dict[str, StepWorker] = {}
    for task in tasks:
        slot = worker_slot(task)
        if slot is None or slot in workers or task.step == START:
            continue
        workers[slot] = StepWorker(environment)
        workers[slot].warm(warm_modules(config, task, values), log_dir / f"warm-{slot}.log")
    return workers


def warm_modules(config: MoeloopConfig, task: Task, values: dict[str, str]) -> list[str]:
    """The step's module, and for the steps that build a model the modules they import lazily: the policy's
    (transformers), and for a rollout that runs on vLLM, vLLM (the largest import)."""
    modules = ["torch", local_argv(task, values)[2]]  # the worker itself sizes torch's threads for each command
    if task.step in (ROLLOUT, EVALUATE):
        modules.append("moeloop.steps.model.policy")
    vllm = config.rollout.engine == "vllm" or (config.rollout.engine == "auto" and importlib.util.find_spec("vllm"))
    if task.step == ROLLOUT and vllm:
        modules.append("vllm")
    return modules


def worker_slot(task: Task) -> str | None:
    """The long-lived worker that runs the task: one per rollout shard (shard k of every iteration, so its engine
    stays loaded) and one per other step, so no iteration pays the imports again. None for a torchrun job of
    several processes, which starts its own."""
    if task.processes > 1:
        return None
    if task.step == ROLLOUT:
        return f"rollout-{dict(task.arguments)['shard']}"
    return task.step.name


class StepWorker:
    """A `python -m moeloop.workflows.worker` process: runs step commands one at a time, keeping engines loaded.

    It looks like a Popen to the runner: poll() is None while a command runs, then its exit code.
    """

    def __init__(self, environment: dict[str, str]):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moeloop.workflows.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=environment,
            text=True,
        )
        self.returncode: int | None = 0

    def start(
        self, argv: list[str], log: Path, cores: set[int] | None = None, threads: int | None = None
    ) -> StepWorker:
        """Run argv next, its process tree on cores (None: where it is) with torch's threads (None: as they are)."""
        if cores is not None:
            pin_process_tree(self.process.pid, cores)
        self.process.stdin.write(json.dumps({"argv": argv, "log": str(log), "threads": threads}) + "\n")
        self.process.stdin.flush()
        self.returncode = None
        return self

    def warm(self, modules: list[str], log: Path) -> None:
        """Have it import modules now, its output into log; no reply comes (a command sent meanwhile waits)."""
        self.process.stdin.write(json.dumps({"warm": modules, "log": str(log)}) + "\n")
        self.process.stdin.flush()

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if select.select([self.process.stdout], [], [], 0)[0]:
            line = self.process.stdout.readline()
            # An empty read is the worker's end: it died (killed, out of memory) mid-command.
            self.returncode = json.loads(line)["returncode"] if line else (self.process.wait() or 1)
        return self.returncode

    def terminate(self) -> None:
        self.process.terminate()

    def close(self) -> None:
        close_workers([self])


def close_workers(workers: list[StepWorker], timeout: float = 60) -> None:
    """End the workers together: each one's input closed first, then each awaited (a worker's exit can take
    seconds, its engine's shutdown included), killed if it has not exited within timeout seconds of the first."""
    for worker in workers:
        worker.process.stdin.close()
    deadline = time.monotonic() + timeout
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.kill()


def failure_line(log: Path) -> str:
    """Why a step failed, from its log: its own last `error: ...` line (without the prefix, which the runner's
    line has already), else a crash's exception line, else the last line. Under torchrun each rank prints its
    line (`[rank0]:` before a traceback's), and torchrun a summary block after them that says nothing."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    crashes = [line for line in lines if EXCEPTION_LINE.match(line)]
    return (errors or crashes or lines or ["no output"])[-1]


def describe_metrics(metrics: dict) -> str:
    parts = [f"iteration {metrics['iteration']:>3}: eval_reward_mean {metrics['eval_reward_mean']:.3f}"]
    if metrics.get("eval_pass_at_k"):  # the sampled responses' pass@k for the largest k
        k, value = max(metrics["eval_pass_at_k"].items(), key=lambda item: int(item[0]))
        parts.append(f"pass@{k} {value:.3f}")
    if metrics.get("reward_mean") is not None:
        kl = "-" if metrics.get("kl") is None else f"{metrics['kl']:.3f}"
        parts.append(f"reward_mean {metrics['reward_mean']:.3f}  kl {kl}  loss {metrics['loss']:+.3f}")
    return "  ".join(parts)
