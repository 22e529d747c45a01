"""An iteration's figures as (tag, value) scalars: its committed metrics file and its steps' reports.

Tags are the metrics' own names (nested ones joined by `/`: `step_seconds/train`, `router/...`) and
`step/<report>/<key>` for the reports (`step/train/grad_norm`, `step/rollout-0/tokens_per_second`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeloop.steps.storage.run import RunStorage

STAMPS = ("started_at", "ended_at")  # wall-clock stamps of a report: the events' time, not figures


@dataclass(frozen=True)
class IterationScalars:
    iteration: int
    wall_time: float  # when the iteration's evaluation ended (its report's stamp): the same on every re-read
    values: dict[str, float]


def flatten(value: Any, prefix: str) -> dict[str, float]:
    """The numeric leaves of nested dicts and lists, by their `/`-joined path; text, None and flags dropped."""
    if isinstance(value, dict):
        return {tag: v for key, item in value.items() for tag, v in flatten(item, f"{prefix}/{key}").items()}
    if isinstance(value, list):
        return {tag: v for index, item in enumerate(value) for tag, v in flatten(item, f"{prefix}/{index}").items()}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {prefix.lstrip("/"): float(value)}
    return {}


def step_reports(storage: RunStorage, iteration: int) -> dict[str, dict[str, Any]]:
    folder = storage.reports(iteration)
    return {name.removesuffix(".json"): storage.read_json(f"{folder}/{name}") for name in storage.list(folder)}


def iteration_scalars(storage: RunStorage, iteration: int, metrics: dict[str, Any]) -> IterationScalars:
    """metrics: the iteration's committed metrics file; the reports are read beside it."""
    reports = step_reports(storage, iteration)
    values = flatten({k: v for k, v in metrics.items() if k != "iteration"}, "")
    for name, report in sorted(reports.items()):
        values.update(flatten({k: v for k, v in report.items() if k not in STAMPS}, f"step/{name}"))
    ended = [r["ended_at"] for r in reports.values() if "ended_at" in r]
    wall_time = reports.get("evaluate", {}).get("ended_at") or max(ended, default=0.0)
    return IterationScalars(iteration, float(wall_time), values)
