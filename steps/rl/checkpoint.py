"""The trainer state as sharded `torch.distributed.checkpoint` (DCP) folders: each rank writes and reads only its own
shards, and a state written at one (world size, EP) shape loads at any other.

A trainer-state folder (committed with the storage's COMMIT protocol, steps/storage/README.md, by
`commit_trainer_state`):

    config.json, tokenizer files   rank 0: the model's HF config (its dtype is the checkpoint's) and tokenizer
    weights/                       DCP: every parameter in fp32 (the optimizer's master weights), and every
                                   persistent buffer (DeepSeek-V3's router correction bias), by HF name
    optimizer/                     DCP: AdamW's step, exp_avg and exp_avg_sq, by HF parameter name
    critic/                        PPO: the critic's, laid out as above

DCP writes one `__<rank>_0.distcp` per rank into each DCP folder and `.metadata` (rank 0), which records every
tensor's global shape and which file holds which chunk of it. Every tensor is declared in its global index
space, so DCP reshards on load:
- dense weights and routers: FSDP2's DTensors over the world mesh, as they are;
- experts: FSDP2 shards this EP rank's slice [E / ep, ...] over the dp ranks that hold it, and the slice is rows
  [r E / ep, (r + 1) E / ep) of the whole [E, ...] tensor. A DTensor over the (ep, dp) mesh placed
  [Shard(0), Shard(0)] (ep outer, dp inner, torch.chunk's split as FSDP2's) says exactly that, over this rank's
  local shard, with no copy and no communication.
Publish turns weights/ into the HF checkpoint (`write_hf_checkpoint`), so no trainer rank gathers the model, and
neither does publish: it reads the weights a saved chunk (or a batch of small tensors) at a time and streams each
block, cast to the dtype HF stores it in (the checkpoint's; fp32 for what HF keeps in fp32), into sharded
safetensors (`moeloop.steps.model.hf_shards`).
"""

from __future__ import annotations

import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.hf_shards import SafetensorsWriter, plan_shards, shard_names, write_index
from moeloop.steps.model.policy import hf_model_on_meta, read_config, sparse_blocks, stored_dtype, stored_tensors, tensor_dtype
from moeloop.steps.model.sharding import local
from moeloop.steps.rl.offload import OffloadedAdamW
from moeloop.steps.rl.parallel import Parallel, expert_parameters
from moeloop.steps.storage.run import RunStorage

WEIGHTS_DIR, OPTIMIZER_DIR = "weights", "optimizer"
METADATA = ".metadata"  # DCP's index of a DCP folder, written last by rank 0
READ_BLOCK_ELEMENTS = 1 << 26  # publish reads a batch of small tensors of at most 256 MiB of fp32 at once


def global_view(value: torch.Tensor, parameter: torch.Tensor, expert: bool, parallel: Parallel) -> torch.Tensor:
    """value (a parameter's, or its optimizer state's, local shard or DTensor) as a DTensor in the parameter's
    global index space, sharing value's storage: what DCP saves from and loads into. One process, or a plain tensor
    (a buffer, replicated): value itself."""
    if not isinstance(parameter, DTensor):
        return value.detach()
    shard = local(value.detach())
    ep_size = parallel.ep_group.size() if parallel.ep_group is not None else 1
    if expert and ep_size > 1:
        mesh, placements = parallel.expert_mesh, (Shard(0), Shard(0))
        shape = torch.Size((parameter.shape[0] * ep_size, *parameter.shape[1:]))
    else:
        mesh, placements, shape = parameter.device_mesh, parameter.placements, parameter.shape
    # DTensor's constructor, not from_local: that one would copy host-offloaded moments onto a CUDA mesh's device.
    meta = TensorMeta(shape, torch.empty(shape, device="meta").stride(), shard.dtype)
    return DTensor(shard, DTensorSpec(mesh, tuple(placements), meta), requires_grad=False)


