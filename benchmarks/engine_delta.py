"""A rollout engine taking the next policy by its delta, on the device its weights live on, at Qwen3-30B-A3B's full
shapes (48 decoder layers, 61 GB of bf16): the delta's in-place write and the weights' digest check, which the
planner charges as delta_apply_seconds_per_gb and delta_check_seconds_per_gb (workflows/capacity/handoff.md); and
the check beside the engine's generating, as a rollout shard runs it.

    python -m benchmarks.engine_delta [--layers 48] [--changed 0.015] [--device cuda] [--decode 64] [--smoke]

The engine's weights are a transformers Qwen3-MoE's on --device, random bf16, mapped as the engine maps them
(`transformers_weights`: experts fused as transformers fuses them). The delta is the product's: `write_delta` from
those weights to the same with --changed of their elements moved by one bf16 step (the changed fraction measured at
learning rate 1e-6: benchmarks/handoff.md), into safetensors files on local disk. The trainer's side is timed as
`commit_delta` runs it on one of a node's 8 ranks (delta_write_seconds_per_gb): the rank's share of both versions in
files, the base's digests known. Then what `moeloop.steps.engines.versions.advance` runs once the delta is fetched:
`EngineWeights.apply_delta` (files read, positions decoded on the weights' device, written in place) and
`EngineWeights.digests` (the weights' digest, checked against the delta's record). The baseline row, in the same
run: the digest check one tensor after another (`tensor_digest` of each, the engine's check before `Digests`). Last,
the engine generating (transformers `generate`, greedy, --decode new tokens for 64 prompts of 16 tokens: the
transformers engine's way) alone, and again beside the digest check `EngineWeights.digests_later` runs on a thread
(`steps/engines/shards.py` generates while it runs), on the product's quarter of the cores and on all of them: how
much the check slows the generating, and how much of it is left once generating ends.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smoke  # noqa: E402

from benchmarks.delta_handoff import hf_tensors, moved_one_step  # noqa: E402
from benchmarks.handoff import qwen3_30b_a3b_shapes  # noqa: E402
from moeloop.steps.engines.weights import BESIDE_THREADS, EngineWeights, transformers_weights
from moeloop.steps.model.delta import (
    HASH_THREADS,
    CheckpointTensors,
    checkpoint_digests,
    tensor_digest,
    weights_digest,
    write_delta,
)
from moeloop.steps.model.hf_shards import INDEX

THREADS = {BESIDE_THREADS: "a quarter of the cores (the product's)", None: "all cores (the check alone's)"}

GB = 1e9


class Held(Mapping[str, torch.Tensor]):
    """The checkpoint tensors an engine holds, each read out of its weights when asked for."""

    def __init__(self, weights: EngineWeights) -> None:
        self.weights = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights.slots)

    def __len__(self) -> int:
        return len(self.weights.slots)


class Moved(Held):
    """The next version: changed of each tensor's elements (chosen by a generator seeded with its name, so the same
    on every read) moved one bf16 step away from zero."""

    def __init__(self, weights: EngineWeights, changed: float) -> None:
        super().__init__(weights)
        self.changed = changed

    def __getitem__(self, name: str) -> torch.Tensor:
        held = self.weights.read(name)
        return moved_one_step(held, self.changed, torch.Generator(held.device).manual_seed(zlib.crc32(name.encode())))


def engine_weights(layers: int, device: torch.device, tiny: bool) -> tuple[Qwen3MoeForCausalLM, EngineWeights]:
    """A transformers Qwen3-MoE of Qwen3-30B-A3B's shapes on device, random bf16, and its weights as a rollout engine
    maps them."""
    config = qwen3_30b_a3b_shapes(layers, tiny=tiny)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02, generator=generator)
    kinds = {tensor.name: (tensor.shape, tensor.dtype) for tensor in hf_tensors(config)}
    return model.eval(), transformers_weights(model, kinds)


def timed(device: torch.device, run: callable) -> tuple[float, object]:  # type: ignore[valid-type]
    """run()'s seconds, its work on the device included, and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, result


def generating(model: Qwen3MoeForCausalLM, device: torch.device, decode: int) -> float:
    """Seconds to generate `decode` tokens, greedy, for 64 prompts of 16 tokens."""
    prompts = torch.randint(0, model.config.vocab_size, (64, 16), generator=torch.Generator().manual_seed(0))
    settings = {"max_new_tokens": decode, "min_new_tokens": decode, "do_sample": False}
    with torch.no_grad():
        return timed(device, lambda: model.generate(prompts.to(device), **settings))[0]


def beside_check(
    model: Qwen3MoeForCausalLM, weights: EngineWeights, device: torch.device, decode: int, threads: int | None,
    held: dict,
) -> tuple[float, float, float]:
    """Generating beside `EngineWeights.digests_later(threads)`, as a rollout shard runs it: the generating's seconds,
    the check's, and what was left of it once the generating ended."""
    started, ended = time.perf_counter(), []
    weights.digests_later(threads)
    weights.reading.add_done_callback(lambda _: ended.append(time.perf_counter()))
    generated = generating(model, device, decode)
    waited, read = timed(device, weights.digests)
    assert read == held, "the check beside the generating read other digests"
    return generated, ended[0] - started, waited


