"""Multi-node training: the train task as steps that create a JobSet of `cluster.train_nodes` pods, each the
single-node trainer pod, with torchrun's rendezvous over the JobSet's headless service, then report its figures.
"""

from __future__ import annotations

from typing import Any

from hera.workflows import Container, Parameter, Resource, Steps
from hera.workflows import Step as HeraStep

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.outputs import OUTPUTS_ENV
from moeloop.workflows.dag import TRAIN, TRAIN_REPORT, Step
from moeloop.workflows.monitoring import template_metrics
from moeloop.workflows.render.parameters import manifest_text
from moeloop.workflows.render.placement import (
    LABEL,
    ROLE_LABEL,
    orchestrator_pod,
    placement,
    pod_container,
    pod_placement,
    pod_volumes,
    train_processes_per_node,
)
from moeloop.workflows.render.step_templates import (
    MISSING_OUTPUT,
    OUTPUTS_DIR,
    container_template,
    step_placeholders,
    template_io,
)

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOBSET_REPLICATED_JOB = "node"
RENDEZVOUS_PORT = 29500


def render_jobset(config: MoeloopConfig, step: Step = TRAIN, name: str | None = None, max_restarts: int = 0) -> dict[str, Any]:
    """The JobSet of the step's pods (a Kubernetes object, so a plain dict); Argo fills its {{...}}. TRAIN: the one a
    multi-node train task creates, generated names, none started again. TRAINER (the chunk's trainer) and
    ROLLOUT_ENGINE (a shard's), from workflows/render/daemons.py: named, all pods started again up to max_restarts
    times when one fails. A torchrun step has `cluster.train_nodes` pods, with torchrun's rendezvous over the
    JobSet's headless service; any other, one pod of its role."""
    role = step.role
    nodes = config.cluster.train_nodes if step.torchrun else 1
    env = [{"name": OUTPUTS_ENV, "value": OUTPUTS_DIR}]
    if step.torchrun:
        # Pod i of replicated job `node` is <jobset>-node-0-i, reachable as such under the subdomain <jobset>.
        rendezvous = [
            f"--nnodes={nodes}",
            "--node-rank=$(NODE_RANK)",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=$(JOBSET_NAME)-{JOBSET_REPLICATED_JOB}-0-0.$(JOBSET_NAME):{RENDEZVOUS_PORT}",
            "--rdzv-id=$(JOBSET_NAME)",
        ]
        argv = step.argv(step_placeholders(step), train_processes_per_node(config), rendezvous)
        downward = [
            ("JOBSET_NAME", "metadata.labels['jobset.sigs.k8s.io/jobset-name']"),
            ("NODE_RANK", "metadata.annotations['batch.kubernetes.io/job-completion-index']"),
        ]
        env[:0] = [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in downward]
    else:
        argv = step.argv(step_placeholders(step))
    volumes, _ = pod_volumes(role, placement(config, role))
    labels = {f"{LABEL}/run": config.run_name, f"{LABEL}/step": step.name, ROLE_LABEL: role}
    if "iteration" in step.params:
        labels[f"{LABEL}/iteration"] = "{{inputs.parameters.iteration}}"
    pod_spec = {
        "restartPolicy": "Never",
        **pod_placement(config, role),
        "containers": [pod_container(config, role, argv, env)],
        **({"volumes": volumes} if volumes else {}),
    }
    job = {
        "parallelism": nodes,
        "completions": nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"metadata": {"labels": labels}, "spec": pod_spec},
    }
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": {**({"name": name} if name else {"generateName": f"{config.run_name}-"}), "labels": labels},
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            # A failed rank fails the iteration's train task; re-running it (Argo retry, resubmit) starts anew.
            # A long-lived process is started again instead: it resumes from the run's storage.
            "failurePolicy": {"maxRestarts": max_restarts},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [JOBSET_REPLICATED_JOB]},
            "replicatedJobs": [{"name": JOBSET_REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


JOBSET_TEMPLATE = f"{TRAIN.name}-jobset"


def jobset_train_templates(config: MoeloopConfig) -> list[Steps | Resource | Container]:
    """The train task's template for a multi-node trainer: steps that create the JobSet and wait for it, then run
    train-report (moeloop.steps.train_report), a CPU pod that reads the committed train report. The JobSet's pods
    are not Argo's, so without it the train figures would be no template's outputs and no gauge."""
    io = template_io(TRAIN, TRAIN.role)
    io["outputs"] = None  # the figures are train-report's
    jobset = Resource(
        name=JOBSET_TEMPLATE,
        **io,
        **orchestrator_pod(config),
        action="create",
        set_owner_reference=True,  # deleted with the Workflow
        manifest=manifest_text(render_jobset(config)),
        success_condition="status.terminalState == Completed",
        failure_condition="status.terminalState == Failed",
    )
    report = container_template(TRAIN_REPORT, config)
    # Its gauges are the train step's, named as a single-node train template names them.
    report.metrics = template_metrics(TRAIN.name, TRAIN_REPORT.params, TRAIN.outputs, config.run_name, MISSING_OUTPUT)
    iteration = [Parameter(name="iteration", value="{{inputs.parameters.iteration}}")]
    train = Steps(
        name=TRAIN.name,
        inputs=[Parameter(name="iteration")],
        sub_steps=[
            HeraStep(name="jobset", template=JOBSET_TEMPLATE, arguments=iteration),
            HeraStep(name="report", template=TRAIN_REPORT.name, arguments=iteration),
        ],
    )
    return [train, jobset, report]
