"""The local runner's long-lived workers and core pinning: each running step on its own share of the cores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from moeloop.workflows.local import cores as cores_module
from moeloop.workflows.local.cores import SharedCores, available_cores, core_shares, held_cores, speed
from moeloop.workflows.local.launch import step_environment
from moeloop.workflows.local.pinning import CoreShares, pin_process_tree
from moeloop.workflows.local.workers import StepWorker
from tests.conftest import MACHINE_CORES

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


@pytest.mark.parametrize(
    ("cores", "running", "starting", "shares", "shrunk"),
    [
        ([0, 1, 2, 3], [], 1, [{0, 1, 2, 3}], []),  # a step alone: all the cores
        ([0, 1, 2, 3], [], 2, [{0, 1}, {2, 3}], []),  # two starting together: disjoint halves
        ([0, 1, 2], [], 2, [{0}, {1, 2}], []),  # the last to start takes what is left: no core idles
        ([0, 1, 2, 3], [{0, 1, 2, 3}], 1, [{2, 3}], [{0, 1}]),  # beside one running alone: half of its cores
        ([0, 1, 2, 3], [{0, 1}], 1, [{2, 3}], [{0, 1}]),  # the free cores first: nothing running moves
        ([0, 1, 2, 3, 4, 5], [{0, 1, 2, 3}], 2, [{4, 5}, {2, 3}], [{0, 1}]),
        ([0, 1], [{0}, {1}], 1, [{0}], [{0}, {1}]),  # more steps than cores: shared
        ([0, 1], [{0}, {1}, {0}], 1, [{1}], [{0}, {1}, {0}]),  # ... the core fewest others run on
        ([4, 6], [], 1, [{4, 6}], []),  # the cores this process may use (a container's cpuset), not 0..n-1
    ],
)
def test_core_shares_give_a_step_alone_all_cores_and_side_by_side_steps_disjoint_ones(
    cores: list[int], running: list[set[int]], starting: int, shares: list[set[int]], shrunk: list[set[int]]
) -> None:
    assert core_shares(cores, running, starting) == (shares, shrunk)


def test_available_cores_are_this_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cores_module.os, "sched_getaffinity", lambda pid: {6, 4}, raising=False)
    assert available_cores() == [4, 6]


def test_step_environment_sizes_threads_and_keeps_vllm_from_binding() -> None:
    pinned = step_environment(3, pin_cores=True)
    assert pinned["OMP_NUM_THREADS"] == "3" and pinned["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    unpinned = step_environment(1, pin_cores=False)
    assert unpinned["OMP_NUM_THREADS"] == "1"
    assert unpinned.get("VLLM_CPU_OMP_THREADS_BIND") == os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    # A rollout's process holds only its engine: vLLM runs the engine core in it, unless the environment says not.
    assert pinned["VLLM_ENABLE_V1_MULTIPROCESSING"] == os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


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
def test_a_worker_runs_each_command_on_the_cores_given(tmp_path: Path, all_machine_cores: list[int]) -> None:
    first, last = ({core} for core in (min(all_machine_cores), max(all_machine_cores)))
    worker = StepWorker(step_environment(1, pin_cores=True))
    try:
        for cores in (first, last):
            # Not a step command: the worker refuses it (exit code 2) and lives on.
            worker.start([sys.executable, "-m", "json.tool"], tmp_path / "refused.log", cores)
            while worker.poll() is None:
                time.sleep(0.01)
            assert worker.returncode == 2
            assert os.sched_getaffinity(worker.pid) == cores
        assert "not a step command" in (tmp_path / "refused.log").read_text()
    finally:
        worker.close()


def run_refused(worker: StepWorker, log: Path, cores: set[int] | None, threads: int | None) -> str:
    """Send the worker a command it refuses (exit code 2, it lives on), after it has set up the command's cores
    and threads; returns the command's log."""
    worker.start([sys.executable, "-m", "json.tool"], log, cores, threads)
    while worker.poll() is None:
        time.sleep(0.01)
    assert worker.returncode == 2
    return log.read_text()


