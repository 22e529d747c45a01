"""The runner's core shares (`moeloop.workflows.local.cores`) applied to its steps' processes: each step's process
tree pinned to its share (Linux CPU affinity), and moved when a step starting beside it takes some of its cores."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from moeloop.workflows.local.cores import SharedCores


class CoreShares(SharedCores):
    """The runner's core shares, applied: when a step starting beside others takes some of their cores, their
    process trees are moved onto the rest, and a worker told to fit its torch threads to them (SIGWINCH,
    `moeloop.workflows.local.worker`); a plain process keeps the threads it started with. pinned False
    (`local.pin_cores` off, or not Linux): shares size the thread counts only."""

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
