"""An MLflow run's life, read back with MLflow's own client on a file store: the config as its params at start, RUNNING
until the target iteration's evaluation ends it FINISHED, RUNNING again on a resume, FAILED when a chunk's Workflow
fails (moeloop.steps.finish, its exit handler, rendered only where mlflow is selected)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import small_config
from tests.processes import run_step
from moeloop.steps.config import MoeloopConfig
from moeloop.steps.observe.scalars import IterationScalars
from moeloop.steps.observe.trackers import MLflowRun, begin_trackers, config_params
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.render.loop import render

mlflow_tracking = pytest.importorskip("mlflow.tracking")


def with_mlflow(store: str, iterations: int = 2) -> MoeloopConfig:
    observe = {"trackers": ["tensorboard", "mlflow"], "mlflow": {"tracking_uri": store}}
    return small_config(iterations=iterations, observe=observe)


def the_run(store: str, config: MoeloopConfig):
    client = mlflow_tracking.MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name(config.run_name).experiment_id])
    return run


def test_a_run_has_the_config_as_params_and_ends_finished_at_the_target(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'mlruns'}"
    config = with_mlflow(store)
    storage = RunStorage(str(tmp_path / "run"))
    begin_trackers(storage, config)
    run = the_run(store, config)
    assert run.info.status == "RUNNING"
    assert run.data.params == config_params(config)
    assert run.data.params["rollout.num_shards"] == "2" and run.data.params["model.checkpoint"] == "null"
    assert json.loads(run.data.params["reward.functions"]) == config.model_dump(mode="json")["reward"]["functions"]

    tracker = MLflowRun(storage, config)
    tracker.record(IterationScalars(1, 1000.0, {"eval_reward_mean": 0.25}))
    assert the_run(store, config).info.status == "RUNNING"
    tracker.record(IterationScalars(2, 1010.0, {"eval_reward_mean": 0.5}))
    assert the_run(store, config).info.status == "FINISHED"

    # Resumed with a later target: RUNNING again; MLflow's params never change, the first stay.
    longer = with_mlflow(store, iterations=4)
    begin_trackers(storage, longer)
    resumed = the_run(store, longer)
    assert (resumed.info.status, resumed.data.params) == ("RUNNING", config_params(config))
    MLflowRun(storage, longer).end("KILLED")
    assert the_run(store, config).info.status == "KILLED"


def test_a_failed_chunk_ends_the_run_failed(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'mlruns'}"
    config = with_mlflow(store)
    storage = RunStorage(str(tmp_path / "run"))
    storage.write_bytes(RunStorage.CONFIG, yaml.safe_dump(config.model_dump(mode="json")).encode())
    begin_trackers(storage, config)

    def finish(status: str) -> subprocess.CompletedProcess[str]:
        return run_step("finish", storage.uri, None, "--status", status)

    succeeded = finish("Succeeded")
    assert succeeded.returncode == 0, succeeded.stderr
    assert the_run(store, config).info.status == "RUNNING"  # the next chunk carries on
    failed = finish("Failed")
    assert failed.returncode == 0, failed.stderr
    assert the_run(store, config).info.status == "FAILED"


def test_the_exit_hook_is_rendered_where_mlflow_is_selected(tmp_path: Path) -> None:
    template = render(with_mlflow("https://mlflow.example.com"), "s3://bucket/runs/x")["workflow-template.yaml"]["spec"]
    status = {"name": "status", "value": "{{workflow.status}}"}
    assert template["hooks"] == {"exit": {"template": "finish", "arguments": {"parameters": [status]}}}
    [finish] = [t for t in template["templates"] if t["name"] == "finish"]
    assert finish["container"]["command"] + finish["container"]["args"] == [
        "python", "-m", "moeloop.steps.finish", "--run", "{{workflow.parameters.run}}",
        "--status", "{{inputs.parameters.status}}",
    ]  # fmt: skip
    plain = render(small_config(iterations=2), "s3://bucket/runs/x")["workflow-template.yaml"]["spec"]
    assert "hooks" not in plain and "finish" not in {t["name"] for t in plain["templates"]}
