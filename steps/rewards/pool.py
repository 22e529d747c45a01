"""The reward functions' worker processes: the reward and evaluate steps (and `moeloop run`'s check of the config)
score through a pool of them (steps/rewards/worker.py), never in their own process.

Each worker imports every configured function once, as it starts (one start per step); then the pool hands each idle
worker the next sample. A call has `reward.timeout_s` seconds: a worker past it is killed. Any way a function fails
(it raises, calls sys.exit, returns no finite number, ends or crashes its process, hangs) is one line naming the
function, the sample and the step: with `reward.on_error: fail` the step stops on it (the workers killed, nothing
scored); with `zero` that call counts as 0, the failure is counted and logged, and a new worker replaces a lost one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

from moeloop.steps.config_reward import RewardConfig, function_key
from moeloop.steps.cores import usable_cores
from moeloop.steps.errors import MoeloopError, print_line
from moeloop.steps.rewards.functions import data_source

# A worker's imports (the reward modules and their libraries: sympy for math-verify, reasoning-gym's tasks) take
# seconds on a busy node; a worker not ready by then is refused as hanging.
IMPORT_SECONDS = 120.0
# Workers when reward.workers is not set: one per core of the step, at most this many. A pod's cores are its node's
# (a request sets no quota), and each worker holds its imports (about 100 MB with sympy's) whether it is busy or not.
DEFAULT_WORKERS = 8
AHEAD = 8  # samples sent to a worker before it answers: it never waits for the pool between two of them
LOGGED_FAILURES = 10  # under on_error zero: the first failures of a call to score() each get a log line
SHOWN_RESPONSE = 200  # characters of the response an error line shows


@dataclass
class Task:
    sample: int
    calls: deque[int]  # positions in the sample's functions still to call, the first one running


@dataclass
class Worker:
    process: subprocess.Popen
    channel: Connection
    deadline: float
    ready: bool = False
    tasks: deque[Task] = field(default_factory=deque)  # sent, in order: the first one is running
    gone: bool = False  # a send found its end closed: it ended, and its answers up to then and its end are read

    def post(self, message: object) -> None:
        try:
            self.channel.send(message)
        except OSError:  # BrokenPipeError: it ended while its earlier samples were under way
            self.gone = True


@dataclass
class Scores:
    rewards: list[float]  # each sample's weighted sum of its functions' values
    failures: int = 0  # calls that failed and counted as 0 (on_error zero)


class RewardPool:
    """`with RewardPool(settings, step) as pool: pool.score(records, responses, samples)`. step names the step in
    error lines, e.g. "the reward step of iteration 3"."""

    def __init__(self, settings: RewardConfig, step: str, processes: int | None = None):
        self.settings = settings
        self.step = step
        self.functions = settings.all_functions()
        self.index = {function_key(f): i for i, f in enumerate(self.functions)}
        self.processes = processes or settings.workers or min(usable_cores(), DEFAULT_WORKERS)
        self.workers: list[Worker] = []
        self.queue: deque[Task] = deque()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, count: int) -> None:
        """count more workers, which import the functions side by side; checked as they answer."""
        for _ in range(count):
            ours, theirs = Pipe()
            process = subprocess.Popen(
                [sys.executable, "-m", "moeloop.steps.rewards.worker", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
            theirs.close()
            worker = Worker(process, ours, time.monotonic() + IMPORT_SECONDS)
            worker.post({"sys_path": sys.path, "functions": [(f.path, f.args) for f in self.functions]})
            self.workers.append(worker)

    def check(self) -> None:
        """One worker imports every function, each checked to take its args: `moeloop run`'s check of the config."""
        if not self.functions:  # reward models alone
            return
        self.start(1)
        while not self.workers[0].ready:
            self.wait()

    def score(self, records: list[dict[str, Any]], responses: list[str], samples: list[str]) -> Scores:
        """Each response's reward: the weighted sum of the functions for its record's data_source. samples names
        each in error lines (e.g. "sample 3-17-2")."""
        self.responses, self.samples = responses, samples
        self.chosen = [self.settings.functions_for(data_source(r)) for r in records]
        self.scores = Scores([0.0] * len(records))
        self.queue = deque(Task(s, deque(range(len(self.chosen[s])))) for s in range(len(records)) if self.chosen[s])
        self.start(max(0, min(self.processes, len(self.queue)) - len(self.workers)))
        while self.queue or any(w.tasks for w in self.workers):
            for worker in self.workers:
                while worker.ready and not worker.gone and len(worker.tasks) < AHEAD and self.queue:
                    self.send(worker, self.queue.popleft(), records)
            self.wait()
        if self.scores.failures > LOGGED_FAILURES:
            print_line(f"warning: {self.scores.failures} reward function calls failed in {self.step}", sys.stderr)
        return self.scores

    def send(self, worker: Worker, task: Task, records: list[dict[str, Any]]) -> None:
        if not worker.tasks:  # its first call starts now; each answer starts the next one's time
            worker.deadline = time.monotonic() + self.settings.timeout_s
        worker.tasks.append(task)
        calls = [self.index[function_key(self.chosen[task.sample][c])] for c in task.calls]
        worker.post((task.sample, records[task.sample], self.responses[task.sample], calls))

    def wait(self) -> None:
        """Take every answer in, then kill the workers past their deadline (an import, or a call)."""
        timed = [w for w in self.workers if not w.ready or w.tasks]
        nearest = min(w.deadline for w in timed) - time.monotonic()
        for channel in wait([w.channel for w in self.workers], timeout=max(0.0, nearest)):
            worker = next(w for w in self.workers if w.channel is channel)
            try:
                answer = channel.recv()
            except (EOFError, OSError):
                self.lost(worker, ended(worker.process))
                continue
            self.take(worker, answer)
        for worker in [w for w in timed if w in self.workers and w.deadline < time.monotonic()]:
            if not worker.channel.poll():  # an answer that came in time is taken next round
                worker.process.kill()
                self.lost(worker, None)

    def take(self, worker: Worker, answer: tuple) -> None:
        if not worker.ready:
            status, problem = answer
            if status != "ready":
                raise MoeloopError(f"{problem} ({self.step})")
            worker.ready = True
            return
        _, _, (status, value) = answer
        task = worker.tasks[0]
        position = task.calls.popleft()
        if status == "value":
            self.scores.rewards[task.sample] += self.chosen[task.sample][position].weight * value
        else:
            self.failed(task.sample, position, value)
        worker.deadline = time.monotonic() + self.settings.timeout_s
        if not task.calls:
            worker.tasks.popleft()

    def lost(self, worker: Worker, status: str | None) -> None:
        """A worker that ended (status: how) or that was killed past its deadline (None): its running call failed,
        and the rest of what it was sent goes to the others, or a new worker."""
        worker.process.wait()
        worker.channel.close()
        self.workers.remove(worker)
        if not worker.tasks:
            paths = ", ".join(f.path for f in self.functions)
            if not worker.ready:
                why = f"took longer than {IMPORT_SECONDS:g} s" if status is None else f"ended its process ({status})"
                raise MoeloopError(f"importing reward functions {paths} {why} ({self.step})")
            raise MoeloopError(f"a reward worker process ended ({status}) ({self.step})")
        why = (
            f"took longer than reward.timeout_s ({self.settings.timeout_s:g} s): its worker process was killed"
            if status is None
            else f"ended its worker process ({status})"
        )
        running = worker.tasks[0]
        self.failed(running.sample, running.calls.popleft(), why)
        self.queue.extendleft(reversed([task for task in worker.tasks if task.calls]))
        if self.queue:
            self.start(1)

    def failed(self, sample: int, position: int, why: str) -> None:
        function = self.chosen[sample][position]
        response = self.responses[sample]
        shown = response if len(response) <= SHOWN_RESPONSE else f"{response[:SHOWN_RESPONSE]}..."
        line = f"reward function {function.path} {why} on {self.samples[sample]} (response {shown!r}) in {self.step}"
        if self.settings.on_error == "fail":
            raise MoeloopError(line)
        self.scores.failures += 1
        if self.scores.failures <= LOGGED_FAILURES:
            print_line(f"warning: {line}; counted as 0 (reward.on_error zero)", sys.stderr)

    def close(self) -> None:
        """End the workers: idle ones read the end of their input and exit; any other is killed."""
        for worker in self.workers:
            if worker.tasks or not worker.ready:
                worker.process.kill()
            worker.channel.close()
        for worker in self.workers:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
        self.workers = []


def ended(process: subprocess.Popen) -> str:
    """How a worker whose connection closed ended: its exit code, or the signal that killed it."""
    try:
        code = process.wait(timeout=5)
    except subprocess.TimeoutExpired:  # it closed its connection and lives on: end it
        process.kill()
        return "it closed its connection"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal has no name
        return f"signal {-code}"
