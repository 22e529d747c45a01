"""The acceptance check of the demo: the README's loop on configs/tiny.yaml, run against a real S3 server
(SeaweedFS, `--root s3://...` with the endpoint and credentials in the AWS chain's environment), learns.

eval_reward_mean (greedy, held-out prompts) at the last iteration must beat the SFT checkpoint's by 0.2.
"""

from __future__ import annotations

from moeloop.steps.config import load_config
from moeloop.steps.storage.run import RunStorage
from tests.conftest import REPO
from tests.processes import moeloop_cli


def test_demo_loop_learns(s3_run_root: str) -> None:
    config = load_config(REPO / "configs" / "tiny.yaml")
    moeloop_cli("run", "configs/tiny.yaml", "--root", s3_run_root, "--no-progress", check=True)
    storage = RunStorage(f"{s3_run_root}/{config.run_name}")
    start = storage.read_json(storage.metrics(0))["eval_reward_mean"]
    last = storage.read_json(storage.metrics(config.iterations))["eval_reward_mean"]
    print(f"eval_reward_mean: SFT {start:.3f} -> iteration {config.iterations} {last:.3f}")
    assert storage.latest() == {"iteration": config.iterations, "checkpoint": storage.checkpoint(config.iterations)}
    assert last >= start + 0.2
