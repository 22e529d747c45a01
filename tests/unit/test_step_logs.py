"""Where a local run's step logs live (workflows/local/logs.py): a folder keyed by the run's URI, so that two roots'
runs of one name never share logs, found again from the URI however it is written; which logs `moeloop logs`
shows, and its refusals in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moeloop.steps.errors import MoeloopError
from moeloop.workflows.local.logs import LOGS, log_folder, step_logs


def test_two_roots_runs_of_one_name_keep_their_logs_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = log_folder(f"{tmp_path}/a/tiny"), log_folder(f"{tmp_path}/b/tiny")
    assert first != second and first.parent == second.parent == LOGS
    assert first.name.startswith("tiny-") and second.name.startswith("tiny-")
    assert log_folder("s3://bucket/a/tiny") != log_folder("s3://bucket/b/tiny")
    # The same run, however its root is written, keeps one folder.
    monkeypatch.chdir(tmp_path)
    assert log_folder("a/tiny") == log_folder(f"{tmp_path}/a/tiny/") == log_folder("./a/tiny") == first


def test_a_runs_logs_in_the_order_last_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    folder = log_folder("root/tiny")
    folder.mkdir(parents=True)
    for age, name in enumerate(["it1-train", "start", "warm-rollout-0", "eval-0"]):
        (folder / f"{name}.log").write_text(f"{name}\n")
        os.utime(folder / f"{name}.log", (1000 - age, 1000 - age))
    assert [log.stem for log in step_logs("root/tiny", None)] == ["eval-0", "start", "it1-train"]  # no warm-up
    assert step_logs("root/tiny", "start") == [folder / "start.log"]
    with pytest.raises(MoeloopError, match=r"^run root/tiny has no log of task 'it9-train' \(tasks: start, "):
        step_logs("root/tiny", "it9-train")
    with pytest.raises(MoeloopError, match="has no log of task '../tiny/start'"):
        step_logs("root/tiny", "../tiny/start")
    # Another root's run of the same name has none.
    with pytest.raises(MoeloopError, match=rf"^no step logs of run other/tiny under {LOGS}/tiny-[0-9a-f]{{8}}/ "):
        step_logs("other/tiny", None)
