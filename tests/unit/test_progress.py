"""The local runner's progress display (workflows/local/progress.py), driven as the runner drives it, on a clock
the test sets: iterations as its unit, one ETA from the measured pace (estimating before any), start's SFT progress
from its log, and no redrawn frames where the output is not a terminal."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tests.conftest import small_config
from moeloop.workflows.dag import Task, loop_tasks
from moeloop.workflows.local.progress import ProgressDisplay, new_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def metrics(iteration: int) -> dict:
    if iteration == 0:  # the starting checkpoint's: no training yet
        return {"iteration": 0, "eval_reward_mean": 0.5, "reward_mean": None, "kl": None, "loss": None}
    return {"iteration": iteration, "eval_reward_mean": 0.5, "reward_mean": 0.4, "kl": 0.01, "loss": -0.1}


def tasks_by_name(iterations: int) -> dict[str, Task]:
    return {task.name: task for task in loop_tasks(small_config(iterations=iterations))}


def test_piped_output_is_one_line_per_iteration_with_one_eta(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tasks, clock, stream = tasks_by_name(4), Clock(), io.StringIO()
    display = ProgressDisplay(list(tasks.values()), True, tmp_path, stream, clock)
    (tmp_path / "start.log").write_text("loading\nprogress: SFT step 4/40, loss 2.100\n")
    display.running(["start"])
    clock.now += 1
    with open(tmp_path / "start.log", "a") as log:
        log.write("progress: SFT step 8/40, loss 1.700\n")
    display.running(["start"])
    assert display.eta() == "estimating"
    with open(tmp_path / "start.log", "a") as log:  # written after the last read, as start ends
        log.write("progress: SFT step 36/40, loss 1.100\nprogress: SFT step 40/40, loss 0.900\n")
    clock.now += 9  # start ends 10 s in: the first iteration's interval begins here
    display.finished(tasks["start"], None)
    display.finished(tasks["eval-0"], metrics(0))
    assert display.eta() == "estimating"  # no iteration has ended: nothing measured says what one takes
    clock.now += 30
    display.finished(tasks["it1-eval"], metrics(1))
    clock.now += 20
    display.finished(tasks["it2-eval"], metrics(2))
    display.close()

    assert stream.getvalue().splitlines() == [
        f"start: SFT step {step}/40, loss {loss:.3f}" for step, loss in ((4, 2.1), (8, 1.7), (36, 1.1), (40, 0.9))
    ]
    printed = capsys.readouterr().out
    assert "\r" not in printed + stream.getvalue()
    assert printed.splitlines() == [
        "iteration   0: eval_reward_mean 0.500",
        "iteration   1: eval_reward_mean 0.500  reward_mean 0.400  kl 0.010  loss -0.100"
        "  [1/4 iterations, 0:00:40 elapsed, ETA 0:01:30]",  # 30 s an iteration, 3 left
        "iteration   2: eval_reward_mean 0.500  reward_mean 0.400  kl 0.010  loss -0.100"
        "  [2/4 iterations, 0:01:00 elapsed, ETA 0:00:50]",  # (30 + 20) / 2 s, 2 left
    ]


def test_a_resumed_runs_iterations_are_those_left(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """On a resume the LATEST evaluation runs again: it is not one of the iterations to run."""
    from moeloop.workflows.local.runner import pending_tasks

    pending = pending_tasks(list(tasks_by_name(4).values()), latest_iteration=2)
    display = ProgressDisplay(pending, True, tmp_path, io.StringIO(), Clock())
    by_name = {task.name: task for task in pending}
    display.finished(by_name["start"], None)
    display.finished(by_name["it2-eval"], metrics(2))
    display.finished(by_name["it3-eval"], metrics(3))
    assert capsys.readouterr().out.splitlines()[-1].endswith("[1/2 iterations, 0:00:00 elapsed, ETA 0:00:00]")


def test_on_a_terminal_each_frame_has_one_eta_and_counts_iterations(tmp_path: Path) -> None:
    tasks, clock, terminal = tasks_by_name(3), Clock(), Terminal()
    display = ProgressDisplay(list(tasks.values()), True, tmp_path, terminal, clock)
    (tmp_path / "start.log").write_text("progress: SFT step 40/40, loss 0.512\n")
    display.running(["start"])
    clock.now += 5
    display.finished(tasks["start"], None)
    display.running(["it1-rollout-0", "it1-rollout-1"])
    clock.now += 12
    display.finished(tasks["it1-eval"], metrics(1))
    display.running(["it2-train"])
    display.close()

    frames = [frame for frame in terminal.getvalue().split("\r") if frame.strip()]
    assert frames
    for frame in frames:
        assert "/3 iterations" in frame and frame.count("ETA") == 1
        assert "<" not in frame and "it/s" not in frame and "s/it" not in frame  # tqdm's own estimate and rate
    assert any("ETA estimating; start: SFT step 40/40, loss 0.512" in frame for frame in frames)
    assert "it2-train: 1/3 iterations" in frames[-1] and "ETA 0:00:24" in frames[-1]


def test_without_progress_only_the_metrics_lines_are_printed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tasks, stream = tasks_by_name(2), Terminal()
    display = ProgressDisplay(list(tasks.values()), False, tmp_path, stream, Clock())
    (tmp_path / "start.log").write_text("progress: SFT step 4/40, loss 2.100\n")
    display.running(["start"])
    display.finished(tasks["start"], None)
    display.finished(tasks["it1-eval"], metrics(1))
    display.close()
    assert stream.getvalue() == ""
    metrics_line = "iteration   1: eval_reward_mean 0.500  reward_mean 0.400  kl 0.010  loss -0.100\n"
    assert capsys.readouterr().out == metrics_line


def test_a_logs_new_progress_lines(tmp_path: Path) -> None:
    log = tmp_path / "start.log"
    assert new_progress(log, 0) == ([], 0)  # not there yet
    log.write_text("x" * 10_000 + "\nprogress: SFT step 1/2, loss 1.000\nsome warning\nprogress: SFT step 2/2, lo")
    lines, offset = new_progress(log, 0)
    assert lines == ["SFT step 1/2, loss 1.000"]  # the line not yet ended waits
    with open(log, "a") as stream:
        stream.write("ss 0.500\n")
    assert new_progress(log, offset) == (["SFT step 2/2, loss 0.500"], log.stat().st_size)
    assert new_progress(log, log.stat().st_size) == ([], log.stat().st_size)
