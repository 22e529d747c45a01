"""Every benchmark script runs in its --smoke mode (benchmarks/smoke.py: the script's whole path at tiny sizes on the
CPU), so a change to the functions a benchmark calls cannot break it unnoticed; a script without the mode fails
here. Its figures are not checked (they mean nothing at those sizes), only that it ran and printed no failed row."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.processes import run_command

SCRIPTS = sorted(path for path in (REPO / "benchmarks").glob("*.py") if 'if __name__ == "__main__":' in path.read_text())
SMOKE_CALLS = ("smoke.parse_args(", "layer_arguments(")
# Those whose --smoke run tests/unit/test_benchmarks.py makes, checking its rows: not run twice.
CHECKED_ROWS = {"changed_fraction.py", "delta_handoff.py", "handoff.py", "route_storage.py"}
# Those that run the whole loop (several `moeloop run`s, vLLM engines): slow even at toy sizes.
LOOPS = {"async_loop.py", "planner_validation.py", "rollout_engines.py", "trl_grpo.py"}


def test_every_benchmark_script_has_a_smoke_mode() -> None:
    assert len(SCRIPTS) >= 15, [path.name for path in SCRIPTS]
    # smoke.parse_args, or moe_layer.layer_arguments, which calls it for the two layer benchmarks.
    lacking = [path.name for path in SCRIPTS if not any(call in path.read_text() for call in SMOKE_CALLS)]
    assert not lacking, f"benchmarks without --smoke (benchmarks/smoke.py): {lacking}"
    # and its usage says so, where a reader of the script looks
    undocumented = [path.name for path in SCRIPTS if "--smoke" not in ast.get_docstring(ast.parse(path.read_text()))]
    assert not undocumented, f"benchmarks whose docstring does not show --smoke: {undocumented}"


def smoke_arguments(script: Path, folder: Path) -> list[str]:
    """What the script needs besides --smoke: TRL's contender, a checkpoint to start from and a file to write."""
    if script.name != "trl_contender.py":
        return []
    from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy
    from moeloop.steps.config import load_config

    config = load_config(REPO / "configs" / "tiny.yaml")
    tokenizer = build_tokenizer(["abcdefghijklmnopqrstuvwxyz"])
    save_policy(build_tiny_model(config.model.tiny, tokenizer, seed=0), tokenizer, folder / "checkpoint")
    return ["--checkpoint", str(folder / "checkpoint"), "--seed", "0", "--out", str(folder / "curve.json")]


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(path, id=path.stem, marks=[pytest.mark.slow] if path.name in LOOPS else [])
        for path in SCRIPTS
        if path.name not in CHECKED_ROWS
    ],
)
def test_a_benchmark_script_runs_in_its_smoke_mode(script: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(script), "--smoke", *smoke_arguments(script, tmp_path)]
    done = run_command(command, cwd=tmp_path, check=True)
    failed = [line for line in done.stdout.splitlines() if line.startswith("|") and "failed" in line]
    assert not failed, failed
