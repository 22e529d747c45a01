"""A policy version's delta: the elements of its HF checkpoint that changed since the version before, which a rollout
engine holding that version applies in place instead of loading the whole checkpoint; and the weights' digest, by
which the engine checks that what it holds then is the new checkpoint, element for element.

Digest. A checkpoint tensor's digest is the BLAKE3 of its bytes as the checkpoint stores them: its dtype, row-major,
its safetensors file's bytes. The weights' digest is the BLAKE3 of every tensor's name and digest, in name order. An
engine computes it from its own weights, whatever layout it holds them in (`moeloop.steps.engines.weights`): it
reads each checkpoint tensor back out of its fused tensors, in the stored dtype.

Layout: a safetensors file per checkpoint file with a changed tensor (`model-00003-of-00012.safetensors`'s changes in
`delta-model-00003-of-00012.safetensors`: each of the ranks that write a checkpoint's files writes their deltas, and
the files are the same whoever wrote them), three tensors per changed checkpoint tensor (chosen by measurement,
benchmarks/deltas.md: the smallest of the fixed-width layouts measured at an RL learning rate's 1-3% of elements
changed, and as cheap to apply):
    {name}:counts   int32 [ceil(numel / 65536)]  how many of its elements changed in each block of 65,536
    {name}:offsets  uint16 [changed]              each changed element's position in its block, ascending
    {name}:values   its stored dtype [changed]    each changed element's new value
"Changed" is bitwise: a value whose bytes differ (so -0.0 and 0.0 differ, and NaN is no exception). Unchanged
tensors are absent. The functions take any mapping of name to tensor: a safetensors folder (`CheckpointTensors`) or
a state dict in memory, so whichever process holds the two versions writes the delta.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import blake3
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeloop.steps.cores import usable_cores
from moeloop.steps.model.file_changes import BLOCK, BLOCK_BITS, DTYPES, file_changes
from moeloop.steps.model.hf_shards import INDEX, SINGLE, read_layout

DELTA_FILE = "delta-{}.safetensors"  # the checkpoint file's stem
DELTA_PARTS = ("counts", "offsets", "values")  # a changed tensor's three tensors in a delta file
PART_DTYPES = {"counts": torch.int32, "offsets": torch.uint16}  # values: the tensor's stored dtype
STORED_DTYPES = DTYPES | {"I32": torch.int32, "U16": torch.uint16}
PARALLEL_HASH_BYTES = 64 << 20  # BLAKE3 hashes a tensor this large on several threads
HASH_THREADS = min(32, usable_cores())  # tensors hashed side by side (BLAKE3 releases the GIL)
IN_FLIGHT_BYTES = 1 << 30  # host tensors read but not yet hashed, at most (a checkpoint's tensors are read one by one)
STAGING_BYTES = 256 << 20  # a GPU's tensors come to the host this much at a time, in each of two pinned buffers


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (uint8, on its device): its dtype's, row-major."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def bytes_digest(data: torch.Tensor, max_threads: int = blake3.blake3.AUTO) -> str:
    """The BLAKE3 of bytes (a uint8 tensor, on any device); bytes of PARALLEL_HASH_BYTES or more on up to max_threads
    threads (AUTO: all cores)."""
    array = data.cpu().numpy()
    threads = max_threads if array.nbytes >= PARALLEL_HASH_BYTES else 1
    return blake3.blake3(memoryview(array), max_threads=threads).hexdigest()


def tensor_digest(tensor: torch.Tensor) -> str:
    """The BLAKE3 of a tensor's bytes: its dtype's, row-major."""
    return bytes_digest(tensor_bytes(tensor))


class Digests:
    """Tensors' digests, hashed on HASH_THREADS threads while the caller reads the next ones. A GPU's tensors come
    to the host through two pinned buffers in turn, one filling while the threads hash the other: one digest check
    of a GPU engine's weights is bound by the host link and the cores, not by one thread hashing (issue 38).

    threads: the most cores its hashing takes (beside other work on the host); None: all of them, HASH_THREADS
    tensors side by side and a large one on every core."""

    def __init__(self, threads: int | None = None) -> None:
        self.pool = ThreadPoolExecutor(threads or HASH_THREADS, thread_name_prefix="digest")
        self.tensor_threads = blake3.blake3.AUTO if threads is None else 1  # for one large tensor
        self.futures: dict[str, Future[str]] = {}
        self.in_flight: deque[tuple[Future[str], int]] = deque()  # host tensors' hashes, oldest first, and sizes
        self.in_flight_bytes = 0
        self.buffers: list[torch.Tensor] = []
        self.hashing: list[list[Future[str]]] = [[], []]  # the hashes reading each buffer
        self.turn, self.staged = 0, []  # the buffer filling, and (name, start, size) copied into it
        self.devices: set[torch.device] = set()  # the GPUs whose copies fill it

    def __enter__(self) -> Digests:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.pool.shutdown(cancel_futures=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor_bytes(tensor)
        if data.is_cuda and len(data) <= STAGING_BYTES:
            self._stage(name, data)
            return
        if data.is_cuda:  # on the caller's stream, after the writes queued there (a pool thread's is the default)
            data = data.cpu()
        while self.in_flight and (self.in_flight[0][0].done() or self.in_flight_bytes + len(data) > IN_FLIGHT_BYTES):
            future, size = self.in_flight.popleft()
            future.result()
            self.in_flight_bytes -= size
        self.futures[name] = self.pool.submit(bytes_digest, data, self.tensor_threads)
        self.in_flight.append((self.futures[name], len(data)))
        self.in_flight_bytes += len(data)

    def _stage(self, name: str, data: torch.Tensor) -> None:
        if not self.buffers:
            self.buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        start = self.staged[-1][1] + self.staged[-1][2] if self.staged else 0
        if start + len(data) > STAGING_BYTES:
            self._hash_staged()
            start = 0
        self.buffers[self.turn][start : start + len(data)].copy_(data, non_blocking=True)
        self.staged.append((name, start, len(data)))
        self.devices.add(data.device)

    def _hash_staged(self) -> None:
        """Hash what the filling buffer holds once its copies are in, and wait until the other one is free."""
        for device in self.devices:
            torch.cuda.current_stream(device).synchronize()
        self.devices.clear()
        buffer = self.buffers[self.turn]
        for name, start, size in self.staged:
            self.futures[name] = self.pool.submit(bytes_digest, buffer[start : start + size])
            self.hashing[self.turn].append(self.futures[name])
        self.staged, self.turn = [], 1 - self.turn
        for future in self.hashing[self.turn]:
            future.result()
        self.hashing[self.turn] = []

    def result(self) -> dict[str, str]:
        """Every added tensor's digest, by name."""
        if self.staged:
            self._hash_staged()
        return {name: future.result() for name, future in self.futures.items()}


