"""A run of bf16 policy versions for the delta tests: checkpoint 0 is the demo's tiny model, random and in bf16
(`model.checkpoint`, so start commits it as it is), and each later checkpoint the one before with a share of its
elements moved by one bf16 step, as an RL update at a low learning rate moves them; each committed with its delta
as publish commits it (`moeloop.steps.storage.deltas.commit_delta`), then LATEST moved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.model.delta import CheckpointTensors
from moeloop.steps.model.hf_shards import INDEX, shard_names
from moeloop.steps.model.policy import build_tiny_model, save_policy
from moeloop.steps.start import demo_tokenizer, start
from moeloop.steps.storage.prompts import task_prompt_sets
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.deltas import commit_delta
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import run_uri
from tests.conftest import small_config

CHANGED = 0.02  # of the elements, per version


def bf16_start(folder: Path, config: MoeloopConfig) -> Path:
    """The demo's tiny model (its tokenizer, its shape), random, saved in bf16."""
    tokenizer = demo_tokenizer(task_prompt_sets(config), config)
    model = build_tiny_model(config.model.tiny, tokenizer, seed=config.seed).to(torch.bfloat16)
    save_policy(model, tokenizer, folder)
    return folder


def next_version(previous: Path, target: Path, seed: int, files: int = 1) -> Path:
    """previous with CHANGED of its elements one bf16 step up or down (its other files as they are), its tensors (by
    name) in `files` safetensors files: one, or shards with an index, as publish writes a larger model's (checkpoint
    0 is one file: start saves the model it loads)."""
    shutil.copytree(previous, target)
    tensors = CheckpointTensors(previous)
    generator = torch.Generator().manual_seed(seed)
    moved = {}
    for name in sorted(tensors):
        bits = tensors[name].view(torch.int16).clone()
        # not at zero (one step down from +0.0 is a NaN's bits) nor next to the largest finite magnitude
        finite_nonzero = ((bits & 0x7FFF) > 1) & ((bits & 0x7FFF) < 0x7F7F)
        mask = (torch.rand(bits.shape, generator=generator) < CHANGED) & finite_nonzero
        steps = torch.where(torch.rand(bits.shape, generator=generator) < 0.5, -1, 1).to(torch.int16)
        moved[name] = torch.where(mask, bits + steps, bits).view(torch.bfloat16)
    for stale in [*target.glob("*.safetensors"), target / INDEX]:
        stale.unlink(missing_ok=True)
    names = sorted(moved)
    file_of = {name: shard_names(files)[index * files // len(names)] for index, name in enumerate(names)}
    for file in sorted(set(file_of.values())):
        save_file({name: moved[name] for name in names if file_of[name] == file}, target / file, {"format": "pt"})
    if files > 1:
        (target / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": file_of}))
    return target


def bf16_run(
    root: Path, versions: int, iterations: int | None = None, files: int = 1, **sections: dict
) -> tuple[str, MoeloopConfig]:
    """A started run (of iterations, by default versions + 1) with checkpoints 0..versions, each but 0 committed
    with its delta; each but 0 in `files` safetensors files, its delta in as many."""
    config = small_config(iterations=iterations or versions + 1, **sections)
    folder = bf16_start(root / "start-model", config)
    config = config.model_copy(update={"model": config.model.model_copy(update={"checkpoint": str(folder)})})
    uri = run_uri(config, str(root / "runs"))
    start(uri, config)
    storage = RunStorage(uri)
    for version in range(1, versions + 1):
        base = fetch_checkpoint(storage, version - 1)
        new = next_version(base, root / f"version-{version}", seed=version, files=files)
        delta = commit_delta(storage, version, CheckpointTensors(base), CheckpointTensors(new), new / "config.json")
        extra = {"iteration": version, "weights_digest": delta["weights_digest"]}
        storage.commit_folder(storage.checkpoint(version), new, extra=extra)
        storage.move_latest(version)
    return uri, config
