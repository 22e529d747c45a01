"""A rollout shard on Spot capacity: killed at any moment, retried as Argo would, committed exactly once."""

from __future__ import annotations

import io
import random
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.rollout import rollout
from moeloop.steps.start import start
from moeloop.steps.storage.run import RunStorage
from tests.conftest import small_config
from tests.processes import fork_server, run_command, run_forked, start_forked_step, start_process, step_command
from moeloop.workflows.dag import run_uri

pytestmark = pytest.mark.slow

KILLS = 20
GRACE_SECONDS = 30  # Kubernetes' default terminationGracePeriodSeconds


def shard_command(uri: str, config: MoeloopConfig) -> list[str]:
    return step_command("rollout", uri, 1, "--shard", "0", "--num-shards", str(config.rollout.num_shards))


def leftovers(folder: Path) -> list[str]:
    """Anything in the experience folder that is not a committed object."""
    return sorted(p.name for p in folder.glob("*") if ".tmp" in p.name) if folder.exists() else []


def start_run(run_root: Path, engine: str, prompts: int = 32, samples: int = 4) -> tuple[str, MoeloopConfig, Path]:
    config = small_config(
        iterations=1, rollout={"engine": engine, "prompts_per_iteration": prompts, "samples_per_prompt": samples}
    )
    uri = run_uri(config, str(run_root))
    start(uri, config)
    shard = run_root / config.run_name / RunStorage.rollout_shard(1, 0, config.rollout.num_shards)
    return uri, config, shard


def test_shard_killed_at_random_moments_commits_exactly_once(run_root: Path) -> None:
    """The shard is killed forked from a process that has imported the steps (tests/processes.py), so that the
    moments fall in its work, not in a fresh interpreter's imports; the retry runs in this process."""
    uri, config, shard = start_run(run_root, "transformers")
    command = shard_command(uri, config)
    run_command(command, check=True)  # a pod's shard, and the checkpoint cache warmed
    reference = shard.read_bytes()
    shard.unlink()
    fork_server()
    started = time.perf_counter()
    assert run_forked(command, run_root / "timed.log") == 0, (run_root / "timed.log").read_text()[-3000:]
    normal_seconds = time.perf_counter() - started
    assert shard.read_bytes() == reference
    expected_rows = (
        config.rollout.prompts_per_iteration // config.rollout.num_shards
    ) * config.rollout.samples_per_prompt

    rng = random.Random(0)
    outcomes = {"killed before commit": 0, "already committed when killed": 0}
    for kill in range(KILLS):
        shard.unlink()
        process = start_forked_step(command, run_root / f"killed-{kill}.log")
        time.sleep(rng.uniform(0, normal_seconds))
        process.kill()
        process.join()
        # Whatever the moment: either no shard at all, or the whole shard.
        if shard.exists():
            assert shard.read_bytes() == reference
            outcomes["already committed when killed"] += 1
        else:
            outcomes["killed before commit"] += 1
        # The retry finds the committed shard and exits, or writes it whole; same seed, same bytes.
        rollout(uri, 1, 0, config.rollout.num_shards)
        assert shard.read_bytes() == reference
    table = pq.read_table(io.BytesIO(reference))
    assert table.num_rows == expected_rows
    assert len(set(table["sample_id"].to_pylist())) == expected_rows
    print(f"{KILLS} SIGKILLs over a {normal_seconds:.1f} s shard: {outcomes}")
    assert outcomes["killed before commit"] > 0


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_sigterm_stops_the_shard_within_the_grace_period_leaving_nothing(run_root: Path, engine: str) -> None:
    uri, config, shard = start_run(run_root, engine, prompts=256, samples=16)
    cache = run_root.parent / "cache"
    process = start_process(shard_command(uri, config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Into the work: the checkpoint is being fetched, so the step runs (its handler is set), then the engine
    # loads or generates. Polling keeps this independent of how long the imports take on a busy machine.
    while not any(cache.rglob("*.safetensors")) and process.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5 if engine == "transformers" else 5)
    assert process.poll() is None, "the shard ended before the signal; lengthen its work"
    signalled = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=GRACE_SECONDS)
    stop_seconds = time.perf_counter() - signalled
    print(f"{engine}: stopped {stop_seconds:.2f} s after SIGTERM")
    assert returncode == 128 + signal.SIGTERM
    assert not shard.exists()
    assert leftovers(shard.parent) == []
