"""The trainer that lives for a chunk (`trainer.lifetime: chunk`; its process is steps/trainer.py).

It holds the policy (PPO: and the critic) and their optimizers in memory from one iteration's update to the next, so
an iteration neither fetches nor commits a trainer state: after each update its ranks write the iteration's HF
checkpoint from memory, each rank whole files of it, and commit its delta side by side, each rank its files'
(`moeloop.steps.storage.deltas.commit_policy_delta`: the bytes publish writes from a trainer state of the same
weights; no rank holds the model). That answers the train step: the rollout engines move to the new policy by its
delta. The checkpoint itself is committed after, in the background (`BackgroundCommits`), while the next rollouts
run; publish waits for it. Every `trainer.state_every` iterations, and after the last it serves, it commits its
trainer state in the background too: the state is copied to host memory, the update goes on.

Started, or started again after a failure, it resumes from the newest committed trainer state and replays the updates
since from their committed experience. The update is deterministic, so every replayed policy must be the one already
committed: its weights' digest is checked against the checkpoint's COMMIT, and a difference is an error, not a fork.
A delta committed before the trainer failed, its checkpoint not, is committed again with the same bytes.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.delta import CheckpointTensors, checkpoint_digests, weights_digest
from moeloop.steps.model.hf_shards import INDEX, SINGLE
from moeloop.steps.rl.checkpoint import (
    OPTIMIZER_DIR,
    WEIGHTS_DIR,
    ReproducibleWriter,
    global_shapes,
    hf_layout,
    sharded_tensors,
    whole_weights,
    write_hf_files,
)
from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.rl.state import UpdatedTrainer, load_trainer_start, update_policy
from moeloop.steps.storage.cache import fetch_verified
from moeloop.steps.storage.deltas import commit_checkpoint, commit_policy_delta
from moeloop.steps.storage.ranks import all_gather, commit_from_ranks
from moeloop.steps.storage.reports import write_report
from moeloop.steps.storage.run import CRITIC_DIR, RunStorage


@dataclass(frozen=True)
class HeldTrainer:
    """The trainer after iteration `iteration`'s update, and this rank's share of the HF checkpoint of it that it
    wrote (`write_share`): the base of the next iteration's delta (None: fetched from the run)."""

    iteration: int
    trainer: UpdatedTrainer
    policy: Path | None


def newest_state(storage: RunStorage, iteration: int) -> int:
    """The newest iteration at or before `iteration` whose trainer state is committed; 0 where none is (the trainer
    then starts from checkpoint 0, as iteration 1's train step does)."""
    return next((i for i in range(iteration, 0, -1) if storage.is_committed(storage.trainer_state(i))), 0)


def resume(
    storage: RunStorage,
    config: MoeloopConfig,
    state: int,
    iteration: int,
    scratch: Path,
    parallel: Parallel,
    background: BackgroundCommits,
) -> HeldTrainer:
    """The trainer as it stood after `iteration`: the committed trainer state of iteration `state` (`newest_state`;
    0: checkpoint 0), then the updates since replayed from their committed experience, each checked against its
    committed checkpoint."""
    model, tokenizer, optimizer, critic = load_trainer_start(storage, state + 1, scratch / "resume", config, parallel)
    shutil.rmtree(scratch / "resume", ignore_errors=True)
    held = HeldTrainer(state, UpdatedTrainer(model, tokenizer, optimizer, critic, {}), None)
    for replayed in range(state + 1, iteration + 1):
        held = advance(storage, config, held, replayed, scratch, parallel, background)
    return held


def advance(
    storage: RunStorage,
    config: MoeloopConfig,
    held: HeldTrainer,
    iteration: int,
    scratch: Path,
    parallel: Parallel,
    background: BackgroundCommits,
) -> HeldTrainer:
    """The held trainer updated by `iteration`'s experience, its delta committed and its checkpoint's commit under
    way in the background (a replay: checked against the committed checkpoint), and its train report written (rank
    0; a replay keeps the report there is)."""
    if iteration != held.iteration + 1:
        raise MoeloopError(
            f"the trainer holds iteration {held.iteration}: it cannot take iteration {iteration}'s update"
        )
    started = time.perf_counter()
    start = (held.trainer.model, held.trainer.tokenizer, held.trainer.optimizer, held.trainer.critic)
    updated = update_policy(storage, config, iteration, scratch, parallel, start)
    # Held until the next update, the gradients would sit beside the next reference pass (steps/rl/memory.py).
    for optimizer in (updated.optimizer, *([updated.critic.optimizer] if updated.critic else [])):
        optimizer.zero_grad(set_to_none=True)
    policy = commit_from_memory(storage, config, iteration, updated, held, scratch, parallel, background, started)
    report_path = storage.report(iteration, "train")
    if parallel.rank == 0 and not storage.exists(report_path):
        write_report(
            storage, iteration, "train", {**updated.report, "seconds": round(time.perf_counter() - started, 3)}
        )
    return HeldTrainer(iteration, updated, policy)


