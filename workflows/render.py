"""Render the loop for Argo: a WorkflowTemplate holding one chunk of the run, a Workflow and a CronWorkflow
that run it, and (multi-node training) the JobSet the train task creates.

A run of any length is a chain of Workflows of `cluster.chunk_iterations` iterations each, so no object
grows with the run (etcd keeps about 1 MB per object; Argo's recursion depth is 100). The template's DAG:

    start -> plan -+-> eval-latest                      (LATEST's evaluation, if it is missing)
                   +-> label                            (the Workflow's first/last-iteration labels)
                   +-> slot1-rollout-* -> ... -> slotK-eval -> next-chunk

`plan` (steps/plan.py) reads LATEST after start has adopted the submitted `iterations`: slot j runs
iteration LATEST + j when j <= its `count`; `next-chunk` creates the next Workflow from the same template when
iterations remain and `chain` is true. The ad-hoc Workflow and the CronWorkflow refer to the template, so
every submission, resubmission or scheduled tick continues from LATEST. Every task, dependency and pod
command comes from workflows/dag.py (`iteration_tasks`, `STEPS`); this module adds placement by role from
`config.cluster`, security contexts, output parameters and the chaining.

The objects are Hera objects (`build` returns them: a WorkflowTemplate whose chunk is a DAG of Tasks over Container
and Resource templates, a Workflow, a CronWorkflow); what `moeloop render` writes is Hera's own serialization of
them, linted first.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hera.workflows import DAG, Container, CronWorkflow, Parameter, Resource, Workflow, WorkflowTemplate
from hera.workflows import Task as HeraTask
from hera.workflows import models as m

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.config_cluster import Resources, RolePlacement, Toleration
from moeloop.steps.errors import MoeloopError
from moeloop.steps.outputs import OUTPUTS_ENV
from moeloop.workflows.dag import EVALUATE, PLAN, START, STEPS, TRAIN, Step, Task, iteration_tasks, run_values, step_role
from moeloop.workflows.lint import lint_documents
from moeloop.workflows.monitoring import run_annotations, template_metrics

API_VERSION = "argoproj.io/v1alpha1"
ENTRYPOINT = "chunk"
# Config fields naming a file the pods read: it must be reachable from inside the image or by URI.
LOCAL_PATH_FIELDS = (("task", "train_prompts"), ("task", "eval_prompts"), ("model", "checkpoint"))
# libyaml's emitter when PyYAML was built with it: same output as PyYAML's own, about 3x faster.
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
# etcd's request limit is ~1.5 MiB and Argo adds status to a Workflow: a rendered object must stay well below.
MAX_OBJECT_BYTES = 1_000_000
# Argo's CRDs allow at most 200 tasks in a DAG (dag.tasks maxItems). That also keeps a running chunk's status,
# one entry (~0.5-1 KB with outputs) per task and retry, within etcd's limit.
MAX_CHUNK_TASKS = 200
DEFAULT_CHUNK_ITERATIONS = 20  # a Workflow per ~day of a large run: short enough to find, resubmit, archive

OUTPUTS_DIR = "/tmp/outputs"  # moeloop.steps.common.print_json writes a report's scalars here ($MOELOOP_OUTPUTS)
MISSING_OUTPUT = "none"  # an output a step did not report (it skipped its work): not a failure
PLAN_OUTPUTS = "tasks.plan.outputs.parameters"
LABEL = "moeloop.dev"

# Run parameters: the submit form of the Argo UI. `chain` is Argo-only (the local runner runs everything).
PARAMETER_DESCRIPTIONS = {
    "run": "The run's folder: <storage root>/<run name>, e.g. s3://bucket/runs/tiny. Pods read and write only here.",
    "iterations": "Target: the run's last iteration. A chunk runs from LATEST + 1 and stops at the target.",
    "model": "HF checkpoint URI to start a new run from; empty: the config's model.checkpoint (or the tiny model).",
    "chain": "Create the next chunk's Workflow when this one ends short of the target (the CronWorkflow sets false).",
    "config": "The run's config as YAML (steps/config.py). A started run refuses changes but to cluster/local/storage_root.",
}

# The contract with manifests/ (Karpenter NodePools, service accounts, images).
ROLE_LABEL = f"{LABEL}/role"
GPU_TAINT = "nvidia.com/gpu"
GPU_ROLES = frozenset({"rollout", "reward", "train"})
ROLE_IMAGES = {
    "rollout": "moeloop-rollout",
    "reward": "moeloop-rollout",  # reward models run on the rollout image's vLLM/torch
    "train": "moeloop-trainer",
    "cpu": "moeloop-cpu",
    "memory": "moeloop-cpu",
}
IMAGE_USER = 1000  # the images' user `moeloop` (uid and gid 1000)
# What AWS documents for NCCL over EFA on p5/p6 (aws-ofi-nccl): libfabric's EFA provider with GPUDirect RDMA;
# NVLink SHARP off (no NVSwitch multicast across EFA nodes); fork-safe registration for dataloader workers.
EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
    "NCCL_DEBUG": "WARN",
}
EFA_DEVICES_PER_NODE = "32"  # p5.48xlarge: 32 EFA network cards
HUGEPAGES = "5120Mi"  # libfabric's EFA provider registers its bounce buffers in 2 MiB huge pages
RENDEZVOUS_PORT = 29500


def role_defaults(config: MoeloopConfig, role: str) -> RolePlacement:
    """A role's placement when the config leaves it out: the manifests' node labels, taints and service accounts."""
    cluster = config.cluster
    tolerations = [Toleration(key=ROLE_LABEL, operator="Equal", value=role, effect="NoSchedule")]
    if role in GPU_ROLES:
        tolerations.append(Toleration(key=GPU_TAINT, operator="Exists", effect="NoSchedule"))
    resources = {
        "rollout": Resources(
            requests={"cpu": "8", "memory": "64Gi"},
            limits={"nvidia.com/gpu": str(config.rollout.vllm.tensor_parallel_size), "memory": "64Gi"},
        ),
        "reward": Resources(requests={"cpu": "8", "memory": "64Gi"}, limits={"nvidia.com/gpu": "1", "memory": "64Gi"}),
        "train": Resources(
            requests={"cpu": "96", "memory": "1024Gi", "hugepages-2Mi": HUGEPAGES},
            limits={
                "nvidia.com/gpu": str(train_processes_per_node(config)),
                "vpc.amazonaws.com/efa": EFA_DEVICES_PER_NODE,
                "hugepages-2Mi": HUGEPAGES,
                "memory": "1024Gi",
            },
        ),
        "cpu": Resources(requests={"cpu": "2", "memory": "8Gi"}, limits={"memory": "16Gi"}),
        # publish writes its checkpoint shards side by side, a core each (benchmarks/handoff.md)
        "memory": Resources(requests={"cpu": "16", "memory": "64Gi"}, limits={"memory": "128Gi"}),
    }[role]
    return RolePlacement(
        image=f"{cluster.image_registry.rstrip('/')}/{ROLE_IMAGES[role]}:{cluster.image_tag}",
        service_account=f"moeloop-{role}",
        node_selector={ROLE_LABEL: role},
        tolerations=tolerations,
        resources=resources,
        env=EFA_ENV if role == "train" else {},
        shm_size={"rollout": "32Gi", "reward": "32Gi", "train": "256Gi"}.get(role, ""),
        priority_class=f"moeloop-{role}",
    )


def placement(config: MoeloopConfig, role: str) -> RolePlacement:
    """The role's placement: the config's fields where given, the role's defaults for the rest."""
    given = getattr(config.cluster, role).model_dump(exclude_none=True)
    return RolePlacement.model_validate(role_defaults(config, role).model_dump() | given)


