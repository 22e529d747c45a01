"""Bytes per token of the recorded routes in the experience, at Qwen3-30B-A3B's and DeepSeek-V3's shapes: a rollout
shard as the rollout step writes it (`steps/rollout.py:rollout_rows`, `steps/storage/experience.py`), before (the
response's routes only, uint16 ids, Parquet's defaults: dictionary encoding, snappy) and now (uint8 ids where the
model has at most 256 experts, zstd; the whole prompt's routes too, by default), and the Parquet encodings of the
routes column that the choice was made from. Expert ids are drawn uniformly (K distinct per position and layer:
the most a bit-packed id can take); `--locality` repeats a position's experts at the next position with that
probability, per layer, a stand-in for the locality of real routing (an assumption, not a measurement).

    .venv/bin/python benchmarks/route_storage.py            # the figures in route_storage.md
    .venv/bin/python benchmarks/route_storage.py --smoke    # a few tokens of each shape: it runs
"""

from __future__ import annotations

import argparse
import io
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke
from moeloop.steps.engines.engine import Completion
from moeloop.steps.engines.routes import expert_id_dtype
from moeloop.steps.engines.shards import rollout_rows
from moeloop.steps.storage.experience import ROLLOUT_SCHEMA, rollout_schema, table_bytes


@dataclass(frozen=True)
class Shape:
    name: str
    decoder_layers: int
    moe_layers: tuple[int, ...]
    experts: int
    top_k: int


SHAPES = (
    Shape("Qwen3-30B-A3B", 48, tuple(range(48)), 128, 8),
    Shape("DeepSeek-V3", 61, tuple(range(3, 61)), 256, 8),  # first_k_dense_replace 3
)
# The routes column's encodings measured: (name, pq.write_table's arguments).
ENCODINGS = (
    ("dictionary, snappy (Parquet's defaults)", {}),
    ("dictionary, zstd (chosen)", {"compression": "zstd"}),
    ("plain, zstd", {"compression": "zstd", "use_dictionary": False}),
    ("byte stream split, zstd", {"compression": "zstd", "use_dictionary": False,
                                 "column_encoding": "BYTE_STREAM_SPLIT"}),
    ("delta binary packed, zstd", {"compression": "zstd", "use_dictionary": False,
                                   "column_encoding": "DELTA_BINARY_PACKED"}),
)  # fmt: skip


def routes(rng: np.random.Generator, positions: int, shape: Shape, locality: float) -> np.ndarray:
    """[positions, MoE layers, K] ids: K distinct experts per position and layer, uniform; with locality, a layer's
    experts at a position repeat the previous position's with that probability."""
    layers = len(shape.moe_layers)
    ids = np.argsort(rng.random((positions, layers, shape.experts)), axis=2)[:, :, : shape.top_k]
    repeat = rng.random((positions, layers)) < locality
    for position in range(1, positions):
        ids[position, repeat[position]] = ids[position - 1, repeat[position]]
    return ids.astype(expert_id_dtype(shape.experts))


def shard_columns(args: argparse.Namespace, shape: Shape, whole_prompt: bool) -> tuple[dict[str, list], int, int]:
    """A shard's columns as the rollout step builds them, with (response tokens, recorded positions)."""
    rng = np.random.default_rng(args.seed)
    prompt_ids, prompts, completions = [], [], []
    responses = positions = 0
    for prompt_id in range(args.prompts):
        prompt = rng.integers(0, 151936, args.prompt_tokens).tolist()
        prompt_ids.append(prompt_id)
        prompts.append(prompt)
        samples = []
        for _ in range(args.samples):
            length = int(rng.integers(args.response_tokens // 2, args.response_tokens + 1))
            recorded = (len(prompt) if whole_prompt else 1) + length - 1
            tokens = rng.integers(0, 151936, length).tolist()
            logprobs = (-rng.random(length) * 3).tolist()
            samples.append(Completion(tokens, logprobs, "length", routes(rng, recorded, shape, args.locality)))
            responses, positions = responses + length, positions + recorded
        completions.append(samples)
    rendered = [("x" * 4 * args.prompt_tokens, prompt) for prompt in prompts]  # about 4 characters a token
    columns = rollout_rows(
        1, 0, 0, "vllm", prompt_ids, rendered, completions, lambda ids: "y" * 4 * len(ids), shape.moe_layers
    )
    return columns, responses, positions


def parquet_bytes(table: pa.Table, **options: object) -> int:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, **options)
    return len(buffer.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=1024, help="the longest; each is drawn from half to it")
    parser.add_argument("--locality", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = smoke.parse_args(parser, prompts=2, samples=2, prompt_tokens=8, response_tokens=16)
    print(f"{args.prompts} prompts x {args.samples} samples, prompts of {args.prompt_tokens} tokens, responses of"
          f" {args.response_tokens // 2}-{args.response_tokens}, locality {args.locality}\n")  # fmt: skip
    print(
        "| shape | shard | routes | ids | Parquet | shard bytes / response token | routes bytes / response token"
        " | routes bytes / recorded position | routes in memory (Arrow) / response token |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        for label, whole_prompt, now in (("before", False, False), ("now, prompt_routes last", False, True),
                                         ("now, prompt_routes all", True, True)):  # fmt: skip
            columns, responses, positions = shard_columns(args, shape, whole_prompt)
            table = pa.table(columns, schema=rollout_schema(shape.experts) if now else ROLLOUT_SCHEMA)
            if not now:
                table = table.drop_columns(["routed_layers"])  # a column the shards had no place for then
            shard = len(table_bytes(table)) if now else parquet_bytes(table)
            column = table.select(["routed_experts"])
            route_bytes = parquet_bytes(column, compression="zstd") if now else parquet_bytes(column)
            ids = table.schema.field("routed_experts").type.value_type
            print(f"| {shape.name} | {label} | {'whole prompt + response' if whole_prompt else 'response'} | {ids} |"
                  f" {'zstd' if now else 'snappy'} | {shard / responses:.1f} | {route_bytes / responses:.1f} |"
                  f" {route_bytes / positions:.1f} | {column.nbytes / responses:.1f} |")  # fmt: skip
    print("\nThe routes column alone (prompt_routes all), bytes per recorded position, by encoding:\n")
    print("| shape | " + " | ".join(name for name, _ in ENCODINGS) + " |")
    print("|---|" + "---|" * len(ENCODINGS))
    for shape in SHAPES:
        columns, _, positions = shard_columns(args, shape, True)
        column = pa.table(columns, schema=rollout_schema(shape.experts)).select(["routed_experts"])
        sizes = [parquet_bytes(column, **options) / positions for _, options in ENCODINGS]
        print(f"| {shape.name} | " + " | ".join(f"{size:.1f}" for size in sizes) + " |")


if __name__ == "__main__":
    main()
