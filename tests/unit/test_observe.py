"""Seeing a run: TensorBoard event files, MLflow runs and W&B offline runs rebuilt from the committed metrics, read
back with TensorBoard's and MLflow's own readers and W&B's own records."""

from __future__ import annotations

import json
import re
import signal
import struct
from collections import Counter
from pathlib import Path

import pytest

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.evaluate import evaluate
from moeloop.steps.errors import MoeloopError
from moeloop.steps.observe.events import masked_crc32c
from moeloop.steps.observe.scalars import flatten, iteration_scalars
from moeloop.steps.observe.trackers import (
    TensorBoardFiles,
    WandbRun,
    begin_trackers,
    check_trackers,
    record_iteration,
    sync_tensorboard,
)
from moeloop.steps.publish import publish
from moeloop.steps.reward import reward
from moeloop.steps.rollout import rollout
from moeloop.steps.start import start
from moeloop.steps.storage.backends import CRASH_AFTER_WRITES
from moeloop.steps.storage.manifest import TEMPORARY
from moeloop.steps.storage.run import RunStorage
from moeloop.steps.train import train
from tests.conftest import REPO, SMALL_TRANSFORMERS_ROLLOUT, run_in_process, small_config
from tests.processes import run_forked, step_command
from moeloop.workflows.dag import run_uri

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def as_float32(value: float) -> float:
    """TensorBoard's simple_value is a float32."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def tensorboard_points(folder: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def expected_scalars(storage: RunStorage, iterations: int) -> dict[int, dict[str, float]]:
    return {
        i: iteration_scalars(storage, i, storage.read_json(storage.metrics(i))).values for i in range(iterations + 1)
    }


def assert_one_point_each(points: dict[str, list[tuple[int, float]]], expected: dict[int, dict[str, float]]) -> None:
    for tag, series in points.items():
        assert max(Counter(step for step, _ in series).values()) == 1, tag
    got = {(tag, step): value for tag, series in points.items() for step, value in series}
    want = {(tag, i): as_float32(value) for i, values in expected.items() for tag, value in values.items()}
    assert got == want


def test_crc32c_and_flatten() -> None:
    # CRC-32C's check value, masked as TFRecord does.
    crc = 0xE3069283
    assert masked_crc32c(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert flatten({"a": 1, "b": {"c": 0.5, "d": None, "e": "x", "f": True}, "g": [2.0, {"h": 3}]}, "") == {
        "a": 1.0,
        "b/c": 0.5,
        "g/0": 2.0,
        "g/1/h": 3.0,
    }


def test_a_missing_tracker_package_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    config = small_config(iterations=1, observe={"trackers": ["tensorboard", "mlflow", "wandb"]})
    find_spec = importlib.util.find_spec
    for missing in ("mlflow", "wandb"):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == missing else find_spec(name))
        with pytest.raises(MoeloopError, match=rf"^observe.trackers selects {missing}, but its package '{missing}'"):
            check_trackers(config)
    with pytest.raises(ValueError, match="more than once"):
        MoeloopConfig.model_validate({**config.model_dump(), "observe": {"trackers": ["mlflow", "mlflow"]}})


@pytest.mark.slow
def test_killed_and_rerun_evaluation_leaves_one_point_per_tag_and_iteration(run_root: Path, tmp_path: Path) -> None:
    mlflow_client = pytest.importorskip("mlflow.tracking")
    store = f"file://{tmp_path / 'mlruns'}"
    observe = {"trackers": ["tensorboard", "mlflow"], "mlflow": {"tracking_uri": store}}
    config = small_config(iterations=2, rollout=SMALL_TRANSFORMERS_ROLLOUT, observe=observe)
    uri = run_uri(config, str(run_root))
    run_in_process(config, uri)

    # Iteration 3 by hand, then its evaluation killed after each of its writes in turn, and run once more.
    longer = config.model_copy(update={"iterations": 3})
    start(uri, longer)
    for shard in range(config.rollout.num_shards):
        rollout(uri, 3, shard, config.rollout.num_shards)
    reward(uri, 3)
    train(uri, 3)
    publish(uri, 3)
    storage = RunStorage(uri)
    for writes in range(1, 10):
        log = tmp_path / f"evaluate-{writes}.log"
        crashed = run_forked(step_command("evaluate", uri, 3), log, {CRASH_AFTER_WRITES: str(writes)})
        if crashed == 0:
            break
        assert crashed == -signal.SIGKILL, log.read_text()[-3000:]
    else:
        pytest.fail("evaluate never finished")
    assert writes >= 3  # it was killed after its report, and after its metrics (before TensorBoard saw them)
    # A leftover of a write killed midway is cleared by the retry (TensorBoard would read it).
    leftover = run_root / config.run_name / f"{TensorBoardFiles.name(3)}{TEMPORARY}0123abcd"
    leftover.write_bytes((run_root / config.run_name / TensorBoardFiles.name(3)).read_bytes())
    evaluate(uri, 3)
    assert not leftover.exists()

    expected = expected_scalars(storage, 3)
    assert {"eval_reward_mean", "kl", "step_seconds/train", "step/train/grad_norm"} <= set(expected[3])
    assert expected[3]["eval_reward_mean"] == storage.read_json(storage.metrics(3))["eval_reward_mean"]
    assert_one_point_each(tensorboard_points(run_root / config.run_name / "tensorboard"), expected)

    client = mlflow_client.MlflowClient(store)
    experiment = client.get_experiment_by_name(config.run_name)
    [run] = client.search_runs([experiment.experiment_id])
    assert run.data.tags["moeloop.run"] == uri
    for tag in expected[3]:
        history = client.get_metric_history(run.info.run_id, tag)
        assert sorted(m.step for m in history) == [i for i in range(4) if tag in expected[i]], tag
        assert {m.step: m.value for m in history} == {i: v[tag] for i, v in expected.items() if tag in v}


def test_s3_event_files_sync_for_tensorboard(s3_run_root: str, run_root: Path, tmp_path: Path) -> None:
    """On S3 the event files are objects of the run; `moeloop sync` copies them where TensorBoard reads them."""
    config = small_config(iterations=1)
    uri = run_uri(config, s3_run_root)
    storage = RunStorage(uri)
    storage.write_bytes(RunStorage.CONFIG, b"run_name: x\n")  # a run, as far as sync asks
    for iteration, seconds in ((0, 2.5), (1, 4.0)):
        report = {"seconds": seconds, "started_at": 100.0 + iteration, "ended_at": 102.5 + iteration}
        storage.write_json(storage.report(iteration, "evaluate"), report)
        storage.write_json(storage.metrics(iteration), {"iteration": iteration, "eval_reward_mean": 0.1 * iteration})
        record_iteration(storage, config, iteration)
    record_iteration(storage, config, 1)  # a retry
    local = tmp_path / "tensorboard"
    assert [p.name for p in sync_tensorboard(uri, local)] == [
        "events.out.tfevents.000000.moeloop",
        "events.out.tfevents.000001.moeloop",
    ]
    assert sync_tensorboard(uri, local) == []  # nothing new
    assert_one_point_each(tensorboard_points(local), expected_scalars(storage, 1))


def wandb_records(path: Path) -> list:
    """The records of a .wandb file: W&B's header, then a LevelDB log (32 KiB blocks of chunks, each with a 7-byte
    header: CRC, length, type) of wandb_internal_pb2.Record messages. wandb 0.31 ships no Python reader."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, position, message = [], 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        message += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL, or the LAST chunk of a message split over blocks
            records.append(Record.FromString(message))
            message = b""
    return records


