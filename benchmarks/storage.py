"""Storage throughput: the storage module against raw boto3 on the same S3 server and the same bytes.

    .venv/bin/python -m benchmarks.storage [--checkpoint-mb 200] [--parquet-mb 100] [--repeats 3]

Starts its own SeaweedFS on loopback (tests/seaweed.py) in a temporary folder. For each operation it
prints the best of `repeats` runs for both sides:

- checkpoint publish: RunStorage.commit_folder (parallel multipart upload, sha256, conditional COMMIT)
  against one boto3 put_object per file, one after another;
- checkpoint fetch: RunStorage.fetch_folder into a local folder (ranged parallel download, sha256
  verified against the COMMIT) against one boto3 get_object per file, written to a local file;
  the last column is raw boto3 plus the sha256 the module checks every byte against, for reference;
- experience write / read: a rollout shard's Parquet bytes committed with a manifest and read back
  verified, against put_object / get_object of the same bytes. Parquet encoding and decoding are
  measured apart, since raw boto3 moves bytes that are already encoded.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from steps.experience import ROLLOUT_SCHEMA, parse_table, table_bytes
from steps.storage import RunStorage
from tests.seaweed import SeaweedS3, start_seaweed

MB = 1_000_000


def best_seconds(repeats: int, run: Callable[[], None], reset: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        reset()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def checkpoint_folder(folder: Path, total_mb: int) -> Path:
    """Like an HF checkpoint: four safetensors shards, plus the small files."""
    folder.mkdir(parents=True)
    for index in range(4):
        (folder / f"model-{index + 1:05d}-of-00004.safetensors").write_bytes(os.urandom(total_mb * MB // 4))
    (folder / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (folder / "tokenizer.json").write_bytes(os.urandom(200_000))
    return folder


def rollout_table(target_mb: int) -> pa.Table:
    """Rollout rows with random token ids and logprobs (they compress as little as real ones)."""
    rng = np.random.default_rng(0)
    rows = target_mb * MB // 420
    prompt = rng.integers(0, 150_000, size=(rows, 24), dtype=np.int32)
    response = rng.integers(0, 150_000, size=(rows, 48), dtype=np.int32)
    logprobs = rng.random((rows, 48), dtype=np.float32) * -5
    columns = {
        "sample_id": [f"1-{i // 16}-{i % 16}" for i in range(rows)],
        "iteration": np.ones(rows, np.int32),
        "shard": np.zeros(rows, np.int32),
        "prompt_id": np.arange(rows, dtype=np.int64) // 16,
        "sample_index": np.arange(rows, dtype=np.int32) % 16,
        "prompt_text": ["reverse: abcdef"] * rows,
        "prompt_token_ids": pa.FixedSizeListArray.from_arrays(prompt.ravel(), 24).cast(pa.list_(pa.int32())),
        "response_token_ids": pa.FixedSizeListArray.from_arrays(response.ravel(), 48).cast(pa.list_(pa.int32())),
        "response_text": ["fedcba"] * rows,
        "behavior_logprobs": pa.FixedSizeListArray.from_arrays(logprobs.ravel(), 48).cast(pa.list_(pa.float32())),
        "finish_reason": ["stop"] * rows,
        "policy_version": np.zeros(rows, np.int32),
        "engine": ["vllm"] * rows,
    }
    return pa.table(columns, schema=ROLLOUT_SCHEMA)


class FreshFolders:
    """A new, uncommitted folder for every committing run: a committed one would make it a no-op."""

    def __init__(self) -> None:
        self.count = 0
        self.current = "bench/folder-000000"

    def next(self) -> None:
        self.count += 1
        self.current = f"bench/folder-{self.count:06d}"


def raw_put_files(server: SeaweedS3, prefix: str, folder: Path) -> None:
    client = server.client()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.put_object(Bucket=server.bucket, Key=f"{prefix}/{path.relative_to(folder)}", Body=path.read_bytes())


def raw_get_files(server: SeaweedS3, prefix: str, folder: Path, target: Path, verify: bool = False) -> None:
    client = server.client()
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = client.get_object(Bucket=server.bucket, Key=f"{prefix}/{path.relative_to(folder)}")["Body"].read()
        if verify:
            hashlib.sha256(data).hexdigest()
        (target / path.relative_to(folder)).write_bytes(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-mb", type=int, default=200)
    parser.add_argument("--parquet-mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="moeloop-bench-"))
    server = start_seaweed(work / "seaweedfs")
    os.environ.update(server.environment())
    rows: list[tuple[str, int, float, float, float | None]] = []
    try:
        source = checkpoint_folder(work / "checkpoint", args.checkpoint_mb)
        size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
        run = RunStorage(f"s3://{server.bucket}/bench/run")
        client = server.client()
        fresh = FreshFolders()

        module = best_seconds(args.repeats, lambda: run.commit_folder(fresh.current, source), fresh.next)
        raw = best_seconds(args.repeats, lambda: raw_put_files(server, "bench/raw-checkpoint", source))
        rows.append(("checkpoint publish", size, module, raw, None))

        fetched = work / "fetched"
        module = best_seconds(
            args.repeats,
            lambda: run.fetch_folder(fresh.current, fetched),
            lambda: shutil.rmtree(fetched, ignore_errors=True),
        )
        raw = best_seconds(
            args.repeats,
            lambda: raw_get_files(server, "bench/raw-checkpoint", source, fetched),
            lambda: shutil.rmtree(fetched, ignore_errors=True),
        )
        verified = best_seconds(
            args.repeats,
            lambda: raw_get_files(server, "bench/raw-checkpoint", source, fetched, verify=True),
            lambda: shutil.rmtree(fetched, ignore_errors=True),
        )
        rows.append(("checkpoint fetch", size, module, raw, verified))

        table = rollout_table(args.parquet_mb)
        started = time.perf_counter()
        data = table_bytes(table)
        encode = time.perf_counter() - started
        shard = "rollout-00000-of-00001.parquet"
        module = best_seconds(
            args.repeats, lambda: run.commit(fresh.current, run.put_objects(fresh.current, {shard: data})), fresh.next
        )
        raw = best_seconds(
            args.repeats, lambda: client.put_object(Bucket=server.bucket, Key="bench/raw-shard", Body=data)
        )
        rows.append(("experience write (Parquet)", len(data), module, raw, None))

        manifest = run.manifest(fresh.current)
        module = best_seconds(args.repeats, lambda: run.read_committed(fresh.current, manifest, [shard]))
        raw = best_seconds(
            args.repeats, lambda: client.get_object(Bucket=server.bucket, Key="bench/raw-shard")["Body"].read()
        )
        verified = best_seconds(
            args.repeats,
            lambda: hashlib.sha256(client.get_object(Bucket=server.bucket, Key="bench/raw-shard")["Body"].read()),
        )
        rows.append(("experience read (Parquet)", len(data), module, raw, verified))
        started = time.perf_counter()
        parse_table(data, "benchmark", ROLLOUT_SCHEMA)
        decode = time.perf_counter() - started
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"storage module vs raw boto3, SeaweedFS on loopback, best of {args.repeats}, {os.cpu_count()} cores")
    print("| operation | MB | storage module MB/s | raw boto3 MB/s | module / raw | raw + sha256 MB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, size, module, raw, verified in rows:
        reference = f"{size / MB / verified:.0f}" if verified else "-"
        print(
            f"| {name} | {size / MB:.0f} | {size / MB / module:.0f} | {size / MB / raw:.0f} | {raw / module:.0%}"
            f" | {reference} |"
        )
    print(
        f"Parquet encode {len(data) / MB / encode:.0f} MB/s, decode {len(data) / MB / decode:.0f} MB/s"
        f" ({table.num_rows} rows; outside the comparison: raw boto3 moves encoded bytes)"
    )


if __name__ == "__main__":
    main()
