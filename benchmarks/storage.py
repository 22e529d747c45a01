"""Storage throughput: the storage module against raw boto3 on the same S3 server and the same bytes.

    .venv/bin/python -m benchmarks.storage [--checkpoint-mb 200] [--parquet-mb 100] [--repeats 3] [--smoke]

Starts its own SeaweedFS on loopback (tests/seaweed.py) in a temporary folder. For each operation it
prints the best of `repeats` runs for both sides:

- checkpoint publish: RunStorage.commit_folder (parallel multipart upload, digests, conditional COMMIT)
  against one boto3 put_object per file, one after another;
- checkpoint fetch: RunStorage.fetch_folder into a local folder (ranged parallel download, digests
  verified against the COMMIT) against one boto3 get_object per file, written to a local file;
  the last column is raw boto3 plus a sha256 of every byte (what the first COMMIT format checked), for
  reference;
- experience write / read: a rollout shard's Parquet bytes committed with a manifest and read back
  verified, against put_object / get_object of the same bytes. Parquet encoding and decoding are
  measured apart, since raw boto3 moves bytes that are already encoded.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import pyarrow as pa
import smoke

from moeloop.steps.storage.experience import ROLLOUT_SCHEMA, parse_table, table_bytes
from moeloop.steps.storage.run import RunStorage
from tests.seaweed import SeaweedS3, start_seaweed

MB = 1_000_000


def best_seconds(repeats: int, runs: dict[str, tuple[Callable[[], None], Callable[[], None]]]) -> dict[str, float]:
    """The best time of each (run, reset) pair, taking turns: on a shared machine a load that comes and goes
    then falls on every side alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (run, reset) in runs.items():
            reset()
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: min(seconds) for name, seconds in times.items()}


def nothing() -> None:
    pass


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
    # The schema's other columns (routes, which an engine records only on request) null.
    columns |= {field.name: pa.nulls(rows, field.type) for field in ROLLOUT_SCHEMA if field.name not in columns}
    return pa.table(columns, schema=ROLLOUT_SCHEMA)


class Fresh:
    """A new name for every writing run, on both sides: committing to a committed folder would be a no-op,
    and writes to new keys are what publishing and rollouts do."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.count = 0

    @property
    def current(self) -> str:
        return f"{self.prefix}-{self.count:06d}"

    def next(self) -> None:
        self.count += 1


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
    args = smoke.parse_args(parser, checkpoint_mb=1, parquet_mb=1, repeats=1)

    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="moeloop-bench-"))
    server = start_seaweed(work / "seaweedfs")
    os.environ.update(server.environment())
    rows: list[tuple[str, int, float, float, float | None]] = []
    try:
        source = checkpoint_folder(work / "checkpoint", args.checkpoint_mb)
        size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
        run = RunStorage(f"s3://{server.bucket}/bench/run")
        client = server.client()
        folders, raw_folders = Fresh("bench/folder"), Fresh("bench/raw-checkpoint")
        best = best_seconds(
            args.repeats,
            {
                "module": (lambda: run.commit_folder(folders.current, source), folders.next),
                "raw": (lambda: raw_put_files(server, raw_folders.current, source), raw_folders.next),
            },
        )
        rows.append(("checkpoint publish", size, best["module"], best["raw"], None))

        fetched = work / "fetched"

        def clear() -> None:
            shutil.rmtree(fetched, ignore_errors=True)

        best = best_seconds(
            args.repeats,
            {
                "module": (lambda: run.fetch_folder(folders.current, fetched), clear),
                "raw": (lambda: raw_get_files(server, raw_folders.current, source, fetched), clear),
                "verified": (lambda: raw_get_files(server, raw_folders.current, source, fetched, verify=True), clear),
            },
        )
        rows.append(("checkpoint fetch", size, best["module"], best["raw"], best["verified"]))

        table = rollout_table(args.parquet_mb)
        started = time.perf_counter()
        data = table_bytes(table)
        encode = time.perf_counter() - started
        shard = "rollout-00000-of-00001.parquet"
        shards = Fresh("bench/raw-shard")
        best = best_seconds(
            args.repeats,
            {
                "module": (
                    lambda: run.commit(folders.current, run.put_objects(folders.current, {shard: data})),
                    folders.next,
                ),
                "raw": (lambda: client.put_object(Bucket=server.bucket, Key=shards.current, Body=data), shards.next),
            },
        )
        rows.append(("experience write (Parquet)", len(data), best["module"], best["raw"], None))

        manifest = run.manifest(folders.current)
        best = best_seconds(
            args.repeats,
            {
                "module": (lambda: run.read_committed(folders.current, manifest, [shard]), nothing),
                "raw": (lambda: client.get_object(Bucket=server.bucket, Key=shards.current)["Body"].read(), nothing),
                "verified": (
                    lambda: hashlib.sha256(client.get_object(Bucket=server.bucket, Key=shards.current)["Body"].read()),
                    nothing,
                ),
            },
        )
        rows.append(("experience read (Parquet)", len(data), best["module"], best["raw"], best["verified"]))
        started = time.perf_counter()
        parse_table(data, "benchmark", ROLLOUT_SCHEMA)
        decode = time.perf_counter() - started
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"storage module vs raw boto3, SeaweedFS on loopback, best of {args.repeats} taking turns,"
        f" {os.cpu_count()} cores, 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
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
