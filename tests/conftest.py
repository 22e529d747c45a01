"""Shared fixtures: a small, fast version of the demo config."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.storage.run import RunStorage

REPO = Path(__file__).resolve().parents[1]

# The S3 server fixtures (`seaweed`, `s3_run_root`): a real SeaweedFS on loopback, started on first use.
pytest_plugins = ["tests.seaweed"]


# small_config's rollout section with the transformers engine (no vLLM start-up), for tests that override rollout.
SMALL_TRANSFORMERS_ROLLOUT = {
    "prompts_per_iteration": 8,
    "samples_per_prompt": 4,
    "num_shards": 2,
    "engine": "transformers",
}


def small_config(iterations: int = 2, **sections: dict) -> MoeloopConfig:
    """configs/tiny.yaml scaled down so that a whole iteration takes seconds."""
    config = load_config(REPO / "configs" / "tiny.yaml")
    updates = {
        "model": {"sft": {"steps": 3}},
        "rollout": {"prompts_per_iteration": 8, "samples_per_prompt": 4, "num_shards": 2},
        "trainer": {"minibatch_size": 16},
        "eval": {"max_prompts": 8},
        **sections,
    }
    data = config.model_dump()
    for section, values in updates.items():
        for key, value in values.items():
            if isinstance(value, dict):
                data[section][key].update(value)
            else:
                data[section][key] = value
    data["iterations"] = iterations
    return MoeloopConfig.model_validate(data)


def run_in_process(config: MoeloopConfig, uri: str) -> None:
    """A whole run: its tasks (workflows/dag.py:loop_tasks) in their order, each step called in this process. For
    tests of what the steps do over a run (a family's model, an algorithm, what a run commits), where the local
    runner, its processes and their overlap are not what they test (tests/loop/test_loop.py, test_async.py are)."""
    from moeloop.steps.evaluate import evaluate
    from moeloop.steps.publish import publish
    from moeloop.steps.reward import reward
    from moeloop.steps.rollout import rollout
    from moeloop.steps.start import start
    from moeloop.steps.train import train
    from moeloop.workflows.dag import loop_tasks

    steps = {"evaluate": evaluate, "reward": reward, "train": train, "publish": publish}
    for task in loop_tasks(config):
        arguments = dict(task.arguments)
        if task.step.name == "start":
            start(uri, config)
        elif task.step.name == "rollout":
            rollout(uri, task.iteration, int(arguments["shard"]), int(arguments["num_shards"]))
        else:
            steps[task.step.name](uri, task.iteration)


def eval_reward_gain(storage: RunStorage, iterations: int, name: str) -> tuple[float, float]:
    """The loop issue's measure: greedy eval_reward_mean of the SFT checkpoint and at iteration iterations (printed,
    with the gain against the 0.2 the demos' learning tests ask for)."""
    start = storage.read_json(storage.metrics(0))["eval_reward_mean"]
    last = storage.read_json(storage.metrics(iterations))["eval_reward_mean"]
    print(f"{name} eval_reward_mean: SFT {start:.3f} -> iteration {iterations} {last:.3f} (gain {last - start:.3f})")
    return start, last


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The checkpoint cache inside the test's folder (MOELOOP_CACHE: the processes the test starts inherit it)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOELOOP_CACHE", str(cache))
    return cache


@pytest.fixture
def run_root(tmp_path: Path, private_cache: Path) -> Path:
    """A storage root, with the checkpoint cache kept inside the test's folder."""
    root = tmp_path / "runs"
    root.mkdir()
    return root


@pytest.fixture(autouse=True)
def no_engine_left_behind() -> Iterator[None]:
    """Steps called in-process keep their rollout engine (moeloop.steps.engines.engine.engine_for); a test starts without one."""
    from moeloop.steps.engines.engine import release_engine

    release_engine()
    yield
    release_engine()


# The cores this machine gives the test session, before a pytest-xdist worker is pinned to its share of them
# (kept in the environment: a test module may import this file again as another module, after the pinning).
MACHINE_CORES = (
    [int(core) for core in os.environ["MOELOOP_TEST_CORES"].split(",")]
    if os.environ.get("MOELOOP_TEST_CORES")
    else sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
)

# Files run first, longest first (`make test` keeps this order: --no-loadscope-reorder), so that the long ones
# start early on both workers and the short files fill in after them.
LONGEST_FILES = [
    "loop/test_demo.py",
    "loop/test_chat_demo.py",
    "loop/test_ppo_rm_demo.py",
    "loop/test_ppo_demo.py",
    "loop/test_async.py",
    "faults/test_storage_faults.py",
    "loop/test_family_demos.py",
    "loop/test_loop.py",
    "loop/test_vllm.py",
    "loop/test_replay.py",
    "faults/test_hostile_input.py",
    "faults/test_rollout_faults.py",
]


def pytest_configure(config: pytest.Config) -> None:
    """The test process computes on one torch thread, as every step process it starts does (tests/processes.py:
    OMP_NUM_THREADS=1): tests compare rows made in this process with a step process's to the byte, and a sum over
    two threads differs from one thread's in its last bits (with two, test_vllm.py's reproducibility and the killed
    shard's retry failed in a plain `pytest` run). Under pytest-xdist (`make test` runs 2 workers) each worker is also
    pinned to its own share of the cores, and so is every process it starts: a local run's steps size their torch
    threads to the cores they see. Unpinned, two workers' steps ran four OpenMP threads on two cores, whose
    spin-waits made tiny.yaml's update 4.5x slower (30.3 s against 6.7 s alone; 9.4 s with one thread each)."""
    import torch

    torch.set_num_threads(1)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if MACHINE_CORES and len(MACHINE_CORES) >= workers > 1:
        os.environ["MOELOOP_TEST_CORES"] = ",".join(map(str, MACHINE_CORES))
        os.sched_setaffinity(0, MACHINE_CORES[int(worker.removeprefix("gw")) % workers :: workers])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/loop/ is slow (`make test-fast` leaves them out); the longest files first."""
    tests = REPO / "tests"
    for item in items:
        if item.path.is_relative_to(tests / "loop"):
            item.add_marker(pytest.mark.slow)
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(tests).as_posix(), len(rank)))


@pytest.fixture
def all_machine_cores() -> Iterator[list[int]]:
    """This process on all the session's cores for the test (a test of how the runner shares them)."""
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, MACHINE_CORES)
    yield MACHINE_CORES
    os.sched_setaffinity(0, pinned)
