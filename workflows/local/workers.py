"""The runner's side of the long-lived step workers (`moeloop.workflows.local.worker`, whose docstring gives the
protocol): starting one, sending it a command or modules to import, polling it, closing them all.

Every worker is forked from one fork server that has imported the steps once (multiprocessing's "forkserver": a
fresh process that imports, then forks on request). A fresh interpreter per worker imported torch, transformers and
the step again, 4.7 s of CPU each: 7 workers on 2 cores held the first step back 12.6 s, on one core 26 s, and
their exits took 3.5-6.7 s more (a 2-iteration run of 5.5 s of steps took 21-38 s in all)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import time
from multiprocessing.context import ForkServerContext
from pathlib import Path

from moeloop.workflows.dag import ROLLOUT_ENGINE, STEPS, TRAINER
from moeloop.workflows.local.pinning import pin_process_tree

# What the fork server imports once: each step's module and what they import lazily to build a model. Not vLLM:
# a rollout worker on it imports it itself (warm_modules), where it runs.
STEP_MODULES = [*(step.module for step in (*STEPS, TRAINER, ROLLOUT_ENGINE)), "moeloop.steps.model.policy", "moeloop.workflows.local.worker"]


@functools.cache
def fork_server() -> ForkServerContext:
    """multiprocessing's fork server context, importing STEP_MODULES (started by the first process it forks, which
    waits for those imports; one server per runner process, whose environment it keeps: a forked worker takes the
    environment it is given)."""
    # The train steps import torch._inductor, which asks torch.cuda.is_available() as it loads. Asked of the CUDA
    # runtime, that poisons fork: every worker forked after it fails its first CUDA call ("initialization error").
    # Asked of NVML, it does not (torch.cuda.is_available's documentation).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(STEP_MODULES)
    return context


class StepWorker:
    """A forked `moeloop.workflows.local.worker.serve` process: runs step commands one at a time, keeping engines
    loaded. It looks like a Popen to the runner: poll() is None while a command runs, then its exit code."""

    def __init__(self, environment: dict[str, str]):
        from moeloop.workflows.local.worker import serve

        self.requests, worker_end = multiprocessing.Pipe()
        self.process = fork_server().Process(target=serve, args=(worker_end, environment), name="step-worker")
        # Ctrl-C waits until the fork server's new child has been sent what it runs: interrupted in between, the
        # runner left a child that printed "EOFError: Ran out of input" under the runner's own last line.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        worker_end.close()
        if hasattr(os, "sched_setaffinity"):  # the runner's cores now: the fork server keeps those it started with
            os.sched_setaffinity(self.pid, os.sched_getaffinity(0))
        self.returncode: int | None = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def start(
        self, argv: list[str], log: Path, cores: set[int] | None = None, threads: int | None = None
    ) -> StepWorker:
        """Run argv next, its process tree on cores (None: where it is) with torch's threads (None: as they are)."""
        if cores is not None:
            pin_process_tree(self.pid, cores)
        self.requests.send({"argv": argv, "log": str(log), "threads": threads})
        self.returncode = None
        return self

    def warm(self, modules: list[str], log: Path) -> None:
        """Have it import modules now, its output into log; no reply comes (a command sent meanwhile waits)."""
        self.requests.send({"warm": modules, "log": str(log)})

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self.requests.poll(0):
            try:
                self.returncode = self.requests.recv()["returncode"]
            except EOFError:  # the worker's end: it died (killed, out of memory) mid-command
                self.process.join()
                self.returncode = self.process.exitcode or 1
        return self.returncode

    def terminate(self) -> None:
        self.process.terminate()

    def close(self) -> None:
        close_workers([self])


def close_workers(workers: list[StepWorker], timeout: float = 60) -> None:
    """End the workers together: each one's requests closed first (the worker returns), then each awaited (a
    worker's exit can take seconds, its engine's shutdown included), killed if it has not exited within timeout
    seconds of the first."""
    for worker in workers:
        worker.requests.close()
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
        if worker.process.exitcode is None:
            worker.process.kill()
            worker.process.join()
