"""Policy-update throughput on one GPU: the product's train step against a careful user of HF transformers.

    PYTHONPATH=. python3 benchmarks/policy_update.py [--batches rl uniform] [--rows careful careful_gc ...]

The model is a `Qwen3MoeForCausalLM` sized to ~1B parameters (Qwen3-30B-A3B's shape scaled down: hidden 1024, 12
layers, 64 experts of intermediate 384, top-8, 16 query and 4 KV heads of 128, every layer sparse, untied
embeddings, vocabulary 32768), random init, the same initial weights for every row. One update is one optimizer
step over the whole batch (one minibatch), gradients accumulated over its microbatches.

Batches:
- `rl`, RL-shaped: 64 samples, `rng = random.Random(0)`, each `(prompt, response) = (rng.randint(128, 512),
  min(4096, int(rng.lognormvariate(6.8, 0.8)) + 256))`: 117,558 real tokens, the longest 4,529; padded per
  microbatch of 8 consecutive samples, 45.8% of the tokens are padding.
- `uniform`: 8 samples of 2048 tokens (no padding).

Rows (`--rows`):
- `careful`, `careful_gc`: careful HF, as a careful user of transformers trains: HF's model (grouped_mm experts,
  SDPA) with fp32 weights under FSDP2 `fully_shard` per decoder layer and at the root,
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, fused fp32 AdamW, every decoder layer
  `torch.compile`'d, padded microbatches of 8 consecutive samples, HF's causal-LM loss over the real tokens;
  `careful_gc` with HF's gradient checkpointing.
- `bf16_hf`, `bf16_ours`: the last table's bf16-everything rows (bf16 weights and AdamW moments, which no careful
  user trains with): HF grouped_mm with compiled layers; `moeloop.steps.model.moe.replace_moe_blocks` and
  `compile_decoder_layers`. Padded microbatches of 8.
- `product`, `product_ac`: the train step's own functions: the model as `python -m moeloop.steps.train` loads it
  (`moeloop.steps.rl.state.load_trainer_model` from an HF checkpoint of the same weights, trainer.precision bf16: FSDP2
  mixed precision, fp32 master weights and moments, packed attention, compiled layers), and one minibatch of
  `moeloop.steps.rl.update.actor_steps` (GRPO's clipped surrogate and the routers' aux loss) over packed microbatches
  of at most --max-tokens tokens; `product_ac` with trainer.activation_checkpointing. Also timed, reported
  apart: its no-gradient logprob pass over the batch (`moeloop.steps.rl.batch.frozen_logprobs`, the old policy's).

Real tokens/s: the batch's real (unpadded) tokens over the median update time of --reps after --warmup. MFU:
model FLOPs per update (6 x active parameters x real tokens, active = every matmul weight except the experts' plus
top_k / num_experts of those, the embedding not a matmul; plus causal attention 6 x layers x heads x head_dim x
the sum over samples of length^2) over the time, against the dense bf16 matmul measured in the same run. Peak GiB:
`torch.cuda.max_memory_allocated` over the row's updates.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from moe_layer import dense_tflops, time_ms
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.model.dispatch import make_dispatcher
from moeloop.steps.model.moe import compile_decoder_layers, replace_moe_blocks
from moeloop.steps.model.policy import build_tokenizer, save_policy
from moeloop.steps.rl.batch import ExperienceBatch, frozen_logprobs
from moeloop.steps.rl.grpo import group_advantages
from moeloop.steps.rl.parallel import Parallel, init_parallel
from moeloop.steps.rl.state import load_trainer_model
from moeloop.steps.rl.update import actor_steps

REPO = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS = ("careful", "careful_gc", "bf16_hf", "bf16_ours", "product", "product_ac")


def build_config(args: argparse.Namespace) -> Qwen3MoeConfig:
    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,  # unused: every layer is sparse
        moe_intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"
    return config


def active_parameters(model: torch.nn.Module, config: Qwen3MoeConfig) -> tuple[int, int]:
    """(all parameters, parameters one token multiplies by): experts count top_k / num_experts, embeddings 0."""
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if "embed_tokens" in name:
            continue
        if "experts." in name:
            active += p.numel() * config.num_experts_per_tok // config.num_experts
        elif p.dim() >= 2:  # matmul weights (norm weights are not matmuls)
            active += p.numel()
    return total, active


def sample_lengths(batch: str) -> list[tuple[int, int]]:
    """(prompt, response) lengths of the batch's samples."""
    if batch == "uniform":
        return [(256, 2048 - 256)] * 8
    rng = random.Random(0)
    return [(rng.randint(128, 512), min(4096, int(rng.lognormvariate(6.8, 0.8)) + 256)) for _ in range(64)]


