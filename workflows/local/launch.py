"""Starting the local runner's tasks: each single-process step on its long-lived worker (`local.workers`), warmed as
the run starts, else as a process of its own; each on its share of the cores, with as many threads as it has
cores, its output in its log."""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from moeloop.steps.config import MoeloopConfig
from moeloop.workflows.dag import EVALUATE, ROLLOUT, ROLLOUT_ENGINE, START, Task
from moeloop.workflows.local.cores import available_cores
from moeloop.workflows.local.pinning import CoreShares, pin_process_tree
from moeloop.workflows.local.ready import worker_slot
from moeloop.workflows.local.workers import StepWorker, close_workers


def local_argv(task: Task, run_values: dict[str, str]) -> list[str]:
    """The task's pod command, with this interpreter as `python` (torchrun's launcher included)."""
    return [sys.executable, *task.argv(run_values)[1:]]


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


class Launcher:
    """Starts tasks on their shares of the cores; holds the run's workers and the shares of what runs."""

    def __init__(self, config: MoeloopConfig, tasks: list[Task], values: dict[str, str], log_dir: Path):
        self.values, self.log_dir, self.use_workers = values, log_dir, config.local.workers
        pinned = config.local.pin_cores and hasattr(os, "sched_setaffinity")  # Linux only
        self.cores = CoreShares(available_cores(), pinned)
        self.daemons = Counter(task.step.name for task in tasks if task.step.daemon)
        self.started: set[str] = set()
        self.workers: dict[str, StepWorker] = {}
        if config.local.workers:
            environment = step_environment(len(self.cores.cores), self.cores.pinned)
            self.workers = warm_workers(config, tasks, values, log_dir, environment)

    def start(self, tasks: list[Task]) -> Iterator[tuple[Task, subprocess.Popen | StepWorker]]:
        """Start the tasks together (their shares are taken at once), yielding each as it has started. A daemon
        (the chunk's trainer, a shard's engine) takes no share and is not pinned: it works while a task that asks it
        waits; the trainer on every core, each of K engines on 1/K of them."""
        steps = [t for t in tasks if not t.step.daemon]
        names = [t.name for t in steps]
        shares = dict(zip(names, self.cores.start(names) if steps else [], strict=True))
        for task in tasks:
            share = shares.get(task.name, set(self.cores.cores))
            if task.step.daemon:  # the shards' engines generate side by side: each its part of the cores' threads
                share = set(sorted(share)[: max(1, len(share) // self.daemons[task.step.name])])
            argv = local_argv(task, self.values)
            log_path = self.log_dir / f"{task.name}.log"
            if task.name not in self.started:  # a daemon started again keeps what its last one said
                log_path.write_bytes(b"")
            self.started.add(task.name)
            threads = max(1, len(share) // task.processes)  # a torchrun job's ranks split the share
            pinned = self.cores.pinned and not task.step.daemon
            environment = step_environment(threads, pinned)
            slot = worker_slot(task) if self.use_workers else None
            if slot:
                if slot not in self.workers or not self.workers[slot].alive():
                    self.workers[slot] = StepWorker(environment)
                process = self.workers[slot].start(argv, log_path, share if pinned else None, threads)
                pid = self.workers[slot].pid
            else:
                with open(log_path, "ab") as log:
                    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=environment)
                pid = process.pid
                # Pinned before its imports are done: torch's threads and torchrun's ranks inherit it.
                if pinned:
                    pin_process_tree(process.pid, share)
            if task.name in shares:
                self.cores.started(task.name, pid, worker=bool(slot))
            yield task, process

    def finished(self, name: str) -> None:
        if name in self.cores.shares:
            self.cores.finished(name)

    def terminate_workers(self) -> None:
        """End the workers at once, without waiting for their imports (a failed or interrupted run)."""
        for worker in self.workers.values():
            worker.terminate()

    def close_workers(self) -> None:
        close_workers(list(self.workers.values()))


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
    (transformers), and for a rollout that runs on vLLM, vLLM (the largest import). All but vLLM are the fork
    server's already (workers.STEP_MODULES): the worker's log says so, in 0.0 s."""
    modules = ["torch", local_argv(task, values)[2]]  # the worker itself sizes torch's threads for each command
    generates = task.step == ROLLOUT_ENGINE or (task.step == ROLLOUT and config.rollout.lifetime == "iteration")
    if generates or task.step == EVALUATE:
        modules.append("moeloop.steps.model.policy")
    vllm = config.rollout.engine == "vllm" or (config.rollout.engine == "auto" and importlib.util.find_spec("vllm"))
    if generates and vllm:
        modules.append("vllm")
    return modules
