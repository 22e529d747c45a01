"""The policy's handoff through S3 at checkpoint scale: trainer state commit, publish, one rollout pod's fetch.

    .venv/bin/python -m benchmarks.handoff [--layers 1 5] [--optimizer-up-to-gb 20] [--shard-gb 4.29] [--smoke]
                                           [--s3torchconnector] [--tiny]

Starts its own SeaweedFS on loopback (tests/seaweed.py). For each size, a model of Qwen3-30B-A3B's real shapes
(hidden 2048, 128 experts of 768, 32 query and 4 KV heads of 128, vocabulary 151,936) with that many decoder
layers and random weights is written as the trainer state one trainer process writes (DCP: fp32 weights, and AdamW's
two fp32 moments while the state is at most --optimizer-up-to-gb, else the weights alone: the disk holds the state
twice, here and in SeaweedFS). Then, each against raw boto3 moving the same bytes with its managed transfers
(`upload_file`/`download_file`: parallel multipart, what a careful user writes), in the same run:

- commit: `moeloop.steps.storage.ranks.commit_from_ranks`, the function the train step ends with;
- publish: `python -m moeloop.steps.publish` as its pod runs it (fetch the weights, write the bf16 HF checkpoint as
  sharded safetensors, commit it, move LATEST), in a child process whose peak RSS is read from the kernel;
  raw boto3 downloads the weights and uploads the checkpoint's files;
- fetch: `moeloop.steps.storage.cache.fetch_checkpoint`, a rollout pod's verified fetch into its cache, against a boto3
  download of the checkpoint's files.
The extrapolation to Qwen3-30B-A3B and Qwen3-235B-A22B from these rates is benchmarks/handoff.md's.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boto3.s3.transfer
import smoke
import torch
import torch.distributed.checkpoint as dcp
import yaml
from transformers import Qwen3MoeConfig

from moeloop.steps.config import load_config
from moeloop.steps.model.policy import build_tokenizer
from moeloop.steps.rl.checkpoint import (
    OPTIMIZER_DIR,
    WEIGHTS_DIR,
    ReproducibleWriter,
    write_hf_checkpoint,
)
from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.ranks import commit_from_ranks
from moeloop.steps.storage.run import RunStorage
from tests.conftest import REPO
from tests.seaweed import SeaweedS3, start_seaweed

GB = 1e9
ITERATION = 1


def qwen3_30b_a3b_shapes(layers: int, tiny: bool = False) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's config with that many decoder layers; tiny: its structure at toy sizes (tests run it)."""
    sizes = dict(vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=128)  # fmt: skip
    if tiny:
        sizes = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, num_experts=4)  # fmt: skip
    return Qwen3MoeConfig(
        **sizes,
        intermediate_size=6144,
        num_hidden_layers=layers,
        num_experts_per_tok=2 if tiny else 8,
        tie_word_embeddings=False,
        dtype="bfloat16",
        architectures=["Qwen3MoeForCausalLM"],
    )


def parameter_shapes(config: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """The HF model's parameters (transformers' fused experts), without building it."""
    h, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    e, i = config.num_experts, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.self_attn.q_proj.weight": (heads * d, h),
            f"{prefix}.self_attn.k_proj.weight": (kv * d, h),
            f"{prefix}.self_attn.v_proj.weight": (kv * d, h),
            f"{prefix}.self_attn.o_proj.weight": (h, heads * d),
            f"{prefix}.self_attn.q_norm.weight": (d,),
            f"{prefix}.self_attn.k_norm.weight": (d,),
            f"{prefix}.mlp.experts.gate_up_proj": (e, 2 * i, h),
            f"{prefix}.mlp.experts.down_proj": (e, h, i),
            f"{prefix}.mlp.gate.weight": (e, h),
            f"{prefix}.input_layernorm.weight": (h,),
            f"{prefix}.post_attention_layernorm.weight": (h,),
        }
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (config.vocab_size, h)}


