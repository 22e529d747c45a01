"""Render the loop's DAG (workflows/dag.py) as an Argo Workflow and WorkflowTemplate, built with Hera.

Every task, dependency and pod command comes from `loop_tasks` and `STEPS`; this module only adds
placement (image, node selector, tolerations, resources) per step role from `config.cluster`.
"""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from hera.workflows import DAG, Container, Parameter, RetryStrategy, Workflow, WorkflowTemplate
from hera.workflows import models as m

from steps.config import ClusterConfig, MoeloopConfig, RolePlacement
from steps.errors import MoeloopError
from workflows.dag import STEPS, Step, Task, loop_tasks
from workflows.lint import lint_document

ENTRYPOINT = "loop"
# Config fields naming a file the pods read: it must be reachable from inside the image or by URI.
LOCAL_PATH_FIELDS = (("task", "train_prompts"), ("task", "eval_prompts"), ("model", "checkpoint"))
# libyaml's emitter when PyYAML was built with it: same output as yaml.safe_dump, about 3x faster.
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def portable_config(config: MoeloopConfig) -> MoeloopConfig:
    """The config with local paths made relative to cwd, the repo root, which is the pods' WORKDIR."""
    cwd = Path.cwd().resolve()
    updates: dict[str, dict[str, str]] = {}
    for section, key in LOCAL_PATH_FIELDS:
        location = getattr(getattr(config, section), key)
        if location is not None:
            updates.setdefault(section, {})[key] = _portable_path(f"{section}.{key}", location, cwd)
    return config.model_copy(
        update={section: getattr(config, section).model_copy(update=keys) for section, keys in updates.items()}
    )


def _portable_path(field: str, location: str, cwd: Path) -> str:
    if "://" in location or not os.path.isabs(location):
        return location
    path = Path(location).resolve()  # a symlink out of the repo is as unreachable as a path outside it
    if not path.is_relative_to(cwd):
        raise MoeloopError(
            f"{field}: local path {location} is not reachable from the cluster; "
            "use an s3:// URI or a path inside the repo"
        )
    return path.relative_to(cwd).as_posix()


def step_placeholders(step: Step) -> dict[str, str]:
    """Argo expressions for every value of the step's argv: run params are workflow-wide, the rest per task."""
    values = {p: f"{{{{workflow.parameters.{p}}}}}" for p in step.run_params}
    values.update({p: f"{{{{inputs.parameters.{p}}}}}" for p in step.params})
    return values


def _resources(placement: RolePlacement) -> m.ResourceRequirements | None:
    requests, limits = placement.resources.requests, placement.resources.limits
    if not requests and not limits:
        return None
    # The generated model keeps extended resources (nvidia.com/gpu) that Hera's Resources would need nested.
    return m.ResourceRequirements(requests=requests or None, limits=limits or None)


# Retry a shard whose pod was lost (status Error: node shutdown, pod deleted) or stopped by a signal (exit 143:
# SIGTERM on a Spot reclaim; 137: SIGKILL after the grace period). A step's own error (exit 1, 2) is final.
SPOT_RETRY_EXPRESSION = 'lastRetry.status == "Error" || asInt(lastRetry.exitCode) in [137, 143]'


def _spot_retry(cluster: ClusterConfig) -> RetryStrategy:
    retry = cluster.spot_retry
    return RetryStrategy(
        limit=retry.limit,
        retry_policy="Always",
        expression=SPOT_RETRY_EXPRESSION,
        backoff=m.Backoff(
            duration=f"{retry.backoff_seconds}s",
            factor=m.IntOrString(retry.backoff_factor),
            cap=f"{retry.max_backoff_seconds}s",
        ),
    )


def _container(step: Step, config: MoeloopConfig) -> Container:
    cluster = config.cluster
    placement: RolePlacement = getattr(cluster, step.role)
    argv = step.argv(step_placeholders(step), step.processes(config))
    return Container(
        retry_strategy=_spot_retry(cluster) if step.role == "rollout" else None,
        name=step.name,
        image=placement.image or cluster.image,
        image_pull_policy="IfNotPresent",
        command=argv[:3],
        args=argv[3:],
        inputs=[Parameter(name=p) for p in step.params],
        labels={"moeloop.dev/step": step.name, "moeloop.dev/role": step.role},
        node_selector=placement.node_selector or None,
        tolerations=[m.Toleration(**t.model_dump(exclude_none=True)) for t in placement.tolerations] or None,
        resources=_resources(placement),
    )


