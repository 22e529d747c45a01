"""What the Argo chunk needs from the steps: the chunk step's decision from LATEST (its `plan` task), the
figures every step writes for its output parameters, and start's run parameters (target iterations, model URI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moeloop.steps.chunk import next_chunk
from moeloop.steps.common import print_json
from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.outputs import OUTPUTS_ENV
from moeloop.steps.start import with_run_arguments
from moeloop.steps.storage.run import RunStorage
from tests.conftest import small_config
from tests.processes import run_step


def stored_run(root: Path, iterations: int, latest: int | None, evaluated: tuple[int, ...] = ()) -> str:
    """A run folder as start and publish leave it: the stored config, LATEST, the metrics evaluated so far."""
    config = small_config(iterations=iterations)
    storage = RunStorage(str(root / config.run_name))
    storage.write_bytes(RunStorage.CONFIG, yaml.safe_dump(config.model_dump(mode="json")).encode())
    if latest is not None:
        checkpoint = storage.checkpoint(latest)
        storage.write_json(RunStorage.LATEST, {"iteration": latest, "checkpoint": checkpoint})
    for iteration in evaluated:
        storage.write_json(storage.metrics(iteration), {"iteration": iteration})
    return storage.uri


@pytest.mark.parametrize(
    ("iterations", "latest", "evaluated", "expected"),
    [
        # A new run: iterations 1..3 of 10, eval-0 to do, more to come.
        (10, 0, (), {"latest": 0, "first": 1, "count": 3, "more": True, "target": 10, "evaluate": True}),
        # Resumed mid-run after a chunk whose last evaluation finished.
        (10, 6, (6,), {"latest": 6, "first": 7, "count": 3, "more": True, "target": 10, "evaluate": False}),
        # The last, short chunk.
        (10, 8, (8,), {"latest": 8, "first": 9, "count": 2, "more": False, "target": 10, "evaluate": False}),
        # At the target: nothing to run (a CronWorkflow tick succeeds at once) but a missing evaluation.
        (10, 10, (), {"latest": 10, "first": 11, "count": 0, "more": False, "target": 10, "evaluate": True}),
    ],
)
def test_next_chunk_continues_from_latest(
    tmp_path: Path, iterations: int, latest: int, evaluated: tuple, expected: dict
) -> None:
    assert next_chunk(stored_run(tmp_path, iterations, latest, evaluated), chunk=3) == expected


def test_next_chunk_refuses_a_run_without_latest_and_a_bad_chunk(tmp_path: Path) -> None:
    run = stored_run(tmp_path, 4, latest=None)
    with pytest.raises(MoeloopError, match="has no LATEST: its start has not finished"):
        next_chunk(run, chunk=2)
    with pytest.raises(MoeloopError, match="^--chunk must be at least 1, not 0"):
        next_chunk(run, chunk=0)
    with pytest.raises(MoeloopError, match="^run does not exist"):
        next_chunk(str(tmp_path / "nothing"), chunk=2)


def test_chunk_cli_writes_the_outputs_argo_reads(tmp_path: Path) -> None:
    """The pod's command as the template runs it: its output files are what `when` and the slots read."""
    run = stored_run(tmp_path, 5, latest=2, evaluated=(2,))
    outputs = tmp_path / "outputs"
    done = run_step("chunk", run, None, "--chunk", "2", env={OUTPUTS_ENV: str(outputs)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["first"] == 3
    files = {path.name: path.read_text() for path in outputs.iterdir()}
    assert files == {"latest": "2", "first": "3", "count": "2", "more": "true", "target": "5", "evaluate": "false"}


def test_print_json_writes_scalars_only_under_argo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    report = {"loss": 0.25, "samples": 32, "engine": "vllm", "skipped": False, "step_seconds": {"a": 1.0}, "kl": None}
    monkeypatch.delenv(OUTPUTS_ENV, raising=False)
    print_json(report)
    assert json.loads(capsys.readouterr().out) == report
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv(OUTPUTS_ENV, str(tmp_path / "out"))
    print_json(report)
    # Nested values and nulls are left out: the template's default ("none") shows instead.
    assert {p.name: p.read_text() for p in (tmp_path / "out").iterdir()} == {
        "loss": "0.25",
        "samples": "32",
        "engine": "vllm",
        "skipped": "false",
    }


def test_start_applies_the_run_parameters_over_the_config() -> None:
    config: MoeloopConfig = small_config(iterations=2)
    assert with_run_arguments(config, None, "") == config
    changed = with_run_arguments(config, 10_000, "s3://models/qwen3-moe")
    assert (changed.iterations, changed.model.checkpoint) == (10_000, "s3://models/qwen3-moe")
    with pytest.raises(MoeloopError, match="iterations"):
        with_run_arguments(config, 0, "")