def trainer_state_tensors(config: Qwen3MoeConfig, with_optimizer: bool) -> dict[str, dict[str, Any]]:
    """What one trainer process's `save_sharded` saves for this model (DCP folder -> state dict), random fp32."""
    generator = torch.Generator().manual_seed(0)
    shapes = parameter_shapes(config)
    weights = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    folders: dict[str, dict[str, Any]] = {WEIGHTS_DIR: weights}
    if with_optimizer:
        folders[OPTIMIZER_DIR] = {
            name: {"step": torch.tensor(1.0), "exp_avg": torch.randn(shape, generator=generator),
                   "exp_avg_sq": torch.rand(shape, generator=generator)}
            for name, shape in shapes.items()
        }  # fmt: skip
    return folders


def save_locally(folders: dict[str, dict[str, Any]], folder: Path, config: Qwen3MoeConfig) -> None:
    """The train step's save: each DCP folder as `save_sharded` writes it, then the config and tokenizer."""
    for name, state in folders.items():
        dcp.save(state, storage_writer=ReproducibleWriter(folder / name), no_dist=True)
    config.save_pretrained(folder)
    build_tokenizer(["0123456789abcdef"]).save_pretrained(folder)


def save_with_s3torchconnector(folders: dict[str, dict[str, Any]], server: SeaweedS3, prefix: str) -> None:
    """The same DCP folders written straight to S3 by AWS's s3torchconnector (its DCP storage writer, 8 threads):
    the alternative issue 20 names. Benchmark-only: `pip install s3torchconnector`; the row is left out without it."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    client_config = S3ClientConfig(force_path_style=True)
    for name, state in folders.items():
        writer = S3StorageWriter("us-east-1", f"s3://{server.bucket}/{prefix}/{name}", client_config, thread_count=8)
        # Its writer takes no endpoint: give it a client that has SeaweedFS's.
        client = S3Client("us-east-1", endpoint=server.endpoint, s3client_config=client_config)
        writer.fs = S3FileSystem("us-east-1", s3_client=client)
        dcp.save(state, storage_writer=writer, no_dist=True)


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in files_of(folder))


@dataclass
class Row:
    stage: str
    size: int
    seconds: float
    baseline_seconds: float
    baseline: str
    note: str = ""


class RawBoto3:
    """boto3's managed transfers, one file after another, each in parallel parts (8 MiB, 10 threads: boto3's
    defaults but for the part size, which is the storage module's)."""

    def __init__(self, server: SeaweedS3) -> None:
        self.server, self.client = server, server.client()
        self.transfer = boto3.s3.transfer.TransferConfig(multipart_chunksize=8 << 20, max_concurrency=10)

    def upload(self, folder: Path, prefix: str) -> None:
        for path in files_of(folder):
            key = f"{prefix}/{path.relative_to(folder).as_posix()}"
            self.client.upload_file(str(path), self.server.bucket, key, Config=self.transfer)

    def download(self, prefix: str, names: list[str], target: Path) -> None:
        for name in names:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(self.server.bucket, f"{prefix}/{name}", str(target / name), Config=self.transfer)

    def delete(self, prefix: str) -> None:
        """Delete every object under prefix, and have SeaweedFS reclaim their space now (it vacuums only past a
        garbage share, on its own schedule): the disk holds the state and the checkpoint twice at most."""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.server.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                self.client.delete_object(Bucket=self.server.bucket, Key=item["Key"])
        master = self.server.ports[0]  # tests/seaweed.py: SERVICES' order
        urllib.request.urlopen(f"http://127.0.0.1:{master}/vol/vacuum?garbageThreshold=0.0001", timeout=600).read()


def timed(run: callable) -> float:  # type: ignore[valid-type]
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def run_config(name: str, shard_bytes: int) -> bytes:
    config = load_config(REPO / "configs" / "tiny.yaml").model_dump(mode="json")
    config |= {"run_name": name, "iterations": ITERATION}
    config["trainer"]["checkpoint_shard_bytes"] = shard_bytes
    return yaml.safe_dump(config, sort_keys=False).encode()


