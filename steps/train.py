"""train: one GRPO or PPO update on the iteration's experience; commits the trainer state (weights, optimizer;
with PPO the critic's too, in critic/).

Starts from the trainer state of the previous iteration (checkpoint 0 for the first, and for PPO a critic made
from it), so the optimizer's moments carry across iterations. The reference policy for the KL is checkpoint 0,
the SFT start: its logprobs are computed once, before the policy is loaded (`moeloop.steps.rl.state.update_policy`).
The update is in steps/rl/update.py, its losses and advantages in steps/rl/grpo.py and steps/rl/ppo.py
(steps/rl/README.md).

One process per GPU where there is CUDA: under torchrun when `trainer.world_size` > 1, over a (dp, ep) device
mesh; each rank holds its models under FSDP2 (steps/model/sharding.py) at `trainer.precision`, and takes its
packed microbatches of every minibatch. The update equals one process's on the whole minibatch
(tests/distributed/test_train_ep.py, tests/distributed/test_fsdp.py). Every rank writes its shards of the trainer
state and uploads them (`moeloop.steps.rl.checkpoint`); rank 0 writes the report, and the state's COMMIT once every
rank's files are up.

With `trainer.lifetime: chunk` the step trains nothing itself: one process, it asks the chunk's trainer
(steps/trainer.py), which holds the policy in memory, for the iteration's update, and waits for its delta.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch.distributed as dist

from moeloop.steps.common import already_committed, open_iteration, print_json, quiet_libraries, step_parser
from moeloop.steps.errors import run_cli
from moeloop.steps.rl.memory import refuse_unfit_trainer
from moeloop.steps.rl.parallel import init_parallel
from moeloop.steps.rl.router_bias import bias_update_rate
from moeloop.steps.rl.state import save_trainer_state, trainer_attention, update_policy
from moeloop.steps.storage.cache import fetch_checkpoint, local_scratch
from moeloop.steps.storage.ranks import commit_from_ranks
from moeloop.steps.storage.commands import ask
from moeloop.steps.storage.reports import write_report
from moeloop.steps.storage.run import CRITIC_DIR, RunStorage

def train(run_uri: str, iteration: int) -> dict[str, Any] | None:
    """The train step on this rank; the report on rank 0, None on the others (they write nothing). With
    `trainer.lifetime: chunk` it asks the chunk's trainer for the update instead (`ask_trainer`)."""
    started = time.perf_counter()
    storage, config = open_iteration(run_uri, iteration)
    if config.trainer.lifetime == "chunk":
        return ask_trainer(storage, iteration)
    output = storage.trainer_state(iteration)
    if storage.is_committed(output):
        return already_committed(storage, output)
    checkpoint_config = json.loads((fetch_checkpoint(storage, 0) / "config.json").read_text())
    refuse_unfit_trainer(config.trainer, checkpoint_config, "checkpoint 0")  # before any weight is loaded
    bias_update_rate(config.trainer, checkpoint_config.get("model_type"))  # a one-line error for a family without bias
    parallel = init_parallel(config.trainer)
    try:
        trainer_attention(config.trainer, parallel)  # an attention that cannot run here: before any weight is loaded
        with local_scratch() as scratch:
            updated = update_policy(storage, config, iteration, scratch, parallel)
            state = scratch / "state"
            if updated.critic is not None:  # the critic's state goes in the same commit, in critic/
                critic = updated.critic
                save_trainer_state(critic.model, updated.tokenizer, critic.optimizer, parallel, state / CRITIC_DIR)
            save_trainer_state(updated.model, updated.tokenizer, updated.optimizer, parallel, state)
            report = {**updated.report, "seconds": round(time.perf_counter() - started, 3)}
            if parallel.rank == 0:
                write_report(storage, iteration, "train", report)
            commit_from_ranks(storage, output, state, parallel, extra={"iteration": iteration})
        return report if parallel.rank == 0 else None
    finally:
        dist.destroy_process_group()


def ask_trainer(storage: RunStorage, iteration: int) -> dict[str, Any]:
    """Ask the chunk's trainer (steps/trainer.py) for iteration's update and wait for it: done when delta N is
    committed and its train report written (the checkpoint's commit follows in the background; publish waits for
    it). Safe to re-run: the command is written once, an update done once."""
    report, delta = storage.report(iteration, "train"), storage.delta(iteration)
    done = lambda: storage.is_committed(delta) and storage.exists(report)  # noqa: E731
    if done():
        return already_committed(storage, delta)
    what = "the chunk's trainer for its update"
    ask(storage, storage.train_command(iteration), done, storage.TRAINER_HEARTBEAT, what)
    return storage.read_json(report)


def main() -> None:
    args = step_parser(__doc__).parse_args()
    quiet_libraries()
    if (report := train(args.run, args.iteration)) is not None:
        print_json(report)


if __name__ == "__main__":
    run_cli(main)
