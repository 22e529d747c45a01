"""What the local runner shows as it runs: the iterations done out of those to run, with one ETA, the steps running,
a step's own progress line (start's SFT), and a line of metrics per evaluation.

On a terminal that is a bar redrawn in place (tqdm, on stderr), the metrics lines scrolling above it, the latest
step progress line in it. Anywhere else (a pipe, a file, CI) nothing is redrawn: each iteration's metrics line ends
with the progress, and every progress line a step writes is printed, at the latest when the step has ended.

The ETA counts iterations, not DAG steps (an iteration's steps take very different times): the mean time between
the last few iterations' ends, the first measured from start's end, times the iterations left. Until the first
iteration has ended it is "estimating": nothing measured yet would say anything about an iteration.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from moeloop.steps.common import PROGRESS_PREFIX
from moeloop.workflows.dag import EVALUATE, PUBLISH, START, Task

PACE_ITERATIONS = 5  # the ETA's pace: the mean of this many last iterations (the first pays engine builds)
READ_EVERY_SECONDS = 0.5


class ProgressDisplay:
    def __init__(
        self,
        tasks: list[Task],
        enabled: bool,
        log_dir: Path | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = sys.stderr if stream is None else stream
        self.enabled, self.log_dir, self.clock = enabled, log_dir, clock
        self.interactive = enabled and self.stream.isatty()
        self.iterations = {t.iteration for t in tasks if t.step == PUBLISH}
        self.started = clock()
        self.ends: list[float] = []  # when start ended, then each iteration (its evaluation): the intervals' ends
        self.done, self.step_progress, self.read_at = 0, "", float("-inf")
        self.read_to: dict[str, int] = {}  # each task's log: how far its progress lines have been read
        self.bar = tqdm(
            total=len(self.iterations),
            file=self.stream,
            disable=not self.interactive,
            dynamic_ncols=True,
            bar_format="{desc}{n_fmt}/{total_fmt} iterations |{bar}| {elapsed}{postfix}",
            postfix="ETA estimating",  # its first frame, drawn here
        )
        self.description = ""
        self._redraw()

    def running(self, names: list[str]) -> None:
        """The tasks now running; their new progress lines are read from their logs now and then."""
        if not self.enabled:
            return
        description = ", ".join(names)
        changed = description != self.description
        self.description = description
        if self.clock() - self.read_at >= READ_EVERY_SECONDS:
            self.read_at = self.clock()
            changed = any([self._read_progress(name) for name in names]) or changed
        if changed:
            self._redraw()

    def _read_progress(self, name: str) -> bool:
        """Read the task's new progress lines (off a terminal, print them); whether there were any."""
        if self.log_dir is None:
            return False
        lines, self.read_to[name] = new_progress(self.log_dir / f"{name}.log", self.read_to.get(name, 0))
        for line in lines:
            self.step_progress = f"{name}: {line}"
            if not self.interactive:
                print(self.step_progress, file=self.stream, flush=True)
        return bool(lines)

    def finished(self, task: Task, metrics: dict | None) -> None:
        """A task done; an evaluation's with its iteration's metrics."""
        if self.enabled:
            self._read_progress(task.name)  # what it wrote since the last read
            if self.step_progress.startswith(f"{task.name}: "):
                self.step_progress = ""
        if task.step == START:
            self.ends.append(self.clock())
        if task.step != EVALUATE:
            return
        line = describe_metrics(metrics)
        if task.iteration in self.iterations:
            self.done += 1
            self.ends.append(self.clock())
            self.bar.update()
            if self.enabled and not self.interactive:
                line += f"  [{self.done}/{len(self.iterations)} iterations, {hms(self.clock() - self.started)}" \
                        f" elapsed, ETA {self.eta()}]"  # fmt: skip
        self.bar.write(line, file=sys.stdout)
        self._redraw()

    def eta(self) -> str:
        """The run's time left: the recent pace times the iterations left; "estimating" until one has ended."""
        intervals = [later - earlier for earlier, later in zip(self.ends, self.ends[1:])]
        if not self.done or not intervals:
            return "estimating"
        recent = intervals[-PACE_ITERATIONS:]
        return hms(sum(recent) / len(recent) * (len(self.iterations) - self.done))

    def _redraw(self) -> None:
        if self.interactive:
            self.bar.set_description_str(f"{self.description}: " if self.description else "", refresh=False)
            self.bar.set_postfix_str(f"ETA {self.eta()}" + (f"; {self.step_progress}" if self.step_progress else ""))

    def close(self) -> None:
        self.bar.close()


def new_progress(log: Path, offset: int) -> tuple[list[str], int]:
    """The progress lines the step has written to its log from offset on, without their prefix, and the offset
    after them (a line not yet ended stays for the next read)."""
    try:
        with open(log, "rb") as stream:
            stream.seek(offset)
            text = stream.read()
    except OSError:
        return [], offset
    whole = text[: text.rfind(b"\n") + 1]
    lines = whole.decode(errors="replace").splitlines()
    return [line.removeprefix(PROGRESS_PREFIX).strip() for line in lines if line.startswith(PROGRESS_PREFIX)], (
        offset + len(whole)
    )


def hms(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def describe_metrics(metrics: dict) -> str:
    parts = [f"iteration {metrics['iteration']:>3}: eval_reward_mean {metrics['eval_reward_mean']:.3f}"]
    if metrics.get("eval_pass_at_k"):  # the sampled responses' pass@k for the largest k
        k, value = max(metrics["eval_pass_at_k"].items(), key=lambda item: int(item[0]))
        parts.append(f"pass@{k} {value:.3f}")
    if metrics.get("reward_mean") is not None:
        kl = "-" if metrics.get("kl") is None else f"{metrics['kl']:.3f}"
        parts.append(f"reward_mean {metrics['reward_mean']:.3f}  kl {kl}  loss {metrics['loss']:+.3f}")
    return "  ".join(parts)