def train_processes_per_node(config: MoeloopConfig) -> int:
    return TRAIN.processes(config) // config.cluster.train_nodes


# ---------------------------------------------------------------------------------------------
# Paths the pods read


def portable_config(config: MoeloopConfig) -> MoeloopConfig:
    """The config with local paths made relative to cwd, the repo root, which is the pods' WORKDIR."""
    cwd = Path.cwd().resolve()
    updates: dict[str, dict[str, str]] = {}
    for section, key in LOCAL_PATH_FIELDS:
        location = getattr(getattr(config, section), key)
        if location is not None:
            updates.setdefault(section, {})[key] = _portable_path(f"{section}.{key}", location, cwd)
    models = [
        model.model_copy(update={"path": _portable_path(f"reward.models[{k}].path", model.path, cwd)})
        for k, model in enumerate(config.reward.models)
    ]
    updates["reward"] = {"models": models}
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


# ---------------------------------------------------------------------------------------------
# Pods


def step_placeholders(step: Step) -> dict[str, str]:
    """Argo expressions for every value of the step's argv: run params are workflow-wide, the rest per task."""
    values = {p: f"{{{{workflow.parameters.{p}}}}}" for p in step.run_params}
    values.update({p: f"{{{{inputs.parameters.{p}}}}}" for p in step.params})
    return values


