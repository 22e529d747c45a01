"""The storage layout's commit protocol on a local folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.ranks import commit_from_ranks
from moeloop.steps.storage.run import RunStorage


def make_folder(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "a.bin").write_bytes(b"alpha")
    (source / "sub" / "b.txt").write_text("beta")
    return source


def test_folder_is_visible_only_once_committed_and_round_trips(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    assert not storage.is_committed("checkpoints/iter-000001")
    storage.commit_folder("checkpoints/iter-000001", make_folder(tmp_path), extra={"iteration": 1})
    assert storage.is_committed("checkpoints/iter-000001")
    commit = storage.fetch_folder("checkpoints/iter-000001", tmp_path / "copy")
    assert commit["iteration"] == 1
    assert set(commit["files"]) == {"a.bin", "sub/b.txt"}
    assert (tmp_path / "copy" / "sub" / "b.txt").read_text() == "beta"


def test_fetch_refuses_a_folder_whose_objects_do_not_match_the_commit(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    storage.commit_folder("checkpoints/iter-000001", make_folder(tmp_path))
    (tmp_path / "run" / "checkpoints" / "iter-000001" / "a.bin").write_bytes(b"tampered")
    with pytest.raises(MoeloopError, match="a.bin"):
        storage.fetch_folder("checkpoints/iter-000001", tmp_path / "copy")


def test_uncommitted_folder_cannot_be_fetched_or_become_latest(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    storage.write_bytes("checkpoints/iter-000002/model.safetensors", b"partial")
    with pytest.raises(MoeloopError, match="not committed"):
        storage.fetch_folder("checkpoints/iter-000002", tmp_path / "copy")
    with pytest.raises(MoeloopError, match="uncommitted"):
        storage.move_latest(2)
    assert storage.latest() is None


def test_latest_never_moves_backwards(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    source = make_folder(tmp_path)
    for iteration in (1, 2):
        storage.commit_folder(storage.checkpoint(iteration), source)
    storage.move_latest(2)
    storage.move_latest(1)  # a re-run of an older publish
    assert storage.latest() == {"iteration": 2, "checkpoint": "checkpoints/iter-000002"}


def test_atomic_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    storage.write_json("metrics/iter-000001.json", {"iteration": 1})
    storage.write_json("metrics/iter-000001.json", {"iteration": 1})
    assert [p.name for p in (tmp_path / "run" / "metrics").iterdir()] == ["iter-000001.json"]


def test_paths_outside_the_run_are_refused(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    with pytest.raises(MoeloopError, match="outside the run"):
        storage.write_bytes("../escape", b"x")


def test_a_folder_an_earlier_attempt_committed_is_left_as_it_is_or_refused_as_foreign(tmp_path: Path) -> None:
    """commit_from_ranks (one process here; the ranks' case: tests/faults/test_chunk_trainer.py) uploads nothing into
    a committed folder: the same files are that commit, other files a foreign folder, refused with it untouched."""
    storage = RunStorage(str(tmp_path / "run"))
    source = make_folder(tmp_path)
    commit_from_ranks(storage, "deltas/iter-000001", source, None, {"iteration": 1})
    committed = tmp_path / "run" / "deltas" / "iter-000001"
    before = {path.name: path.stat().st_mtime_ns for path in committed.rglob("*")}
    commit_from_ranks(storage, "deltas/iter-000001", source, None, {"iteration": 1})  # a re-run
    (source / "a.bin").write_bytes(b"another")
    with pytest.raises(MoeloopError, match="already committed with different content"):
        commit_from_ranks(storage, "deltas/iter-000001", source, None, {"iteration": 1})
    assert {path.name: path.stat().st_mtime_ns for path in committed.rglob("*")} == before
    assert (committed / "a.bin").read_bytes() == b"alpha"
