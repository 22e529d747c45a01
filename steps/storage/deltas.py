"""A policy version's delta folder in the run, `deltas/iter-NNNNNN/`, committed beside its checkpoint: the record of
the version's weights (`digests.json`: every tensor's digest, the weights' digest and its base's, how much changed),
the checkpoint's `config.json` and, where it is smaller than the checkpoint, the delta from version N-1
(`delta-*.safetensors`, `moeloop.steps.model.delta`). Publish commits it before the checkpoint (`commit_policy`);
a trainer that lives for a chunk commits it before it answers the train step, each of its ranks the delta of the
checkpoint files it wrote, and the checkpoint after, in the background (`commit_policy_delta`, `commit_checkpoint`).
Rollout engines read it to move from the version they hold to the next (`moeloop.steps.engines.versions`), before
that version's checkpoint is committed if it is not yet.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.delta import CheckpointTensors, DeltaSummary, write_delta
from moeloop.steps.storage.cache import local_scratch
from moeloop.steps.storage.ranks import all_gather, commit_from_ranks, leads
from moeloop.steps.storage.reports import write_report
from moeloop.steps.storage.run import RunStorage

if TYPE_CHECKING:
    from moeloop.steps.rl.parallel import Parallel

RECORD = "digests.json"
ARCHITECTURE = "config.json"


def commit_delta(
    storage: RunStorage,
    iteration: int,
    base: Mapping[str, torch.Tensor] | None,
    new: CheckpointTensors,
    architecture: Path,
    parallel: Parallel | None = None,
) -> dict[str, Any]:
    """Write and commit deltas/iter-N for checkpoint N (new: its tensors, or this rank's share of them; architecture:
    its config.json, which an engine taking the delta before the checkpoint is committed is keyed by) against
    checkpoint N-1 (base; None or of other tensors: the record alone). The delta is left out where it is no smaller
    than the checkpoint: an engine then fetches that. Safe to re-run: the same versions write the same bytes.
    Returns what it measured, and the weights' digest, which checkpoint N's COMMIT records (`weights_digest` in its
    extra): the digest an engine checks its weights against, whatever delta brought them. parallel: the ranks that
    share the checkpoint's tensors between them, each writing the delta of its own (collective); None: one process."""
    started = time.perf_counter()
    with local_scratch() as scratch:
        known = recorded_digests(storage, iteration - 1) if base is not None else None  # not hashed again
        try:
            summary, other_model = write_delta(base, new, scratch, new.files, known), None
        except ValueError as error:  # another model (a starting checkpoint stored otherwise): no delta
            for partial in scratch.glob("delta-*.safetensors"):
                partial.unlink()
            summary, other_model = write_delta(None, new, scratch, new.files), str(error)
        parts = all_gather((summary, other_model), parallel)
        summary = DeltaSummary.merged([part for part, _ in parts])
        why = next((reason for _, reason in parts if reason is not None), None)
        if why is not None:  # on any rank: the delta is none of the ranks'
            summary = dataclasses.replace(summary, base_digests={}, changed=0, delta_bytes=0)
        elif summary.delta_bytes >= summary.checkpoint_bytes:
            why = "no smaller than the checkpoint"
        if why is not None:
            for delta in scratch.glob("delta-*.safetensors"):
                delta.unlink()
        record = summary.record(iteration - 1, iteration)
        if leads(parallel):
            (scratch / RECORD).write_text(json.dumps(record, sort_keys=True) + "\n")
            shutil.copyfile(architecture, scratch / ARCHITECTURE)
        extra = {"iteration": iteration, "weights_digest": record["digest"]}  # as the checkpoint's COMMIT records it
        commit_from_ranks(storage, storage.delta(iteration), scratch, parallel, extra)
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


def recorded_digests(storage: RunStorage, version: int) -> dict[str, str] | None:
    """The tensor digests the version's delta record holds, where it is committed and whole and agrees with its
    checkpoint's COMMIT; else None."""
    try:
        found = delta_files(storage, version)
        recorded = storage.manifest(storage.checkpoint(version)).get("weights_digest")
    except MoeloopError:
        return None
    if found is None or found[0]["digest"] != recorded:
        return None
    return found[0]["tensors"]


def fetch_delta(storage: RunStorage, iteration: int, files: dict[str, dict[str, Any]], target: Path) -> list[Path]:
    """Version N's delta files into target, each verified against its COMMIT entry, in order."""
    storage.fetch_files(storage.delta(iteration), files, target)
    return [target / name for name in sorted(files)]


def commit_policy(
    storage: RunStorage, iteration: int, policy: Path, critic: Path | None, base: Path, started: float
) -> dict[str, Any]:
    """Commit checkpoint N (the HF folder policy; PPO: its critic's beside it) with deltas/iter-N against checkpoint
    N-1 (base, an HF folder) first, and publish's report: what publish does once it has the checkpoint. LATEST is
    publish's to move."""
    report = commit_policy_delta(storage, iteration, policy, base, started)
    commit_checkpoint(storage, iteration, policy, critic, report["weights_digest"])
    return report


def commit_policy_delta(
    storage: RunStorage,
    iteration: int,
    policy: Path,
    base: Path,
    started: float,
    parallel: Parallel | None = None,
    mine: Collection[str] | None = None,
) -> dict[str, Any]:
    """Commit deltas/iter-N of checkpoint N (the HF folder policy) against checkpoint N-1 (base) and write publish's
    report: the first half of `commit_policy`, which a trainer that lives for a chunk (steps/rl/held.py) runs on
    each rank for its share (mine: the HF tensors it wrote, whose files its folders hold) before it answers the train
    step. The report, with the weights' digest that checkpoint N's COMMIT records."""
    new = CheckpointTensors(policy, mine)
    delta = commit_delta(storage, iteration, CheckpointTensors(base, mine), new, policy / ARCHITECTURE, parallel)
    report = {"seconds": round(time.perf_counter() - started, 3), **delta}
    if leads(parallel):
        write_report(storage, iteration, "publish", report)
    return report


def commit_checkpoint(
    storage: RunStorage,
    iteration: int,
    policy: Path,
    critic: Path | None,
    weights_digest: str,
    parallel: Parallel | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Commit checkpoint N (PPO: its critic first, so that a committed policy always has its critic beside it), its
    COMMIT recording the weights' digest: the second half of `commit_policy`; a chunk's trainer runs it in the
    background, over a process group of its own (group), each rank its share (`uploads`)."""
    extra = {"iteration": iteration}
    if critic is not None:
        names = uploads(critic, parallel)
        commit_from_ranks(storage, storage.critic(iteration), critic, parallel, extra, group, names)
    extra |= {"weights_digest": weights_digest}
    commit_from_ranks(storage, storage.checkpoint(iteration), policy, parallel, extra, group, uploads(policy, parallel))


def uploads(folder: Path, parallel: Parallel | None) -> set[str] | None:
    """The files of a checkpoint folder that this rank commits: the tensor files it holds (those it wrote), and rank
    0 all the others (config, tokenizer, index), which every rank writes. None: all it holds (one process, rank 0)."""
    if leads(parallel):
        return None
    return {path.name for path in folder.iterdir() if path.suffix == ".safetensors"}
