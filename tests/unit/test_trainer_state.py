"""trainer-state (steps/trainer_state.py), the Argo chunk's wait for its trainer's last trainer state: it returns
once that state is committed, not before, while the trainer beats; it fails saying so when the trainer is silent,
and refuses an iteration outside the run's."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage import commands
from moeloop.steps.storage.run import RunStorage
from moeloop.steps.trainer_state import wait_for_state
from tests.conftest import small_config

LAST = 2


def a_run(tmp_path: Path) -> RunStorage:
    storage = RunStorage(str(tmp_path / "run"))
    config = small_config(LAST, trainer={"lifetime": "chunk", "state_every": 2})
    storage.write_bytes(RunStorage.CONFIG, yaml.safe_dump(config.model_dump(mode="json")).encode())
    return storage


def beat(storage: RunStorage) -> None:
    storage.write_bytes(RunStorage.TRAINER_HEARTBEAT, json.dumps({"at": time.time(), "holds": LAST}).encode())


def test_the_wait_ends_once_the_last_state_is_committed_while_the_trainer_beats(tmp_path: Path) -> None:
    storage = a_run(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    (state / "weights.bin").write_bytes(b"trainer state")
    last_commit_began: list[float] = []

    def trainer() -> None:  # beats, commits the state of an earlier iteration, then the last one's
        for _ in range(4):
            beat(storage)
            time.sleep(0.3)
        storage.commit_folder(storage.trainer_state(LAST - 1), state)
        beat(storage)
        time.sleep(0.3)
        last_commit_began.append(time.perf_counter())
        storage.commit_folder(storage.trainer_state(LAST), state)

    beat(storage)
    thread = threading.Thread(target=trainer)
    thread.start()
    report = wait_for_state(storage.uri, LAST)
    returned_at = time.perf_counter()
    thread.join()
    assert last_commit_began and returned_at >= last_commit_began[0]
    assert report["state"] == LAST and report["seconds"] >= 1.2
    assert storage.is_committed(storage.trainer_state(LAST))


def test_the_wait_fails_saying_so_when_the_trainer_is_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = a_run(tmp_path)
    monkeypatch.setattr(commands, "SILENT_SECONDS", 1.0)
    with pytest.raises(MoeloopError, match="^the chunk's end waits for its trainer's state of iteration 2, which has"
                       " not been heard from at all"):  # fmt: skip
        wait_for_state(storage.uri, LAST)
    beat(storage)
    with pytest.raises(MoeloopError, match="which has not been heard from since .* UTC"):
        wait_for_state(storage.uri, LAST)


def test_an_iteration_outside_the_run_is_refused(tmp_path: Path) -> None:
    storage = a_run(tmp_path)
    with pytest.raises(MoeloopError, match=r"^--last 3 is outside this run's iterations 1\.\.2$"):
        wait_for_state(storage.uri, LAST + 1)
