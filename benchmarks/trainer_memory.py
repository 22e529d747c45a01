"""The most decoder layers of a Qwen3-30B-A3B-shaped policy that the product's train step trains on one GPU, and its
peak memory per layer count.

    PYTHONPATH=. python3 benchmarks/trainer_memory.py --layers 14 16 [--offload] [--checkpointing]

The shape is Qwen3-30B-A3B's (hidden 2048, moe_intermediate 768, 128 experts, top-8, 32 query / 4 KV heads of
128, vocabulary 151936), with --layers decoder layers; the batch is --samples samples of --seq tokens (a 512-token
prompt, the rest response; --seq 1024 or less: half of it prompt), one minibatch. --smoke: a tiny shape on the CPU
in fp32 (no memory figures). Each layer count runs in a fresh process, as the train step does:
1. the reference policy (random weights, as the train step's checkpoint 0) sharded as the trainer's, its logprobs
   over the batch computed once (`moeloop.steps.rl.batch.frozen_logprobs`), then freed;
2. the policy (the same weights) as the trainer holds it (`moeloop.steps.rl.state.prepare_trainer_model`:
   trainer.precision bf16, fp32 master weights and AdamW moments; the moments in host memory with --offload), its
   old logprobs, and --steps optimizer steps of `moeloop.steps.rl.update.actor_steps` over packed microbatches, each over
   the whole batch. Two by default: AdamW makes its moments at the first step, so only from the second on is the
   backward's peak the one of a train step of several minibatches.
The weights are made in memory (random, HF's init scale) instead of read from safetensors, which would need the
model on disk first; everything else is the train step's own code. Peaks: the tensors
(`torch.cuda.max_memory_allocated`) over all of it, and the reference pass's alone; the GPU's, which decides what
fits: the caching allocator's peak reservation (`max_memory_reserved`, fragmentation included) plus what the
process holds outside it (the CUDA context, library workspaces: the device's used memory less the reservation).
Beside them, what the memory model (`moeloop.steps.rl.memory`, the check `start` and `train` refuse with) predicts
for the same shape and settings, and its error against the GPU's peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from moeloop.steps.rl.memory import GIB, predict_train_peak_bytes
from moeloop.steps.model.shape import shape_from_hf_config
from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.model.policy import shard_model
from moeloop.steps.rl.batch import ExperienceBatch, frozen_logprobs
from moeloop.steps.rl.parallel import Parallel, init_parallel
from moeloop.steps.rl.state import make_optimizer, prepare_trainer_model
from moeloop.steps.rl.update import actor_steps

REPO = Path(__file__).resolve().parents[1]


QWEN3_30B_A3B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8}  # fmt: skip
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2}


def shape(layers: int, tiny: bool = False) -> Qwen3MoeConfig:
    config = Qwen3MoeConfig(
        **(TINY if tiny else QWEN3_30B_A3B), num_hidden_layers=layers, norm_topk_prob=True,
        max_position_embeddings=40960, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        router_aux_loss_coef=0.001,
    )  # fmt: skip
    config._experts_implementation = "grouped_mm"
    return config


def trainer_config(args: argparse.Namespace) -> MoeloopConfig:
    data = load_config(REPO / "configs" / "tiny.yaml").model_dump()
    data["trainer"].update(
        minibatch_size=args.samples, epochs=1, learning_rate=1e-5, precision="fp32" if args.smoke else "bf16",
        activation_checkpointing=args.checkpointing, max_tokens_per_microbatch=args.max_tokens,
        offload_optimizer=args.offload,
    )  # fmt: skip
    data["rollout"].update(max_new_tokens=args.seq, prompts_per_iteration=1, samples_per_prompt=args.samples, num_shards=1)
    return MoeloopConfig.model_validate(data)


def random_model(config: Qwen3MoeConfig, settings: object, parallel: Parallel) -> torch.nn.Module:
    """The trainer's model of config with random weights (normal, std 0.02; norms 1), made on the GPU."""
    model = shard_model(AutoModelForCausalLM, config, "local", "grouped_mm", parallel.ep_group, parallel.device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return prepare_trainer_model(model, settings, parallel)


def batch(args: argparse.Namespace, device: torch.device, vocab: int) -> ExperienceBatch:
    generator = torch.Generator().manual_seed(0)
    shape_BT = (args.samples, args.seq)
    response_mask_BT = torch.zeros(shape_BT, dtype=torch.bool)
    response_mask_BT[:, min(512, args.seq // 2) :] = True
    return ExperienceBatch(
        torch.randint(2, vocab, shape_BT, generator=generator), torch.ones(shape_BT, dtype=torch.long),
        response_mask_BT, -2 * torch.rand(shape_BT, generator=generator) * response_mask_BT,
        torch.rand(args.samples, generator=generator), torch.zeros(args.samples, dtype=torch.long),
    ).to(device)  # fmt: skip


def predicted_gib(args: argparse.Namespace) -> float:
    """The memory model's peak for this run: the train step's own call (`refuse_unfit_trainer`), one rank."""
    tokens = args.samples * args.seq
    memory = predict_train_peak_bytes(
        shape_from_hf_config(shape(args.layers[0], args.smoke).to_dict(), "benchmark"), 1, 1,
        min(args.max_tokens, tokens), config_precision(args), args.checkpointing, args.offload, "precomputed", gradient_accumulation=tokens > args.max_tokens,
    )  # fmt: skip
    return memory.total / GIB


def config_precision(args: argparse.Namespace) -> str:
    return "fp32" if args.smoke else "bf16"


def gib(read: str) -> float:
    """torch.cuda's figure of that name in GiB (0 on the CPU, --smoke)."""
    return getattr(torch.cuda, read)() / 2**30 if torch.cuda.is_available() else 0.0


def measure(args: argparse.Namespace) -> dict:
    config = trainer_config(args)
    settings = config.trainer
    parallel = init_parallel(settings)
    model_shape = shape(args.layers[0], args.smoke)
    experience = batch(args, parallel.device, model_shape.vocab_size)
    temperature, budget = config.rollout.temperature, settings.max_tokens_per_microbatch
    started = time.perf_counter()
    reference = random_model(model_shape, settings, parallel)
    ref_logprobs_BT = frozen_logprobs(reference, experience, temperature, budget, parallel)
    del reference
    gc.collect()  # as moeloop.steps.rl.state.reference_logprobs frees it
    reference_peak = gib("max_memory_allocated")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    left_by_reference = gib("memory_allocated")
    model = random_model(model_shape, settings, parallel)
    optimizer = make_optimizer(model, settings)
    loaded = gib("memory_allocated")
    old_logprobs_BT = frozen_logprobs(model, experience, temperature, budget, parallel)
    advantages_B = torch.linspace(-1, 1, args.samples, device=parallel.device)
    schedule = [torch.arange(args.samples)] * args.steps
    step_started = time.perf_counter()
    measured = actor_steps(
        model, optimizer, experience, schedule, advantages_B, old_logprobs_BT, None, ref_logprobs_BT,
        experience.response_mask_BT, config, parallel,
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
    outside_allocator = (total - free) / 2**30 - gib("memory_reserved")
    peak, predicted = gib("max_memory_allocated"), predicted_gib(args)
    gpu_peak = gib("max_memory_reserved") + outside_allocator
    return {
        "layers": args.layers[0],
        "max_tokens": args.max_tokens,
        "parameters": sum(p.numel() for p in model.parameters()),
        "optimizer_steps": args.steps,
        "peak_gib": round(peak, 2),
        "gpu_peak_gib": round(gpu_peak, 2),
        "outside_allocator_gib": round(outside_allocator, 2),
        "predicted_gib": round(predicted, 2),
        "prediction_error": f"{predicted / gpu_peak - 1:+.1%}" if gpu_peak else None,
        "reference_pass_peak_gib": round(reference_peak, 2),
        "allocated_after_reference_gib": round(left_by_reference, 2),  # the batch, and anything the reference left
        "allocated_after_policy_load_gib": round(loaded, 2),
        "step_seconds": round(time.perf_counter() - step_started, 2),
        "seconds": round(time.perf_counter() - started, 1),
        "tokens_per_second": round(args.samples * args.seq / (time.perf_counter() - step_started), 1),
        "grad_norm": measured["grad_norm"][0],
        "offload": args.offload,
        "checkpointing": args.checkpointing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", help="layer counts, each in a fresh process (required)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps, each over the whole batch")
    parser.add_argument("--offload", action="store_true", help="trainer.offload_optimizer")
    parser.add_argument("--checkpointing", action="store_true", help="trainer.activation_checkpointing")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # run one layer count here
    args = smoke.parse_args(parser, layers=[1], samples=2, seq=64, max_tokens=128)
    if not args.layers:
        parser.error("--layers is required")
    if args.one:
        try:
            print(json.dumps(measure(args)), flush=True)
        except torch.OutOfMemoryError:
            print(json.dumps({"layers": args.layers[0], "out_of_memory": True}), flush=True)
        return
    flags = [f for f, on in (("--offload", args.offload), ("--checkpointing", args.checkpointing)) if on]
    for layers in args.layers:
        command = [sys.executable, __file__, "--one", "--layers", str(layers), "--samples", str(args.samples),
                   "--seq", str(args.seq), "--max-tokens", str(args.max_tokens), "--steps", str(args.steps),
                   *flags, *(["--smoke"] if args.smoke else [])]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
