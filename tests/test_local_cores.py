"""The local runner's long-lived workers and core pinning: each running step on its own share of the cores."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workflows import local
from workflows.local import StepWorker, core_groups, pin_process_tree, step_environment

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


@pytest.mark.parametrize(
    ("cores", "parallelism", "groups"),
    [
        ({0, 1, 2, 3, 4, 5, 6, 7}, 2, [{0, 1, 2, 3}, {4, 5, 6, 7}]),
        ({0, 1}, 2, [{0}, {1}]),
        ({0, 1, 2}, 2, [{0}, {1}]),  # an odd core stays unused rather than unbalance the shares
        ({0, 1}, 3, [{0}, {1}, {0}]),  # more steps than cores: shared round-robin
        ({4, 6}, 1, [{4, 6}]),  # the cores this process may use (a container's cpuset), not 0..n-1
    ],
)
def test_core_groups_split_this_processes_cores(
    monkeypatch: pytest.MonkeyPatch, cores: set[int], parallelism: int, groups: list[set[int]]
) -> None:
    monkeypatch.setattr(local.os, "sched_getaffinity", lambda pid: cores, raising=False)
    assert core_groups(parallelism) == groups


def test_step_environment_sizes_threads_and_keeps_vllm_from_binding() -> None:
    pinned = step_environment(3, pin_cores=True)
    assert pinned["OMP_NUM_THREADS"] == "3" and pinned["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    unpinned = step_environment(1, pin_cores=False)
    assert unpinned["OMP_NUM_THREADS"] == "1"
    assert unpinned.get("VLLM_CPU_OMP_THREADS_BIND") == os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


@linux_only
def test_pinning_moves_a_process_its_threads_and_its_children() -> None:
    """A worker's engine keeps helper processes and threads (vLLM's engine core) from command to command: pinning
    the worker for the next command moves all of them."""
    cores = {max(os.sched_getaffinity(0))}
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; print(subprocess.Popen(['sleep', '60']).pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child = int(parent.stdout.readline())
        pin_process_tree(parent.pid, cores)
        for pid in (parent.pid, child):
            threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
            assert threads and all(os.sched_getaffinity(thread) == cores for thread in threads)
    finally:
        parent.kill()
        parent.wait()


@linux_only
def test_a_worker_runs_each_command_on_the_cores_given(tmp_path: Path) -> None:
    first, last = ({core} for core in (min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))))
    worker = StepWorker(step_environment(1, pin_cores=True))
    try:
        for cores in (first, last):
            # Not a step command: the worker refuses it (exit code 2) and lives on.
            worker.start([sys.executable, "-m", "json.tool"], tmp_path / "refused.log", cores)
            while worker.poll() is None:
                time.sleep(0.01)
            assert worker.returncode == 2
            assert os.sched_getaffinity(worker.process.pid) == cores
        assert "not a step command" in (tmp_path / "refused.log").read_text()
    finally:
        worker.close()
