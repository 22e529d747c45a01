"""rollout_engine: shard k's rollout engine for the chunk (`rollout.lifetime: chunk`): one process that keeps its
inference engine, and the policy version it holds, until it has served iteration --last.

It takes each iteration's shard as a command: the rollout step of iteration N, shard k, writes
commands/iter-N-rollout-k.json and waits (steps/rollout.py); the engine moves to the iteration's policy version by
its deltas, in place, else the full checkpoint (`moeloop.steps.engines.versions.engine_at`), generates the shard and
commits it, as the rollout step does. Iterations come in order; one whose shard is committed is skipped. On Spot a
reclaimed engine's pod stops at SIGTERM without writing; the process started in its place builds its engine from the
full checkpoint and serves the command that was pending, so the shard is generated again, once, from the start.
"""

from __future__ import annotations

from typing import Any

import time

from moeloop.steps.common import print_json, quiet_libraries
from moeloop.steps.engines.shards import add_shard_arguments, check_shard, exit_on_sigterm, generate_shard
from moeloop.steps.errors import ArgumentParser, MoeloopError, run_cli
from moeloop.steps.storage.commands import Heartbeat, wait_for_command
from moeloop.steps.storage.run import RunStorage, open_run


def first_unserved(storage: RunStorage, shard: int, num_shards: int) -> int:
    """The first iteration after LATEST whose shard is not committed: the shards of LATEST and before are."""
    latest = storage.latest()
    iteration = (latest["iteration"] if latest else 0) + 1
    while storage.exists(storage.rollout_shard(iteration, shard, num_shards)):
        iteration += 1
    return iteration


def serve(run_uri: str, shard: int, num_shards: int, last: int) -> dict[str, Any]:
    storage, config = open_run(run_uri)
    if config.rollout.lifetime != "chunk":
        raise MoeloopError("rollout.lifetime is iteration: each rollout step generates, with no engine to ask")
    check_shard(config, shard, num_shards)
    if not 1 <= last <= config.iterations:
        raise MoeloopError(f"--last {last} is outside this run's iterations 1..{config.iterations}")
    heartbeat = Heartbeat(storage, storage.engine_heartbeat(shard))
    served = []
    try:
        for iteration in range(first_unserved(storage, shard, num_shards), last + 1):
            if storage.exists(storage.rollout_shard(iteration, shard, num_shards)):
                continue
            wait_for_command(storage, storage.rollout_command(iteration, shard))
            report = generate_shard(storage, config, iteration, shard, num_shards, time.perf_counter())
            heartbeat.holds = report.get("policy_version", heartbeat.holds)
            served.append({"iteration": iteration, "policy_update": report.get("policy_update")})
    finally:
        heartbeat.stop()
    return {"shard": shard, "served": served}


def main() -> None:
    exit_on_sigterm()
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--run", required=True, help="the run's folder URI (local path or s3://...)")
    add_shard_arguments(parser)
    parser.add_argument("--last", required=True, type=int, help="the last iteration this engine serves")
    args = parser.parse_args()
    quiet_libraries()
    print_json(serve(args.run, args.shard, args.num_shards, args.last))


if __name__ == "__main__":
    run_cli(main)