def checkpointed(model: nn.Module) -> dict[str, torch.Tensor]:
    """What weights/ holds of model, by HF name: its parameters, then its persistent buffers that are none (a
    DeepSeek-V3 router's correction bias, which no optimizer steps and the HF checkpoint holds)."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    buffers = {k: v for k, v in model.state_dict(keep_vars=True).items() if not isinstance(v, nn.Parameter)}
    return tensors | buffers


def sharded_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(weights, optimizer state) by HF name, each a global view of this rank's shard (a buffer: replicated, as it
    is)."""
    experts = expert_parameters(model)
    weights, moments = {}, {}
    for name, tensor in checkpointed(model).items():
        expert = tensor in experts
        weights[name] = global_view(tensor, tensor, expert, parallel)
        if isinstance(tensor, nn.Parameter):
            moments[name] = {
                key: global_view(value, tensor, expert, parallel) if value.dim() else value
                for key, value in optimizer.state[tensor].items()
            }
    return weights, moments


class ReproducibleWriter(FileSystemWriter):
    """DCP's file writer, less the storage metadata it puts in `.metadata` (a fresh save id and the local folder's
    path): the same state then writes the same bytes, so a retried or replayed train step commits the same digests.
    Loading does not read it."""

    def storage_meta(self) -> None:  # type: ignore[override]
        return None


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel, directory: Path) -> None:
    """This rank's shards of the weights and the optimizer state into directory's DCP folders. Collective."""
    weights, moments = sharded_tensors(model, optimizer, parallel)
    dcp.save(weights, storage_writer=ReproducibleWriter(directory / WEIGHTS_DIR))
    dcp.save(moments, storage_writer=ReproducibleWriter(directory / OPTIMIZER_DIR))


