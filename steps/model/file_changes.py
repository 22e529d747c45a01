"""A delta's changes for all the tensors of one checkpoint file at once: where the file of the version before has the
same layout (the same tensors at the same offsets: the trainer writes every version's files alike) and its tensors'
elements are all of one size (bf16 and fp16, or fp32), the two files' data compare as one array, and the changed
positions split among the tensors by their offsets. A rank's share of Qwen3-30B-A3B is 2,358 tensors in 6 files,
most of them one expert's 3 MB: compared a tensor at a time, the calls per tensor were most of `write_delta`'s time
(2.3x it, benchmarks/handoff.md), and the delta write is on the handoff's critical path (issue 38). The encoding is
`moeloop.steps.model.delta`'s (counts, offsets, values)."""

from __future__ import annotations

import mmap
from collections.abc import Collection
from pathlib import Path

import torch

from moeloop.steps.model.hf_shards import SAFETENSORS_DTYPE, read_layout

BLOCK_BITS = 16  # moeloop.steps.model.delta's blocks: a changed tensor's positions are counted per block of
BLOCK = 1 << BLOCK_BITS  # this many elements, a position within one fits a uint16
DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPE.items()}  # what a checkpoint stores, by its code
BITS = {2: torch.int16, 4: torch.int32}  # a compare by element size


def file_changes(
    base: Path, new: Path, names: Collection[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """Each changed tensor's (counts, offsets, values) from safetensors file base to new, by name; unchanged tensors
    absent. None where the files' layouts differ, names are not all of the file's tensors, or its tensors' elements
    differ in size or are of another dtype: the caller compares those a tensor at a time."""
    base_start, base_entries = read_layout(base)
    new_start, new_entries = read_layout(new)
    if base_entries != new_entries or set(new_entries) != set(names) or not new_entries:
        return None
    sizes_of = {DTYPES[entry["dtype"]].itemsize if entry["dtype"] in DTYPES else 0 for entry in new_entries.values()}
    if len(sizes_of) != 1 or (item := sizes_of.pop()) not in BITS:
        return None
    ordered = sorted(new_entries, key=lambda name: new_entries[name]["data_offsets"][0])
    starts = torch.tensor([new_entries[name]["data_offsets"][0] // item for name in ordered], dtype=torch.int64)
    sizes = torch.tensor([torch.Size(new_entries[name]["shape"]).numel() for name in ordered], dtype=torch.int64)
    elements = new_entries[ordered[-1]]["data_offsets"][1] // item
    with open(base, "rb") as base_file, open(new, "rb") as new_file:
        # copy-on-write maps: writable for torch.frombuffer, read without a copy
        base_map = mmap.mmap(base_file.fileno(), 0, access=mmap.ACCESS_COPY)
        new_map = mmap.mmap(new_file.fileno(), 0, access=mmap.ACCESS_COPY)
    base_data = torch.frombuffer(base_map, dtype=BITS[item], count=elements, offset=base_start)
    new_data = torch.frombuffer(new_map, dtype=BITS[item], count=elements, offset=new_start)
    positions = torch.nonzero(base_data != new_data).view(-1)  # in the file's data, ascending
    values = new_data[positions]
    del base_data, new_data
    base_map.close()
    new_map.close()

    changed = torch.diff(torch.searchsorted(positions, torch.cat([starts, starts[-1:] + sizes[-1:]])))
    local = positions - torch.repeat_interleave(starts, changed, output_size=len(positions))
    blocks = -(-sizes // BLOCK)  # each tensor's counts
    first_block = torch.cumsum(blocks, 0) - blocks
    block_of = torch.repeat_interleave(first_block, changed, output_size=len(positions)) + (local >> BLOCK_BITS)
    counts = torch.bincount(block_of, minlength=int(blocks.sum())).to(torch.int32)
    offsets = (local & (BLOCK - 1)).to(torch.uint16)
    found: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    cuts = torch.cumsum(changed, 0).tolist()
    for index, (name, stop, block, count) in enumerate(zip(ordered, cuts, first_block.tolist(), blocks.tolist())):
        start = cuts[index - 1] if index else 0
        if stop > start:
            dtype = DTYPES[new_entries[name]["dtype"]]
            found[name] = (
                counts[block : block + count].clone(),
                offsets[start:stop].clone(),
                values[start:stop].view(dtype).clone(),
            )
    return found
