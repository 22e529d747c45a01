"""Step templates: each step of workflows/dag.py as an Argo Container template, its argv with Argo's placeholders.

Rollout shards, the only pods on Spot capacity, retry when their pod is lost or stopped by a signal.
"""

from __future__ import annotations

from typing import Any

from hera.workflows import Container, Parameter
from hera.workflows import models as m

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.outputs import OUTPUTS_ENV
from moeloop.workflows.dag import PLAN, Step, step_role
from moeloop.workflows.monitoring import template_metrics
from moeloop.workflows.render.placement import LABEL, ROLE_LABEL, placement, pod_container, pod_volumes, template_placement

OUTPUTS_DIR = "/tmp/outputs"  # moeloop.steps.common.print_json writes a report's scalars here ($MOELOOP_OUTPUTS)
MISSING_OUTPUT = "none"  # an output a step did not report (it skipped its work): not a failure


def step_placeholders(step: Step) -> dict[str, str]:
    """Argo expressions for every value of the step's argv: run params are workflow-wide, the rest per task."""
    values = {p: f"{{{{workflow.parameters.{p}}}}}" for p in step.run_params}
    values.update({p: f"{{{{inputs.parameters.{p}}}}}" for p in step.params})
    return values


def container_template(step: Step, config: MoeloopConfig) -> Container:
    """The step's pod: its argv in its role's container, placed and secured by role, its figures as outputs."""
    argv = step.argv(step_placeholders(step), step.processes(config))
    role = step_role(step, config)
    where = placement(config, role)
    volumes, mounts = pod_volumes(role, where)
    container = pod_container(config, role, argv, [{"name": OUTPUTS_ENV, "value": OUTPUTS_DIR}])
    return Container(
        name=step.name,
        **template_io(step, role),
        **template_placement(config, role),
        image=where.image,
        image_pull_policy=container["imagePullPolicy"],
        command=container["command"],
        args=container["args"],
        env=[m.EnvVar.model_validate(variable) for variable in container["env"]],
        resources=m.ResourceRequirements.model_validate(container["resources"]) if "resources" in container else None,
        security_context=m.SecurityContext.model_validate(container["securityContext"]),
        volume_mounts=[m.VolumeMount.model_validate(mount) for mount in mounts] or None,
        volumes=[m.Volume.model_validate(volume) for volume in volumes] or None,
        retry_strategy=_spot_retry(config) if role == "rollout" else None,
        metrics=template_metrics(step.name, step.params, step.outputs, config.run_name, MISSING_OUTPUT),
    )


def template_io(step: Step, role: str) -> dict[str, Any]:
    """Inputs, the step's figures as outputs, and pod labels that find a step's pods by role and iteration."""
    labels = {f"{LABEL}/step": step.name, ROLE_LABEL: role}
    if "iteration" in step.params:
        labels[f"{LABEL}/iteration"] = "{{inputs.parameters.iteration}}"
    io: dict[str, Any] = {"labels": labels, "inputs": [Parameter(name=p) for p in step.params] or None}
    # plan's outputs steer the DAG: missing, the chunk must fail. A step's figures may be absent (skipped work).
    default = None if step is PLAN else MISSING_OUTPUT
    outputs = [
        Parameter(name=name, value_from=m.ValueFrom(path=f"{OUTPUTS_DIR}/{name}", default=default))
        for name in step.outputs
    ]
    io["outputs"] = outputs or None
    return io


# Retry a shard whose pod was lost (status Error: node shutdown, pod deleted) or stopped by a signal (exit 143:
# SIGTERM on a Spot reclaim; 137: SIGKILL after the grace period). A step's own error (exit 1, 2) is final.
SPOT_RETRY_EXPRESSION = 'lastRetry.status == "Error" || asInt(lastRetry.exitCode) in [137, 143]'


def _spot_retry(config: MoeloopConfig) -> m.RetryStrategy:
    retry = config.cluster.spot_retry
    return m.RetryStrategy(
        limit=m.IntOrString(retry.limit),
        retry_policy="Always",
        expression=SPOT_RETRY_EXPRESSION,
        backoff=m.Backoff(
            duration=f"{retry.backoff_seconds}s",
            factor=m.IntOrString(retry.backoff_factor),
            cap=f"{retry.max_backoff_seconds}s",
        ),
    )
