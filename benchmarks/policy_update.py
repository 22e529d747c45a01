"""Policy-update throughput on one GPU: the product's train step against a careful user of HF transformers.

    PYTHONPATH=. python3 benchmarks/policy_update.py [--batches rl uniform] [--rows careful careful_packed ...]
        [--processes 3] [--profile [--trace DIR]] [--attention auto] [--smoke]

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
- `careful_packed`: careful HF that packs too: the same model, FSDP2 mixed precision and compiled layers, fed the
  product's packed microbatches (the same plan of at most --max-tokens tokens: batch 1, `position_ids` restarting
  per sample, no attention mask, no label across a sample boundary) with `attn_implementation="flex_attention"`,
  from which HF builds a document mask (on the CPU, which has no flex attention backward, SDPA's dense masks).
- `bf16_hf`, `bf16_ours`: the last table's bf16-everything rows (bf16 weights and AdamW moments, which no careful
  user trains with): HF grouped_mm with compiled layers; `moeloop.steps.model.moe.replace_moe_blocks` and
  `compile_decoder_layers`. Padded microbatches of 8.
- `product`, `product_ac`: the train step's own functions: the model as `python -m moeloop.steps.train` loads it
  (`moeloop.steps.rl.state.load_trainer_model` from an HF checkpoint of the same weights, trainer.precision bf16: FSDP2
  mixed precision, fp32 master weights and moments, packed attention, compiled layers), and one minibatch of
  `moeloop.steps.rl.update.actor_steps` (GRPO's clipped surrogate and the routers' aux loss) over packed microbatches
  of at most --max-tokens tokens, attention by --attention (trainer.attention); `product_ac` with
  trainer.activation_checkpointing. Also timed, reported apart: its no-gradient logprob pass over the batch
  (`moeloop.steps.rl.batch.frozen_logprobs`, the old policy's).

Each (batch, row) runs in --processes fresh processes (0, the default: all rows in this one, one after the other),
which build the model, compile, warm up and time on their own (the H200 figures: 3); the table gives the median over the processes of each one's
median, and the processes' spread, (slowest - fastest) / median. --profile adds, per row, from one more update
under `torch.profiler`: kernels launched, compiled regions entered (`CompiledFunction` forward, its backward; per
decoder layer and microbatch, the head's and the losses' compiled passes included), and the GPU's idle share
(1 - the union of its kernels' and copies' time over the span from the update's start on the host to its last
GPU work).

Real tokens/s: the batch's real (unpadded) tokens over the median update time of --reps after --warmup. MFU:
model FLOPs per update (6 x active parameters x real tokens, active = every matmul weight except the experts' plus
top_k / num_experts of those, the embedding not a matmul; plus causal attention 6 x layers x heads x head_dim x
the sum over samples of length^2) over the time, against the dense bf16 matmul measured in the same run. Peak GiB:
`torch.cuda.max_memory_allocated` over the row's updates.
"""

from __future__ import annotations

import argparse
import copy
import gc
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke
import torch
import torch.distributed as dist
from moe_layer import dense_tflops, time_ms
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.model.dispatch import make_dispatcher
from moeloop.steps.model.microbatch import pack_rows
from moeloop.steps.model.moe import compile_decoder_layers, replace_moe_blocks
from moeloop.steps.model.policy import build_tokenizer, save_policy
from moeloop.steps.rl.batch import ExperienceBatch, frozen_logprobs
from moeloop.steps.rl.grpo import group_advantages
from moeloop.steps.rl.packing import plan_microbatches
from moeloop.steps.rl.parallel import Parallel, init_parallel, mesh_parallel
from moeloop.steps.rl.state import load_trainer_model
from moeloop.steps.rl.update import actor_steps

REPO = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS = ("careful", "careful_packed", "careful_gc", "bf16_hf", "bf16_ours", "product", "product_ac")
HfMicrobatch = tuple[dict[str, torch.Tensor], float]  # the model's keyword arguments, share of the real tokens


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