def commit_from_memory(
    storage: RunStorage,
    config: MoeloopConfig,
    iteration: int,
    updated: UpdatedTrainer,
    held: HeldTrainer,
    scratch: Path,
    parallel: Parallel,
    background: BackgroundCommits,
    started: float,
) -> Path:
    """Write this rank's share of checkpoint `iteration` from the trainer's memory (`write_share`), commit its delta
    against the held one (this rank's share of the previous checkpoint, as this returned it; None: fetched), the
    ranks side by side, and hand the checkpoint's commit to the background; or, if it is committed already, check
    that it is the same policy. This rank's folder of the new checkpoint (the next base). Collective."""
    shard_bytes = config.trainer.checkpoint_shard_bytes
    policy = scratch / f"policy-{iteration}"
    mine = write_share(updated.model, updated.tokenizer, parallel, policy, shard_bytes, scratch / "policy-config")
    background.wait("checkpoint")  # the held checkpoint is committed: its folder may go once the delta is written
    committed = storage.manifest(storage.checkpoint(iteration))
    if committed is not None:
        shares = all_gather(checkpoint_digests(CheckpointTensors(policy, mine)), parallel)
        digest = weights_digest({name: value for share in shares for name, value in share.items()})
        if digest != committed.get("weights_digest"):
            raise MoeloopError(
                f"the trainer's replay of iteration {iteration} made other weights than its committed checkpoint"
                f" {storage.display(storage.checkpoint(iteration))} (digest {digest[:12]}, committed"
                f" {str(committed.get('weights_digest'))[:12]}): the update did not repeat itself (it must run on the"
                " threads, world size and kernels that made the checkpoint: a float sum's order follows them)"
            )
    else:
        critic = None
        if updated.critic is not None:
            critic = scratch / f"critic-{iteration}"
            model = updated.critic.model
            write_share(model, updated.tokenizer, parallel, critic, shard_bytes, scratch / "critic-config")
        base_dir = held.policy or fetch_share(storage, iteration - 1, mine)
        report = commit_policy_delta(storage, iteration, policy, base_dir, started, parallel, mine)
        background.submit_checkpoint(iteration, policy, critic, report["weights_digest"])
    if held.policy is not None:
        shutil.rmtree(held.policy)
    return policy


def write_share(
    model: nn.Module, tokenizer: Any, parallel: Parallel, output: Path, shard_bytes: int, config_dir: Path
) -> set[str]:
    """This rank's share of model's HF checkpoint into output: whole files (`HFLayout.shares`: the ranks' shares
    balanced by bytes), and the config, tokenizer and index, which every rank writes. The names of the HF tensors
    it wrote. Collective: the ranks gather the weights one tensor at a time."""
    layout = hf_layout(model_files(model, tokenizer, config_dir), global_shapes(model, parallel), shard_bytes)
    files = layout.shares(parallel.world_size)[parallel.rank]
    tensors = whole_weights(model, parallel, {key for file in files for key in layout.keys[file]})
    write_hf_files(layout, lambda keys: ((key, tensors[key]) for key in keys), output, files)
    return set(layout.weight_map(files))


def fetch_share(storage: RunStorage, iteration: int, names: Collection[str]) -> Path:
    """The files of committed checkpoint `iteration` that hold the named tensors (a rank's share), and its other
    files (config, tokenizer, index), as a local folder, verified and cached: the base of a delta where the trainer
    holds no checkpoint of its own yet."""
    folder = storage.checkpoint(iteration)
    manifest = storage.manifest(folder)
    if manifest is None:
        raise MoeloopError(f"checkpoint of iteration {iteration} is not committed: {storage.display(folder)}")
    files = manifest["files"]
    if INDEX in files:
        weight_map = json.loads(storage.read_committed(folder, manifest, [INDEX])[INDEX])["weight_map"]
        needed = {weight_map[name] for name in names if name in weight_map}
    else:
        needed = {SINGLE} if names else set()
    share = {name: entry for name, entry in files.items() if not name.endswith(".safetensors") or name in needed}
    return fetch_verified(storage, folder, share)


