"""The policy's handoff by delta against the full checkpoint, at Qwen3-30B-A3B's shapes, on SeaweedFS.

    .venv/bin/python -m benchmarks.delta_handoff [--layers 1 5] [--changed 0.015] [--smoke]

Starts its own SeaweedFS on loopback (tests/seaweed.py). For each size, a model of Qwen3-30B-A3B's real shapes with
that many decoder layers (benchmarks/handoff.py: 1 layer is a 2.5 GB bf16 checkpoint, 5 layers 7.5 GB): checkpoint 0
random in bf16, and checkpoint 1 the same with --changed of its elements moved by one bf16 step (what an RL update
at learning rate 1e-6 changes: benchmarks/changed_fraction.py), both in publish's layout (HF names, sharded
safetensors of 4 GiB). Both the full path and the delta path run in the same run, on the same bytes:

- publish: the full path commits checkpoint 1 (its upload and COMMIT); the delta path is what publish adds for it,
  the base (checkpoint 0) fetched into its cache and `moeloop.steps.storage.deltas.commit_delta` (compare, digest,
  write, upload, COMMIT);
- a rollout engine holding checkpoint 0 (transformers, bf16, on the CPU): the full path fetches checkpoint 1 into
  its cache, verified, and loads it in place (`load_weights`); the delta path is
  `moeloop.steps.engines.versions.engine_at`: the delta fetched and verified, written into the weights in place,
  and the weights' digest read back and checked. Its in-place write and its digest check are also timed alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402

from benchmarks.handoff import parameter_shapes, qwen3_30b_a3b_shapes, timed  # noqa: E402
from moeloop.steps.config import load_config
from moeloop.steps.engines.engine import release_engine
from moeloop.steps.engines.versions import engine_at
from moeloop.steps.model.delta import CheckpointTensors, DeltaFile
from moeloop.steps.model.hf_shards import StoredTensor, plan_shards, shard_names, write_index
from moeloop.steps.model.policy import build_tokenizer
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.deltas import commit_delta, delta_files, fetch_delta
from moeloop.steps.storage.run import RunStorage
from tests.conftest import REPO
from tests.seaweed import start_seaweed

GB = 1e9
SHARD_BYTES = 4 << 30


def hf_tensors(config) -> list[StoredTensor]:  # noqa: ANN001 - a transformers config
    """The checkpoint's tensors as publish stores them: per-expert projections, everything in bf16."""
    blocks = {f"model.layers.{layer}.mlp": None for layer in range(config.num_hidden_layers)}
    tensors = []
    for key, shape in parameter_shapes(config).items():
        block = key.split(".experts.")[0] if ".experts." in key else None
        if block in blocks:
            per_expert = shape[1] // (2 if key.endswith("gate_up_proj") else 1)
            names = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
            tensors += [StoredTensor(f"{block}.experts.{e}.{name}.weight", (per_expert, *shape[2:]), torch.bfloat16)
                        for e in range(shape[0]) for name in names]  # fmt: skip
        else:
            tensors.append(StoredTensor(key, shape, torch.bfloat16))
    return tensors


def moved_one_step(tensor: torch.Tensor, changed: float, generator: torch.Generator) -> torch.Tensor:
    """A bf16 tensor with `changed` of its elements (drawn from generator) moved one bf16 step away from zero: what
    an RL update at a small learning rate mostly does. Zeros and the smallest magnitudes stay."""
    bits = tensor.view(torch.int16)
    moved = (torch.rand(bits.shape, generator=generator, device=bits.device) < changed) & ((bits & 0x7FFF) > 1)
    return torch.where(moved, bits + torch.where(bits > 0, 1, -1).to(torch.int16), bits).view(torch.bfloat16)


def write_version(folder: Path, config, base: Path | None, changed: float) -> None:  # noqa: ANN001
    """Checkpoint 0 (base None: random) or the next (base's elements, changed of them one bf16 step away), a shard
    at a time in memory."""
    tensors = {t.name: [t] for t in hf_tensors(config)}
    shards = plan_shards(tensors, SHARD_BYTES)
    names = shard_names(len(shards))
    generator = torch.Generator().manual_seed(1 if base is None else 2)
    previous = CheckpointTensors(base) if base is not None else None
    folder.mkdir(parents=True)
    for name, keys in zip(names, shards, strict=True):
        state = {}
        for key in keys:
            if previous is None:
                state[key] = (0.02 * torch.randn(tensors[key][0].shape, generator=generator)).to(torch.bfloat16)
                continue
            state[key] = moved_one_step(previous[key], changed, generator)
        save_file(state, folder / name, metadata={"format": "pt"})
    write_index(folder, names, [[tensors[key][0] for key in keys] for keys in shards])
    config.save_pretrained(folder)
    build_tokenizer(["0123456789abcdef"]).save_pretrained(folder)