# Runs its argv and prints the peak RSS of that child, in KiB. A child's ru_maxrss counts the image it was forked
# from until it execs, so the step is forked from this small process, not from the benchmark's (which holds the
# trainer state it wrote).
PEAK_RSS_OF = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL);"
    " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def publish_in_child(uri: str, environment: dict[str, str]) -> tuple[float, int]:
    """`python -m moeloop.steps.publish` as its pod runs it: (seconds, peak RSS in bytes)."""
    step = [sys.executable, "-m", "moeloop.steps.publish", "--run", uri, "--iteration", str(ITERATION)]
    started = time.perf_counter()
    command = [sys.executable, "-c", PEAK_RSS_OF, *step]
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"publish failed: {done.stderr[-2000:]}")
    return seconds, int(done.stdout.split()[-1]) * 1024  # Linux reports KiB


def measure(
    server: SeaweedS3, work: Path, config: Qwen3MoeConfig, optimizer_up_to: float, shard_bytes: int,
    compare_s3torchconnector: bool,
) -> list[Row]:
    layers = config.num_hidden_layers
    weights_bytes = sum(torch.Size(s).numel() for s in parameter_shapes(config).values()) * 4
    with_optimizer = 3 * weights_bytes <= optimizer_up_to
    name = f"handoff-{layers}"
    run = RunStorage(f"s3://{server.bucket}/{name}")
    run.write_bytes(RunStorage.CONFIG, run_config(name, shard_bytes))
    raw = RawBoto3(server)
    rows = []

    local_state = work / "state"
    folders = trainer_state_tensors(config, with_optimizer)
    save_locally(folders, local_state, config)
    state_size = size_of(local_state)
    commit = timed(lambda: commit_from_ranks(run, run.trainer_state(ITERATION), local_state, Parallel(), {}))
    raw_commit = timed(lambda: raw.upload(local_state, f"raw-{name}/state"))
    raw.delete(f"raw-{name}/state/")  # the same bytes as the product's, which the baselines below read
    what = "fp32 weights + AdamW moments" if with_optimizer else "fp32 weights only (the disk holds no more)"
    rows.append(Row("trainer state upload + COMMIT", state_size, commit, raw_commit, "boto3", what))
    weights = {WEIGHTS_DIR: folders[WEIGHTS_DIR]}
    del folders
    if compare_s3torchconnector:  # the weights alone: its writer holds several GB beyond the tensors it writes
        local_weights = work / "weights-only"
        save = timed(lambda: save_locally(weights, local_weights, config))
        commit = timed(lambda: commit_from_ranks(run, "trainer/weights-only", local_weights, Parallel(), {}))
        size = size_of(local_weights)
        shutil.rmtree(local_weights)
        direct = timed(lambda: save_with_s3torchconnector(weights, server, f"s3tc-{name}"))
        raw.delete(f"s3tc-{name}/")
        rows.append(Row("fp32 weights: save (DCP) + upload + COMMIT", size, save + commit, direct,
                        "s3torchconnector's DCP writer to S3"))  # fmt: skip
    del weights
    weight_names = [p.relative_to(local_state).as_posix() for p in files_of(local_state)]
    weight_names = [n for n in weight_names if not n.startswith(f"{OPTIMIZER_DIR}/")]
    # The checkpoint publish diffs its policy against (deltas/, benchmarks/delta_handoff.py): the same weights here,
    # so publish's row holds the diff's read and compare but no changed element.
    write_hf_checkpoint(local_state, work / "previous", shard_bytes)
    run.commit_folder(run.checkpoint(ITERATION - 1), work / "previous", extra={"iteration": ITERATION - 1})
    shutil.rmtree(work / "previous")
    shutil.rmtree(local_state)

    publish, peak_rss = publish_in_child(run.uri, {**os.environ, "OMP_NUM_THREADS": "2"})
    manifest = run.manifest(run.checkpoint(ITERATION))
    assert manifest is not None
    checkpoint_names = sorted(manifest["files"])
    checkpoint_size = sum(entry["size"] for entry in manifest["files"].values())
    shards = [entry["size"] for n, entry in manifest["files"].items() if n.endswith(".safetensors")]
    scratch = work / "raw-publish"

    def raw_publish() -> None:
        raw.download(f"{name}/{run.trainer_state(ITERATION)}", weight_names, scratch / "state")
        # The same bytes up as the product's checkpoint: its files, fetched once beforehand (untimed).
        raw.upload(scratch / "checkpoint", f"raw-{name}/checkpoint")

    run.fetch_files(run.checkpoint(ITERATION), manifest["files"], scratch / "checkpoint")
    raw_publish_seconds = timed(raw_publish)
    shutil.rmtree(scratch)
    moved = sum(entry["size"] for n, entry in run.manifest(run.trainer_state(ITERATION))["files"].items()
                if not n.startswith(f"{OPTIMIZER_DIR}/")) + checkpoint_size
    rows.append(
        Row("publish", moved, publish, raw_publish_seconds, "boto3",
            f"{len(shards)} shards, largest {max(shards) / GB:.2f} GB; peak RSS {peak_rss / GB:.2f} GB"
            f" = {peak_rss / max(shards):.2f}x the largest shard")
    )

    os.environ["MOELOOP_CACHE"] = str(work / "cache")
    fetch = timed(lambda: fetch_checkpoint(run, ITERATION))
    raw_fetch = timed(lambda: raw.download(f"raw-{name}/checkpoint", checkpoint_names, work / "raw-fetch"))
    rows.append(Row("rollout pod fetch", checkpoint_size, fetch, raw_fetch, "boto3", "verified into the cache"))
    shutil.rmtree(work / "cache")
    shutil.rmtree(work / "raw-fetch")
    raw.delete(f"raw-{name}/")
    raw.delete(f"{name}/")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--optimizer-up-to-gb", type=float, default=20)
    parser.add_argument("--shard-gb", type=float, default=4 * 2**30 / GB, help="trainer.checkpoint_shard_bytes")
    parser.add_argument("--s3torchconnector", action="store_true", help="also time its DCP writer (pip install it)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, same structure (tests/unit/test_benchmarks.py)")
    args = smoke.parse_args(parser, tiny=True, layers=[2], shard_gb=0.00002)

    load_before = os.getloadavg()[0]
    rows = []
    for layers in args.layers:
        config = qwen3_30b_a3b_shapes(layers, args.tiny)
        shapes = parameter_shapes(config)
        gb = sum(torch.Size(shape).numel() for shape in shapes.values()) * 2 / GB
        print(f"{layers} layers: a {gb:.1f} GB bf16 checkpoint", file=sys.stderr, flush=True)
        # A server of its own per size: SeaweedFS reclaims deleted objects' space only when it vacuums.
        work = Path(tempfile.mkdtemp(prefix="moeloop-handoff-"))
        server = start_seaweed(work / "seaweedfs")
        os.environ.update(server.environment())
        try:
            measured = measure(
                server, work, config, args.optimizer_up_to_gb * GB, int(args.shard_gb * GB), args.s3torchconnector
            )
            rows += [(layers, gb, row) for row in measured]
        finally:
            server.stop()
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"handoff on SeaweedFS over loopback, Qwen3-30B-A3B shapes, {os.cpu_count()} cores, peak host memory"
        f" {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB in the benchmark itself,"
        f" 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print("| checkpoint (bf16) | stage | GB | moeloop s | moeloop GB/s | baseline | baseline s | baseline GB/s |"
          " moeloop speed / baseline | notes |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---|")
    for layers, gb, row in rows:
        print(
            f"| {gb:.1f} GB ({layers} layers) | {row.stage} | {row.size / GB:.2f} | {row.seconds:.1f}"
            f" | {row.size / GB / row.seconds:.2f} | {row.baseline} | {row.baseline_seconds:.1f}"
            f" | {row.size / GB / row.baseline_seconds:.2f} | {row.baseline_seconds / row.seconds:.0%} | {row.note} |"
        )


if __name__ == "__main__":
    main()