def model_files(model: nn.Module, tokenizer: Any, directory: Path) -> Path:
    """directory with the model's HF config and the tokenizer, as a trainer state holds them."""
    model.config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of tensor (a plain tensor, or a DTensor's local shard under the same spec) in host memory."""
    if isinstance(tensor, DTensor):
        return DTensor(tensor.to_local().to("cpu", copy=True), tensor._spec, requires_grad=False)
    return tensor.to("cpu", copy=True)


class BackgroundCommits:
    """Commits in a thread, one at a time and in order, while the updates go on: each checkpoint the held trainer
    wrote (its delta already committed), and its states, each copied to host memory when submitted, then written
    (DCP, `moeloop.steps.rl.checkpoint`), uploaded and committed beside the update. Its collectives go over a gloo
    group of their own, so they never interleave with the update's. A failure is raised by the next wait."""

    def __init__(self, storage: RunStorage, parallel: Parallel) -> None:
        self.storage, self.parallel = storage, parallel
        self.group = dist.new_group(backend="gloo")
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="background-commits")
        self.pending: dict[str, Future] = {}  # the last commit submitted of each kind: "checkpoint", "state"

    def submit_checkpoint(self, iteration: int, policy: Path, critic: Path | None, weights_digest: str) -> None:
        """Commit checkpoint `iteration` (PPO: its critic first) from this rank's folders of it; the critic's goes
        once committed, the policy's stays (the next delta's base)."""
        self.wait("checkpoint")

        def commit() -> None:
            commit_checkpoint(self.storage, iteration, policy, critic, weights_digest, self.parallel, self.group)
            if critic is not None:
                shutil.rmtree(critic)

        self.pending["checkpoint"] = self.thread.submit(commit)

    def submit_state(self, held: HeldTrainer, directory: Path) -> None:
        """Commit the held trainer's state, copied to host memory now; one copy at a time (a state is the model and
        its optimizer's moments: host memory holds one)."""
        self.wait("state")
        trainer, parallel = held.trainer, self.parallel
        models = [(trainer.model, trainer.optimizer, directory)]
        if trainer.critic is not None:
            models.append((trainer.critic.model, trainer.critic.optimizer, directory / CRITIC_DIR))
        copies = []
        for model, optimizer, folder in models:
            weights, moments = sharded_tensors(model, optimizer, parallel)
            moments_copy = {name: {k: host_copy(v) for k, v in state.items()} for name, state in moments.items()}
            copies.append(({name: host_copy(v) for name, v in weights.items()}, moments_copy, folder))
            if parallel.rank == 0:
                model_files(model, trainer.tokenizer, folder)
        self.pending["state"] = self.thread.submit(self._commit_state, held.iteration, copies, directory)

    def _commit_state(self, iteration: int, copies: list, directory: Path) -> None:
        for weights, moments, folder in copies:
            dcp.save(weights, storage_writer=ReproducibleWriter(folder / WEIGHTS_DIR), process_group=self.group)
            dcp.save(moments, storage_writer=ReproducibleWriter(folder / OPTIMIZER_DIR), process_group=self.group)
        folder = self.storage.trainer_state(iteration)
        extra = {"iteration": iteration}
        commit_from_ranks(self.storage, folder, directory, self.parallel, extra, group=self.group)
        shutil.rmtree(directory, ignore_errors=True)

    def check(self) -> None:
        """Raise what failed among the commits done, without waiting for the others: a trainer idle between
        iterations learns of a failed commit while it waits, and fails (to be started again) instead of holding
        publish up."""
        for pending in self.pending.values():
            if pending.done():
                pending.result()

    def wait(self, *kinds: str) -> None:
        """Until the last commit submitted of each kind (none named: of every kind) is done, raising what failed."""
        for kind in kinds or tuple(self.pending):
            pending = self.pending.pop(kind, None)
            if pending is not None:
                pending.result()

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=False)
