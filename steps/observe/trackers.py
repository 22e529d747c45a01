"""The trackers of `observe.trackers`: where each committed iteration's scalars go.

- tensorboard: one event file per iteration, <run>/tensorboard/events.out.tfevents.<iteration>.moeloop, written
  whole (an atomic object, local or S3) from the committed files: a rewrite is the same bytes, so a retried step
  adds no point. Needs no package (steps/observe/events.py); reading it takes TensorBoard.
- mlflow: one MLflow run per moeloop run (tagged moeloop.run=<run URI>), created by the start step with the run's
  config as its params (dotted keys; MLflow's params never change, so a key logged once keeps its first value);
  a point is logged only where that metric has none at the iteration yet. The target iteration's evaluation ends
  the run FINISHED; a run that stops short ends FAILED or KILLED (`end_trackers`: the local runner, or on Argo the
  chunk's exit handler, moeloop.steps.finish); a start that resumes it makes it RUNNING again.
- wandb: one W&B run per moeloop run, its id a hash of the run URI, resumed by each step that records (offline
  mode needs no network: `wandb sync` uploads its files later). Each iteration is one row whose x-axis is its
  `iteration` figure, not W&B's own step: evaluations of consecutive iterations may finish out of order, and W&B
  drops a row whose step is below the run's. A committed marker per iteration, written once W&B has the row,
  makes a retry skip it.

Each tracker's package is imported only when it is selected; `check_trackers` tells a missing one up front.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.inputs import output_folder
from moeloop.steps.observe.events import event_file
from moeloop.steps.observe.scalars import IterationScalars, iteration_scalars
from moeloop.steps.storage.run import RunStorage

# The package each tracker imports (TensorBoard's files need none).
PACKAGES = {"tensorboard": None, "mlflow": "mlflow", "wandb": "wandb"}
# What MLflow refuses in a metric's name (its validate_param_and_metric_name): a data_source's name, in the eval
# figures' tags (eval_by_source/<data_source>/...), may have it.
MLFLOW_REFUSED = re.compile(r"[^/\w.\- :]")


def check_trackers(config: MoeloopConfig) -> None:
    """A one-line error for a selected tracker whose package is not installed, before anything runs."""
    for name in config.observe.trackers:
        package = PACKAGES[name]
        if package and importlib.util.find_spec(package) is None:
            raise MoeloopError(
                f"observe.trackers selects {name}, but its package {package!r} is not installed"
                " (pip install 'moeloop[observe]')"
            )


class TensorBoardFiles:
    FOLDER = "tensorboard"

    def __init__(self, storage: RunStorage, config: MoeloopConfig):
        self.storage = storage

    @classmethod
    def name(cls, iteration: int) -> str:
        return f"{cls.FOLDER}/events.out.tfevents.{iteration:06d}.moeloop"

    def begin(self) -> None:
        pass  # each iteration's file stands alone

    def end(self, status: str) -> None:
        pass  # nothing to close

    def record(self, scalars: IterationScalars) -> None:
        # A local write killed midway leaves its temporary beside the file, and TensorBoard reads every file named
        # *tfevents*: a whole one would repeat the points. The retry's write removes it (backends.local_temporary).
        name = self.name(scalars.iteration)
        self.storage.write_bytes(name, event_file(scalars.iteration, scalars.wall_time, sorted(scalars.values.items())))


def sync_tensorboard(run_uri: str, local_dir: Path) -> list[Path]:
    """Copy the run's event files into local_dir (for `tensorboard --logdir`); files already there are kept."""
    storage = RunStorage(run_uri)
    storage.require_run()
    output_folder(local_dir, "DIR")
    copied = []
    for name, size in sorted(storage.sizes(TensorBoardFiles.FOLDER).items()):
        target = local_dir / name
        if target.exists() and target.stat().st_size == size:
            continue  # an event file is written once, whole: same size, same file
        temporary = target.with_name(f".{target.name}.partial")
        temporary.write_bytes(storage.read_bytes(f"{TensorBoardFiles.FOLDER}/{name}"))
        os.replace(temporary, target)
        copied.append(target)
    return copied


