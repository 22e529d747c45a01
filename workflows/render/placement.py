"""Placement by role and pod security: where and as what each role's pods run.

A role's defaults are the contract with manifests/ (Karpenter NodePools, taints, service accounts, images); any
field of `cluster.<role>` replaces its default. The fields come out in Kubernetes' spelling (the JobSet's pods)
and as a Hera template's arguments.
"""

from __future__ import annotations

from typing import Any

from hera.workflows import models as m

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.config_cluster import Resources, RolePlacement, Toleration
from moeloop.workflows.render.images import role_image

LABEL = "moeloop.dev"

# The contract with manifests/ (Karpenter NodePools, service accounts, images).
ROLE_LABEL = f"{LABEL}/role"
GPU_TAINT = "nvidia.com/gpu"
GPU_ROLES = frozenset({"rollout", "reward", "train"})
IMAGE_USER = 1000  # the images' user `moeloop` (uid and gid 1000)
# Every container's root filesystem is read-only; what the steps and their libraries write goes to these emptyDirs:
# /tmp (scratch, $MOELOOP_CACHE, the outputs, torch's and DeepEP's JIT caches) and the images' $HOME (the caches of
# Hugging Face, vLLM and Triton under ~/.cache, W&B's and matplotlib's settings).
IMAGE_HOME = "/home/moeloop"
WRITABLE_PATHS = {"tmp": "/tmp", "home": IMAGE_HOME}
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


def role_defaults(config: MoeloopConfig, role: str) -> RolePlacement:
    """A role's placement when the config leaves it out: the manifests' node labels, taints and service accounts."""
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
        image=role_image(config, role),
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
    return config.trainer.world_size // config.cluster.train_nodes


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
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities, "readOnlyRootFilesystem": True}


def pod_volumes(role: str, where: RolePlacement) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): the writable paths, /dev/shm in memory for NCCL and vLLM workers, huge pages for EFA on
    the trainer."""
    volumes = [{"name": name, "emptyDir": {}} for name in WRITABLE_PATHS]
    mounts = [{"name": name, "mountPath": path} for name, path in WRITABLE_PATHS.items()]
    if where.shm_size:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": where.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if role == "train":
        volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages"}})
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    return volumes, mounts


def _resources(resources: Resources) -> dict[str, dict[str, str]]:
    return {key: value for key, value in (("requests", resources.requests), ("limits", resources.limits)) if value}


def pod_placement(config: MoeloopConfig, role: str) -> dict[str, Any]:
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


def template_placement(config: MoeloopConfig, role: str, service_account: str | None = None) -> dict[str, Any]:
    """The same fields as a Hera template's arguments."""
    pod = pod_placement(config, role)
    return {
        "service_account_name": service_account or pod.get("serviceAccountName"),
        "priority_class_name": pod.get("priorityClassName"),
        "node_selector": pod.get("nodeSelector"),
        "tolerations": [m.Toleration.model_validate(t) for t in pod.get("tolerations", ())] or None,
        "pod_security_context": m.PodSecurityContext.model_validate(pod["securityContext"]),
    }


def pod_container(config: MoeloopConfig, role: str, argv: list[str], extra_env: list[dict] = ()) -> dict[str, Any]:
    """The role's container running argv, in Kubernetes spelling (the JobSet's pods)."""
    where = placement(config, role)
    _, mounts = pod_volumes(role, where)
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


def orchestrator_pod(config: MoeloopConfig) -> dict[str, Any]:
    """Resource templates run Argo's executor on CPU nodes, as the orchestrator, under `restricted`."""
    return template_placement(config, "cpu", service_account=config.cluster.orchestrator_service_account)
