"""chunk: which iterations the next chunk of an Argo run runs, decided from LATEST at run time (the DAG's `plan`
task; not `moeloop plan`, the capacity planner).

A run of any length is a chain of Workflows of `cluster.chunk_iterations` iterations (workflows/render/).
Each starts here, after start has adopted the submitted iteration count: the chunk runs iterations
LATEST+1 .. LATEST+count, and `more` says whether iterations remain after it. Re-running a chunk (Argo's
retry or resubmit, the CronWorkflow's next tick) therefore continues where the run stands.
"""

from __future__ import annotations

from typing import Any

from moeloop.steps.common import print_json
from moeloop.steps.errors import ArgumentParser, MoeloopError, run_cli
from moeloop.steps.storage.lease import check_free
from moeloop.steps.storage.run import open_run


def next_chunk(run_uri: str, chunk: int) -> dict[str, Any]:
    if chunk < 1:
        raise MoeloopError(f"--chunk must be at least 1, not {chunk}")
    storage, config = open_run(run_uri)
    check_free(storage)  # a `moeloop run` drives this run: a chunk beside it would do every step twice
    latest = storage.latest()
    if latest is None:
        raise MoeloopError(f"run {storage.uri} has no LATEST: its start has not finished")
    done = latest["iteration"]
    count = max(0, min(chunk, config.iterations - done))
    return {
        "latest": done,
        "first": done + 1,
        "count": count,
        "more": done + count < config.iterations,
        "target": config.iterations,
        # LATEST's evaluation may have been cut short (a failed or stopped chunk): run it again if so.
        "evaluate": not storage.exists(storage.metrics(done)),
    }


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--run", required=True, help="the run's folder URI (local path or s3://...)")
    parser.add_argument("--chunk", required=True, type=int, help="iterations per chunk (cluster.chunk_iterations)")
    args = parser.parse_args()
    print_json(next_chunk(args.run, args.chunk))


if __name__ == "__main__":
    run_cli(main)