def weights_digest(digests: Mapping[str, str]) -> str:
    """One digest of all tensors: BLAKE3 over each name and its tensor's digest, in name order."""
    hasher = blake3.blake3()
    for name in sorted(digests):
        hasher.update(name.encode() + b"\0" + bytes.fromhex(digests[name]))
    return hasher.hexdigest()


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """The tensors of an HF checkpoint folder (one safetensors file, or an index of shards), each read from its file
    when asked for, in its stored dtype."""

    def __init__(self, folder: Path, names: Collection[str] | None = None) -> None:
        """names: only these of its tensors (those it holds; a rank's share of a checkpoint, whose other files its
        folder may lack)."""
        index = folder / INDEX
        if names is not None and not names:
            file_of = {}
        elif index.exists():
            file_of = {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        else:
            with safe_open(folder / SINGLE, "pt") as single:
                file_of = dict.fromkeys(single.keys(), folder / SINGLE)
        self.file_of = file_of if names is None else {name: file_of[name] for name in names if name in file_of}
        self.open: dict[Path, object] = {}

    @property
    def files(self) -> dict[str, str]:
        """The file holding each tensor, by name."""
        return {name: path.name for name, path in self.file_of.items()}

    def _file(self, name: str) -> object:
        path = self.file_of[name]
        if path not in self.open:
            self.open[path] = safe_open(path, "pt")
        return self.open[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)  # type: ignore[attr-defined]

    def kinds(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor's shape and stored dtype, from the files' headers (no tensor is read)."""
        slices = {name: self._file(name).get_slice(name) for name in self.file_of}  # type: ignore[attr-defined]
        return {name: (tuple(s.get_shape()), DTYPES[s.get_dtype()]) for name, s in slices.items()}

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)


def checkpoint_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Every tensor's digest, by name (each tensor read once, in turn)."""
    with Digests() as digests:
        for name in tensors:
            digests.add(name, tensors[name])
        return digests.result()


def changed_positions(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The flat positions (int64, ascending) where new's bytes differ from base's."""
    if base.shape != new.shape or base.dtype != new.dtype:
        kinds = f"{tuple(base.shape)} {base.dtype} and {tuple(new.shape)} {new.dtype}"
        raise ValueError(f"tensors of {kinds} differ in kind")
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    return torch.nonzero(base.reshape(-1).view(bits) != new.reshape(-1).view(bits)).view(-1)


def encode(positions: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, offsets) of ascending flat positions in a tensor of numel elements."""
    counts = torch.bincount(positions >> BLOCK_BITS, minlength=-(-numel // BLOCK)).to(torch.int32)
    return counts, (positions & (BLOCK - 1)).to(torch.uint16)


def decode(counts: torch.Tensor, offsets: torch.Tensor, block_starts: torch.Tensor | None = None) -> torch.Tensor:
    """The flat positions (int64) that (counts, offsets) encode; block_starts: each block's first position (default:
    its index x BLOCK; an engine gives where it holds the tensor's elements, for blocks of several tensors at once)."""
    if block_starts is None:
        block_starts = torch.arange(len(counts), dtype=torch.int64, device=counts.device) * BLOCK
    # output_size: on a GPU, without it repeat_interleave waits for the device to learn its length
    positions = torch.repeat_interleave(block_starts, counts.to(torch.int64), output_size=len(offsets))
    return positions + offsets.to(torch.int64)


@dataclass
class DeltaSummary:
    """What a delta holds: base_digests and digests, every tensor's of the two versions (base_digests empty without
    a base)."""

    base_digests: dict[str, str]
    digests: dict[str, str]
    changed: int  # elements
    elements: int
    delta_bytes: int  # of its files
    checkpoint_bytes: int  # of the new version's tensors

    @classmethod
    def merged(cls, parts: list[DeltaSummary]) -> DeltaSummary:
        """The summary of the delta whose files and tensors `parts` (a writer's each: a rank's) hold between them."""
        counts = ("changed", "elements", "delta_bytes", "checkpoint_bytes")
        return cls(
            {name: digest for part in parts for name, digest in part.base_digests.items()},
            {name: digest for part in parts for name, digest in part.digests.items()},
            *(sum(getattr(part, count) for part in parts) for count in counts),
        )

    def record(self, base: int, iteration: int) -> dict[str, object]:
        """The delta's record (its folder's digests.json): the versions, their weights' digests, the new one's
        tensor digests, and how much changed."""
        return {
            "base": base, "iteration": iteration,
            "base_digest": weights_digest(self.base_digests) if self.base_digests else None,
            "digest": weights_digest(self.digests),
            "changed": self.changed, "elements": self.elements, "delta_bytes": self.delta_bytes,
            "checkpoint_bytes": self.checkpoint_bytes, "tensors": self.digests,
        }  # fmt: skip


def write_delta(
    base: Mapping[str, torch.Tensor] | None,
    new: Mapping[str, torch.Tensor],
    output: Path,
    files: Mapping[str, str] | None = None,
    base_digests: Mapping[str, str] | None = None,
) -> DeltaSummary:
    """The delta from base to new (the same tensor names, shapes and dtypes; a ValueError else) into output's
    safetensors files, a file per checkpoint file (files: the one holding each of new's tensors, by name; None: one
    file), and both versions' digests, computed on the way: each tensor is read once from each side. Without a base:
    new's digests alone. base_digests: base's tensors' digests where they are known (its committed record), taken as
    they are; the others are hashed. Two checkpoint folders' files of one layout compare a file at a time
    (`file_changes`), others a tensor at a time: the same delta either way."""
    if base is not None and set(base) != set(new):
        raise ValueError(f"the versions hold different tensors: {sorted(set(base) ^ set(new))[:3]}")
    output.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[str]] = {}
    for name in sorted(new):
        groups.setdefault(files[name] if files is not None else SINGLE, []).append(name)
    summary = DeltaSummary({}, {}, 0, 0, 0, 0)
    known = base_digests or {}
    with Digests() as digests, Digests() as hashed_base:
        for file in sorted(groups):
            entries: dict[str, torch.Tensor] = {}
            at_once = None
            if isinstance(base, CheckpointTensors) and isinstance(new, CheckpointTensors):
                name = groups[file][0]
                at_once = file_changes(base.file_of[name], new.file_of[name], groups[file])
            for name in groups[file]:
                now = new[name]
                digests.add(name, now)
                summary.elements += now.numel()
                summary.checkpoint_bytes += now.numel() * now.element_size()
                if base is None:
                    continue
                if name in known:
                    summary.base_digests[name] = known[name]
                else:
                    hashed_base.add(name, base[name])
                if at_once is not None:
                    parts = at_once.get(name)
                else:
                    positions = changed_positions(base[name], now)
                    parts = (*encode(positions, now.numel()), now.reshape(-1)[positions]) if len(positions) else None
                if parts is not None:
                    summary.changed += len(parts[1])
                    entries |= {f"{name}:{part}": tensor for part, tensor in zip(DELTA_PARTS, parts, strict=True)}
            if entries:
                path = output / DELTA_FILE.format(Path(file).stem)
                save_file(entries, path)
                summary.delta_bytes += path.stat().st_size
        summary.digests, summary.base_digests = digests.result(), summary.base_digests | hashed_base.result()
    return summary


@dataclass(frozen=True)
class Changed:
    """One changed tensor of a delta file: where its parts lie in the file's data, as element ranges [start, stop)
    of the data seen as their dtypes (counts int32, offsets uint16, values the tensor's stored dtype)."""

    name: str
    counts: tuple[int, int]
    offsets: tuple[int, int]
    values: tuple[int, int]
    dtype: torch.dtype

    @property
    def size(self) -> int:
        """Its changed elements."""
        return self.offsets[1] - self.offsets[0]

    @property
    def blocks(self) -> int:
        """Its blocks of BLOCK elements (its counts)."""
        return self.counts[1] - self.counts[0]


class DeltaFile:
    """One delta file read whole into host memory: its data, and its changed tensors in the order the file holds
    them (a GPU engine copies their parts by the batch, not by the tensor: `EngineWeights.apply_delta`). A file
    whose tensors are not a delta's parts is a ValueError naming the first that is not."""

    def __init__(self, path: Path) -> None:
        start, entries = read_layout(path)
        found: dict[str, dict[str, dict[str, Any]]] = {}
        for key, entry in entries.items():
            name, _, part = key.rpartition(":")
            found.setdefault(name, {})[part] = entry
        data_bytes = path.stat().st_size - start
        changed = [self._changed(path.name, name, parts, data_bytes) for name, parts in found.items()]
        self.changed = sorted(changed, key=lambda c: (str(c.dtype), c.values))
        self.data = torch.empty(data_bytes, dtype=torch.uint8)
        with open(path, "rb") as file:
            file.seek(start)
            if file.readinto(self.data.numpy()) != len(self.data):
                raise ValueError(f"{path.name} ended while it was read")

    @staticmethod
    def _changed(file: str, name: str, parts: dict[str, dict[str, Any]], data_bytes: int) -> Changed:
        if sorted(parts) != sorted(DELTA_PARTS):
            raise ValueError(f"{file}: {name} has the parts {sorted(parts)}, a delta's are {list(DELTA_PARTS)}")
        spans = {}
        for part, entry in parts.items():
            dtype = STORED_DTYPES.get(entry["dtype"])
            begin, end = entry["data_offsets"]
            size = dtype.itemsize if dtype else 1
            if dtype is None or dtype != PART_DTYPES.get(part, dtype) or entry["shape"] != [(end - begin) // size]:
                raise ValueError(f"{file}: {name}:{part} ({entry['dtype']} {entry['shape']}) is no delta's {part}")
            if begin % size or (end - begin) % size:
                raise ValueError(f"{file}: {name}:{part} lies across its dtype's {size}-byte elements")
            if not 0 <= begin <= end <= data_bytes:
                raise ValueError(f"{file}: {name}:{part} lies at bytes {begin}-{end} of its {data_bytes} bytes of data")
            spans[part] = (begin // size, end // size)
        offsets, values = (spans[part][1] - spans[part][0] for part in ("offsets", "values"))
        if offsets != values:
            raise ValueError(f"{file}: {name} has {offsets} offsets and {values} values")
        dtype = STORED_DTYPES[parts["values"]["dtype"]]
        return Changed(name, spans["counts"], spans["offsets"], spans["values"], dtype)

    def parts(self, part: str, changed: list[Changed]) -> torch.Tensor:
        """The part (counts, offsets or values) of changed tensors (at least one; for values, of one dtype), one
        after another, on the host: a view of the data where the file holds them so (as write_delta lays them out), else
        a copy."""
        dtype = PART_DTYPES.get(part, changed[0].dtype)
        flat = self.data[: len(self.data) // dtype.itemsize * dtype.itemsize].view(dtype)
        spans = [getattr(c, part) for c in changed]
        if all(one[1] == following[0] for one, following in zip(spans, spans[1:])):
            return flat[spans[0][0] : spans[-1][1]]
        return torch.cat([flat[begin:end] for begin, end in spans])
