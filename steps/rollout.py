"""rollout: G samples for each prompt of this shard's part of the iteration's batch, as one Parquet shard.

The batch is drawn deterministically from (run, iteration); shard k of K takes every K-th prompt, and its
sampling seed comes from (run, iteration, shard): re-running a shard gives the same samples
(`moeloop.steps.engines.shards`). A shard that is already committed is left as it is. With `rollout.lifetime: chunk`
the step generates nothing itself: it asks the shard's rollout engine, which keeps its engine and its policy across
the chunk, and waits for the shard.
"""

from __future__ import annotations

import time
from typing import Any

from moeloop.steps.common import already_committed, open_iteration, print_json, quiet_libraries, step_parser
from moeloop.steps.engines.shards import add_shard_arguments, check_shard, exit_on_sigterm, generate_shard
from moeloop.steps.errors import run_cli
from moeloop.steps.storage.commands import ask
from moeloop.steps.storage.experience import read_rollout_shard


def rollout(run_uri: str, iteration: int, shard: int, num_shards: int) -> dict[str, Any]:
    """The shard's samples, committed, and its report. With `rollout.lifetime: chunk` the step asks the shard's
    rollout engine (steps/rollout_engine.py) for them, and waits for the shard."""
    step_started = time.perf_counter()
    storage, config = open_iteration(run_uri, iteration)
    check_shard(config, shard, num_shards)
    output = storage.rollout_shard(iteration, shard, num_shards)
    if storage.exists(output):
        read_rollout_shard(storage, iteration, shard, num_shards)  # rows of this shard, or foreign data: an error
        return already_committed(storage, output)
    if config.rollout.lifetime == "chunk":
        what = f"shard {shard}'s rollout engine for its samples"
        heartbeat = storage.engine_heartbeat(shard)
        ask(storage, storage.rollout_command(iteration, shard), lambda: storage.exists(output), heartbeat, what)
        return storage.read_json(storage.report(iteration, f"rollout-{shard}"))
    return generate_shard(storage, config, iteration, shard, num_shards, step_started)


def main() -> None:
    exit_on_sigterm()
    parser = step_parser(__doc__)
    add_shard_arguments(parser)
    args = parser.parse_args()
    quiet_libraries()
    print_json(rollout(args.run, args.iteration, args.shard, args.num_shards))


if __name__ == "__main__":
    run_cli(main)
