"""The run's pictures, PNGs drawn headless (matplotlib's Agg) from its committed metrics files.

- learning_curves.png: eval and train reward with KL on a second axis; logprob mismatch; clip fractions; the
  policy's entropy.
- time_balance.png: per iteration, its period (publish to publish) and each role's busy and idle time in it.
- expert_load.png: the router's load imbalance per layer (`router/...` metrics holding "imbalance"), when the
  metrics carry them.
- pass_at_k.png: per data_source, the greedy responses' pass@1 and the sampled responses' pass@k for the largest k
  (steps/evaluate.py), when the metrics carry them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moeloop.steps.errors import MoeloopError
from moeloop.steps.observe.scalars import flatten

# (role, path into an iteration's metrics): each role's busy seconds in an iteration (rollout: the slowest shard's).
ROLES = (
    ("rollout", ("rollout_seconds",)),
    ("reward", ("step_seconds", "reward")),
    ("train", ("step_seconds", "train")),
    ("publish", ("step_seconds", "publish")),
)


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MoeloopError("plots need matplotlib: pip install 'moeloop[observe]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt: Any, figure: Any, path: Path) -> None:
    """Atomically: a reader sees the old picture or the new one."""
    for axes in figure.axes:
        axes.xaxis.set_major_locator(plt.MaxNLocator(integer=True))  # iterations
    partial = path.with_name(f".{path.name}.partial")
    figure.savefig(partial, format="png", dpi=100)
    plt.close(figure)
    os.replace(partial, path)


def series(all_metrics: list[dict[str, Any]], *path: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of one figure, where the iterations have it."""
    points = []
    for metrics in all_metrics:
        value: Any = metrics
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            points.append((metrics["iteration"], float(value)))
    return [i for i, _ in points], [v for _, v in points]


def learning_curves(plt: Any, all_metrics: list[dict[str, Any]], path: Path) -> None:
    figure, (rewards, mismatch, clipped, entropy) = plt.subplots(1, 4, figsize=(20, 4), layout="constrained")
    rewards.plot(*series(all_metrics, "eval_reward_mean"), "o-", label="eval reward (greedy)")
    rewards.plot(*series(all_metrics, "reward_mean"), "s-", label="train reward (sampled)")
    rewards.set(xlabel="iteration", ylabel="reward", title="Rewards and KL")
    kl = rewards.twinx()
    kl.plot(*series(all_metrics, "kl"), "^--", color="tab:red", label="KL to reference")
    kl.set_ylabel("KL")
    lines = rewards.get_legend_handles_labels()[0] + kl.get_legend_handles_labels()[0]
    rewards.legend(lines, [line.get_label() for line in lines], loc="best", fontsize="small")
    mismatch.plot(*series(all_metrics, "logprob_mismatch"), "o-", label="engine vs trainer logprob")
    mismatch.plot(*series(all_metrics, "behavior_kl"), "s-", label="behaviour KL")
    mismatch.set(xlabel="iteration", title="Engine / trainer mismatch")
    mismatch.legend(fontsize="small")
    clipped.plot(*series(all_metrics, "clip_fraction_binding"), "o-", label="clip binds")
    clipped.plot(*series(all_metrics, "clip_fraction_out_of_range"), "s-", label="ratio out of range")
    clipped.set(xlabel="iteration", ylabel="fraction of tokens", title="Clip fractions")
    clipped.legend(fontsize="small")
    entropy.plot(*series(all_metrics, "entropy"), "o-")
    entropy.set(xlabel="iteration", ylabel="nats", title="Policy entropy (mean per token)")
    save(plt, figure, path)


def time_balance(plt: Any, all_metrics: list[dict[str, Any]], path: Path) -> None:
    """Per iteration, its period (publish to publish: `iteration_seconds`) and, side by side, each role's bar: busy
    (solid), then idle for the rest of the period (hatched). The roles overlap in time (a step's wait is the others'
    work), so nothing is stacked across roles: each bar is one role's share of the same period."""
    figure, axes = plt.subplots(figsize=(9, 4), layout="constrained")
    iterations, periods = series([m for m in all_metrics if m["iteration"] > 0], "iteration_seconds")
    width = 0.8 / len(ROLES)
    for k, (role, key) in enumerate(ROLES):
        found = dict(zip(*series(all_metrics, *key), strict=True))
        busy = [found.get(i, 0.0) for i in iterations]
        idle = [max(0.0, period - b) for period, b in zip(periods, busy, strict=True)]
        x = [i - 0.4 + width * (k + 0.5) for i in iterations]
        axes.bar(x, busy, width, color=f"C{k}", label=role)
        axes.bar(x, idle, width, bottom=busy, color=f"C{k}", alpha=0.25, hatch="//", label="idle" if k == 0 else None)
    axes.hlines(periods, [i - 0.45 for i in iterations], [i + 0.45 for i in iterations], colors="black", label="period")
    axes.set(xlabel="iteration", ylabel="seconds", title="Each role's busy and idle time in the iteration's period")
    axes.legend(fontsize="small", ncols=3)
    save(plt, figure, path)


def imbalance_series(all_metrics: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    flat = [(m["iteration"], flatten(m, "")) for m in all_metrics]
    tags = sorted({t for _, f in flat for t in f if t.startswith("router/") and "imbalance" in t})
    return {tag: ([i for i, f in flat if tag in f], [f[tag] for _, f in flat if tag in f]) for tag in tags}


def expert_load(plt: Any, all_metrics: list[dict[str, Any]], path: Path) -> bool:
    found = imbalance_series(all_metrics)
    if not found:
        return False
    figure, axes = plt.subplots(figsize=(7, 4), layout="constrained")
    for tag, (iterations, values) in found.items():
        axes.plot(iterations, values, "o-", label=tag.removeprefix("router/"))
    axes.set(xlabel="iteration", ylabel="max / mean tokens per expert - 1", title="Expert load imbalance")
    axes.legend(fontsize="small")
    save(plt, figure, path)
    return True


def pass_at_k(plt: Any, all_metrics: list[dict[str, Any]], path: Path) -> bool:
    sources = sorted({source for m in all_metrics for source in m.get("eval_by_source") or {}})
    if not sources:
        return False
    figure, axes = plt.subplots(figsize=(7, 4), layout="constrained")
    for number, source in enumerate(sources):
        color = f"C{number % 10}"
        greedy = series(all_metrics, "eval_by_source", source, "pass_at_1")
        axes.plot(*greedy, "o-", color=color, label=f"{source} greedy")
        ks = {k for m in all_metrics for k in ((m.get("eval_by_source") or {}).get(source, {}).get("pass_at_k") or {})}
        if ks:
            k = max(ks, key=int)
            sampled = series(all_metrics, "eval_by_source", source, "pass_at_k", k)
            axes.plot(*sampled, "s--", color=color, label=f"{source} pass@{k}")
    axes.set(xlabel="iteration", ylabel="share of prompts", ylim=(-0.02, 1.02))
    axes.set_title("Greedy pass@1 and sampled pass@k")
    axes.legend(fontsize="small")
    save(plt, figure, path)
    return True


def write_plots(all_metrics: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Every picture the metrics allow, into folder; returns the files written."""
    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "learning_curves.png", folder / "time_balance.png"]
    learning_curves(plt, all_metrics, written[0])
    time_balance(plt, all_metrics, written[1])
    if expert_load(plt, all_metrics, folder / "expert_load.png"):
        written.append(folder / "expert_load.png")
    if pass_at_k(plt, all_metrics, folder / "pass_at_k.png"):
        written.append(folder / "pass_at_k.png")
    return written