def sample_lengths(batch: str, divisor: int = 1) -> list[tuple[int, int]]:
    """(prompt, response) lengths of the batch's samples, each divided by divisor (at least 1)."""
    if batch == "uniform":
        lengths = [(256, 2048 - 256)] * 8
    else:
        rng = random.Random(0)
        lengths = [(rng.randint(128, 512), min(4096, int(rng.lognormvariate(6.8, 0.8)) + 256)) for _ in range(64)]
    return [(max(p // divisor, 1), max(r // divisor, 1)) for p, r in lengths]


def experience(lengths: list[tuple[int, int]], vocab: int, device: torch.device, seed: int = 0) -> ExperienceBatch:
    """Random tokens in the batch's shape, right-padded, 8 samples per prompt group, random rewards."""
    generator = torch.Generator().manual_seed(seed)
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


def padded_microbatches(batch: ExperienceBatch) -> list[HfMicrobatch]:
    """HF's input: microbatches of 8 consecutive samples, each padded to its longest."""
    total = float(batch.attention_mask_BT.sum())
    micro = []
    for start in range(0, len(batch.input_ids_BT), 8):
        mask_bT = batch.attention_mask_BT[start : start + 8]
        width = int(mask_bT.sum(1).max())
        ids_bT, mask_bT = batch.input_ids_BT[start : start + 8, :width], mask_bT[:, :width]
        labels_bT = ids_bT.masked_fill(mask_bT == 0, -100)
        micro.append(({"input_ids": ids_bT, "attention_mask": mask_bT, "labels": labels_bT}, float(mask_bT.sum()) / total))
    return micro


def packed_microbatches(batch: ExperienceBatch, max_tokens: int) -> list[HfMicrobatch]:
    """HF's input packed as the product packs (`plan_microbatches`, `pack_rows`): one row of samples end to end,
    positions restarting per sample, a sample's first token no label (so no token predicts the next sample's)."""
    lengths = batch.attention_mask_BT.sum(1).tolist()
    micro = []
    for members in plan_microbatches(lengths, max_tokens, 1)[0]:
        packed = pack_rows(batch.input_ids_BT, lengths, members)
        labels_1N = packed.input_ids_1N.masked_fill(packed.position_ids_1N == 0, -100)
        inputs = {"input_ids": packed.input_ids_1N, "position_ids": packed.position_ids_1N, "labels": labels_1N}
        micro.append((inputs, packed.num_tokens / sum(lengths)))
    return micro


def hf_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro: list[HfMicrobatch]) -> Callable[[], None]:
    def update() -> None:
        optimizer.zero_grad(set_to_none=True)
        for inputs, share in micro:
            (model(**inputs).loss * share).backward()
        optimizer.step()

    return update


def careful_hf(
    initial: torch.nn.Module, checkpointing: bool, attention: str = "sdpa"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    config = copy.deepcopy(initial.config)
    config._attn_implementation = attention
    with torch.device(DEVICE):
        model = Qwen3MoeForCausalLM(config)
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
        max_tokens_per_microbatch=args.max_tokens, attention=args.attention,
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


def profile_counts(
    update: Callable[[], None], device: torch.device, per_layer: int, trace: Path | None
) -> dict[str, float]:
    """One update under torch.profiler: kernels launched, compiled regions entered forward and backward (also over
    per_layer: layers x microbatches), and the GPU's idle share from the update's start on the host to its last GPU
    work. The trace itself goes to `trace` (gzipped), where given."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        with record_function("policy_update"):
            update()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        prof.export_chrome_trace(f"{folder}/trace.json")
        raw = Path(f"{folder}/trace.json").read_bytes()
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_bytes(gzip.compress(raw))
    events = json.loads(raw)["traceEvents"]
    names = [event.get("name", "") for event in events if event.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    counts = {
        "compiled regions forward": names.count("CompiledFunction"),
        "compiled regions backward": names.count("CompiledFunctionBackward"),
        "kernels": sum(1 for e in events if e.get("cat") == "kernel"),
    }
    counts["compiled regions forward per layer"] = counts["compiled regions forward"] / per_layer
    counts["compiled regions backward per layer"] = counts["compiled regions backward"] / per_layer
    if gpu:
        start = next(e["ts"] for e in events if e.get("name") == "policy_update" and e.get("cat") == "user_annotation")
        busy, reached = 0.0, start
        for begin, end in gpu:  # the union of the GPU's intervals
            busy += max(0.0, end - max(begin, reached))
            reached = max(reached, end)
        counts["gpu idle share"] = 1 - busy / (reached - start)
    return counts


def measure_row(args: argparse.Namespace, name: str, row: str) -> dict[str, Any]:
    """One row on one batch in this process: its median seconds per update, peak GiB, dense TFLOP/s measured here,
    the product's logprob pass, and with --profile the counts of `profile_counts`."""
    device = torch.device(args.device)
    config = build_config(args)
    product_settings = product_config(args, checkpointing=False).trainer
    # A one-process group (FSDP2 needs one, for every row), made by the first row of this process.
    parallel = mesh_parallel(1, device.type) if dist.is_initialized() else init_parallel(product_settings)
    result: dict[str, Any] = {"dense": dense_tflops(device, args.dense_size, 3, 10)}
    torch.manual_seed(0)
    with torch.device(device):
        initial = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # bf16-representable weights, so that the bf16 checkpoint holds exactly them
        for p in initial.parameters():
            p.copy_(p.to(torch.bfloat16))
    checkpoint = Path(tempfile.mkdtemp()) / "checkpoint"
    save_policy(initial.to(torch.bfloat16), build_tokenizer(["abc"]), checkpoint)
    initial.float().cpu()  # off the GPU, so that it is in no row's peak
    batch = experience(sample_lengths(name, args.length_divisor), args.vocab, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if row.startswith("product"):
        settings = product_config(args, checkpointing=row == "product_ac")
        update, logprob_pass, model = product_update(checkpoint, batch, settings, parallel)
        result["logprob pass"] = time_ms(logprob_pass, device, 1, args.reps) / 1e3
        microbatches = len(plan_microbatches(batch.attention_mask_BT.sum(1).tolist(), args.max_tokens, 1)[0])
    else:
        packed = "flex_attention" if device.type == "cuda" else "sdpa"  # the CPU has no flex attention backward
        maker = {"careful": lambda: careful_hf(initial, False), "careful_gc": lambda: careful_hf(initial, True),
                 "careful_packed": lambda: careful_hf(initial, False, packed),
                 "bf16_hf": lambda: bf16_everything(initial, False),
                 "bf16_ours": lambda: bf16_everything(initial, True)}[row]  # fmt: skip
        model, optimizer = maker()
        micro = packed_microbatches(batch, args.max_tokens) if row == "careful_packed" else padded_microbatches(batch)
        update, microbatches = hf_update(model, optimizer, micro), len(micro)
    result["seconds"] = time_ms(update, device, args.warmup, args.reps) / 1e3
    result["peak"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    if args.profile:
        trace = Path(args.trace) / f"{name}-{row}-{os.getpid()}.json.gz" if args.trace else None
        result |= profile_counts(update, device, args.layers * microbatches, trace)
    return result


def measure_in_processes(args: argparse.Namespace, name: str, row: str) -> list[dict[str, Any]]:
    """measure_row in --processes fresh processes, one after the other (this script again, with --one)."""
    results = []
    for _ in range(args.processes):
        command = [sys.executable, __file__, *sys.argv[1:], "--one", "--batches", name, "--rows", row]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
        results.append(json.loads(lines[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", default=["rl", "uniform"], choices=["rl", "uniform"])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--max-tokens", type=int, default=32768, help="the product's trainer.max_tokens_per_microbatch")
    parser.add_argument("--attention", default="auto", help="the product's trainer.attention")
    parser.add_argument("--length-divisor", type=int, default=1, help="every sample's lengths divided by this")
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
    parser.add_argument("--processes", type=int, default=0, help="fresh processes per row (0: all rows in this one)")
    parser.add_argument("--profile", action="store_true", help="kernels, compiled regions, GPU idle share per row")
    parser.add_argument("--trace", help="with --profile: a folder for each profiled update's trace (gzipped JSON)")
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script with a tiny --layers etc.")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one batch and row, JSON out
    args = smoke.parse_args(
        parser, device="cpu", batches=["uniform"], rows=["careful", "careful_packed", "product"], layers=1, hidden=64,
        intermediate=32, heads=2, kv_heads=1, head_dim=32, experts=4, top_k=2, vocab=256, warmup=0, reps=1,
        dense_size=256, max_tokens=512, processes=1, profile=True, length_divisor=32,
    )  # fmt: skip
    if args.one:
        print(json.dumps(measure_row(args, args.batches[0], args.rows[0])), flush=True)
        return
    config = build_config(args)
    with torch.device("meta"):
        total, active = active_parameters(Qwen3MoeForCausalLM(config), config)
    where = f"{args.processes} fresh processes a row" if args.processes else "all rows in one process"
    print(
        f"## Policy update, Qwen3-MoE {total / 1e9:.2f} B parameters ({active / 1e6:.0f} M active): H={args.hidden}, "
        f"{args.layers} layers, {args.experts} experts x I={args.intermediate}, top-{args.top_k}, {args.heads} q / "
        f"{args.kv_heads} kv heads x {args.head_dim}, vocab {args.vocab}; median of {args.reps} updates after "
        f"{args.warmup}, {where}; product attention {args.attention}; "
        f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'CPU'}, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}\n"
    )
    for name in args.batches:
        lengths = sample_lengths(name, args.length_divisor)
        real = sum(p + r for p, r in lengths)
        flops = 6 * active * real + 6 * args.layers * args.heads * args.head_dim * sum((p + r) ** 2 for p, r in lengths)
        groups = [lengths[start : start + 8] for start in range(0, len(lengths), 8)]
        padded = sum(len(group) * max(p + r for p, r in group) for group in groups)
        print(f"\n### Batch {name}: {len(lengths)} samples, {real:,} real tokens ({1 - real / padded:.1%} padding in "
              f"microbatches of 8), longest {max(p + r for p, r in lengths)}; {flops / 1e12:.1f} model TFLOP per "
              f"update\n")  # fmt: skip
        print("| row | s / update | processes' s | spread | real tokens/s | vs careful HF | vs packed careful HF "
              "| MFU (measured dense) | peak GiB | profile |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        medians: dict[str, float] = {}
        for row in args.rows:
            try:
                results = measure_in_processes(args, name, row) if args.processes else [measure_row(args, name, row)]
            except Exception as error:  # noqa: BLE001 -- out of memory, or a compile failure: report it, keep the rest
                print(f"| {row} | failed: {type(error).__name__}: {str(error).splitlines()[0][:160]} | | | | | | | | |")
                continue
            finally:
                gc.collect()
            seconds = [r["seconds"] for r in results]
            medians[row] = median = statistics.median(seconds)
            dense = statistics.median(r["dense"] for r in results)
            ratios = [f"{medians[base] / median:.2f}x" if base in medians else "" for base in ("careful", "careful_packed")]
            extra = ""
            if "logprob pass" in results[0]:
                passes = statistics.median(r["logprob pass"] for r in results)
                extra = f" (its logprob pass: {passes:.2f} s, {real / passes:,.0f} tokens/s)"
            counts = {key: statistics.median(r[key] for r in results) for key in results[0] if key in PROFILED}
            profiled = ", ".join(f"{key} {value:.3g}" for key, value in counts.items())
            print(f"| {row}{extra} | {median:.3f} | {' '.join(f'{s:.3f}' for s in seconds)} | "
                  f"{(max(seconds) - min(seconds)) / median:.1%} | {real / median:,.0f} | {' | '.join(ratios)} | "
                  f"{100 * flops / median / 1e12 / dense:.1f}% | {max(r['peak'] for r in results):.1f} | {profiled} |",
                  flush=True)  # fmt: skip


PROFILED = ("kernels", "compiled regions forward per layer", "compiled regions backward per layer", "gpu idle share")


if __name__ == "__main__":
    main()
