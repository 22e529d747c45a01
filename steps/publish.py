"""publish: turn the iteration's trainer state into the HF checkpoint the next rollouts load.

Fetches the committed trainer state's fp32 weights (its DCP shards, `moeloop.steps.rl.checkpoint`), config and tokenizer,
verified against its COMMIT (not the optimizer state), writes them as an HF checkpoint in the config's dtype (sharded
safetensors of at most `trainer.checkpoint_shard_bytes`, streamed block by block: no process holds the model),
commits that to checkpoints/iter-N/, writes that folder's COMMIT last, and only then moves LATEST. Before the
checkpoint it commits deltas/iter-N/ (`moeloop.steps.storage.deltas`): its weights' digests and the elements changed
since checkpoint N-1 (fetched into the cache), which rollout engines apply in place; the checkpoint's COMMIT records
its weights' digest. With `trainer.lifetime: chunk` the chunk's trainer commits both (steps/rl/held.py), the
checkpoint in the background after the train step: publish waits for it while the trainer is heard, then moves
LATEST. With PPO the
trainer state holds the critic in critic/: it is committed first, to critics/iter-N/ (an HF token-classification
checkpoint), so a committed policy checkpoint always has its critic beside it.
"""

from __future__ import annotations

import time
from typing import Any

from moeloop.steps.common import already_committed, open_iteration, print_json, step_parser
from moeloop.steps.errors import MoeloopError, run_cli
from moeloop.steps.rl.checkpoint import OPTIMIZER_DIR, write_hf_checkpoint
from moeloop.steps.storage.cache import fetch_checkpoint, local_scratch
from moeloop.steps.storage.commands import wait_while_heard
from moeloop.steps.storage.deltas import commit_policy
from moeloop.steps.storage.run import CRITIC_DIR


def publish(run_uri: str, iteration: int) -> dict[str, Any]:
    started = time.perf_counter()
    storage, config = open_iteration(run_uri, iteration)
    checkpoint = storage.checkpoint(iteration)
    if config.trainer.lifetime == "chunk":  # the chunk's trainer commits it, after the delta that answered train
        waiter = f"publish of iteration {iteration} waits for its checkpoint from the chunk's trainer"
        wait_while_heard(storage, lambda: storage.is_committed(checkpoint), storage.TRAINER_HEARTBEAT, waiter)
    if storage.is_committed(checkpoint):
        storage.move_latest(iteration)  # a crash may have come between the COMMIT and LATEST
        return already_committed(storage, checkpoint)
    state = storage.trainer_state(iteration)
    if not storage.is_committed(state):
        raise MoeloopError(f"iteration {iteration} has no committed trainer state: {storage.display(state)}")
    with local_scratch() as scratch:
        files = storage.manifest(state)["files"]
        optimizer = (f"{OPTIMIZER_DIR}/", f"{CRITIC_DIR}/{OPTIMIZER_DIR}/")
        weights = {name: entry for name, entry in files.items() if not name.startswith(optimizer)}
        storage.fetch_files(state, weights, scratch / "state")
        shard_bytes = config.trainer.checkpoint_shard_bytes
        write_hf_checkpoint(scratch / "state", scratch / "policy", shard_bytes)
        critic = None
        if (scratch / "state" / CRITIC_DIR).is_dir():
            critic = scratch / CRITIC_DIR
            write_hf_checkpoint(scratch / "state" / CRITIC_DIR, critic, shard_bytes)
        base = fetch_checkpoint(storage, iteration - 1)
        report = commit_policy(storage, iteration, scratch / "policy", critic, base, started)
    storage.move_latest(iteration)
    return report


def main() -> None:
    args = step_parser(__doc__).parse_args()
    print_json(publish(args.run, args.iteration))


if __name__ == "__main__":
    run_cli(main)