def experience(lengths: list[tuple[int, int]], vocab: int, device: torch.device) -> ExperienceBatch:
    """Random tokens in the batch's shape, right-padded, 8 samples per prompt group, random rewards."""
    generator = torch.Generator().manual_seed(0)
    width = max(p + r for p, r in lengths)
    input_ids_BT = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask_BT = torch.zeros(len(lengths), width, dtype=torch.long)
    response_mask_BT = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, (prompt, response) in enumerate(lengths):
        input_ids_BT[row, : prompt + response] = torch.randint(2, vocab, (prompt + response,), generator=generator)
        attention_mask_BT[row, : prompt + response] = 1
        response_mask_BT[row, prompt : prompt + response] = True
    behavior_BT = -2 * torch.rand(input_ids_BT.shape, generator=generator) * response_mask_BT
    rewards_B = torch.rand(len(lengths), generator=generator)
    groups_B = torch.arange(len(lengths)) // 8
    return ExperienceBatch(input_ids_BT, attention_mask_BT, response_mask_BT, behavior_BT, rewards_B, groups_B).to(
        device
    )


def padded_microbatches(batch: ExperienceBatch) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """HF's input: microbatches of 8 consecutive samples, each padded to its longest; (ids, mask, labels, share of
    the batch's real tokens)."""
    total = float(batch.attention_mask_BT.sum())
    micro = []
    for start in range(0, len(batch.input_ids_BT), 8):
        mask_bT = batch.attention_mask_BT[start : start + 8]
        width = int(mask_bT.sum(1).max())
        ids_bT, mask_bT = batch.input_ids_BT[start : start + 8, :width], mask_bT[:, :width]
        labels_bT = ids_bT.masked_fill(mask_bT == 0, -100)
        micro.append((ids_bT, mask_bT, labels_bT, float(mask_bT.sum()) / total))
    return micro


def hf_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro: list) -> Callable[[], None]:
    def update() -> None:
        optimizer.zero_grad(set_to_none=True)
        for ids_bT, mask_bT, labels_bT, share in micro:
            (model(input_ids=ids_bT, attention_mask=mask_bT, labels=labels_bT).loss * share).backward()
        optimizer.step()

    return update


