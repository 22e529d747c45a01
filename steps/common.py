"""What every step CLI shares: its arguments, opening its iteration, its printed report."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import ArgumentParser, MoeloopError, print_line
from moeloop.steps.outputs import write_outputs
from moeloop.steps.storage.run import RunStorage, open_run


def step_parser(description: str | None) -> argparse.ArgumentParser:
    parser = ArgumentParser(description=description)
    parser.add_argument("--run", required=True, help="the run's folder URI (local path or s3://...)")
    parser.add_argument("--iteration", required=True, type=int)
    return parser


def open_iteration(run_uri: str, iteration: int, first: int = 1) -> tuple[RunStorage, MoeloopConfig]:
    """The run, checked to have the iteration (RL iterations start at 1; 0 is the SFT start)."""
    storage, config = open_run(run_uri)
    if not first <= iteration <= config.iterations:
        raise MoeloopError(f"iteration {iteration} is outside this run's iterations {first}..{config.iterations}")
    return storage, config


def already_committed(storage: RunStorage, relative: str) -> dict[str, str]:
    """The report of a step that finds its output committed and does nothing: re-runs are no-ops. The step has
    checked that the output is its own first (anything else there is foreign data: an error)."""
    return {"skipped": f"already committed: {storage.display(relative)}"}


def quiet_libraries() -> None:
    """Step logs hold our lines, not library progress bars."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


PROGRESS_PREFIX = "progress: "


def print_progress(text: str) -> None:
    """A line of the step's own progress, into its log (stderr): `moeloop run` shows the latest one as it runs."""
    print_line(PROGRESS_PREFIX + text, sys.stderr)


def print_json(report: dict[str, Any]) -> None:
    """Print the step's report as one JSON line; under Argo also write its scalars as output parameters."""
    print_line(json.dumps(report, sort_keys=True))
    write_outputs(report)
