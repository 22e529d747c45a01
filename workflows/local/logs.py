"""Where a local run's step logs live, and which of them `moeloop logs` shows.

A run's logs are in .moeloop/logs/<run_name>-<8 hex digits>/ under the working directory, one <task>.log per task
(and warm-<worker>.log per warmed worker). The digits are a hash of the run's URI (a local folder made absolute),
so two roots' runs of the same name keep their logs apart, and a run's logs are found again from its URI alone.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from moeloop.steps.errors import MoeloopError

LOGS = Path(".moeloop") / "logs"


def log_folder(run_uri: str) -> Path:
    """The folder of the run's step logs, relative to the working directory."""
    location = run_uri if "://" in run_uri else os.path.abspath(run_uri)
    name = location.rstrip("/").rsplit("/", 1)[-1]
    return LOGS / f"{name}-{hashlib.sha256(location.rstrip('/').encode()).hexdigest()[:8]}"


def step_logs(run_uri: str, task: str | None) -> list[Path]:
    """The log of one task of the run, or every task's (the workers' warm-up logs left out) in the order they were
    last written."""
    folder = log_folder(run_uri)
    if not folder.is_dir():
        raise MoeloopError(f"no step logs of run {run_uri} under {folder}/ (moeloop run writes them there)")
    if task is not None:
        log = folder / f"{task}.log"
        if "/" in task or not log.is_file():
            raise MoeloopError(
                f"run {run_uri} has no log of task {task!r} (tasks: start, eval-0, it<i>-rollout-<k>, it<i>-reward,"
                " it<i>-train, it<i>-publish, it<i>-eval)"
            )
        return [log]
    logs = [p for p in folder.glob("*.log") if not p.name.startswith("warm-")]
    return sorted(logs, key=lambda p: (p.stat().st_mtime, p.name))