def measure(
    storage: RunStorage, work: Path, config, changed: float  # noqa: ANN001 - a transformers config
) -> list[tuple[str, float, float, str]]:
    """(stage, full path seconds, delta path seconds, note) rows."""
    write_version(work / "v0", config, None, changed)
    storage.commit_folder(storage.checkpoint(0), work / "v0", extra={"iteration": 0})
    write_version(work / "v1", config, work / "v0", changed)
    shutil.rmtree(work / "v0")
    size = sum(p.stat().st_size for p in (work / "v1").glob("*.safetensors"))

    started = time.perf_counter()
    base = fetch_checkpoint(storage, 0)
    base_fetch = time.perf_counter() - started
    new = CheckpointTensors(work / "v1")
    report = commit_delta(storage, 1, CheckpointTensors(base), new, work / "v1" / "config.json")
    delta_publish = time.perf_counter() - started
    extra = {"iteration": 1, "weights_digest": report["weights_digest"]}  # as publish commits it
    commit = timed(lambda: storage.commit_folder(storage.checkpoint(1), work / "v1", extra=extra))
    shutil.rmtree(work / "v1")
    rows = [("publish: checkpoint commit / base fetch + delta commit", commit, delta_publish,
             f"{size / GB:.2f} GB checkpoint; base fetch {base_fetch:.1f} s; delta {report['delta_bytes'] / GB:.3f}"
             f" GB, {report['delta_changed_fraction']:.2%} of elements changed")]  # fmt: skip

    rollout = load_config(REPO / "configs" / "tiny.yaml").rollout
    rollout = rollout.model_copy(update={"engine": "transformers", "transformers_dtype": "bfloat16"})
    engine, _ = engine_at(storage, 0, rollout)  # the engine holding version 0, built untimed
    started = time.perf_counter()
    folder = fetch_checkpoint(storage, 1)
    fetch = time.perf_counter() - started
    load = timed(lambda: engine.load_weights(folder))
    shutil.rmtree(folder)
    engine.load_weights(base)
    engine_at(storage, 0, rollout)  # held again at version 0, its digest checked
    _, delta = engine_at(storage, 1, rollout)
    assert delta["policy_update"] == "delta", delta
    rows.append(("rollout engine: fetch / delta fetch", fetch, delta["fetch_seconds"],
                 f"{delta['fetched_bytes'] / GB:.3f} GB of delta, verified, file by file beside the writes;"
                 f" waited for {delta['fetch_wait_seconds']:.2f} s"))  # fmt: skip
    rows.append(("rollout engine: load in place / apply + digest check", load, delta["engine_seconds"],
                 "transformers, bf16, CPU; the move's time less its wait for the fetch"))  # fmt: skip
    engine.load_weights(base)
    engine.map_weights(base)
    _, files = delta_files(storage, 1)
    paths = fetch_delta(storage, 1, files, work / "delta")
    apply = timed(lambda: engine.apply_delta(paths))
    digest = timed(engine.weight_digests)
    changed_elements = sum(changed.size for path in paths for changed in DeltaFile(path).changed)
    rows.append(("rollout engine: the in-place write alone / the digest check alone", apply, digest,
                 f"{changed_elements:,} elements written"))  # fmt: skip
    release_engine()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--changed", type=float, default=0.015, help="the share of elements checkpoint 1 changes")
    args = smoke.parse_args(parser, layers=[2])  # --smoke: Qwen3-30B-A3B's structure at toy sizes
    load_before = os.getloadavg()[0]
    results = []
    for layers in args.layers:
        config = qwen3_30b_a3b_shapes(layers, tiny=args.smoke)
        work = Path(tempfile.mkdtemp(prefix="moeloop-delta-handoff-"))
        server = start_seaweed(work / "seaweedfs")
        os.environ.update(server.environment() | {"MOELOOP_CACHE": str(work / "cache")})
        try:
            storage = RunStorage(f"s3://{server.bucket}/delta-{layers}")
            run_config = load_config(REPO / "configs" / "tiny.yaml").model_dump(mode="json") | {"run_name": "delta"}
            storage.write_bytes(RunStorage.CONFIG, yaml.safe_dump(run_config).encode())
            results += [(layers, row) for row in measure(storage, work, config, args.changed)]
        finally:
            server.stop()
            shutil.rmtree(work, ignore_errors=True)
    print(f"delta handoff on SeaweedFS over loopback, Qwen3-30B-A3B shapes, {os.cpu_count()} cores, {args.changed:.1%}"
          f" of elements changed, 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("| layers | stage: full path / delta path | full s | delta s | delta / full | notes |")
    print("|---:|---|---:|---:|---:|---|")
    for layers, (stage, full, delta, note) in results:
        print(f"| {layers} | {stage} | {full:.2f} | {delta:.2f} | {delta / max(full, 1e-9):.2f} | {note} |")


if __name__ == "__main__":
    main()
