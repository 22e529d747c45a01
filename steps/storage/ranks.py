"""A folder that a trainer's ranks commit together (a trainer state, or a checkpoint and its delta written from the
trainer's memory): each rank uploads the files it wrote, in parallel with the others, and rank 0 writes COMMIT once
all have (steps/storage/README.md's protocol). Collective: every rank returns, or raises the same error, once the
folder is committed.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.manifest import local_entry
from moeloop.steps.storage.run import RunStorage

if TYPE_CHECKING:
    from moeloop.steps.rl.parallel import Parallel

T = TypeVar("T")


def all_gather(value: T, parallel: Parallel | None, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's value, in rank order, on every rank (over group; default: the world). parallel None: one
    process."""
    if parallel is None or parallel.world_size == 1:
        return [value]
    gathered: list[Any] = [None] * parallel.world_size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def leads(parallel: Parallel | None) -> bool:
    """Whether this process writes what one process writes for all ranks (rank 0; one process: it)."""
    return parallel is None or parallel.rank == 0


def commit_from_ranks(
    storage: RunStorage,
    folder: str,
    local_dir: Path,
    parallel: Parallel | None,
    extra: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    names: Collection[str] | None = None,
) -> None:
    """Every rank uploads the files under local_dir (names: only those of them), rank 0 commits the folder naming
    all ranks' files, then every rank returns (parallel None: one process). A folder committed already (by an
    attempt before this one) is uploaded to by none: it is this commit if it names the same files, else foreign, an
    error on every rank."""
    sources = {p.relative_to(local_dir).as_posix(): p for p in sorted(local_dir.rglob("*")) if p.is_file()}
    if names is not None:
        sources = {name: path for name, path in sources.items() if name in names}
    if storage.manifest(folder) is not None:
        files = {name: local_entry(path) for name, path in sources.items()}
    else:
        files = storage.put_objects(folder, sources)
    everyone = {name: entry for part in all_gather(files, parallel, group) for name, entry in part.items()}
    failure = None
    if leads(parallel):
        try:
            storage.commit(folder, everyone, extra)
        except MoeloopError as error:
            failure = str(error)
    failures = all_gather(failure, parallel, group)  # and no rank goes on before the folder is committed
    if failures[0] is not None:
        raise MoeloopError(failures[0])
