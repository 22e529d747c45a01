"""How the local runner shares this machine's cores among the steps it runs side by side. The runner applies it
(`pinning.py`); the capacity planner plays it (`workflows/capacity/schedule.py`) and replays it over a run's
reports (`workflows/capacity/rates.py`), so both see the cores a step had."""

from __future__ import annotations

import os
from collections import Counter


def available_cores() -> list[int]:
    """The cores this process may use (a container's cpuset), not 0..n-1."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def core_shares(cores: list[int], running: list[set[int]], starting: int) -> tuple[list[set[int]], list[set[int]]]:
    """Cores for `starting` steps that start beside steps running on the `running` shares, as pods on nodes of
    their own: an equal share of all the cores each (a step alone: all of them), from the free cores first (the
    last step to start takes all that are left, so none idles), then taken from the largest running shares.
    Returns the new shares and the running ones as they become (shrunk, never moved elsewhere). With more steps
    than cores, a step shares the core fewest others run on."""
    running = [set(share) for share in running]
    target = max(1, len(cores) // (len(running) + starting))
    shares: list[set[int]] = []
    for index in range(starting):
        used = set().union(*running, *shares)
        free = [core for core in cores if core not in used]
        share = set(free if index == starting - 1 else free[:target])
        while len(share) < target and max(map(len, running + shares), default=0) > target:
            largest = max(running + shares, key=len)
            core = max(largest)
            largest.remove(core)
            share.add(core)
        if not share:
            load = Counter(core for other in running + shares for core in other)
            share = {min(cores, key=lambda core: load[core])}
        shares.append(share)
    return shares, running


def speed(share: set[int], shares: list[set[int]]) -> float:
    """The cores' worth a step on `share` runs at, beside steps on `shares` (its own included): each of its cores
    split among the steps on it."""
    load = Counter(core for other in shares for core in other)
    return sum(1 / load[core] for core in share)


class SharedCores:
    """Which cores each running step has, by name (`core_shares`). A step keeps its cores until it ends, but for
    the ones that a step starting beside it takes; cores freed by a step that ends go to the next to start, not to
    those running (measured: a torch step whose threads grow mid-run, pinned, ran slower than on its one core)."""

    def __init__(self, cores: list[int]):
        self.cores = cores
        self.shares: dict[str, set[int]] = {}

    def start(self, names: list[str]) -> list[set[int]]:
        shares, running = core_shares(self.cores, list(self.shares.values()), len(names))
        self.shares = dict(zip(self.shares, running, strict=True)) | dict(zip(names, shares, strict=True))
        return shares

    def finished(self, name: str) -> None:
        self.shares.pop(name)

    def speed(self, name: str) -> float:
        return speed(self.shares[name], list(self.shares.values()))


def held_cores(spans: dict[str, tuple[float, float]], count: int) -> dict[str, float]:
    """The mean cores' worth each step had over its (start, end) span, the shares replayed on `count` cores in the
    order the steps started and ended (an end before a start at the same instant)."""
    timed = {name: span for name, span in spans.items() if span[1] > span[0]}
    events = sorted([(end, 0, name) for name, (_, end) in timed.items()] + [(s, 1, n) for n, (s, _) in timed.items()])
    cores, held = SharedCores(list(range(count))), dict.fromkeys(spans, 0.0)
    last = events[0][0] if events else 0.0
    for when, starts, name in events:
        for running in cores.shares:
            held[running] += cores.speed(running) * (when - last)
        last = when
        if starts:
            cores.start([name])
        else:
            cores.finished(name)
    return {name: held[name] / (end - start) if name in timed else float(count) for name, (start, end) in spans.items()}