def careful_hf(initial: torch.nn.Module, checkpointing: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with torch.device(DEVICE):
        model = Qwen3MoeForCausalLM(initial.config)
    model.load_state_dict(initial.state_dict())
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if model.device.type == "cuda":
            layer.compile()
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def bf16_everything(initial: torch.nn.Module, ours: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with torch.device(DEVICE):
        model = Qwen3MoeForCausalLM(initial.config)
    model.load_state_dict(initial.state_dict())
    model.to(torch.bfloat16)
    if ours:
        replace_moe_blocks(model, make_dispatcher("local", initial.config.num_experts), "grouped_mm")
        compile_decoder_layers(model)
    elif model.device.type == "cuda":
        for layer in model.model.layers:
            layer.compile()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def product_config(args: argparse.Namespace, checkpointing: bool) -> MoeloopConfig:
    data = load_config(REPO / "configs" / "tiny.yaml").model_dump()
    data["trainer"].update(
        minibatch_size=64, epochs=1, learning_rate=1e-5, precision="bf16", activation_checkpointing=checkpointing,
        max_tokens_per_microbatch=args.max_tokens,
    )  # fmt: skip
    data["rollout"].update(max_new_tokens=4096, prompts_per_iteration=8, samples_per_prompt=8)
    return MoeloopConfig.model_validate(data)


def product_update(
    checkpoint: Path, batch: ExperienceBatch, config: MoeloopConfig, parallel: Parallel
) -> tuple[Callable[[], None], Callable[[], None], torch.nn.Module]:
    """(one actor minibatch step, the old-policy logprob pass, the model), as the train step runs them."""
    model, _, optimizer = load_trainer_model(checkpoint, config.trainer, parallel)
    rows_B = torch.arange(len(batch.rewards_B))
    advantages_B = group_advantages(batch.rewards_B, batch.group_ids_B, scale=True)
    temperature = config.rollout.temperature
    old_logprobs_BT = frozen_logprobs(model, batch, temperature, config.trainer.max_tokens_per_microbatch, parallel)

    def update() -> None:
        actor_steps(
            model, optimizer, batch, [rows_B], advantages_B, old_logprobs_BT, None, None, batch.response_mask_BT,
            config, parallel,
        )  # fmt: skip

    def logprob_pass() -> None:
        frozen_logprobs(model, batch, temperature, config.trainer.max_tokens_per_microbatch, parallel)

    return update, logprob_pass, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", default=["rl", "uniform"], choices=["rl", "uniform"])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--max-tokens", type=int, default=32768, help="the product's trainer.max_tokens_per_microbatch")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dense-size", type=int, default=8192)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script with a tiny --layers etc.")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = build_config(args)
    product_settings = product_config(args, checkpointing=False).trainer
    parallel = init_parallel(product_settings)  # a one-process group: FSDP2 needs one, for every row
    dense = dense_tflops(device, args.dense_size, 3, 10)

    torch.manual_seed(0)
    with torch.device(device):
        initial = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # bf16-representable weights, so that the bf16 checkpoint holds exactly them
        for p in initial.parameters():
            p.copy_(p.to(torch.bfloat16))
    total, active = active_parameters(initial, config)
    checkpoint = Path(tempfile.mkdtemp()) / "checkpoint"
    save_policy(initial.to(torch.bfloat16), build_tokenizer(["abc"]), checkpoint)
    initial.float().cpu()  # off the GPU, so that it is in no row's peak
    print(
        f"## Policy update, Qwen3-MoE {total / 1e9:.2f} B parameters ({active / 1e6:.0f} M active): H={args.hidden}, "
        f"{args.layers} layers, {args.experts} experts x I={args.intermediate}, top-{args.top_k}, {args.heads} q / "
        f"{args.kv_heads} kv heads x {args.head_dim}, vocab {args.vocab}; dense bf16 {args.dense_size}^3 measured "
        f"{dense:.0f} TFLOP/s; median of {args.reps} updates after {args.warmup}; "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}\n"
    )
    for name in args.batches:
        lengths = sample_lengths(name)
        batch = experience(lengths, args.vocab, device)
        real = sum(p + r for p, r in lengths)
        flops = 6 * active * real + 6 * args.layers * args.heads * args.head_dim * sum((p + r) ** 2 for p, r in lengths)
        micro = padded_microbatches(batch)
        padded = sum(ids.numel() for ids, *_ in micro)
        print(f"\n### Batch {name}: {len(lengths)} samples, {real:,} real tokens ({1 - real / padded:.1%} padding in "
              f"microbatches of 8), longest {max(p + r for p, r in lengths)}; {flops / 1e12:.1f} model TFLOP per "
              f"update\n")  # fmt: skip
        print("| row | s / update | real tokens/s | vs careful HF | MFU (measured dense) | peak GiB |")
        print("|---|---|---|---|---|---|")
        baseline = None
        for row in args.rows:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            extra = ""
            try:
                if row.startswith("product"):
                    settings = product_config(args, checkpointing=row == "product_ac")
                    update, logprob_pass, model = product_update(checkpoint, batch, settings, parallel)
                    passes = time_ms(logprob_pass, device, 1, args.reps) / 1e3
                    extra = f" (its logprob pass: {passes:.2f} s, {real / passes:,.0f} tokens/s)"
                else:
                    maker = {"careful": lambda: careful_hf(initial, False), "careful_gc": lambda: careful_hf(initial, True),
                             "bf16_hf": lambda: bf16_everything(initial, False),
                             "bf16_ours": lambda: bf16_everything(initial, True)}[row]  # fmt: skip
                    model, optimizer = maker()
                    update = hf_update(model, optimizer, micro)
                seconds = time_ms(update, device, args.warmup, args.reps) / 1e3
            except Exception as error:  # noqa: BLE001 -- out of memory, or a compile failure: report it, keep the rest
                print(f"| {row} | failed: {type(error).__name__}: {str(error).splitlines()[0][:160]} | | | | |")
                continue
            finally:
                model = update = None  # noqa: F841 -- free the row's model before the next
                gc.collect()
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            if device.type == "cuda":
                torch.cuda.empty_cache()
            baseline = baseline or (seconds if row == "careful" else None)
            ratio = f"{baseline / seconds:.2f}x" if baseline else ""
            print(f"| {row}{extra} | {seconds:.3f} | {real / seconds:,.0f} | {ratio} | "
                  f"{100 * flops / seconds / 1e12 / dense:.1f}% | {peak:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
