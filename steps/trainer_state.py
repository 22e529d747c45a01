"""trainer-state: on Argo, a chunk's wait for its trainer's last trainer state (`trainer.lifetime: chunk`).

The chunk's trainer (steps/trainer.py) commits the trainer state of the chunk's last iteration in the background,
after that iteration's checkpoint, which is all the last train step waits for. The chunk's exit handler deletes the
trainer's JobSet as soon as the chunk's tasks are done, and the next chunk's trainer starts from the newest committed
state: without this task a commit still running at the chunk's end would be cut off, and the next trainer would
replay up to `trainer.state_every` updates on the GPUs. So the chunk ends, and the next one is submitted, only once
this pod, on a CPU node, has seen that state committed. It fails as an asking step does when the trainer has gone
silent. Locally the runner waits for the trainer's own exit, which comes after the same commit.

    python -m moeloop.steps.trainer_state --run URI --last N
"""

from __future__ import annotations

import time
from typing import Any

from moeloop.steps.common import print_json
from moeloop.steps.errors import ArgumentParser, MoeloopError, run_cli
from moeloop.steps.storage.commands import wait_while_heard
from moeloop.steps.storage.run import RunStorage, open_run


def wait_for_state(run_uri: str, last: int) -> dict[str, Any]:
    """Wait until the trainer state of iteration `last` is committed: its report (the seconds waited)."""
    storage, config = open_run(run_uri)
    if not 1 <= last <= config.iterations:
        raise MoeloopError(f"--last {last} is outside this run's iterations 1..{config.iterations}")
    started = time.perf_counter()
    state = storage.trainer_state(last)
    waiter = f"the chunk's end waits for its trainer's state of iteration {last}"
    wait_while_heard(storage, lambda: storage.is_committed(state), RunStorage.TRAINER_HEARTBEAT, waiter)
    return {"state": last, "seconds": round(time.perf_counter() - started, 3)}


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--run", required=True, help="the run's folder URI (local path or s3://...)")
    parser.add_argument("--last", required=True, type=int, help="the chunk's last iteration")
    args = parser.parse_args()
    print_json(wait_for_state(args.run, args.last))


if __name__ == "__main__":
    run_cli(main)
