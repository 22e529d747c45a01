"""A bf16 engine against the fp32 trainer, routing replay off and on: one update each, on the same rollouts.

    python benchmarks/replay_mismatch.py [--prompts 16] [--samples 4] [--seed 0] [--smoke]

The engine is transformers `generate` in bf16 (`rollout.transformers_dtype`) on a random tiny Qwen3-MoE (vLLM
records no routes here, steps/rl/README.md), recording each response token's experts; the trainer holds the fp32
policy. Prints, per setting, the train report's logprob_mismatch, behavior_kl, routing_agreement, mismatch_masked
(token masking in [0.8, 1.25]) and the router's load imbalance and entropy.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke
import torch
from transformers import Qwen3MoeForCausalLM

from moeloop.steps.config import load_config
from moeloop.steps.engines.engine import Sampling, TransformersEngine
from moeloop.steps.model.policy import build_tokenizer, save_policy, tiny_model_config
from moeloop.steps.rl.batch import experience_batch, frozen_logprobs
from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.rl.state import load_trainer_model
from moeloop.steps.rl.update import policy_update

REPO = Path(__file__).resolve().parents[1]
SHOWN = ("logprob_mismatch", "behavior_kl", "routing_agreement", "mismatch_masked", "router_load_imbalance")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = smoke.parse_args(parser, prompts=2, samples=2)
    base = load_config(REPO / "configs" / "tiny.yaml")
    tokenizer = build_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789+=")
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        policy = Path(folder) / "policy"
        save_policy(Qwen3MoeForCausalLM(tiny_model_config(base.model.tiny, tokenizer)), tokenizer, policy)
        engine = TransformersEngine(policy, "bfloat16")
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(2, len(tokenizer)) for _ in range(rng.randrange(3, 8))] for _ in range(args.prompts)]
        # The prompt's last position's routes only, as the figures in replay_mismatch.md were measured.
        sampling = Sampling(
            args.samples, 1.0, 1.0, base.rollout.max_new_tokens, args.seed, record_routing=True, prompt_routes="last"
        )
        samples = [(p, c) for p, cs in zip(prompts, engine.generate(prompts, sampling), strict=True) for c in cs]
        rollouts = {
            "prompt_token_ids": [p for p, _ in samples],
            "response_token_ids": [c.token_ids for _, c in samples],
            "behavior_logprobs": [c.logprobs for _, c in samples],
            "routed_experts": [c.routed_experts.reshape(-1) for _, c in samples],
            "routed_layers": [list(engine.routed_layers)] * len(samples),
            "sample_id": [str(i) for i in range(len(samples))],
            "prompt_id": [i // args.samples for i in range(len(samples))],
        }
        rewards = {str(i): float(rng.random() < 0.5) for i in range(len(samples))}
        batch = experience_batch(rollouts, rewards, base.model.tiny.num_experts_per_tok)
        print("| replay | " + " | ".join(SHOWN) + " |\n|" + "---|" * (len(SHOWN) + 1))
        for replay in ("off", "rollout"):
            data = base.model_dump()
            data["algorithm"].update(routing_replay=replay, mismatch={"level": "token", "low": 0.8, "high": 1.25})
            data["rollout"]["engine"] = "transformers"
            data["trainer"].update(minibatch_size=len(samples), precision="fp32")
            config = type(base).model_validate(data)
            model, _, optimizer = load_trainer_model(policy, config.trainer, Parallel())
            # The reference is the policy itself (kl_coef is 0 in the demo: it only has to be there).
            ref_logprobs_BT = frozen_logprobs(
                model, batch, config.rollout.temperature, config.trainer.max_tokens_per_microbatch, Parallel()
            )
            report = policy_update(model, ref_logprobs_BT, optimizer, batch, config, seed=args.seed)
            print(f"| {replay} | " + " | ".join(f"{report[key]:.4f}" for key in SHOWN) + " |")


if __name__ == "__main__":
    main()
