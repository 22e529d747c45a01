"""The config's `cluster` section: where and as what each role's pods run on Argo (workflows/render/ reads it).
Part of the one typed config (steps/config.py), kept apart for its size."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from moeloop.steps.config_base import Strict


class Resources(Strict):
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}


class Toleration(Strict):
    key: str
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


ROLES = ("rollout", "reward", "train", "cpu", "memory")


class RolePlacement(Strict):
    """Where a role's pods run and as what. None takes the role's default (workflows/render/placement.py:role_defaults),
    which matches manifests/: nodes labelled and tainted `moeloop.dev/role=<role>`, service account
    `moeloop-<role>`, the role's image."""

    image: str | None = None
    service_account: str | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[Toleration] | None = None
    resources: Resources | None = None
    env: dict[str, str] | None = None
    shm_size: str | None = None  # a memory-backed /dev/shm of this size; "" for none
    priority_class: str | None = None  # a PriorityClass of manifests/ (moeloop-<role>): who is preempted first


class SpotRetry(Strict):
    """Argo retries of a rollout shard whose Spot node was reclaimed (pod error, SIGTERM or SIGKILL)."""

    limit: int = Field(10, ge=0)
    backoff_seconds: int = Field(30, gt=0)
    backoff_factor: int = Field(2, ge=1)
    max_backoff_seconds: int = Field(1800, gt=0)


class Schedule(Strict):
    """The CronWorkflow's schedules: each tick runs one chunk from LATEST, nothing once the target is reached."""

    schedules: list[str] = Field(["0 * * * *"], min_length=1)
    timezone: str = "UTC"


class ClusterConfig(Strict):
    namespace: str = "moeloop"
    # Images are <image_registry>/moeloop-{rollout,trainer,cpu}:<image_tag> unless a role names its own.
    image_registry: str = "ghcr.io/moeloop"
    image_tag: str = "0.1.0"
    # The workflow's own service account, also used by resource templates (next chunk, JobSet, labels).
    orchestrator_service_account: str = "moeloop-orchestrator"
    # Iterations per Workflow: a run of any length is a chain of Workflows of this many iterations.
    # None: 20, or fewer where rollout shards are many (workflows/render/chunk.py:chunk_size).
    chunk_iterations: int | None = Field(None, gt=0)
    # Pods of the multi-node trainer (a JobSet when > 1); trainer.world_size processes are split over them.
    train_nodes: int = Field(1, gt=0)
    schedule: Schedule = Schedule()
    # Where each role's pods go: rollout (Spot GPU), reward (GPU reward models), train (on-demand GPU, EFA),
    # cpu (start, plan, rule rewards, evaluate), memory (publish: checkpoint caching).
    rollout: RolePlacement = RolePlacement()
    reward: RolePlacement = RolePlacement()
    train: RolePlacement = RolePlacement()
    cpu: RolePlacement = RolePlacement()
    memory: RolePlacement = RolePlacement()
    spot_retry: SpotRetry = SpotRetry()
