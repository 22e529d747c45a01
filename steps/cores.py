"""How many cores a step may keep busy: its CPU affinity (a container's cpuset), and within it its cgroup's CPU quota
(a Kubernetes pod's `limits.cpu`, or a namespace LimitRange's default). The kernel enforces a quota by throttling,
not by hiding cores: a pod limited to 8 CPUs still sees a p5en node's 192 in its affinity and `os.cpu_count()`, and
threads sized to those would spend the quota in a fraction of each period and then wait out the rest."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")  # a container's own cgroup, in its cgroup namespace


def cpu_quota(root: Path = CGROUP) -> float | None:
    """The cgroup's CPU quota in cores: cgroup v2's cpu.max, else v1's cpu.cfs_quota_us over cpu.cfs_period_us. None
    where it sets none ("max", -1) or has none to read."""
    try:
        if (root / "cpu.max").exists():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cores(root: Path = CGROUP) -> int:
    """The cores in this process's affinity, at most its cgroup's CPU quota rounded up; at least 1."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota(root)
    return max(1, min(affinity, math.ceil(quota)) if quota is not None else affinity)
