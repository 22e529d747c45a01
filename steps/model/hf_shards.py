"""An HF checkpoint's weights written as a stream of sharded safetensors: `model-0000k-of-0000n.safetensors` and
`model.safetensors.index.json` (one shard: `model.safetensors`), what `from_pretrained` and vLLM load.

Every file's header is known before its first byte (names, dtypes and shapes come from the trainer state's index),
so each tensor's bytes go to disk as they arrive: the writer holds nothing but the block it is given, whatever the
shard size. safetensors' format: an 8-byte little-endian header length, a JSON header (padded with spaces to 8
bytes) naming each tensor's dtype, shape and [begin, end) byte range in the data that follows, tensors back to back.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the HF checkpoint, as its files hold it."""

    name: str
    shape: tuple[int, ...]

    def nbytes(self, dtype: torch.dtype) -> int:
        return math.prod(self.shape) * dtype.itemsize


def plan_shards(tensors: list[StoredTensor], dtype: torch.dtype, max_shard_bytes: int) -> list[list[StoredTensor]]:
    """tensors, in order, cut into shards of at most max_shard_bytes (a tensor larger than that is a shard alone)."""
    shards: list[list[StoredTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes(dtype) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes(dtype)
    return shards


def shard_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def header(shard: list[StoredTensor], dtype: torch.dtype) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    begin = 0
    for tensor in shard:
        end = begin + tensor.nbytes(dtype)
        entries[tensor.name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(tensor.shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data then starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


class ShardedSafetensorsWriter:
    """Writes the tensors of plan_shards' shards into output, in that order, from blocks of bytes: each `write` takes
    the next rows of the stream (in dtype), which may end inside a tensor or span several, and several files."""

    def __init__(self, output: Path, shards: list[list[StoredTensor]], dtype: torch.dtype) -> None:
        self.output, self.shards, self.dtype = output, shards, dtype
        self.names = shard_names(len(shards))
        self.shard = -1
        self.left = 0  # bytes the open file still takes
        self.file: BinaryIO | None = None

    def __enter__(self) -> ShardedSafetensorsWriter:
        self.output.mkdir(parents=True, exist_ok=True)
        return self

    def _next_file(self) -> None:
        if self.file is not None:
            self.file.close()
        self.shard += 1
        shard = self.shards[self.shard]
        self.file = open(self.output / self.names[self.shard], "wb")  # noqa: SIM115 (closed by the writer)
        self.file.write(header(shard, self.dtype))
        self.left = sum(tensor.nbytes(self.dtype) for tensor in shard)

    def write(self, block: torch.Tensor) -> None:
        if block.dtype != self.dtype:
            raise ValueError(f"a block of {block.dtype} for a checkpoint of {self.dtype}")
        data = memoryview(block.contiguous().view(-1).view(torch.uint8).numpy())
        while len(data):
            while self.left == 0:
                self._next_file()
            assert self.file is not None
            taken = min(self.left, len(data))
            self.file.write(data[:taken])
            self.left -= taken
            data = data[taken:]

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.file is not None:
            self.file.close()
        if kind is not None:
            return
        if self.left or self.shard != len(self.shards) - 1:
            raise RuntimeError(f"the stream ended {self.left} bytes short of shard {self.shard + 1} of {len(self.shards)}")
        if len(self.shards) > 1:
            weight_map = {tensor.name: name for name, shard in zip(self.names, self.shards) for tensor in shard}
            total = sum(tensor.nbytes(self.dtype) for shard in self.shards for tensor in shard)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.output / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
