"""trainer: the chunk's trainer (`trainer.lifetime: chunk`): one process (torchrun: one per GPU) that holds the
policy and its optimizer in memory across iterations until it has served iteration --last.

It takes each iteration's update as a command: the train step of iteration N writes commands/iter-N-train.json and waits
(steps/train.py); the trainer, holding N-1, runs N's update, commits delta N and writes the train report, which answers
the train step, then commits checkpoint N in the background (steps/rl/held.py), and every `trainer.state_every`
iterations, and after --last, its trainer state too. Started, it resumes at once to the newest committed checkpoint (the
newest committed trainer state, then the updates since replayed and checked), so that work is done while the iteration's
rollouts run. While it lives, rank 0 writes its heartbeat (`moeloop.steps.storage.commands`): a train step whose trainer
has gone silent says so and fails. Under torchrun rank 0 reads the commands and tells the other ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from moeloop.steps.common import print_json, quiet_libraries
from moeloop.steps.errors import ArgumentParser, MoeloopError, run_cli
from moeloop.steps.rl.held import BackgroundCommits, HeldTrainer, advance, newest_state, resume
from moeloop.steps.rl.parallel import Parallel, init_parallel
from moeloop.steps.rl.state import trainer_attention
from moeloop.steps.storage.cache import local_scratch
from moeloop.steps.storage.commands import POLL_SECONDS, Heartbeat
from moeloop.steps.storage.run import RunStorage, open_run


def newest_checkpoint(storage: RunStorage) -> int:
    """The newest committed checkpoint: LATEST's, or a later one whose publish has not moved LATEST yet."""
    latest = storage.latest()
    newest = latest["iteration"] if latest else 0
    while storage.is_committed(storage.checkpoint(newest + 1)):
        newest += 1
    return newest


def next_command(storage: RunStorage, iteration: int, parallel: Parallel, background: BackgroundCommits) -> None:
    """Wait until the train step of `iteration` has asked for its update, raising meanwhile what the background
    commits failed at. Collective: rank 0 looks, and tells the others each time whether it is there, so no rank
    waits in a collective longer than a poll."""
    while True:
        background.check()
        found = [storage.exists(storage.train_command(iteration)) if parallel.rank == 0 else None]
        if parallel.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        if found[0]:
            return
        time.sleep(POLL_SECONDS)


def serve(run_uri: str, last: int) -> dict[str, Any] | None:
    """Serve the run's train commands up to iteration `last`; the trainer's report on rank 0 (None on the others)."""
    storage, config = open_run(run_uri)
    if config.trainer.lifetime != "chunk":
        raise MoeloopError("trainer.lifetime is iteration: each iteration's train step trains, with no trainer to ask")
    if not 1 <= last <= config.iterations:
        raise MoeloopError(f"--last {last} is outside this run's iterations 1..{config.iterations}")
    every = config.trainer.state_every
    parallel = init_parallel(config.trainer)
    heartbeat = Heartbeat(storage, RunStorage.TRAINER_HEARTBEAT) if parallel.rank == 0 else None
    served, start, replayed = [], 0, 0
    try:
        trainer_attention(config.trainer, parallel)
        with local_scratch() as scratch:
            background = BackgroundCommits(storage, parallel)
            try:
                start = newest_checkpoint(storage) if parallel.rank == 0 else None
                if parallel.world_size > 1:
                    start = [start]
                    dist.broadcast_object_list(start, src=0)
                    start = start[0]
                state = newest_state(storage, start)
                replayed = start - state
                held: HeldTrainer = resume(storage, config, state, start, scratch, parallel, background)
                while held.iteration < last:
                    if heartbeat:
                        heartbeat.holds = held.iteration
                    next_command(storage, held.iteration + 1, parallel, background)
                    held = advance(storage, config, held, held.iteration + 1, scratch, parallel, background)
                    served.append(held.iteration)
                    if held.iteration % every == 0 or held.iteration == last:
                        background.submit_state(held, scratch / f"state-{held.iteration}")
                if (
                    held.iteration == last
                    and last not in served
                    and not storage.is_committed(storage.trainer_state(last))
                ):
                    # started again after serving last, before its state
                    background.submit_state(held, scratch / f"state-{last}")
                background.wait()
            finally:
                background.close()
    finally:
        if heartbeat:
            heartbeat.stop()
        dist.destroy_process_group()
    return {"resumed_at": start, "served": served, "replayed": replayed} if parallel.rank == 0 else None


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--run", required=True, help="the run's folder URI (local path or s3://...)")
    parser.add_argument("--last", required=True, type=int, help="the last iteration this trainer serves")
    args = parser.parse_args()
    quiet_libraries()
    if (report := serve(args.run, args.last)) is not None:
        print_json(report)


if __name__ == "__main__":
    run_cli(main)
