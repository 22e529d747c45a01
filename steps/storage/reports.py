"""A step's report in the run, reports/iter-NNNNNN/<step>.json: what it measured, stamped with its span."""

from __future__ import annotations

import time
from typing import Any

from moeloop.steps.storage.run import RunStorage


def write_report(storage: RunStorage, iteration: int, name: str, report: dict[str, Any]) -> None:
    """The step's report, stamped with its wall-clock span in Unix seconds: `ended_at` now, as the step writes
    it (before it commits its output), and `started_at` the report's `seconds` earlier. Evaluate reads the
    stamps of all steps, wherever they ran, to tell how long each waited on the others."""
    ended_at = time.time()
    report.update(started_at=round(ended_at - report["seconds"], 3), ended_at=round(ended_at, 3))
    storage.write_json(storage.report(iteration, name), report)
