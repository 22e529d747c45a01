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

Documents are built as the plain dicts Argo reads (tests check Hera's models read and write them back
unchanged) and linted against the closed upstream schema before they are written.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from steps.config import MoeloopConfig, Resources, RolePlacement, Toleration
from steps.errors import MoeloopError
from steps.outputs import OUTPUTS_ENV
from workflows.dag import EVALUATE, PLAN, START, STEPS, TRAIN, Step, Task, iteration_tasks, run_values, step_role
from workflows.lint import lint_documents

API_VERSION = "argoproj.io/v1alpha1"
ENTRYPOINT = "chunk"
# Config fields naming a file the pods read: it must be reachable from inside the image or by URI.
LOCAL_PATH_FIELDS = (("task", "train_prompts"), ("task", "eval_prompts"), ("model", "checkpoint"))
# libyaml's emitter when PyYAML was built with it: same output as yaml.safe_dump, about 3x faster.
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
# etcd's request limit is ~1.5 MiB and Argo adds status to a Workflow: a rendered object must stay well below.
MAX_OBJECT_BYTES = 1_000_000
# Argo's CRDs allow at most 200 tasks in a DAG (dag.tasks maxItems). That also keeps a running chunk's status,
# one entry (~0.5-1 KB with outputs) per task and retry, within etcd's limit.
MAX_CHUNK_TASKS = 200
DEFAULT_CHUNK_ITERATIONS = 20  # a Workflow per ~day of a large run: short enough to find, resubmit, archive

OUTPUTS_DIR = "/tmp/outputs"  # steps.common.print_json writes a report's scalars here ($MOELOOP_OUTPUTS)
MISSING_OUTPUT = "none"  # an output a step did not report (it skipped its work): not a failure
PLAN_OUTPUTS = "tasks.plan.outputs.parameters"
LABEL = "moeloop.dev"