def test_shared_cores_track_the_shares_as_steps_start_and_end() -> None:
    """A step keeps what is left of its share until it ends; freed cores wait for the next step to start
    (`SharedCores`'s docstring says why they do not go to the running ones)."""
    shares = SharedCores([0, 1, 2, 3])
    assert shares.start(["train"]) == [{0, 1, 2, 3}]
    assert shares.start(["publish"]) == [{2, 3}] and shares.shares["train"] == {0, 1}
    assert shares.start(["rollout"]) == [{1}] and shares.shares["train"] == {0}
    assert shares.speed("train") == 1 and shares.speed("rollout") == 1
    shares.finished("publish")
    assert shares.shares == {"train": {0}, "rollout": {1}}
    assert shares.start(["eval"]) == [{2, 3}]  # the free cores first


def test_speed_splits_a_core_among_the_steps_on_it() -> None:
    assert speed({0}, [{0}, {0}, {1}]) == 0.5
    assert speed({0, 1}, [{0, 1}, {1}]) == 1.5


def test_held_cores_replays_the_shares_over_the_steps_spans() -> None:
    """Train alone on 2 cores from 0 s; publish starts beside it at 2 s and takes one, which train does not get
    back when publish ends: 2 s x 2 + 8 s x 1 = 12 core-seconds over 10 s."""
    held = held_cores({"train": (0.0, 10.0), "publish": (2.0, 3.0), "eval": (10.0, 11.0)}, 2)
    assert held == pytest.approx({"train": 1.2, "publish": 1.0, "eval": 2.0})


@linux_only
@pytest.mark.skipif(len(MACHINE_CORES) < 2, reason="needs 2 cores")
def test_a_step_alone_gets_all_cores_and_threads_and_two_side_by_side_get_disjoint_ones(
    tmp_path: Path, all_machine_cores: list[int]
) -> None:
    """The runner's bookkeeping (CoreShares) and real workers: the first step runs alone, on every core with as
    many torch threads (read back from torch in the worker); a second starting beside it takes half of them, and
    the first's whole process tree moves onto the other half, and its torch threads fit it again (SIGWINCH)."""
    cores = available_cores()
    shares = CoreShares(cores, pinned=True)
    workers = [StepWorker(step_environment(len(cores), pin_cores=True)) for _ in range(2)]
    try:
        [alone] = shares.start(["first"])
        shares.started("first", workers[0].pid, worker=True)
        log = run_refused(workers[0], tmp_path / "first.log", alone, len(alone))
        assert os.sched_getaffinity(workers[0].pid) == set(cores)
        assert f"worker: {len(cores)} torch threads, cores {cores}" in log

        [beside] = shares.start(["second"])
        shares.started("second", workers[1].pid, worker=True)
        log = run_refused(workers[1], tmp_path / "second.log", beside, len(beside))
        first_threads = [int(t.name) for t in Path(f"/proc/{workers[0].pid}/task").iterdir()]
        first_cores = {core for thread in first_threads for core in os.sched_getaffinity(thread)}
        second_cores = os.sched_getaffinity(workers[1].pid)
        assert first_cores and second_cores and not first_cores & second_cores
        assert first_cores | second_cores == set(cores)
        assert f"worker: {len(second_cores)} torch threads, cores {sorted(second_cores)}" in log
        # The first worker, told its share shrank, runs as many torch threads as it has cores left.
        shrunk = f"worker: {len(first_cores)} torch threads, cores {sorted(first_cores)} (share shrunk)"
        deadline = time.monotonic() + 120  # a hang guard: the worker answers at once on an idle machine
        while shrunk not in (tmp_path / "first.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert shrunk in (tmp_path / "first.log").read_text()
    finally:
        for worker in workers:
            worker.close()


@linux_only
def test_a_share_change_while_torch_is_imported_is_applied_once_the_import_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGWINCH can come while a worker is still importing torch: the handler must not touch the half-made module
    (that failed a step with 'partially initialized module torch'); the next use_threads fits the threads."""
    import torch

    from moeloop.workflows.local import worker

    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # use_threads sets it
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # partly initialised: no functions yet
    worker.fit_threads_to_cores(signal.SIGWINCH, None)
    assert worker.refit_pending
    monkeypatch.setitem(sys.modules, "torch", torch)
    threads = torch.get_num_threads()
    try:
        worker.use_threads(1)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0)) and not worker.refit_pending
    finally:
        torch.set_num_threads(threads)