class MLflowRun:
    RUN_TAG = "moeloop.run"

    def __init__(self, storage: RunStorage, config: MoeloopConfig):
        settings = config.observe.mlflow
        uri = settings.tracking_uri
        if uri and ("://" not in uri or uri.startswith("file:")):
            # MLflow 3 refuses a file store unless opted in; a local folder is what a laptop or a test has.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        self.experiment = settings.experiment or config.run_name
        self.run_uri, self.config = storage.uri, config

    def existing_run(self) -> Any | None:
        """The MLflow run of this moeloop run (the first, were there several), or None."""
        experiment = self.client.get_experiment_by_name(self.experiment)
        if experiment is None:
            return None
        quoted = self.run_uri.replace("'", "\\'")
        runs = self.client.search_runs([experiment.experiment_id], filter_string=f"tags.`{self.RUN_TAG}` = '{quoted}'")
        return min(runs, key=lambda r: r.info.start_time) if runs else None

    def run_id(self) -> str:
        """The MLflow run of this moeloop run, created (with its experiment) where there is none."""
        if (run := self.existing_run()) is not None:
            return run.info.run_id
        experiment = self.client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.experiment)
        run_name = os.path.basename(self.run_uri.rstrip("/"))
        return self.client.create_run(experiment_id, tags={self.RUN_TAG: self.run_uri}, run_name=run_name).info.run_id

    def begin(self) -> None:
        """The run exists, RUNNING (again, on a resume), with the config's keys as params (those it lacks)."""
        from mlflow.entities import Param

        run = self.client.get_run(self.run_id())
        if run.info.status != "RUNNING":
            self.client.update_run(run.info.run_id, status="RUNNING")
        missing = [Param(k, v) for k, v in config_params(self.config).items() if k not in run.data.params]
        for first in range(0, len(missing), 100):  # log_batch's limit on params
            self.client.log_batch(run.info.run_id, params=missing[first : first + 100])

    def end(self, status: str) -> None:
        """The run ends with status (FINISHED, FAILED, KILLED), if the start step made one."""
        if (run := self.existing_run()) is not None:
            self.client.set_terminated(run.info.run_id, status)

    def record(self, scalars: IterationScalars) -> None:
        from mlflow.entities import Metric

        run_id = self.run_id()
        timestamp = int(scalars.wall_time * 1000)
        names = {MLFLOW_REFUSED.sub("_", tag): value for tag, value in sorted(scalars.values.items())}
        missing = [
            Metric(name, value, timestamp, scalars.iteration)
            for name, value in names.items()
            if all(m.step != scalars.iteration for m in self.client.get_metric_history(run_id, name))
        ]
        for first in range(0, len(missing), 1000):  # log_batch's limit
            self.client.log_batch(run_id, metrics=missing[first : first + 1000])
        if scalars.iteration >= self.config.iterations:  # the target reached: the run is done
            self.client.set_terminated(run_id, "FINISHED")


class WandbRun:
    FOLDER = "wandb"  # the markers of the iterations W&B has

    def __init__(self, storage: RunStorage, config: MoeloopConfig):
        self.storage = storage
        self.config = config
        self.id = hashlib.sha256(storage.uri.encode()).hexdigest()[:16]
        self.mode = os.environ.get("WANDB_MODE") or config.observe.wandb.mode

    @classmethod
    def marker(cls, iteration: int) -> str:
        return f"{cls.FOLDER}/iter-{iteration:06d}.json"

    def resume(self, **arguments):
        import wandb

        settings = self.config.observe.wandb
        run = wandb.init(
            id=self.id,
            resume="allow",
            project=settings.project or self.config.run_name,
            entity=settings.entity,
            name=os.path.basename(self.storage.uri.rstrip("/")),
            mode=self.mode,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            **arguments,
        )
        run.define_metric("iteration")
        run.define_metric("*", step_metric="iteration")
        return run

    def begin(self) -> None:
        self.resume(config=self.config.model_dump(mode="json")).finish()

    def end(self, status: str) -> None:
        pass  # each step finishes the W&B run it resumed

    def record(self, scalars: IterationScalars) -> None:
        marker = self.marker(scalars.iteration)
        if self.storage.exists(marker):
            return
        run = self.resume()
        run.log({"iteration": scalars.iteration, **scalars.values})
        run.finish()  # returns once the row is in the offline file, or on the server
        self.storage.write_json(marker, {"wandb_run": self.id, "mode": self.mode})


TRACKERS = {"tensorboard": TensorBoardFiles, "mlflow": MLflowRun, "wandb": WandbRun}


def open_trackers(storage: RunStorage, config: MoeloopConfig) -> list:
    check_trackers(config)
    return [TRACKERS[name](storage, config) for name in config.observe.trackers]


def begin_trackers(storage: RunStorage, config: MoeloopConfig) -> None:
    """The start step's part: the trackers' runs exist before any iteration records into them."""
    for tracker in open_trackers(storage, config):
        tracker.begin()


def end_trackers(storage: RunStorage, config: MoeloopConfig, status: str) -> None:
    """A run that stopped short of its target: its trackers' runs end with status (FAILED, or KILLED when it was
    stopped by a signal)."""
    for tracker in open_trackers(storage, config):
        tracker.end(status)


def config_params(config: MoeloopConfig) -> dict[str, str]:
    """The config as MLflow params: its keys dotted, each value as text (JSON for lists and nulls)."""

    def leaves(value: Any, prefix: str) -> dict[str, str]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in leaves(item, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): value if isinstance(value, str) else json.dumps(value)}

    return leaves(config.model_dump(mode="json"), "")


def record_iteration(storage: RunStorage, config: MoeloopConfig, iteration: int) -> None:
    """Send the iteration's committed metrics and reports to every selected tracker (safe to repeat)."""
    scalars = iteration_scalars(storage, iteration, storage.read_json(storage.metrics(iteration)))
    for tracker in open_trackers(storage, config):
        tracker.record(scalars)
