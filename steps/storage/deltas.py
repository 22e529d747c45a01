"""A policy version's delta folder in the run, `deltas/iter-NNNNNN/`, committed beside its checkpoint: the record of
the version's weights (`digests.json`: every tensor's digest, the weights' digest and its base's, how much changed)
and, where it is smaller than the checkpoint, the delta from version N-1 (`delta-*.safetensors`,
`moeloop.steps.model.delta`). Publish commits it before the checkpoint (`commit_policy`, which a trainer that lives
for a chunk calls too); rollout engines read it to move from the version they hold to the next
(`moeloop.steps.engines.versions`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from moeloop.steps.model.delta import CheckpointTensors, write_delta
from moeloop.steps.storage.cache import local_scratch
from moeloop.steps.storage.reports import write_report
from moeloop.steps.storage.run import RunStorage

RECORD = "digests.json"


def commit_delta(
    storage: RunStorage,
    iteration: int,
    base: Mapping[str, torch.Tensor] | None,
    new: Mapping[str, torch.Tensor],
    max_file_bytes: int,
) -> dict[str, Any]:
    """Write and commit deltas/iter-N for checkpoint N (new: its tensors by name) against checkpoint N-1 (base; None
    or of other tensors: the record alone). The delta is left out where it is no smaller than the checkpoint: an
    engine then fetches that. Safe to re-run: the same versions write the same bytes. Returns what it measured, and
    the weights' digest, which checkpoint N's COMMIT records (`weights_digest` in its extra): the digest an engine
    checks its weights against, whatever delta brought them."""
    started = time.perf_counter()
    with local_scratch() as scratch:
        try:
            summary = write_delta(base, new, scratch, max_file_bytes)
        except ValueError as error:  # another model (a starting checkpoint stored otherwise): no delta
            for partial in scratch.glob("delta-*.safetensors"):
                partial.unlink()
            summary, why = write_delta(None, new, scratch, max_file_bytes), str(error)
        else:
            why = None if summary.delta_bytes < summary.checkpoint_bytes else "no smaller than the checkpoint"
        if why is not None:
            for delta in scratch.glob("delta-*.safetensors"):
                delta.unlink()
        record = summary.record(iteration - 1, iteration)
        (scratch / RECORD).write_text(json.dumps(record, sort_keys=True) + "\n")
        storage.commit_folder(storage.delta(iteration), scratch, extra={"iteration": iteration})
    report = {
        "weights_digest": record["digest"],  # for checkpoint N's COMMIT: what an engine holding it must read back
        "delta_changed_fraction": round(summary.changed / max(summary.elements, 1), 6),
        "delta_bytes": summary.delta_bytes if why is None else 0,
        "delta_seconds": round(time.perf_counter() - started, 3),
    }
    return report if why is None else report | {"delta_left_out": why}


def delta_files(storage: RunStorage, iteration: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
    """The record of version N's weights and its delta's files (their COMMIT entries; none where publish left the
    delta out), or None where its delta folder is not committed. A damaged folder is an error (MoeloopError)."""
    folder = storage.delta(iteration)
    manifest = storage.manifest(folder)
    if manifest is None:
        return None
    record = json.loads(storage.read_committed(folder, manifest, [RECORD])[RECORD])
    files = {name: entry for name, entry in manifest["files"].items() if name.startswith("delta-")}
    return record, files


def fetch_delta(storage: RunStorage, iteration: int, files: dict[str, dict[str, Any]], target: Path) -> list[Path]:
    """Version N's delta files into target, each verified against its COMMIT entry, in order."""
    storage.fetch_files(storage.delta(iteration), files, target)
    return [target / name for name in sorted(files)]


def commit_policy(
    storage: RunStorage, iteration: int, policy: Path, critic: Path | None, base: Path, shard_bytes: int, started: float
) -> dict[str, Any]:
    """Commit checkpoint N (the HF folder policy; PPO: its critic's beside it) with deltas/iter-N against checkpoint
    N-1 (base, an HF folder) first, and publish's report: what publish does once it has the checkpoint, and what a
    trainer that lives for a chunk does with the checkpoint it writes from memory (steps/rl/held.py). LATEST is
    publish's to move."""
    delta = commit_delta(storage, iteration, CheckpointTensors(base), CheckpointTensors(policy), shard_bytes)
    report = {"seconds": round(time.perf_counter() - started, 3), **delta}
    write_report(storage, iteration, "publish", report)
    if critic is not None:
        storage.commit_folder(storage.critic(iteration), critic, extra={"iteration": iteration})
    extra = {"iteration": iteration, "weights_digest": delta["weights_digest"]}
    storage.commit_folder(storage.checkpoint(iteration), policy, extra=extra)
    return report
