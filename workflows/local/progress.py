"""What the local runner shows as it runs: a progress bar of the steps done, the steps running as its description,
a line of metrics per evaluation, and the run's time left."""

from __future__ import annotations

import time

from tqdm import tqdm

from moeloop.workflows.dag import EVALUATE, Task


class ProgressDisplay:
    def __init__(self, tasks: list[Task], enabled: bool):
        self.bar = tqdm(total=len(tasks), unit="step", disable=not enabled, dynamic_ncols=True)
        self.description = ""
        self.iterations_left = len({t.iteration for t in tasks if t.step == EVALUATE and t.iteration > 0})
        self.started, self.iterations_done = time.time(), 0

    def running(self, names: list[str]) -> None:
        if self.description != ", ".join(names):
            self.description = ", ".join(names)
            self.bar.set_description(self.description)

    def finished(self, task: Task, metrics: dict | None) -> None:
        """A task done; an evaluation's with its iteration's metrics."""
        self.bar.update()
        if task.step != EVALUATE:
            return
        self.bar.write(describe_metrics(metrics))
        if task.iteration > 0:
            self.iterations_done += 1
            eta = overall_eta(time.time() - self.started, self.iterations_done, self.iterations_left)
            self.bar.set_postfix_str(f"ETA {eta}")

    def close(self) -> None:
        self.bar.close()


def overall_eta(elapsed: float, done: int, total: int) -> str:
    """The run's time left at the measured pace so far: seconds per finished iteration, steps overlapping as they
    did (tqdm's own estimate counts steps, and an iteration's steps take very different times)."""
    seconds = round(elapsed / done * (total - done))
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
