"""An HF checkpoint's weights written as a stream of sharded safetensors: `model-0000k-of-0000n.safetensors` and
`model.safetensors.index.json` (one shard: `model.safetensors`), what `from_pretrained` and vLLM load.

Every file's header is known before its first byte (names, dtypes and shapes come from the trainer state's index),
so each tensor's bytes go to disk as they arrive: the writer holds nothing but the block it is given, whatever the
shard size. Each tensor has its own dtype (HF keeps a few in fp32 in a bf16 checkpoint). safetensors' format: an
8-byte little-endian header length, a JSON header (padded with spaces to 8 bytes) naming each tensor's dtype, shape
and [begin, end) byte range in the data that follows, tensors back to back.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the HF checkpoint, as its files hold it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(tensors: dict[str, list[StoredTensor]], max_shard_bytes: int) -> list[list[str]]:
    """The model's tensors (each stored as its list of HF tensors), in order, cut into shards of at most
    max_shard_bytes, a model tensor never split (one larger than that is a shard alone): each shard is then
    written from its own tensors, independently of the others."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, stored in tensors.items():
        nbytes = sum(tensor.nbytes() for tensor in stored)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def header(tensors: list[StoredTensor]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    begin = 0
    for tensor in tensors:
        end = begin + tensor.nbytes()
        dtype = SAFETENSORS_DTYPE[tensor.dtype]
        entries[tensor.name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data then starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    """Writes one safetensors file of tensors (in that order) from blocks of bytes: each `write` takes the next rows
    of the stream, in the dtype of the tensor they start in, which may end inside a tensor or span several (of that
    dtype)."""

    def __init__(self, path: Path, tensors: list[StoredTensor]) -> None:
        self.path, self.tensors = path, tensors
        self.ends = list(itertools.accumulate(tensor.nbytes() for tensor in tensors))  # each tensor's end byte
        self.left = self.ends[-1] if tensors else 0
        self.file: BinaryIO | None = None

    def __enter__(self) -> SafetensorsWriter:
        self.file = open(self.path, "wb")  # noqa: SIM115 (closed on exit)
        self.file.write(header(self.tensors))
        return self

    def write(self, block: torch.Tensor) -> None:
        data = memoryview(block.contiguous().view(-1).view(torch.uint8).numpy())
        if len(data) > self.left:
            raise ValueError(f"{self.path.name} takes {self.left} more bytes, not {len(data)}")
        if data:
            current = self.tensors[bisect.bisect_right(self.ends, self.ends[-1] - self.left)]
            if block.dtype != current.dtype:
                raise ValueError(f"a block of {block.dtype} for {current.name}, stored in {current.dtype}")
        assert self.file is not None
        self.file.write(data)
        self.left -= len(data)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self.file is not None
        self.file.close()
        if kind is None and self.left:
            raise RuntimeError(f"{self.path.name} ended {self.left} bytes short")


def read_layout(path: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """A safetensors file's header: where its data starts (bytes from the file's start), and each tensor's entry
    (dtype as the format names it: F32, BF16, I32, ...; shape; data_offsets: its bytes' [begin, end) in the data)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8).ljust(8, b"\0"))
        if length > path.stat().st_size:
            raise ValueError(f"{path.name} is not a safetensors file (its header would be {length} bytes)")
        entries = json.loads(file.read(length))
    return 8 + length, {name: entry for name, entry in entries.items() if name != "__metadata__"}


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors file's tensors as its header lists them: {name: (dtype, shape)}."""
    return {name: (entry["dtype"], tuple(entry["shape"])) for name, entry in read_layout(path)[1].items()}


def write_index(output: Path, names: list[str], shards: list[list[StoredTensor]]) -> None:
    """The index of a sharded checkpoint (none for one file): which file holds each tensor."""
    if len(names) == 1:
        return
    weight_map = {tensor.name: name for name, shard in zip(names, shards, strict=True) for tensor in shard}
    total = sum(tensor.nbytes() for shard in shards for tensor in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (output / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