# Run parameters: the submit form of the Argo UI. `chain` is Argo-only (the local runner runs everything).
PARAMETER_DESCRIPTIONS = {
    "run": "The run's folder: <storage root>/<run name>, e.g. s3://bucket/runs/tiny. Pods read and write only here.",
    "iterations": "Target: the run's last iteration. A chunk runs from LATEST + 1 and stops at the target.",
    "model": "HF checkpoint URI to start a new run from; empty: the config's model.checkpoint (or the tiny model).",
    "chain": "Create the next chunk's Workflow when this one ends short of the target (the CronWorkflow sets false).",
    "config": "The run's config as JSON (steps/config.py). A started run refuses changes except to iterations/cluster.",
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
        "memory": Resources(requests={"cpu": "4", "memory": "64Gi"}, limits={"memory": "128Gi"}),
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
    """The pod-level fields of a role's pods, in Argo template and Kubernetes PodSpec spelling alike."""
    where = placement(config, role)
    fields: dict[str, Any] = {
        "serviceAccountName": where.service_account,
        "priorityClassName": where.priority_class,
        "nodeSelector": where.node_selector,
        "tolerations": [t.model_dump(exclude_none=True) for t in where.tolerations or ()],
        "securityContext": pod_security(role),
    }
    return {key: value for key, value in fields.items() if value}


def _container(config: MoeloopConfig, role: str, argv: list[str], extra_env: list[dict] = ()) -> dict[str, Any]:
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


def _step_template(step: Step, config: MoeloopConfig) -> dict[str, Any]:
    if step is TRAIN and config.cluster.train_nodes > 1:
        return _jobset_train_template(config)
    argv = step.argv(step_placeholders(step), step.processes(config))
    outputs_env = [{"name": OUTPUTS_ENV, "value": OUTPUTS_DIR}]
    role = step_role(step, config)
    template: dict[str, Any] = {
        "name": step.name,
        **_template_io(step, role),
        **_pod_placement(config, role),
        "container": _container(config, role, argv, outputs_env),
    }
    volumes, _ = _volumes(role, placement(config, role))
    if volumes:
        template["volumes"] = volumes
    if role == "rollout":
        template["retryStrategy"] = _spot_retry(config)
    return template


def _template_io(step: Step, role: str) -> dict[str, Any]:
    """Inputs, the step's figures as outputs, and pod labels that find a step's pods by role and iteration."""
    labels = {f"{LABEL}/step": step.name, ROLE_LABEL: role}
    if "iteration" in step.params:
        labels[f"{LABEL}/iteration"] = "{{inputs.parameters.iteration}}"
    io: dict[str, Any] = {"metadata": {"labels": labels}}
    if step.params:
        io["inputs"] = {"parameters": [{"name": p} for p in step.params]}
    if step.outputs:
        # plan's outputs steer the DAG: missing, the chunk must fail. A step's figures may be absent (skipped work).
        default = {} if step is PLAN else {"default": MISSING_OUTPUT}
        io["outputs"] = {
            "parameters": [
                {"name": name, "valueFrom": {"path": f"{OUTPUTS_DIR}/{name}", **default}} for name in step.outputs
            ]
        }
    return io


# Retry a shard whose pod was lost (status Error: node shutdown, pod deleted) or stopped by a signal (exit 143:
# SIGTERM on a Spot reclaim; 137: SIGKILL after the grace period). A step's own error (exit 1, 2) is final.
SPOT_RETRY_EXPRESSION = 'lastRetry.status == "Error" || asInt(lastRetry.exitCode) in [137, 143]'


def _spot_retry(config: MoeloopConfig) -> dict[str, Any]:
    retry = config.cluster.spot_retry
    return {
        "limit": retry.limit,
        "retryPolicy": "Always",
        "expression": SPOT_RETRY_EXPRESSION,
        "backoff": {
            "duration": f"{retry.backoff_seconds}s",
            "factor": retry.backoff_factor,
            "cap": f"{retry.max_backoff_seconds}s",
        },
    }


# ---------------------------------------------------------------------------------------------
# Multi-node training: a JobSet of `cluster.train_nodes` pods, torchrun rendezvous over its headless service


JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOBSET_REPLICATED_JOB = "node"


def render_jobset(config: MoeloopConfig) -> dict[str, Any]:
    """The JobSet the multi-node train task creates; Argo fills its {{...}} placeholders."""
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


def _jobset_train_template(config: MoeloopConfig) -> dict[str, Any]:
    io = _template_io(TRAIN, TRAIN.role)
    io.pop("outputs")  # the figures stay in the JobSet's pods (and reports/iter-N/train.json)
    return {
        "name": TRAIN.name,
        **io,
        **_orchestrator_pod(config),
        "resource": {
            "action": "create",
            "setOwnerReference": True,  # deleted with the Workflow
            "manifest": yaml.safe_dump(render_jobset(config), sort_keys=False),
            "successCondition": "status.terminalState == Completed",
            "failureCondition": "status.terminalState == Failed",
        },
    }


def _orchestrator_pod(config: MoeloopConfig) -> dict[str, Any]:
    """Resource templates run Argo's executor on CPU nodes, as the orchestrator, under `restricted`."""
    pod = _pod_placement(config, "cpu")
    pod["serviceAccountName"] = config.cluster.orchestrator_service_account
    return pod


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


def _dag_task(task: Task, **fields: Any) -> dict[str, Any]:
    arguments = [{"name": p, "value": v} for p, v in task.arguments]
    dag_task: dict[str, Any] = {"name": task.name, "template": task.step.name}
    if arguments:
        dag_task["arguments"] = {"parameters": arguments}
    if task.dependencies:
        dag_task["dependencies"] = list(task.dependencies)
    return dag_task | fields


def _slot_task(task: Task) -> dict[str, Any]:
    dag_task = _dag_task(task, when=_counted(task.iteration))
    for parameter in dag_task["arguments"]["parameters"]:
        if parameter["name"] == "iteration":
            parameter["value"] = slot_iteration(task.iteration)
    return dag_task


def _chunk_dag(config: MoeloopConfig) -> dict[str, Any]:
    start = Task(START.name, START, 0, (("iteration", "0"),), ())
    plan = Task(PLAN.name, PLAN, 0, (("chunk", str(chunk_size(config))),), (START.name,))
    latest = Task("eval-latest", EVALUATE, 0, (("iteration", f"{{{{{PLAN_OUTPUTS}.latest}}}}"),), (PLAN.name,))
    slots = chunk_tasks(config)
    return {
        "name": ENTRYPOINT,
        "dag": {
            "tasks": [
                _dag_task(start),
                _dag_task(plan),
                _dag_task(latest, when=f"{{{{{PLAN_OUTPUTS}.evaluate}}}} == true"),
                {
                    "name": "label",
                    "template": "label",
                    "arguments": {"parameters": [{"name": k, "value": v} for k, v in LABEL_INPUTS.items()]},
                    "dependencies": [PLAN.name],
                    "when": _counted(1),
                },
                *(_slot_task(task) for task in slots),
                {
                    "name": "next-chunk",
                    "template": "next-chunk",
                    "dependencies": [f"slot{slots[-1].iteration}-eval"],
                    "when": f"{{{{{PLAN_OUTPUTS}.more}}}} == true && {{{{workflow.parameters.chain}}}} == true",
                },
            ]
        },
    }


def _label_template(config: MoeloopConfig) -> dict[str, Any]:
    """Labels the running Workflow with the iterations plan chose, so the UI finds a run's chunk by iteration."""
    patch = {
        "apiVersion": API_VERSION,
        "kind": "Workflow",
        "metadata": {
            "name": "{{workflow.name}}",
            "labels": {f"{LABEL}/{name}-iteration": f"{{{{inputs.parameters.{name}}}}}" for name in LABEL_INPUTS},
        },
    }
    return {
        "name": "label",
        "inputs": {"parameters": [{"name": name} for name in LABEL_INPUTS]},
        **_orchestrator_pod(config),
        "resource": {"action": "patch", "mergeStrategy": "merge", "manifest": yaml.safe_dump(patch, sort_keys=False)},
    }


def next_chunk_manifest(config: MoeloopConfig) -> str:
    """The next chunk's Workflow, with this Workflow's parameters. Argo substitutes {{...}} into the text
    before parsing it; each value is a block scalar, so a URI or the config's JSON needs no YAML quoting."""
    arguments = "".join(
        f"    - name: {name}\n      value: |-\n        {{{{workflow.parameters.{name}}}}}\n" for name in PARAMETERS
    )
    return (
        f"apiVersion: {API_VERSION}\n"
        "kind: Workflow\n"
        "metadata:\n"
        f"  generateName: {config.run_name}-\n"
        "  labels:\n"
        + "".join(f"    {key}: {value}\n" for key, value in _run_labels(config).items())
        + f"    {LABEL}/chained-from: '{{{{workflow.name}}}}'\n"
        "spec:\n"
        "  workflowTemplateRef:\n"
        f"    name: {template_name(config)}\n"
        "  arguments:\n"
        "    parameters:\n" + arguments
    )


def _next_chunk_template(config: MoeloopConfig) -> dict[str, Any]:
    return {
        "name": "next-chunk",
        **_orchestrator_pod(config),
        # No owner reference: the next chunk outlives this Workflow (and its garbage collection).
        "resource": {"action": "create", "manifest": next_chunk_manifest(config)},
    }


# ---------------------------------------------------------------------------------------------
# Documents


PARAMETERS = ("run", "iterations", "model", "chain", "config")


def _run_labels(config: MoeloopConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": "moeloop", f"{LABEL}/run": config.run_name}


def _arguments(config: MoeloopConfig, run_uri: str, chain: bool) -> dict[str, str]:
    return {**run_values(portable_config(config), run_uri), "chain": json.dumps(chain)}


def _metadata(config: MoeloopConfig, **name: str) -> dict[str, Any]:
    return {**name, "namespace": config.cluster.namespace, "labels": _run_labels(config)}


def render_workflow_template(config: MoeloopConfig, run_uri: str) -> dict[str, Any]:
    values = _arguments(config, run_uri, chain=True)
    parameters = []
    for name in PARAMETERS:
        # `value` is what the controller substitutes; `default` is what the UI's submit form pre-fills.
        parameter = {"name": name, "value": values[name], "default": values[name]}
        parameter["description"] = PARAMETER_DESCRIPTIONS[name]
        if name == "chain":
            parameter["enum"] = ["true", "false"]
        parameters.append(parameter)
    templates = [
        _chunk_dag(config),
        *(_step_template(step, config) for step in STEPS),
        _label_template(config),
        _next_chunk_template(config),
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": "WorkflowTemplate",
        "metadata": _metadata(config, name=template_name(config)),
        "spec": {
            "entrypoint": ENTRYPOINT,
            "serviceAccountName": config.cluster.orchestrator_service_account,
            "arguments": {"parameters": parameters},
            # One chunk of a run at a time, whoever submitted it: a chained chunk waits for its predecessor.
            "synchronization": {"mutexes": [{"name": f"moeloop-run-{config.run_name}"}]},
            "workflowMetadata": {"labels": _run_labels(config)},
            "podMetadata": {"labels": {f"{LABEL}/run": config.run_name}},
            "templates": templates,
        },
    }


def _referring_spec(config: MoeloopConfig, run_uri: str, chain: bool) -> dict[str, Any]:
    values = _arguments(config, run_uri, chain)
    return {
        "workflowTemplateRef": {"name": template_name(config)},
        "arguments": {"parameters": [{"name": name, "value": values[name]} for name in PARAMETERS]},
    }


def render_workflow(config: MoeloopConfig, run_uri: str, iterations: int | None = None) -> dict[str, Any]:
    """An ad-hoc run: the template's chunk, chained until the target (the template must be registered)."""
    config = with_target(config, iterations)
    return {
        "apiVersion": API_VERSION,
        "kind": "Workflow",
        "metadata": _metadata(config, generateName=f"{config.run_name}-"),
        "spec": _referring_spec(config, run_uri, chain=True),
    }


def render_cron_workflow(config: MoeloopConfig, run_uri: str) -> dict[str, Any]:
    """Each tick runs one chunk from LATEST (no chaining: the schedule is the chain); at the target a tick
    runs start and plan only and succeeds. Forbid: no tick while the previous one runs."""
    schedule = config.cluster.schedule
    return {
        "apiVersion": API_VERSION,
        "kind": "CronWorkflow",
        "metadata": _metadata(config, name=template_name(config)),
        "spec": {
            "schedules": list(schedule.schedules),
            "timezone": schedule.timezone,
            "concurrencyPolicy": "Forbid",
            "startingDeadlineSeconds": 300,
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            # The run's labels come from the template's workflowMetadata (Hera's CronWorkflow drops its own).
            "workflowSpec": _referring_spec(config, run_uri, chain=False),
        },
    }


def with_target(config: MoeloopConfig, iterations: int | None) -> MoeloopConfig:
    return config if iterations is None else config.model_copy(update={"iterations": iterations})


def render(config: MoeloopConfig, run_uri: str, iterations: int | None = None) -> dict[str, dict]:
    """Every object of the run, by file name. `iterations` sets the target (the chunks do not depend on it)."""
    config = with_target(config, iterations)
    return {
        "workflow-template.yaml": render_workflow_template(config, run_uri),
        "workflow.yaml": render_workflow(config, run_uri),
        "cron-workflow.yaml": render_cron_workflow(config, run_uri),
    }


def write_rendered(documents: dict[str, dict], out_dir: Path) -> list[Path]:
    """Lint every document (templateRefs across them) and check its size, then write each as YAML;
    one invalid document means nothing is written."""
    errors = lint_documents(documents.values(), source=str(out_dir))
    if errors:
        raise MoeloopError(f"refusing to write an invalid manifest: {errors[0]}")
    for file_name, document in documents.items():
        size = object_bytes(document)
        if size > MAX_OBJECT_BYTES:
            raise MoeloopError(f"{file_name}: {size} bytes is over the {MAX_OBJECT_BYTES}-byte object limit")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_write_atomically(out_dir / file_name, document) for file_name, document in documents.items()]


def object_bytes(document: dict) -> int:
    """The object's size as the API server stores it (JSON)."""
    return len(json.dumps(document, separators=(",", ":")).encode())


def _write_atomically(path: Path, document: dict) -> Path:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as stream:
            yaml.dump(document, stream, Dumper=YAML_DUMPER, sort_keys=False)
        os.chmod(temporary, 0o644)  # mkstemp makes it owner-only; a manifest is meant to be read by others
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def dag_tasks(document: dict) -> dict[str, tuple[str, ...]]:
    """Task name -> sorted dependencies of the entrypoint DAG of a rendered WorkflowTemplate."""
    spec = document["spec"]
    dag = next(template["dag"] for template in spec["templates"] if template["name"] == spec["entrypoint"])
    return {task["name"]: tuple(sorted(task.get("dependencies", ()))) for task in dag["tasks"]}
