"""train: one GRPO policy update on the iteration's experience; commits the trainer state (weights, optimizer).

Starts from the trainer state of the previous iteration (checkpoint 0 for the first), so the optimizer's
moments carry across iterations. The reference policy for the KL is checkpoint 0, the SFT start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steps.common import (
    already_committed,
    derive_seed,
    fetch_checkpoint,
    local_scratch,
    open_iteration,
    print_json,
    quiet_libraries,
    step_parser,
    write_report,
)
from steps.config import MoeloopConfig
from steps.errors import run_cli
from steps.experience import read_rewards, read_rollouts
from steps.grpo import group_advantages, grpo_loss
from steps.policy import load_policy, pack_sequences, save_policy, token_logprobs
from steps.storage import OPTIMIZER_FILE, RunStorage


@dataclass(frozen=True)
class ExperienceBatch:
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    behavior_logprobs_BT: torch.Tensor  # the engine's logprobs, at the response positions
    rewards_B: torch.Tensor
    group_ids_B: torch.Tensor  # samples of one prompt form a group


def experience_batch(rollouts: dict[str, list], rewards_by_sample: dict[str, float], pad_id: int) -> ExperienceBatch:
    prompts, responses = rollouts["prompt_token_ids"], rollouts["response_token_ids"]
    input_ids_BT, attention_mask_BT, response_mask_BT = pack_sequences(prompts, responses, pad_id)
    behavior_BT = torch.zeros(input_ids_BT.shape)
    for row, (prompt, logprobs) in enumerate(zip(prompts, rollouts["behavior_logprobs"], strict=False)):
        behavior_BT[row, len(prompt) : len(prompt) + len(logprobs)] = torch.tensor(logprobs)
    return ExperienceBatch(
        input_ids_BT,
        attention_mask_BT,
        response_mask_BT,
        behavior_BT,
        torch.tensor([rewards_by_sample[s] for s in rollouts["sample_id"]], dtype=torch.float32),
        torch.tensor(rollouts["prompt_id"]),
    )


@torch.no_grad()
def frozen_logprobs(model: torch.nn.Module, batch: ExperienceBatch, temperature: float, minibatch: int) -> torch.Tensor:
    model.eval()
    chunks = [
        token_logprobs(
            model, batch.input_ids_BT[i : i + minibatch], batch.attention_mask_BT[i : i + minibatch], temperature
        )[0]
        for i in range(0, len(batch.input_ids_BT), minibatch)
    ]
    return torch.cat(chunks)


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return float((values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))


def grpo_update(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: ExperienceBatch,
    config: MoeloopConfig,
    seed: int,
) -> dict[str, float]:
    """Advantages, then epochs x minibatches of clipped-surrogate steps; returns what it measured."""
    settings, algorithm = config.trainer, config.algorithm
    temperature = config.rollout.temperature
    mask_BT = batch.response_mask_BT
    advantages_B = group_advantages(batch.rewards_B, batch.group_ids_B, scale=algorithm.scale_rewards)
    # pi_old is the trainer's own view of the behaviour policy, so the first step's ratio is exactly 1.
    old_logprobs_BT = frozen_logprobs(model, batch, temperature, settings.minibatch_size)
    ref_logprobs_BT = frozen_logprobs(reference, batch, temperature, settings.minibatch_size)
    log_ratio_BT = ref_logprobs_BT - old_logprobs_BT
    kl_before = masked_mean(torch.exp(log_ratio_BT) - log_ratio_BT - 1, mask_BT)
    # Engine vs trainer on the same policy version: mean |difference| and KL(behaviour || trainer), k3.
    behavior_gap_BT = old_logprobs_BT - batch.behavior_logprobs_BT
    mismatch = masked_mean(behavior_gap_BT.abs(), mask_BT)
    behavior_kl = masked_mean(torch.exp(behavior_gap_BT) - behavior_gap_BT - 1, mask_BT)

    aux_coef = getattr(model.config, "router_aux_loss_coef", 0.0)
    generator = torch.Generator().manual_seed(seed)
    losses, clip_fractions, grad_norms = [], [], []
    model.train()
    for _ in range(settings.epochs):
        order = torch.randperm(len(advantages_B), generator=generator)
        for start in range(0, len(order), settings.minibatch_size):
            rows = order[start : start + settings.minibatch_size]
            logprobs_BT, aux_loss = token_logprobs(
                model, batch.input_ids_BT[rows], batch.attention_mask_BT[rows], temperature
            )
            terms = grpo_loss(
                logprobs_BT,
                old_logprobs_BT[rows],
                advantages_B[rows],
                mask_BT[rows],
                clip_eps=algorithm.clip_eps,
                ref_logprobs_BT=ref_logprobs_BT[rows] if algorithm.kl_coef > 0 else None,
                kl_coef=algorithm.kl_coef,
            )
            loss = terms.loss + aux_coef * aux_loss if aux_loss is not None else terms.loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)))
            optimizer.step()
            losses.append(terms.loss.item())
            clip_fractions.append(float(terms.clip_fraction))
    return {
        "loss": sum(losses) / len(losses),
        "kl": kl_before,
        "clip_fraction": sum(clip_fractions) / len(clip_fractions),
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "logprob_mismatch": mismatch,
        "behavior_kl": behavior_kl,
        "advantage_abs_mean": float(advantages_B.abs().mean()),
        "optimizer_steps": len(losses),
        "response_tokens": int(mask_BT.sum()),
    }


def load_trainer_start(storage: RunStorage, iteration: int, scratch: Path) -> tuple[Any, Any, dict | None]:
    """The previous trainer state if there is one, else the policy checkpoint the rollouts used."""
    previous = storage.trainer_state(iteration - 1)
    if storage.is_committed(previous):
        storage.fetch_folder(previous, scratch / "previous")
        model, tokenizer = load_policy(scratch / "previous")
        return model, tokenizer, torch.load(scratch / "previous" / OPTIMIZER_FILE, weights_only=True)
    model, tokenizer = load_policy(fetch_checkpoint(storage, iteration - 1))
    return model, tokenizer, None


def update_policy(
    storage: RunStorage, config: MoeloopConfig, iteration: int, scratch: Path
) -> tuple[Any, Any, Any, dict]:
    """The iteration's policy update in memory: (model, tokenizer, optimizer, report). Deterministic."""
    rollouts = read_rollouts(storage, iteration, config.rollout.num_shards).to_pydict()
    rewards = read_rewards(storage, iteration).to_pydict()
    rewards_by_sample = dict(zip(rewards["sample_id"], rewards["reward"], strict=False))
    seed = derive_seed(config.run_name, config.seed, "train", iteration)
    torch.manual_seed(seed)
    model, tokenizer, optimizer_state = load_trainer_start(storage, iteration, scratch)
    reference, _ = load_policy(fetch_checkpoint(storage, 0))
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.trainer.learning_rate,
        betas=config.trainer.betas,
        weight_decay=config.trainer.weight_decay,
    )
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    batch = experience_batch(rollouts, rewards_by_sample, tokenizer.pad_token_id)
    started = time.perf_counter()
    report: dict[str, Any] = grpo_update(model, reference, optimizer, batch, config, seed)
    seconds = time.perf_counter() - started
    report["train_tokens_per_second"] = round(int(batch.attention_mask_BT.sum()) * config.trainer.epochs / seconds, 1)
    return model, tokenizer, optimizer, report


def train(run_uri: str, iteration: int) -> dict[str, Any]:
    started = time.perf_counter()
    storage, config = open_iteration(run_uri, iteration)
    output = storage.trainer_state(iteration)
    if storage.is_committed(output):
        return already_committed(storage, output)
    with local_scratch() as scratch:
        model, tokenizer, optimizer, report = update_policy(storage, config, iteration, scratch)
        save_policy(model, tokenizer, scratch / "state")
        torch.save(optimizer.state_dict(), scratch / "state" / OPTIMIZER_FILE)
        report["seconds"] = round(time.perf_counter() - started, 3)
        write_report(storage, iteration, "train", report)
        storage.commit_folder(output, scratch / "state", extra={"iteration": iteration})
    return report


def main() -> None:
    args = step_parser(__doc__).parse_args()
    quiet_libraries()
    print_json(train(args.run, args.iteration))


if __name__ == "__main__":
    run_cli(main)
