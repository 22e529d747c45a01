"""`moeloop report RUN [--plot DIR]`: the loop's balance and the MoE's stability per iteration, read from the run's
committed metrics files (and its pictures, drawn by steps/observe/plots.py).

Only metrics/iter-NNNNNN.json count: evaluate writes each one whole (an atomic object) once the iteration
is published, so an iteration still in flight is simply not there yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeloop.steps.inputs import output_folder
from moeloop.steps.storage.metrics import committed_metrics
from moeloop.steps.storage.run import RunStorage

# (header, metrics field): durations and waits in seconds, defined in the README's "Balance".
COLUMNS = (
    ("iter", "iteration"),
    ("staleness", "staleness"),
    ("rollout s", "rollout_seconds"),
    ("reward s", "reward_seconds"),
    ("train s", "train_seconds"),
    ("rollout wait", "rollout_wait_seconds"),
    ("reward wait", "reward_wait_seconds"),
    ("train wait", "train_wait_seconds"),
    ("iteration s", "iteration_seconds"),
    # The MoE's stability: the policy's entropy, the routers' health and the engine/trainer mismatch (README
    # "Metrics").
    ("entropy", "entropy"),
    ("imbalance", "router_load_imbalance"),
    ("router entropy", "router_entropy"),
    ("agreement", "routing_agreement"),
    ("mismatch", "logprob_mismatch"),
    ("masked", "mismatch_masked"),
    ("eval reward", "eval_reward_mean"),
)
# Ratios and shares: three decimals (the durations take one).
FINE = {field for _, field in COLUMNS[9:]}


def table_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """The table's fields of one iteration's metrics (a run from before they were recorded lacks some)."""
    steps, waits = metrics.get("step_seconds") or {}, metrics.get("wait_seconds") or {}
    router = metrics.get("router") or {}
    return {
        **metrics,
        "router_load_imbalance": router.get("load_imbalance"),
        "router_entropy": router.get("entropy"),
        "routing_agreement": router.get("routing_agreement"),
        "reward_seconds": steps.get("reward"),
        "train_seconds": steps.get("train"),
        "reward_wait_seconds": waits.get("reward"),
        "train_wait_seconds": waits.get("train"),
    }


def format_table(all_metrics: list[dict[str, Any]]) -> str:
    def cell(field: str, value: Any) -> str:
        if value is None:
            return "-"
        return (
            f"{value:.3f}"
            if field in FINE
            else f"{value:.1f}"
            if isinstance(value, float)
            else str(value)
        )

    rows = [[header for header, _ in COLUMNS]]
    rows += [[cell(field, table_row(m).get(field)) for _, field in COLUMNS] for m in all_metrics]
    widths = [max(len(row[column]) for row in rows) for column in range(len(COLUMNS))]
    return "\n".join("  ".join(text.rjust(width) for text, width in zip(row, widths, strict=True)) for row in rows)


def print_report(run_uri: str, plot_dir: Path | None = None) -> None:
    storage = RunStorage(run_uri)
    storage.require_run()
    if plot_dir is not None:
        output_folder(plot_dir, "--plot")  # before the table: a bad folder is the one line printed
    all_metrics = committed_metrics(storage)
    print(format_table(all_metrics))
    if not all_metrics:
        print(f"(no iteration of {run_uri} has committed metrics yet)")
    elif plot_dir is not None:
        from moeloop.steps.observe.plots import write_plots

        for path in write_plots(all_metrics, plot_dir):
            print(path)