def share_of(layers: int) -> int:
    """A rank's decoder layers of a node's 8 (at least one)."""
    return max(1, layers // 8)


def rank_share_write(weights: EngineWeights, changed: float, layers: int, work: Path) -> tuple[float, float, int]:
    """write_delta as commit_delta runs it on one of a train node's 8 ranks: its share of the checkpoint (its first
    share_of(layers) decoder layers' tensors, a file a layer), both versions in safetensors files on local disk (the
    base as the iteration before wrote it, the new one as the rank just did: both in the page cache), the base's
    digests known from its record. Its seconds, the share's GB and layers."""
    share = share_of(layers)
    files = {name: f"model-{int(name.split('.')[2]):05d}.safetensors" for name in weights.slots
             if name.startswith("model.layers.") and int(name.split(".")[2]) < share}  # fmt: skip
    for folder, version in (("base", Held(weights)), ("new", Moved(weights, changed))):
        for file in sorted(set(files.values())):
            names = [name for name, held_in in files.items() if held_in == file]
            (work / folder).mkdir(parents=True, exist_ok=True)
            save_file({name: version[name].cpu() for name in names}, work / folder / file)
        (work / folder / INDEX).write_text(json.dumps({"weight_map": files}))
    base, new = CheckpointTensors(work / "base"), CheckpointTensors(work / "new")
    known = checkpoint_digests(base)  # commit_delta reads them from the base's record
    seconds, summary = timed(torch.device("cpu"), lambda: write_delta(base, new, work / "delta", new.files, known))
    return seconds, summary.checkpoint_bytes / GB, share


def measure(layers: int, changed: float, device: torch.device, tiny: bool, decode: int) -> list[tuple[str, float, str]]:
    """(stage, seconds, note) rows."""
    model, weights = engine_weights(layers, device, tiny)
    held = Held(weights)
    work = Path(tempfile.mkdtemp(prefix="moeloop-engine-delta-"))
    try:
        write, summary = timed(device, lambda: write_delta(held, Moved(weights, changed), work))
        files = sorted(work.glob("delta-*.safetensors"))
        rank_write, rank_gb, share = rank_share_write(weights, changed, layers, work / "rank")
        serial, before = timed(device, lambda: {name: tensor_digest(held[name]) for name in weights.slots})
        check_before, parallel = timed(device, weights.digests)
        assert before == parallel == summary.base_digests, "the digest checks disagree with write_delta's"
        apply, _ = timed(device, lambda: weights.apply_delta(files))
        check, after = timed(device, weights.digests)
        assert weights_digest(after) == weights_digest(summary.digests) != weights_digest(before), "apply missed"
        generating(model, device, 2)  # warm: the first generate's set-up is in neither row
        alone_before = generating(model, device, decode)
        beside = {threads: beside_check(model, weights, device, decode, threads, after) for threads in THREADS}
        alone = min(alone_before, generating(model, device, decode))  # before and after: the faster
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = summary.checkpoint_bytes / GB
    share = f"{summary.changed / summary.elements:.2%} of {summary.elements:,} elements"
    share_layers = share_of(layers)
    return [
        ("write_delta of the engine's weights on the device (both digests, compare, write)", write,
         f"{summary.delta_bytes / GB:.3f} GB of delta files, {share}"),
        (f"write_delta as commit_delta runs it on a rank: its share ({share_layers} layers) in files", rank_write,
         f"{rank_gb:.2f} GB, the base's digests known; a node of 8 ranks: {rank_write / rank_gb / 8:.4f} s/GB"),
        ("digest check, one tensor after another (baseline)", serial,
         f"{gb:.2f} GB checkpoint, {len(before):,} tensors"),
        ("digest check, Digests (the engine's)", check_before, f"{serial / check_before:.1f}x the baseline"),
        ("in-place write: EngineWeights.apply_delta (files read, decoded, written)", apply,
         f"{summary.changed:,} elements written"),
        ("digest check after the write", check, "equals the delta record's"),
        ("apply + digest check", apply + check, f"{(apply + check) / gb:.4f} s/GB of checkpoint"),
        (f"generating alone: {decode} tokens for 64 prompts, greedy", alone, "transformers generate, before and after"),
    ] + [
        row
        for threads, (generated, read, waited) in beside.items()
        for row in (
            (f"generating beside the digest check on {THREADS[threads]}", generated,
             f"{generated / alone - 1:+.1%} against alone"),
            (f"that digest check ({threads or HASH_THREADS} threads)", read,
             f"left once generating ended: {waited:.2f} s (alone: {check:.2f} s)"),
        )
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--changed", type=float, default=0.015, help="the share of elements the next version changes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--decode", type=int, default=64, help="tokens generated beside the check")
    args = smoke.parse_args(parser, layers=2, device="cpu", decode=4)  # --smoke: Qwen3-30B-A3B's structure at toy sizes
    device = torch.device(args.device)
    rows = measure(args.layers, args.changed, device, args.smoke, args.decode)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"engine delta at Qwen3-30B-A3B's shapes, {args.layers} layers, on {name}, {args.changed:.1%} changed")
    print("| stage | s | notes |")
    print("|---|---:|---|")
    for stage, seconds, note in rows:
        print(f"| {stage} | {seconds:.2f} | {note} |")


if __name__ == "__main__":
    main()
