"""A step's core count is its affinity within its cgroup's CPU quota, as a pod's `limits.cpu` sets it; cgroup
folders written here in the kernel's formats (v2's cpu.max, v1's cfs files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moeloop.steps.cores import cpu_quota, usable_cores


def cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "800000 100000"}, 8.0),
        ({"cpu.max": "150000 100000"}, 1.5),
        ({"cpu.max": "max 100000"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000", "cpu/cpu.cfs_period_us": "100000"}, 4.0),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({}, None),
        ({"cpu.max": "garbled"}, None),
    ],
)
def test_the_cgroups_quota_is_read_in_cores_from_either_version(
    tmp_path: Path, files: dict[str, str], quota: float | None
) -> None:
    assert cpu_quota(cgroup(tmp_path, files)) == quota


def test_the_usable_cores_are_the_affinitys_within_the_quota_rounded_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(192)))  # a p5en node, as a pod sees it
    assert usable_cores(cgroup(tmp_path / "limited", {"cpu.max": "800000 100000"})) == 8
    assert usable_cores(cgroup(tmp_path / "fraction", {"cpu.max": "150000 100000"})) == 2
    assert usable_cores(cgroup(tmp_path / "tiny", {"cpu.max": "10000 100000"})) == 1
    assert usable_cores(cgroup(tmp_path / "unlimited", {"cpu.max": "max 100000"})) == 192
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert usable_cores(cgroup(tmp_path / "wide", {"cpu.max": "800000 100000"})) == 2
