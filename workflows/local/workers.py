"""The runner's side of the long-lived step workers (`python -m moeloop.workflows.local.worker`, whose docstring
gives the protocol): starting one, sending it a command or modules to import, polling it, closing them all."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

from moeloop.workflows.local.pinning import pin_process_tree


class StepWorker:
    """A `python -m moeloop.workflows.local.worker` process: runs step commands one at a time, keeping engines loaded.

    It looks like a Popen to the runner: poll() is None while a command runs, then its exit code.
    """

    def __init__(self, environment: dict[str, str]):
        # A session of its own: a Ctrl-C at the terminal reaches the runner alone, which ends its workers
        # (terminate_workers); sent to a worker still starting, it printed a "Fatal Python error" into the terminal.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moeloop.workflows.local.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=environment,
            text=True,
            start_new_session=True,
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
