"""The acceptance check of the demo: the README's loop on configs/tiny.yaml learns.

eval_reward_mean (greedy, held-out prompts) at the last iteration must beat the SFT checkpoint's by 0.2.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from steps.config import load_config
from steps.storage import RunStorage
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_demo_loop_learns(run_root: Path) -> None:
    config = load_config(REPO / "configs" / "tiny.yaml")
    subprocess.run(
        [sys.executable, "-m", "workflows.cli", "run", "configs/tiny.yaml", "--root", str(run_root), "--no-progress"],
        cwd=REPO,
        check=True,
    )
    storage = RunStorage(str(run_root / config.run_name))
    start = storage.read_json(storage.metrics(0))["eval_reward_mean"]
    last = storage.read_json(storage.metrics(config.iterations))["eval_reward_mean"]
    print(f"eval_reward_mean: SFT {start:.3f} -> iteration {config.iterations} {last:.3f}")
    assert last >= start + 0.2
