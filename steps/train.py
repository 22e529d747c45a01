"""train: one GRPO or PPO update on the iteration's experience; commits the trainer state (weights, optimizer;
with PPO the critic's too, in critic/).

Starts from the trainer state of the previous iteration (checkpoint 0 for the first, and for PPO a critic made
from it), so the optimizer's moments carry across iterations. The reference policy for the KL is checkpoint 0,
the SFT start: its logprobs are computed once, before the policy is loaded. The update is in steps/rl/update.py,
its losses and advantages in steps/rl/grpo.py and steps/rl/ppo.py (steps/rl/README.md).

One process per GPU where there is CUDA: under torchrun when `trainer.world_size` > 1, over a (dp, ep) device
mesh; each rank holds its models under FSDP2 (steps/model/sharding.py) at `trainer.precision`, and takes its
packed microbatches of every minibatch. The update equals one process's on the whole minibatch
(tests/distributed/test_train_ep.py, tests/distributed/test_fsdp.py). Every rank writes its shards of the trainer state and uploads them
(`moeloop.steps.rl.checkpoint`); rank 0 writes the report, and the state's COMMIT once every rank's files are up.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeloop.steps.common import (
    already_committed,
    derive_seed,
    open_iteration,
    print_json,
    quiet_libraries,
    step_parser,
    write_report,
)
from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError, run_cli
from moeloop.steps.model.families import moe_layers
from moeloop.steps.model.policy import hf_model_on_meta, read_config
from moeloop.steps.rl.batch import experience_batch, recorded_routes
from moeloop.steps.rl.checkpoint import commit_trainer_state
from moeloop.steps.rl.memory import refuse_unfit_trainer
from moeloop.steps.rl.parallel import Parallel, init_parallel
from moeloop.steps.rl.router_bias import bias_update_rate
from moeloop.steps.rl.state import load_trainer_start, reference_logprobs, save_trainer_state, trainer_attention
from moeloop.steps.rl.update import Critic, policy_update, require_finite
from moeloop.steps.storage.cache import fetch_checkpoint, local_scratch
from moeloop.steps.storage.experience import read_rewards, read_rollouts, rollout_columns
from moeloop.steps.storage.run import CRITIC_DIR, RunStorage


@dataclass(frozen=True)
class UpdatedTrainer:
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    critic: Critic | None
    report: dict[str, Any]


def update_policy(
    storage: RunStorage, config: MoeloopConfig, iteration: int, scratch: Path, parallel: Parallel = Parallel()
) -> UpdatedTrainer:
    """The iteration's update in memory: the policy (PPO: and the critic) after it, and the report. Deterministic."""
    rollouts = rollout_columns(read_rollouts(storage, iteration, config.rollout.num_shards))
    recorded = recorded_routes(rollouts)
    if config.algorithm.routing_replay == "rollout" and not recorded:
        raise MoeloopError(
            f"algorithm.routing_replay rollout needs the rollout shards' routed_experts column: iteration {iteration}'s"
            " shards lack it (written before it existed, or by an engine that did not record routes)"
        )
    rewards = read_rewards(storage, iteration).to_pydict()
    rewards_by_sample = dict(zip(rewards["sample_id"], rewards["reward"], strict=False))
    for sample, value in rewards_by_sample.items():  # the reward step refuses these: this is foreign data
        require_finite(value, f"{storage.display(storage.rewards(iteration))}: the reward of sample {sample}")
    seed = derive_seed(config.run_name, config.seed, "train", iteration)
    torch.manual_seed(seed)
    settings = config.trainer
    architecture = read_config(fetch_checkpoint(storage, 0))[0]
    top_k = architecture.num_experts_per_tok if recorded else None
    layers = moe_layers(hf_model_on_meta(architecture)) if recorded else ()  # for shards that name none
    batch = experience_batch(rollouts, rewards_by_sample, top_k, layers)
    batch = batch.to(parallel.device)
    ref_logprobs_BT = reference_logprobs(fetch_checkpoint(storage, 0), batch, config, parallel)
    model, tokenizer, optimizer, critic = load_trainer_start(storage, iteration, scratch, config, parallel)
    started = time.perf_counter()
    report = policy_update(model, ref_logprobs_BT, optimizer, batch, config, seed, parallel, critic)
    seconds = time.perf_counter() - started
    report["train_tokens_per_second"] = round(int(batch.attention_mask_BT.sum()) * settings.epochs / seconds, 1)
    report["device"] = str(parallel.device)
    report["precision"] = settings.compute_precision(parallel.device.type == "cuda")
    report["attention"] = model.config._attn_implementation
    if parallel.device.type == "cuda":
        report["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(parallel.device)
    return UpdatedTrainer(model, tokenizer, optimizer, critic, report)


def train(run_uri: str, iteration: int) -> dict[str, Any] | None:
    """The train step on this rank; the report on rank 0, None on the others (they write nothing)."""
    started = time.perf_counter()
    storage, config = open_iteration(run_uri, iteration)
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
            commit_trainer_state(storage, output, state, parallel, extra={"iteration": iteration})
        return report if parallel.rank == 0 else None
    finally:
        dist.destroy_process_group()


def main() -> None:
    args = step_parser(__doc__).parse_args()
    quiet_libraries()
    if (report := train(args.run, args.iteration)) is not None:
        print_json(report)


if __name__ == "__main__":
    run_cli(main)