def wandb_offline_rows(folder: Path, run_id: str) -> list[dict[str, float]]:
    """Every history row of every offline session of the W&B run (one folder each), in the order they were logged.
    W&B's own keys (_step, _timestamp, _runtime) are left out: offline, each session counts _step from 0."""
    rows = []
    for session in folder.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"):
        for record in wandb_records(session):
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    rows.sort(key=lambda row: row["_timestamp"])
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def test_wandb_offline_run_has_one_row_per_iteration(run_root: Path, tmp_path: Path, monkeypatch) -> None:
    """Offline, with no network: the W&B run of a committed run, recorded out of order and again, holds each
    iteration's figures once, at iteration = its x-axis."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (tmp_path / "wandb-files").mkdir()
    config = small_config(iterations=2, observe={"trackers": ["wandb"], "wandb": {"mode": "offline"}})
    uri = run_uri(config, str(run_root))
    storage = RunStorage(uri)
    storage.write_bytes(RunStorage.CONFIG, b"run_name: x\n")
    begin_trackers(storage, config)
    for iteration in (0, 2, 1):  # iteration 2's evaluation finishes before iteration 1's
        report = {"seconds": 2.5 + iteration, "started_at": 100.0 + iteration, "ended_at": 102.5 + iteration}
        storage.write_json(storage.report(iteration, "evaluate"), report)
        storage.write_json(storage.metrics(iteration), {"iteration": iteration, "eval_reward_mean": 0.25 * iteration})
        record_iteration(storage, config, iteration)
    for iteration in (1, 2):  # retries of recorded iterations: no new session, no new row
        record_iteration(storage, config, iteration)
    assert len(list((tmp_path / "wandb-files").glob("wandb/offline-run-*"))) == 4  # the start's, and 3 iterations'

    run_id = WandbRun(storage, config).id
    rows = wandb_offline_rows(tmp_path / "wandb-files", run_id)
    assert [row["iteration"] for row in rows] == [0, 2, 1]
    expected = expected_scalars(storage, 2)
    assert {row["iteration"]: {k: v for k, v in row.items() if k != "iteration"} for row in rows} == expected
    assert expected[2] == {"eval_reward_mean": 0.5, "step/evaluate/seconds": 4.5}
    assert storage.read_json(WandbRun.marker(1)) == {"wandb_run": run_id, "mode": "offline"}
    # The run's config is the moeloop config, given by the start step's session.
    sessions = (tmp_path / "wandb-files").glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")
    updates = [r.run.config.update for s in sessions for r in wandb_records(s) if r.WhichOneof("record_type") == "run"]
    given = [{i.key: json.loads(i.value_json) for i in u if i.key != "_wandb"} for u in updates]
    assert config.model_dump(mode="json") in given


def rendered_metric_names(config: MoeloopConfig) -> set[str]:
    from moeloop.workflows.render.loop import build

    templates = build(config, "s3://bucket/runs/x").template.to_dict()["spec"]["templates"]
    return {g["name"] for t in templates for g in t.get("metrics", {}).get("prometheus", [])}


def test_step_templates_emit_their_figures_and_the_dashboard_queries_only_those() -> None:
    from moeloop.workflows.render.loop import build

    config = small_config(iterations=1)
    document = build(config, "s3://bucket/runs/x").template.to_dict()
    templates = {t["name"]: t for t in document["spec"]["templates"]}
    [loss] = [g for g in templates["train"]["metrics"]["prometheus"] if g["name"] == "moeloop_train_loss"]
    assert loss["gauge"]["value"] == "{{outputs.parameters.loss}}"
    assert loss["labels"] == [{"key": "run", "value": config.run_name}]  # no iteration: tests/cluster/test_dashboard.py
    assert "moeloop_rollout_engine" not in rendered_metric_names(config)  # text, not a figure
    annotations = document["spec"]["workflowMetadata"]["annotations"]
    tensorboard = "https://s3.console.aws.amazon.com/s3/buckets/bucket?prefix=runs/x/tensorboard/"
    assert annotations["moeloop-tensorboard"] == tensorboard

    dashboard = json.loads((REPO / "manifests" / "monitoring" / "grafana-dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    named = {name for q in queries for name in re.findall(r"\bmoeloop_[a-z_]+", q)}
    assert named and named <= rendered_metric_names(config), named - rendered_metric_names(config)


def test_report_plot_writes_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from moeloop.steps.observe.plots import write_plots

    metrics = [{"iteration": 0, "eval_reward_mean": 0.4}] + [
        {
            "iteration": i,
            "eval_reward_mean": 0.4 + 0.1 * i,
            "reward_mean": 0.3 + 0.1 * i,
            "kl": 0.01 * i,
            "logprob_mismatch": 0.001,
            "clip_fraction_binding": 0.05,
            "clip_fraction_out_of_range": 0.08,
            "entropy": 1.5 - 0.1 * i,
            "rollout_seconds": 3.0,
            "step_seconds": {"reward": 0.2, "train": 2.0, "publish": 0.5},
            "wait_seconds": {"reward": 0.1, "train": 0.0},
            "rollout_wait_seconds": 1.0,
            "router": {"load_imbalance": [0.5 / i, 0.3]},
        }
        for i in (1, 2, 3)
    ]
    written = write_plots(metrics, tmp_path / "plots")
    assert [p.name for p in written] == ["learning_curves.png", "time_balance.png", "expert_load.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") and p.stat().st_size > 10_000 for p in written)
    assert write_plots([m for m in metrics if "router" not in m], tmp_path / "few")[-1].name == "time_balance.png"