def _run_parameters(kind: type[Workflow], run_uri: str, config_json: str) -> list[Parameter]:
    values = {"run": run_uri, "config": config_json}
    if kind is WorkflowTemplate:
        # `value` is what the controller substitutes; `default` is what submit forms pre-fill from a template.
        return [Parameter(name=name, value=value, default=value) for name, value in values.items()]
    return [Parameter(name=name, value=value) for name, value in values.items()]


def _dag_task(task: Task) -> dict[str, Any]:
    """The dict Hera's DAGTask model dumps to, in the same key order."""
    dag_task: dict[str, Any] = {"arguments": {"parameters": [{"name": p, "value": v} for p, v in task.arguments]}}
    if task.dependencies:
        dag_task["dependencies"] = list(task.dependencies)
    dag_task.update(name=task.name, template=task.step.name)
    return dag_task


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building or dumping a large acyclic document:
    the collections its ~10^6 new containers trigger take most of the time otherwise."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _entrypoint_dag(document: dict) -> dict:
    spec = document["spec"]
    return next(template["dag"] for template in spec["templates"] if template["name"] == spec["entrypoint"])


def _build(kind: type[Workflow], config: MoeloopConfig, run_uri: str, iterations: int | None, **metadata: Any) -> dict:
    with kind(
        **metadata,
        namespace=config.cluster.namespace,
        labels={"app.kubernetes.io/name": "moeloop", "moeloop.dev/run": config.run_name},
        entrypoint=ENTRYPOINT,
        service_account_name=config.cluster.service_account,
        arguments=_run_parameters(kind, run_uri, portable_config(config).to_json()),
    ) as workflow:
        DAG(name=ENTRYPOINT)
        for step in STEPS:
            _container(step, config)
    document = workflow.to_dict()
    # Hera takes ~90 us per Task (runtime protocol checks, models): 10,000 iterations are 60,002 tasks,
    # ~5 s per document. So the tasks are written as the dicts its DAGTask dumps to (a test checks that
    # Workflow.from_dict round-trips them).
    with _collector_paused():
        _entrypoint_dag(document)["tasks"] = [_dag_task(task) for task in loop_tasks(config, iterations)]
    return document


def render_workflow(config: MoeloopConfig, run_uri: str, iterations: int | None = None) -> dict:
    return _build(Workflow, config, run_uri, iterations, generate_name=f"{config.run_name}-")


def render_workflow_template(config: MoeloopConfig, run_uri: str, iterations: int | None = None) -> dict:
    return _build(WorkflowTemplate, config, run_uri, iterations, name=f"moeloop-{config.run_name}")


def render(config: MoeloopConfig, run_uri: str, iterations: int | None = None) -> dict[str, dict]:
    return {
        "workflow.yaml": render_workflow(config, run_uri, iterations),
        "workflow-template.yaml": render_workflow_template(config, run_uri, iterations),
    }


def write_rendered(documents: dict[str, dict], out_dir: Path) -> list[Path]:
    """Lint every document, then write each as YAML; one invalid document means nothing is written."""
    for file_name, document in documents.items():
        errors = lint_document(document, source=str(out_dir / file_name))
        if errors:
            raise MoeloopError(f"refusing to write an invalid manifest: {errors[0]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_write_atomically(out_dir / file_name, document) for file_name, document in documents.items()]


def _write_atomically(path: Path, document: dict) -> Path:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as stream, _collector_paused():
            yaml.dump(document, stream, Dumper=YAML_DUMPER, sort_keys=False)
        os.chmod(temporary, 0o644)  # mkstemp makes it owner-only; a manifest is meant to be read by others
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def dag_tasks(document: dict) -> dict[str, tuple[str, ...]]:
    """Task name -> sorted dependencies of the entrypoint DAG of a rendered Workflow or WorkflowTemplate."""
    return {task["name"]: tuple(sorted(task.get("dependencies", ()))) for task in _entrypoint_dag(document)["tasks"]}


# Minimal CronWorkflow so that `moeloop schedule` has an object to send; the chunked one (schedules from the
# config, continuing from LATEST) replaces it.
CRON_SCHEDULES = ("0 */6 * * *",)


def render_cron_workflow(config: MoeloopConfig, run_uri: str) -> dict:
    """A CronWorkflow that starts the registered WorkflowTemplate with its default parameters."""
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "CronWorkflow",
        "metadata": {
            "name": f"moeloop-{config.run_name}",
            "namespace": config.cluster.namespace,
            "labels": {"app.kubernetes.io/name": "moeloop", "moeloop.dev/run": config.run_name},
        },
        "spec": {
            "schedules": list(CRON_SCHEDULES),
            "concurrencyPolicy": "Forbid",
            "workflowSpec": {"workflowTemplateRef": {"name": f"moeloop-{config.run_name}"}},
        },
    }
