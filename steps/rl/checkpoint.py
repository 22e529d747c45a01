"""The trainer state as sharded `torch.distributed.checkpoint` (DCP) folders: each rank writes and reads only its own
shards, and a state written at one (world size, EP) shape loads at any other.

A trainer-state folder (committed with the storage's COMMIT protocol, steps/storage/README.md, by
`moeloop.steps.storage.ranks.commit_from_ranks`):

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
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from moeloop.steps.cores import usable_cores
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.hf_shards import SafetensorsWriter, StoredTensor, plan_shards, shard_names, write_index
from moeloop.steps.model.policy import hf_model_on_meta, read_config, sparse_blocks, stored_dtype, stored_tensors, tensor_dtype
from moeloop.steps.model.sharding import local
from moeloop.steps.rl.offload import OffloadedAdamW
from moeloop.steps.rl.parallel import Parallel, expert_parameters

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
    (`read_in_blocks`), so a writer holds a saved chunk and a block, never the model; the files are written side by
    side, one thread each, as many at once as this process has cores."""
    folder = state_dir / WEIGHTS_DIR
    shapes = {key: tuple(value.size) for key, value in saved_shapes(folder).items()}
    layout = hf_layout(state_dir, shapes, max_shard_bytes)
    write_hf_files(layout, lambda keys: read_in_blocks(folder, keys), output, range(len(layout.names)))


@dataclass(frozen=True)
class HFLayout:
    """The HF checkpoint of a model (its config's, of the trainer's tensors' shapes): its files, the trainer tensors
    (by key) each holds, and the HF tensors each of those is stored as (per expert, in the stored dtype)."""

    model: nn.Module  # the HF model on the meta device, of its config
    tokenizer: Any
    stored: dict[str, list[StoredTensor]]  # by trainer key
    names: list[str]  # the files
    keys: list[list[str]]  # each file's trainer keys

    def shares(self, world_size: int) -> list[list[int]]:
        """The files each of world_size ranks writes: the largest first, each to the rank holding the fewest bytes
        so far (the same on every rank)."""
        size = [sum(t.nbytes() for key in keys for t in self.stored[key]) for keys in self.keys]
        shares: list[list[int]] = [[] for _ in range(world_size)]
        held = [0] * world_size
        for file in sorted(range(len(size)), key=lambda f: (-size[f], f)):
            rank = min(range(world_size), key=lambda r: (held[r], r))
            shares[rank].append(file)
            held[rank] += size[file]
        return [sorted(share) for share in shares]

    def weight_map(self, files: Iterable[int]) -> dict[str, str]:
        """The HF tensors of these files, each with its file's name."""
        return {t.name: self.names[f] for f in files for key in self.keys[f] for t in self.stored[key]}


def hf_layout(config_dir: Path, shapes: dict[str, tuple[int, ...]], max_shard_bytes: int) -> HFLayout:
    """The HF checkpoint's layout of the model config_dir's config describes, of its tensors by trainer name (of
    the given shapes), in files of at most max_shard_bytes."""
    config, tokenizer = read_config(config_dir)
    dtype = stored_dtype(config)
    model = hf_model_on_meta(config)
    require_same_shapes(shapes, {key: tuple(value.shape) for key, value in checkpointed(model).items()}, str(config_dir))
    blocks = sparse_blocks(model)
    stored = {key: stored_tensors(key, shape, blocks, tensor_dtype(key, model, dtype)) for key, shape in sorted(shapes.items())}
    keys = plan_shards(stored, max_shard_bytes)
    model.config.dtype = str(dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    return HFLayout(model, tokenizer, stored, shard_names(len(keys)), keys)


def write_hf_files(
    layout: HFLayout,
    read_blocks: Callable[[list[str]], Iterator[tuple[str, torch.Tensor]]],
    output: Path,
    files: Iterable[int],
) -> None:
    """These files of the layout's checkpoint (their tensors read by read_blocks(keys), as (key, row block) in keys'
    order), and its index, config and tokenizer: a checkpoint folder whose other files, if any, are written
    elsewhere (by other ranks)."""
    output.mkdir(parents=True, exist_ok=True)

    def write_file(file: int) -> None:
        keys = layout.keys[file]
        with SafetensorsWriter(output / layout.names[file], [t for key in keys for t in layout.stored[key]]) as writer:
            for key, block in read_blocks(keys):
                writer.write(block.to(layout.stored[key][0].dtype))

    files = list(files)
    with ThreadPoolExecutor(max(1, min(len(files), usable_cores()))) as pool:
        for done in [pool.submit(write_file, file) for file in files]:
            done.result()
    write_index(output, layout.names, [[t for key in keys for t in layout.stored[key]] for keys in layout.keys])
    layout.model.config.save_pretrained(output)
    if layout.model.can_generate():
        layout.model.generation_config.save_pretrained(output)
    layout.tokenizer.save_pretrained(output)


def global_shapes(model: nn.Module, parallel: Parallel) -> dict[str, tuple[int, ...]]:
    """Every tensor `save_sharded` saves of model, by name, with its whole shape (no tensor is gathered)."""
    experts = expert_parameters(model)
    return {name: tuple(global_view(t, t, t in experts, parallel).shape) for name, t in checkpointed(model).items()}


def whole_weights(model: nn.Module, parallel: Parallel, keep: Collection[str]) -> dict[str, torch.Tensor]:
    """The tensors named in keep (this rank's) of those `save_sharded` saves of model, whole, in fp32 on the host.
    Collective: the ranks gather one tensor at a time, in name order, so none holds more than a tensor besides its
    shard and the host copies of those it keeps."""
    experts = expert_parameters(model)
    whole = {}
    for name, tensor in sorted(checkpointed(model).items()):
        view = global_view(tensor, tensor, tensor in experts, parallel)
        value = view.full_tensor() if isinstance(view, DTensor) else view
        if name in keep:
            whole[name] = value.to("cpu", torch.float32, copy=True)
    return whole
