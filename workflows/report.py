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
    # What users compare runs by (steps/evaluate.py): the greedy responses' reward and pass@1, and pass@k.
    ("eval reward", "eval_reward_mean"),
    ("greedy pass@1", "eval_pass_at_1"),
)
# Ratios and shares: three decimals (the durations take one).
FINE = {field for _, field in COLUMNS[9:]} | {"reward_mean", "pass_at_1"}


def table_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """The table's fields of one iteration's metrics (a run from before they were recorded lacks some)."""
    steps, waits = metrics.get("step_seconds") or {}, metrics.get("wait_seconds") or {}
    router = metrics.get("router") or {}
    return {
        **metrics,
        **pass_at_k_fields(metrics.get("eval_pass_at_k")),
        "router_load_imbalance": router.get("load_imbalance"),
        "router_entropy": router.get("entropy"),
        "routing_agreement": router.get("routing_agreement"),
        "reward_seconds": steps.get("reward"),
        "train_seconds": steps.get("train"),
        "reward_wait_seconds": waits.get("reward"),
        "train_wait_seconds": waits.get("train"),
    }


def pass_at_k_fields(pass_at_k: dict[str, float] | None) -> dict[str, float]:
    """{"pass@K": value} of the sampled responses' pass@k (steps/evaluate.py), as the table's fields."""
    return {f"pass@{k}": value for k, value in (pass_at_k or {}).items()}


def sampled_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A column for each k of pass@k that some row has, by k."""
    ks = sorted({int(key[5:]) for row in rows for key in row if key.startswith("pass@")})
    return [(f"pass@{k}", f"pass@{k}") for k in ks]


def format_table(all_metrics: list[dict[str, Any]]) -> str:
    rows = [table_row(m) for m in all_metrics]
    return aligned([*COLUMNS, *sampled_columns(rows)], rows)


def format_sources_table(all_metrics: list[dict[str, Any]]) -> str | None:
    """The eval figures of each data_source, iteration by iteration; None where the eval set has one source (the
    main table's figures are its own)."""
    rows = [
        {"iteration": m["iteration"], "data_source": source, **figures, **pass_at_k_fields(figures.get("pass_at_k"))}
        for m in all_metrics
        for source, figures in sorted((m.get("eval_by_source") or {}).items())
    ]
    if len({row["data_source"] for row in rows}) < 2:
        return None
    columns = [
        ("iter", "iteration"),
        ("data_source", "data_source"),
        ("prompts", "prompts"),
        ("eval reward", "reward_mean"),
        ("greedy pass@1", "pass_at_1"),
    ]
    return aligned(columns + sampled_columns(rows), rows)


def aligned(columns: list[tuple[str, str]], rows: list[dict[str, Any]]) -> str:
    """The rows' fields under the columns' headers, right-aligned; missing figures as "-"."""

    def cell(field: str, value: Any) -> str:
        if value is None:
            return "-"
        if not isinstance(value, float):
            return str(value)
        return f"{value:.3f}" if field in FINE or field.startswith("pass@") else f"{value:.1f}"

    table = [[header for header, _ in columns]]
    table += [[cell(field, row.get(field)) for _, field in columns] for row in rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(columns))]
    return "\n".join("  ".join(text.rjust(width) for text, width in zip(row, widths, strict=True)) for row in table)


def run_metrics(run_uri: str, plot_dir: Path | None = None) -> list[dict[str, Any]]:
    """Every committed iteration's metrics, in order (what `moeloop report -o json|yaml` prints); a --plot folder
    is checked first, so that a bad one is the one line printed."""
    storage = RunStorage(run_uri)
    storage.require_run()
    if plot_dir is not None:
        output_folder(plot_dir, "--plot")
    return committed_metrics(storage)


def print_report(run_uri: str, plot_dir: Path | None = None) -> None:
    all_metrics = run_metrics(run_uri, plot_dir)
    print(format_table(all_metrics))
    if (sources := format_sources_table(all_metrics)) is not None:
        print(f"\neval by data_source\n{sources}")
    if not all_metrics:
        print(f"(no iteration of {run_uri} has committed metrics yet)")
    elif plot_dir is not None:
        from moeloop.steps.observe.plots import write_plots

        for path in write_plots(all_metrics, plot_dir):
            print(path)