def fresh_state(parameter: nn.Parameter, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Zeroed AdamW state for parameter, laid out as the optimizer keeps it, for DCP to load into."""
    if isinstance(optimizer, OffloadedAdamW):
        shard = local(parameter.detach())
        pin = shard.is_cuda
        moments = {key: torch.zeros(shard.shape, dtype=shard.dtype, pin_memory=pin) for key in ("exp_avg", "exp_avg_sq")}
        return {"step": torch.tensor(0.0), **moments}
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    step = torch.zeros((), dtype=torch.float32, device=parameter.device if on_device else "cpu")
    return {"step": step, "exp_avg": torch.zeros_like(parameter.detach()), "exp_avg_sq": torch.zeros_like(parameter.detach())}


def load_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel, directory: Path, source: str
) -> None:
    """The inverse of `save_sharded`, at this rank's shape whatever the saving one's: the weights into the model's
    parameters in place, the optimizer state into fresh tensors. Refuses a state whose tensors are not this
    model's (source names it). Collective."""
    stepped = saved_shapes(directory / OPTIMIZER_DIR)  # parameters never stepped (frozen routers) have no state
    for name, parameter in model.named_parameters():
        if f"{name}.step" in stepped:
            optimizer.state[parameter] = fresh_state(parameter, optimizer)
    weights, moments = sharded_tensors(model, optimizer, parallel)
    require_same_tensors(directory / WEIGHTS_DIR, weights, source)
    dcp.load(weights, checkpoint_id=directory / WEIGHTS_DIR)
    dcp.load(moments, checkpoint_id=directory / OPTIMIZER_DIR)


def saved_shapes(folder: Path) -> dict[str, TensorStorageMetadata]:
    metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {key: value for key, value in metadata.items() if isinstance(value, TensorStorageMetadata)}


def require_same_tensors(folder: Path, weights: dict[str, torch.Tensor], source: str) -> None:
    """A one-line error naming the first tensor whose name or global shape differs between the state and the model."""
    saved = {key: tuple(value.size) for key, value in saved_shapes(folder).items()}
    require_same_shapes(saved, {key: tuple(value.shape) for key, value in weights.items()}, source)


def require_same_shapes(saved: dict[str, tuple[int, ...]], ours: dict[str, tuple[int, ...]], source: str) -> None:
    for key in sorted(saved.keys() | ours.keys()):
        if saved.get(key) != ours.get(key):
            raise MoeloopError(
                f"trainer state {source} is not of this model: {key} is {saved.get(key, 'absent')} there,"
                f" {ours.get(key, 'absent')} in the model"
            )


def commit_trainer_state(
    storage: RunStorage,
    folder: str,
    local_dir: Path,
    parallel: Parallel,
    extra: dict[str, Any],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Every rank uploads the files it wrote under local_dir (its shards; rank 0 also the config, tokenizer and DCP
    indexes), in parallel on S3; rank 0 gathers their COMMIT entries and writes COMMIT, the folder's commit point,
    once all have arrived. Collective over group (default: the world)."""
    sources = {p.relative_to(local_dir).as_posix(): p for p in sorted(local_dir.rglob("*")) if p.is_file()}
    files = storage.put_objects(folder, sources)
    gathered: list[Any] | None = [None] * parallel.world_size if parallel.rank == 0 else None
    if parallel.world_size > 1:
        dist.gather_object(files, gathered, dst=0, group=group)
    else:
        gathered = [files]
    if parallel.rank == 0:
        storage.commit(folder, {name: entry for part in gathered for name, entry in part.items()}, extra)
    if parallel.world_size > 1:
        dist.barrier(group=group)  # no rank reports the state committed before it is


def read_whole(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, whole, in dtype, in one process (tests compare states with it)."""
    state = {key: torch.empty(value.size, dtype=value.properties.dtype) for key, value in saved_shapes(folder).items()}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return {key: value.to(dtype) for key, value in state.items()}


class RowsPlanner(DefaultLoadPlanner):
    """Loads rows [start, start + len(buffer)) of each saved tensor into its buffer (the state dict's values), from
    whichever saved chunks hold them."""

    def __init__(self, starts: dict[str, int]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.starts = starts

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        reads = []
        for key, buffer in self.state_dict.items():
            offsets = torch.Size((self.starts[key],) + (0,) * (buffer.dim() - 1))
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=buffer.size())
            reads += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(reads)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the buffer is the local chunk: read items' offsets are relative to it


class IndexOnceReader(FileSystemReader):
    """DCP's file reader, reading the folder's `.metadata` once however many loads it serves."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:
        if self.metadata is None:
            self.metadata = super().read_metadata()
        return self.metadata


def row_blocks(value: TensorStorageMetadata) -> list[tuple[int, int]]:
    """The [start, stop) row ranges to read a saved tensor in: whole if small, else one per saved chunk's rows (a
    trainer rank's shard), so a read holds the chunk it loads and its block, not the tensor."""
    rows = value.size[0] if len(value.size) else 1
    if math.prod(value.size) <= READ_BLOCK_ELEMENTS or not len(value.size):
        return [(0, rows)]
    cuts = sorted({0, rows} | {c.offsets[0] for c in value.chunks} | {c.offsets[0] + c.sizes[0] for c in value.chunks})
    return list(itertools.pairwise(cuts))


def read_in_blocks(folder: Path, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a DCP folder named by keys, in that order, as (key, row block) in their saved dtype: small
    tensors a batch of at most READ_BLOCK_ELEMENTS per load, large ones a saved chunk's rows at a time."""
    reader = IndexOnceReader(folder)
    saved = saved_shapes(folder)
    pending: dict[str, torch.Tensor] = {}
    starts: dict[str, int] = {}

    def load() -> Iterator[tuple[str, torch.Tensor]]:
        dcp.load(pending, storage_reader=reader, planner=RowsPlanner(starts), no_dist=True)
        yield from pending.items()
        pending.clear()
        starts.clear()

    for key in keys:
        value = saved[key]
        for start, stop in row_blocks(value):
            block = torch.empty((stop - start, *value.size[1:]), dtype=value.properties.dtype)
            if pending and sum(t.numel() for t in pending.values()) + block.numel() > READ_BLOCK_ELEMENTS:
                yield from load()
            if key in pending:  # one block of a key per load
                yield from load()
            pending[key], starts[key] = block, start
    if pending:
        yield from load()


def write_hf_checkpoint(state_dir: Path, output: Path, max_shard_bytes: int) -> None:
    """The HF checkpoint of a trainer-state folder (its weights/, config and tokenizer): sharded safetensors in the
    config's dtype (what HF keeps in fp32 in fp32, as its save_pretrained writes it), the experts per expert and
    every tensor named as the model's family stores them. Each block is cast and streamed to its file as it is read
    (`read_in_blocks`), so a writer holds a saved chunk and a block, never the model; the files are written side by side, one thread each, as many at once as this process has cores."""
    folder = state_dir / WEIGHTS_DIR
    shapes = {key: tuple(value.size) for key, value in saved_shapes(folder).items()}
    write_hf_shards(state_dir, shapes, lambda keys: read_in_blocks(folder, keys), output, max_shard_bytes)


def write_hf_from_memory(held_dir: Path, tensors: dict[str, torch.Tensor], output: Path, max_shard_bytes: int) -> None:
    """The HF checkpoint of whole tensors held in memory (`whole_weights`), with held_dir's config and tokenizer:
    the bytes `write_hf_checkpoint` writes from a trainer state of the same weights (each tensor cast the same way)."""
    shapes = {key: tuple(value.shape) for key, value in tensors.items()}
    write_hf_shards(held_dir, shapes, lambda keys: ((key, tensors[key]) for key in keys), output, max_shard_bytes)


def whole_weights(model: nn.Module, parallel: Parallel) -> dict[str, torch.Tensor] | None:
    """Every tensor `save_sharded` saves of model, whole, in fp32 on the host: on rank 0; None on the others.
    Collective: the ranks gather one tensor at a time, in name order, so none holds more than a tensor besides its
    shard (rank 0 keeps each one's host copy)."""
    experts = expert_parameters(model)
    whole = {}
    for name, tensor in sorted(checkpointed(model).items()):
        view = global_view(tensor, tensor, tensor in experts, parallel)
        value = view.full_tensor() if isinstance(view, DTensor) else view
        if parallel.rank == 0:
            whole[name] = value.to("cpu", torch.float32, copy=True)
    return whole if parallel.rank == 0 else None


def write_hf_shards(
    config_dir: Path,
    shapes: dict[str, tuple[int, ...]],
    read_blocks: Callable[[list[str]], Iterator[tuple[str, torch.Tensor]]],
    output: Path,
    max_shard_bytes: int,
) -> None:
    """The HF checkpoint of the model config_dir's config describes, its tensors (by trainer name, of the given
    shapes) read by read_blocks(keys) as (key, row block) in keys' order."""
    config, tokenizer = read_config(config_dir)
    dtype = stored_dtype(config)
    model = hf_model_on_meta(config)
    require_same_shapes(shapes, {key: tuple(value.shape) for key, value in checkpointed(model).items()}, str(config_dir))
    blocks = sparse_blocks(model)
    stored = {key: stored_tensors(key, shape, blocks, tensor_dtype(key, model, dtype)) for key, shape in sorted(shapes.items())}
    shards = plan_shards(stored, max_shard_bytes)
    names = shard_names(len(shards))
    output.mkdir(parents=True, exist_ok=True)

    def write_shard(name: str, keys: list[str]) -> None:
        with SafetensorsWriter(output / name, [t for key in keys for t in stored[key]]) as writer:
            for key, block in read_blocks(keys):
                writer.write(block.to(stored[key][0].dtype))

    with ThreadPoolExecutor(min(len(shards), len(os.sched_getaffinity(0)))) as pool:
        for done in [pool.submit(write_shard, name, keys) for name, keys in zip(names, shards, strict=True)]:
            done.result()
    write_index(output, names, [[t for key in keys for t in stored[key]] for keys in shards])
    model.config.dtype = str(dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(output)
    if model.can_generate():
        model.generation_config.save_pretrained(output)
    tokenizer.save_pretrained(output)
