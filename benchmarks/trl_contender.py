"""TRL's GRPOTrainer on moeloop's demo, the contender `benchmarks/trl_grpo.py` runs: not part of moeloop.

Measured in an environment of its own, with TRL installed (`benchmarks/trl_grpo.py` says how), never moeloop's:

    TRL-PYTHON benchmarks/trl_contender.py --checkpoint SFT --seed S --iterations N --out CURVE.json [--smoke]

The tests' extras install the same TRL into moeloop's environment (it adds only TRL and accelerate there), so CI runs
its --smoke mode (tests/unit/test_benchmark_smoke.py).

The same task as `moeloop run configs/tiny.yaml`: its SFT checkpoint, prompts, reward
(`moeloop.steps.demo_task.reverse_positions`, imported from this repository, standard library only), batch (192 prompts x
16 samples an iteration), learning rate, 2 epochs of minibatches of 128, clip 0.2, no KL, token-mean loss
(`loss_type="bnpo"`), the same optimizer (AdamW, betas, weight decay, gradient clipping: `trl_grpo.py` passes
them from the run's config), fp32 without gradient checkpointing (TRL's defaults, bf16 and checkpointing on, are
overridden: see `main`), and the same evaluation: greedy on the 256 held-out prompts, grouped by prompt length so
nothing is padded (as moeloop's transformers engine does), after every iteration's last optimizer step and once
before the first. The evaluations are timed and taken out of the clock (moeloop evaluates beside its loop).
CURVE.json: {"iterations": [{"iteration", "eval_reward_mean", "seconds"}], "eval_seconds", "seconds"}, seconds
counted from the process's start (`--started-at`, the launcher's clock) without the evaluations.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
# moeloop is not installed in TRL's environment: the repository's root, linked as `moeloop`, is its package (as
# pyproject.toml maps steps/ to moeloop.steps), from which only the demo's reward (standard library) is imported.
PACKAGE_LINK = Path(tempfile.mkdtemp(prefix="moeloop-link-"))
atexit.register(shutil.rmtree, PACKAGE_LINK)  # the link, not what it points to
(PACKAGE_LINK / "moeloop").symlink_to(REPO, target_is_directory=True)
sys.path.insert(0, str(PACKAGE_LINK))

import smoke  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from moeloop.steps.demo_task import reverse_positions  # noqa: E402

PROMPTS_PER_ITERATION, SAMPLES_PER_PROMPT, MINIBATCH, EPOCHS = 192, 16, 128, 2
STEPS_PER_ITERATION = PROMPTS_PER_ITERATION * SAMPLES_PER_PROMPT // MINIBATCH * EPOCHS  # 48, as moeloop's


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@torch.no_grad()
def greedy_eval(model, tokenizer, records: list[dict], max_new_tokens: int) -> float:
    was_training = model.training
    model.eval()
    by_length: dict[int, list[int]] = defaultdict(list)
    ids = [tokenizer(r["prompt"])["input_ids"] for r in records]
    for index, prompt in enumerate(ids):
        by_length[len(prompt)].append(index)
    total = 0.0
    for indices in by_length.values():
        prompts = torch.tensor([ids[i] for i in indices])
        out = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for i, row in zip(indices, out[:, prompts.shape[1] :], strict=True):
            total += reverse_positions(records[i], tokenizer.decode(row, skip_special_tokens=True))
    model.train(was_training)
    return total / len(records)


class IterationEval(TrainerCallback):
    """Evaluate before training and after every STEPS_PER_ITERATION optimizer steps, the time taken out."""

    def __init__(self, tokenizer, records: list[dict], max_new_tokens: int, started_at: float):
        self.tokenizer, self.records, self.max_new_tokens = tokenizer, records, max_new_tokens
        self.started_at, self.eval_seconds, self.curve = started_at, 0.0, []

    def evaluate(self, model, iteration: int) -> None:
        began = time.time()
        reward = greedy_eval(model, self.tokenizer, self.records, self.max_new_tokens)
        seconds = began - self.started_at - self.eval_seconds
        self.eval_seconds += time.time() - began
        self.curve.append({"iteration": iteration, "eval_reward_mean": reward, "seconds": seconds})
        print(f"iteration {iteration:3d}: eval_reward_mean {reward:.3f} at {seconds:.1f} s", flush=True)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % STEPS_PER_ITERATION == 0:
            self.evaluate(model, state.global_step // STEPS_PER_ITERATION)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", type=Path, required=True, help="the SFT checkpoint (an HF folder)")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--iterations", type=int, default=24)
    # The demo's settings, which trl_grpo.py reads from moeloop's config of the run and passes (defaults: tiny.yaml's).
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.99])
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--clip-eps", type=float, default=0.2)
    parser.add_argument("--clip-eps-high", type=float, default=0.2)
    parser.add_argument("--max-new-tokens", type=int, default=10)
    parser.add_argument("--started-at", type=float, default=time.time())
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--eval-prompts", type=int, default=None, help="the first this many held-out prompts (all)")
    args = smoke.parse_args(parser, iterations=1, eval_prompts=8)

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    train = Dataset.from_list(read_jsonl(REPO / "configs" / "data" / "reverse-train.jsonl"))
    held_out = read_jsonl(REPO / "configs" / "data" / "reverse-eval.jsonl")[: args.eval_prompts]

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [reverse_positions({"answer": a}, c) for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=str(args.out.parent / f"trl-{args.seed}"),
        seed=args.seed,
        use_cpu=True,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        adam_beta1=args.betas[0],
        adam_beta2=args.betas[1],
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        # TRL's GRPOConfig defaults both to True (1.16.0): bf16 autocast and recomputation on a CPU, for a 3-layer
        # model, which a careful user turns off (moeloop's demo trains in fp32 without checkpointing).
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=MINIBATCH,
        gradient_accumulation_steps=1,
        steps_per_generation=PROMPTS_PER_ITERATION * SAMPLES_PER_PROMPT // MINIBATCH,
        num_generations=SAMPLES_PER_PROMPT,
        num_iterations=EPOCHS,
        max_steps=args.iterations * STEPS_PER_ITERATION,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        epsilon=args.clip_eps,
        epsilon_high=args.clip_eps_high,
        loss_type="bnpo",
        logging_steps=STEPS_PER_ITERATION,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callback = IterationEval(tokenizer, held_out, args.max_new_tokens, args.started_at)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=train, processing_class=tokenizer,
        callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    result = {
        "iterations": callback.curve,
        "eval_seconds": callback.eval_seconds,
        "seconds": time.time() - args.started_at - callback.eval_seconds,
    }
    partial = args.out.with_suffix(".partial")
    partial.write_text(json.dumps(result, indent=1))
    partial.replace(args.out)


if __name__ == "__main__":
    main()