def pod_security(role: str) -> dict[str, Any]:
    """Pod Security Standard `restricted` for every role but train, which runs as root (see container_security)."""
    if role == "train":
        return {"runAsUser": 0, "runAsGroup": 0, "seccompProfile": {"type": "RuntimeDefault"}}
    return {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_USER,
        "runAsGroup": IMAGE_USER,
        "fsGroup": IMAGE_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security(role: str) -> dict[str, Any]:
    """No privilege escalation and no capabilities, except IPC_LOCK for the trainer: libfabric pins (locks) the
    buffers EFA reads by DMA. Kubernetes grants added capabilities only to root processes (it sets no ambient
    capabilities), so the trainer runs as uid 0 with every other capability dropped."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if role == "train":
        capabilities["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities}


def _volumes(role: str, where: RolePlacement) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): /dev/shm in memory for NCCL and vLLM workers, huge pages for EFA on the trainer."""
    volumes, mounts = [], []
    if where.shm_size:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": where.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if role == "train":
        volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages"}})
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    return volumes, mounts


def _resources(resources: Resources) -> dict[str, dict[str, str]]:
    return {key: value for key, value in (("requests", resources.requests), ("limits", resources.limits)) if value}


def _pod_placement(config: MoeloopConfig, role: str) -> dict[str, Any]:
    """The pod-level fields of a role's pods, in Kubernetes PodSpec spelling (the JobSet's pods)."""
    where = placement(config, role)
    fields: dict[str, Any] = {
        "serviceAccountName": where.service_account,
        "priorityClassName": where.priority_class,
        "nodeSelector": where.node_selector,
        "tolerations": [t.model_dump(exclude_none=True) for t in where.tolerations or ()],
        "securityContext": pod_security(role),
    }
    return {key: value for key, value in fields.items() if value}


def _placed(config: MoeloopConfig, role: str, service_account: str | None = None) -> dict[str, Any]:
    """The same fields as a Hera template's arguments."""
    pod = _pod_placement(config, role)
    return {
        "service_account_name": service_account or pod.get("serviceAccountName"),
        "priority_class_name": pod.get("priorityClassName"),
        "node_selector": pod.get("nodeSelector"),
        "tolerations": [m.Toleration.model_validate(t) for t in pod.get("tolerations", ())] or None,
        "pod_security_context": m.PodSecurityContext.model_validate(pod["securityContext"]),
    }


def _container(config: MoeloopConfig, role: str, argv: list[str], extra_env: list[dict] = ()) -> dict[str, Any]:
    """The role's container running argv, in Kubernetes spelling (the JobSet's pods)."""
    where = placement(config, role)
    _, mounts = _volumes(role, where)
    env = [*extra_env, *({"name": k, "value": v} for k, v in sorted(where.env.items()))]
    container: dict[str, Any] = {
        "name": "main",
        "image": where.image,
        "imagePullPolicy": "IfNotPresent",
        "command": argv[:3],
        "args": argv[3:],
        "env": env,
        "resources": _resources(where.resources),
        "securityContext": container_security(role),
        "volumeMounts": mounts,
    }
    return {key: value for key, value in container.items() if value}


def _step_template(step: Step, config: MoeloopConfig) -> Container | Resource:
    if step is TRAIN and config.cluster.train_nodes > 1:
        return _jobset_train_template(config)
    argv = step.argv(step_placeholders(step), step.processes(config))
    role = step_role(step, config)
    where = placement(config, role)
    volumes, mounts = _volumes(role, where)
    container = _container(config, role, argv, [{"name": OUTPUTS_ENV, "value": OUTPUTS_DIR}])
    return Container(
        name=step.name,
        **_template_io(step, role),
        **_placed(config, role),
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


def _template_io(step: Step, role: str) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------
# Multi-node training: a JobSet of `cluster.train_nodes` pods, torchrun rendezvous over its headless service


JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOBSET_REPLICATED_JOB = "node"


def render_jobset(config: MoeloopConfig) -> dict[str, Any]:
    """The JobSet the multi-node train task creates (a Kubernetes object, so a plain dict); Argo fills its {{...}}."""
    nodes = config.cluster.train_nodes
    # Pod i of replicated job `node` is <jobset>-node-0-i, reachable as such under the subdomain <jobset>.
    rendezvous = [
        f"--nnodes={nodes}",
        "--node-rank=$(NODE_RANK)",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=$(JOBSET_NAME)-{JOBSET_REPLICATED_JOB}-0-0.$(JOBSET_NAME):{RENDEZVOUS_PORT}",
        "--rdzv-id=$(JOBSET_NAME)",
    ]
    argv = TRAIN.argv(step_placeholders(TRAIN), train_processes_per_node(config), rendezvous)
    downward = [
        ("JOBSET_NAME", "metadata.labels['jobset.sigs.k8s.io/jobset-name']"),
        ("NODE_RANK", "metadata.annotations['batch.kubernetes.io/job-completion-index']"),
    ]
    env = [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in downward]
    env.append({"name": OUTPUTS_ENV, "value": OUTPUTS_DIR})
    volumes, _ = _volumes("train", placement(config, "train"))
    labels = {
        f"{LABEL}/run": config.run_name,
        f"{LABEL}/step": TRAIN.name,
        ROLE_LABEL: TRAIN.role,
        f"{LABEL}/iteration": "{{inputs.parameters.iteration}}",
    }
    pod_spec = {
        "restartPolicy": "Never",
        **_pod_placement(config, "train"),
        "containers": [_container(config, "train", argv, env)],
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
        "metadata": {"generateName": f"{config.run_name}-", "labels": labels},
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            # A failed rank fails the iteration's train task; re-running it (Argo retry, resubmit) starts anew.
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [JOBSET_REPLICATED_JOB]},
            "replicatedJobs": [{"name": JOBSET_REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


def _jobset_train_template(config: MoeloopConfig) -> Resource:
    io = _template_io(TRAIN, TRAIN.role)
    io["outputs"] = None  # the figures stay in the JobSet's pods (and reports/iter-N/train.json)
    return Resource(
        name=TRAIN.name,
        **io,
        **_orchestrator_pod(config),
        action="create",
        set_owner_reference=True,  # deleted with the Workflow
        manifest=yaml.safe_dump(render_jobset(config), sort_keys=False),
        success_condition="status.terminalState == Completed",
        failure_condition="status.terminalState == Failed",
    )


def _orchestrator_pod(config: MoeloopConfig) -> dict[str, Any]:
    """Resource templates run Argo's executor on CPU nodes, as the orchestrator, under `restricted`."""
    return _placed(config, "cpu", service_account=config.cluster.orchestrator_service_account)


# ---------------------------------------------------------------------------------------------
# The chunk: start -> plan -> K iteration slots -> next chunk


# The chunk's tasks besides its iteration slots.
FIXED_CHUNK_TASKS = ("start", "plan", "eval-latest", "label", "next-chunk")
# The label task's inputs: the iterations plan chose (a template cannot see the DAG's tasks).
LABEL_INPUTS = {
    "first": f"{{{{{PLAN_OUTPUTS}.first}}}}",
    "last": f"{{{{=asInt({PLAN_OUTPUTS}.first) + asInt({PLAN_OUTPUTS}.count) - 1}}}}",
}


def template_name(config: MoeloopConfig) -> str:
    return f"moeloop-{config.run_name}"


def chunk_size(config: MoeloopConfig) -> int:
    """Iterations per chunk: cluster.chunk_iterations, by default 20 or as many as MAX_CHUNK_TASKS allows."""
    per_iteration = len(iteration_tasks(config, 1, PLAN.name))
    fitting = (MAX_CHUNK_TASKS - len(FIXED_CHUNK_TASKS)) // per_iteration
    if config.cluster.chunk_iterations is None:
        return max(1, min(DEFAULT_CHUNK_ITERATIONS, fitting))
    if config.cluster.chunk_iterations > fitting:
        raise MoeloopError(
            f"cluster.chunk_iterations {config.cluster.chunk_iterations} makes a Workflow of more than"
            f" {MAX_CHUNK_TASKS} tasks at {per_iteration} tasks per iteration; at most {fitting}"
        )
    return config.cluster.chunk_iterations


def chunk_tasks(config: MoeloopConfig) -> list[Task]:
    """The chunk's iteration slots: dag.py's iterations 1..K named slot<j>, rooted at plan."""
    return iteration_tasks(config, chunk_size(config), PLAN.name, prefix="slot")


def slot_iteration(slot: int) -> str:
    """The iteration slot j runs: LATEST + j, i.e. plan's `first` + j - 1."""
    first = f"{PLAN_OUTPUTS}.first"
    return f"{{{{{first}}}}}" if slot == 1 else f"{{{{=asInt({first}) + {slot - 1}}}}}"


def _counted(slot: int) -> str:
    """Slot j runs when plan's count reaches j: short chunks and the target skip the rest."""
    return f"{{{{{PLAN_OUTPUTS}.count}}}} >= {slot}"


def _dag_task(task: Task, when: str | None = None, **values: str) -> HeraTask:
    """dag.py's task as a Hera task; `values` replace its arguments' values."""
    arguments = [Parameter(name=p, value=values.get(p, v)) for p, v in task.arguments]
    return HeraTask(
        name=task.name,
        template=task.step.name,
        arguments=arguments or None,
        dependencies=list(task.dependencies) or None,
        when=when,
    )


def _chunk_dag(config: MoeloopConfig) -> DAG:
    start = Task(START.name, START, 0, (("iteration", "0"),), ())
    plan = Task(PLAN.name, PLAN, 0, (("chunk", str(chunk_size(config))),), (START.name,))
    latest = Task("eval-latest", EVALUATE, 0, (("iteration", f"{{{{{PLAN_OUTPUTS}.latest}}}}"),), (PLAN.name,))
    slots = chunk_tasks(config)
    return DAG(
        name=ENTRYPOINT,
        tasks=[
            _dag_task(start),
            _dag_task(plan),
            _dag_task(latest, when=f"{{{{{PLAN_OUTPUTS}.evaluate}}}} == true"),
            HeraTask(
                name="label",
                template="label",
                arguments=[Parameter(name=k, value=v) for k, v in LABEL_INPUTS.items()],
                dependencies=[PLAN.name],
                when=_counted(1),
            ),
            *(_dag_task(task, when=_counted(task.iteration), iteration=slot_iteration(task.iteration)) for task in slots),
            HeraTask(
                name="next-chunk",
                template="next-chunk",
                dependencies=[f"slot{slots[-1].iteration}-eval"],
                when=f"{{{{{PLAN_OUTPUTS}.more}}}} == true && {{{{workflow.parameters.chain}}}} == true",
            ),
        ],
    )


def _label_template(config: MoeloopConfig) -> Resource:
    """Labels the running Workflow with the iterations plan chose, so the UI finds a run's chunk by iteration."""
    patch = {  # a merge patch, not a whole Workflow: a plain dict
        "apiVersion": API_VERSION,
        "kind": "Workflow",
        "metadata": {
            "name": "{{workflow.name}}",
            "labels": {f"{LABEL}/{name}-iteration": f"{{{{inputs.parameters.{name}}}}}" for name in LABEL_INPUTS},
        },
    }
    return Resource(
        name="label",
        inputs=[Parameter(name=name) for name in LABEL_INPUTS],
        **_orchestrator_pod(config),
        action="patch",
        merge_strategy="merge",
        manifest=yaml.safe_dump(patch, sort_keys=False),
    )


def next_chunk_workflow(config: MoeloopConfig) -> Workflow:
    """The Workflow the last task creates: the next chunk, with this Workflow's parameters. Argo substitutes
    {{...}} into the manifest's text before parsing it: each value is written as toJson's JSON string, which YAML
    reads back as the very value, whatever its quotes, colons or lines."""
    return Workflow(
        generate_name=f"{config.run_name}-",
        labels={**_run_labels(config), f"{LABEL}/chained-from": "{{workflow.name}}"},
        workflow_template_ref=m.WorkflowTemplateRef(name=template_name(config)),
        arguments=[Parameter(name=name, value=f"{{{{=toJson(workflow.parameters.{name})}}}}") for name in PARAMETERS],
    )


def _next_chunk_template(config: MoeloopConfig) -> Resource:
    return Resource(
        name="next-chunk",
        **_orchestrator_pod(config),
        # No owner reference: the next chunk outlives this Workflow (and its garbage collection).
        action="create",
        manifest=next_chunk_workflow(config),
    )


# ---------------------------------------------------------------------------------------------
# The objects


PARAMETERS = ("run", "iterations", "model", "chain", "config")
CONFIG_HEADER = (
    "# The run's config (steps/config.py). The parameters `iterations` and `model` override its own; a started\n"
    "# run refuses changes to anything but cluster, local and storage_root.\n"
)
YAML_WIDTH = 1 << 16  # no folded lines: a diff of two renders shows whole values


def _run_labels(config: MoeloopConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": "moeloop", f"{LABEL}/run": config.run_name}


def _arguments(config: MoeloopConfig, run_uri: str, chain: bool) -> dict[str, str]:
    """The run parameters' values; the config as YAML, which the Argo UI's forms show line by line."""
    shipped = portable_config(config)
    config_text = CONFIG_HEADER + yaml.safe_dump(shipped.model_dump(mode="json"), sort_keys=False)
    return {**run_values(shipped, run_uri), "config": config_text, "chain": json.dumps(chain)}


@dataclass(frozen=True)
class Loop:
    """The run's Argo objects, as Hera objects: a WorkflowTemplate holding one chunk, and the Workflow and
    CronWorkflow that run it. Change them as Hera objects (`chunk` is the template's DAG); `moeloop render`
    writes them with Hera's serialization, submit/register/schedule send them."""

    template: WorkflowTemplate
    workflow: Workflow
    cron_workflow: CronWorkflow

    @property
    def chunk(self) -> DAG:
        return next(t for t in self.template.templates if isinstance(t, DAG) and t.name == ENTRYPOINT)

    def objects(self) -> dict[str, Workflow]:
        """By the file name `moeloop render` writes each to."""
        return dict(zip(FILES, (self.template, self.workflow, self.cron_workflow)))


FILES = ("workflow-template.yaml", "workflow.yaml", "cron-workflow.yaml")


def build(config: MoeloopConfig, run_uri: str, iterations: int | None = None) -> Loop:
    """Every Argo object of the run at `run_uri` (e.g. s3://bucket/runs/<run_name>). `iterations` sets the target;
    the chunks do not depend on it."""
    config = with_target(config, iterations)
    metadata = {"namespace": config.cluster.namespace, "labels": _run_labels(config)}
    values = _arguments(config, run_uri, chain=True)
    template = WorkflowTemplate(
        name=template_name(config),
        **metadata,
        entrypoint=ENTRYPOINT,
        service_account_name=config.cluster.orchestrator_service_account,
        # `value` is what the controller substitutes; `default` is what the UI's submit form pre-fills.
        arguments=[
            Parameter(
                name=name,
                value=values[name],
                default=values[name],
                description=PARAMETER_DESCRIPTIONS[name],
                enum=["true", "false"] if name == "chain" else None,
            )
            for name in PARAMETERS
        ],
        # One chunk of a run at a time, whoever submitted it: a chained chunk waits for its predecessor.
        synchronization=m.Synchronization(mutexes=[m.Mutex(name=f"moeloop-run-{config.run_name}")]),
        workflow_metadata=m.WorkflowMetadata(labels=_run_labels(config), annotations=run_annotations(run_uri)),
        pod_metadata=m.Metadata(labels={f"{LABEL}/run": config.run_name}),
        templates=[
            _chunk_dag(config),
            *(_step_template(step, config) for step in STEPS),
            _label_template(config),
            _next_chunk_template(config),
        ],
    )
    return Loop(
        template=template,
        workflow=Workflow(generate_name=f"{config.run_name}-", **metadata, **_referring(config, run_uri, True)),
        # Each tick runs one chunk from LATEST (no chaining: the schedule is the chain); at the target a tick runs
        # start and plan only and succeeds. Forbid: no tick while the previous one runs.
        cron_workflow=CronWorkflow(
            name=template_name(config),
            **metadata,
            schedules=list(config.cluster.schedule.schedules),
            timezone=config.cluster.schedule.timezone,
            concurrency_policy="Forbid",
            starting_deadline_seconds=300,
            successful_jobs_history_limit=3,
            failed_jobs_history_limit=3,
            **_referring(config, run_uri, False),
        ),
    )


def _referring(config: MoeloopConfig, run_uri: str, chain: bool) -> dict[str, Any]:
    """A Workflow spec that runs the template (the template must be registered) with the run's arguments."""
    values = _arguments(config, run_uri, chain)
    return {
        "workflow_template_ref": m.WorkflowTemplateRef(name=template_name(config)),
        "arguments": [Parameter(name=name, value=values[name]) for name in PARAMETERS],
    }


def with_target(config: MoeloopConfig, iterations: int | None) -> MoeloopConfig:
    return config if iterations is None else config.model_copy(update={"iterations": iterations})


def render(config: MoeloopConfig, run_uri: str, iterations: int | None = None) -> dict[str, dict]:
    """Every object of the run as the dict Argo reads, by file name."""
    return {name: hera_object.to_dict() for name, hera_object in build(config, run_uri, iterations).objects().items()}


# ---------------------------------------------------------------------------------------------
# Writing


def write_rendered(loop: Loop, out_dir: Path) -> list[Path]:
    """Lint every object (templateRefs across them) and check its size, then write each with Hera's YAML
    serialization into out_dir. Nothing is written unless all can be."""
    objects = loop.objects()
    documents = {name: hera_object.to_dict() for name, hera_object in objects.items()}
    errors = lint_documents(documents.values(), source=str(out_dir))
    if errors:
        raise MoeloopError(f"refusing to write an invalid manifest: {errors[0]}")
    for file_name, document in documents.items():
        size = object_bytes(document)
        if size > MAX_OBJECT_BYTES:
            raise MoeloopError(f"{file_name}: {size} bytes is over the {MAX_OBJECT_BYTES}-byte object limit")
    texts = {name: hera_object.to_yaml(Dumper=YAML_DUMPER, width=YAML_WIDTH) for name, hera_object in objects.items()}
    return write_files(texts, out_dir)


def write_files(texts: dict[str, str], out_dir: Path) -> list[Path]:
    """Write each text to out_dir/<name>, replacing what is there: all or none. Every text goes to a temporary
    name first; only when all are written are they renamed into place."""
    if out_dir.exists() and not out_dir.is_dir():
        raise MoeloopError(f"{out_dir}: not a folder; -o names the folder to write into")
    temporaries: list[str] = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            temporaries.append(_write_temporary(out_dir / name, text))
    except OSError as error:
        for temporary in temporaries:
            os.unlink(temporary)
        raise MoeloopError(f"{out_dir}: cannot write there: {error.strerror or error}") from None
    paths = [out_dir / name for name in texts]
    for temporary, path in zip(temporaries, paths):
        os.replace(temporary, path)
    return paths


def object_bytes(document: dict) -> int:
    """The object's size as the API server stores it (JSON)."""
    return len(json.dumps(document, separators=(",", ":")).encode())


def _write_temporary(path: Path, text: str) -> str:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as stream:
            stream.write(text)
        os.chmod(temporary, 0o644)  # mkstemp makes it owner-only; a manifest is meant to be read by others
    except BaseException:
        os.unlink(temporary)
        raise
    return temporary


def dag_tasks(document: dict) -> dict[str, tuple[str, ...]]:
    """Task name -> sorted dependencies of the entrypoint DAG of a rendered WorkflowTemplate."""
    spec = document["spec"]
    dag = next(template["dag"] for template in spec["templates"] if template["name"] == spec["entrypoint"])
    return {task["name"]: tuple(sorted(task.get("dependencies", ()))) for task in dag["tasks"]}
