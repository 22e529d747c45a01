"""The MoE layer's forward + backward on one GPU at Qwen3-30B-A3B or DeepSeek-V3 expert shapes, in expert-matmul
TFLOP/s.

    PYTHONPATH=. python3 benchmarks/moe_layer.py [--tokens 16384] [--profile-dir DIR] [--smoke]
    PYTHONPATH=. python3 benchmarks/moe_layer.py --family deepseek_v3 --tokens 8192 --eager-reps 0

Defaults (`--family qwen3_moe`): hidden 2048, expert intermediate 768, 128 experts, top-8, 16384 tokens, bf16,
random init (router and experts ~ N(0, 0.02), inputs ~ N(0, 1)). `--family deepseek_v3` takes DeepSeek-V3's
block: hidden 7168, expert intermediate 2048, 256 routed experts in 8 groups (top-4 groups) and 1 shared expert,
top-8, HF's group-limited sigmoid router with routed_scaling_factor 2.5. FLOPs count the expert matmuls only: per
(token, expert) pair, routed or shared, 2*H*2I (gate+up) + 2*I*H (down) forward, and twice that backward (input
and weight gradients), so 18*H*I per pair for forward + backward. The rows take turns (`time_interleaved`, as the chip's
clocks fall under its power cap): --rounds rounds of --reps timed iterations each (CUDA events), after --warmup;
a row's figure is the median of its rounds' medians. Every iteration sets the gradients to None first.

Rows, all measured in the same run:
- dense: one bf16 matmul 8192 x 8192 x 8192 (the chip's practical ceiling), and one of the experts' total
  shape, [T*K, H] @ [H, 2I] then [T*K, I] @ [I, H] forward + backward as plain matmuls (no grouping);
- bare grouped SwiGLU: `moeloop.steps.model.moe.GroupedExperts` on T*K rows already sorted by expert, perfectly balanced
  (T*K/E rows each): what the experts cost with no routing at all; with torch's grouped_mm and the eager
  SwiGLU (the issue's reference), with grouped_mm and the Triton SwiGLU, and as `GroupedExperts` runs on a
  Hopper GPU (`moeloop.steps.model.kernels`' Triton grouped GEMM and SwiGLU);
- ours: `moeloop.steps.model.moe.MoeBlock`, `local` dispatcher, `grouped_mm` experts (HF's router included): compiled whole
  (`torch.compile`, fullgraph), as `compile_decoder_layers` compiles it in bf16 at EP = 1; eager, as the
  block runs under EP > 1, with `moeloop.steps.model.kernels` as on CUDA; eager with torch's grouped_mm instead of the
  Triton GEMM; and eager with grouped_mm, the eager SwiGLU and index_select + sum (`TORCH_KERNELS`), to show
  what those are worth;
- HF transformers' `Qwen3MoeSparseMoeBlock` (or `DeepseekV3MoE`) with `experts_implementation="grouped_mm"`, its
  fastest, and "eager".
DeepSeek-V3's experts hold 11.3 G parameters (22.5 GB in bf16, as much again for their gradients), so its run
keeps two copies (HF's and ours, the compiled block sharing ours) and leaves out the bare rows, which would be a
third. Every routed row is checked against HF grouped_mm on the same weights, input and upstream gradient (relative
error of the output, x.grad, the experts' and the router's weight gradients; "ok" below 1e-2, bf16).
Prints Markdown tables; with --profile-dir, writes torch.profiler kernel tables there.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from moeloop.steps.model import kernels
from moeloop.steps.model.dispatch import make_dispatcher
from moeloop.steps.model.families import family_of_block
from moeloop.steps.model.moe import GroupedExperts, MoeBlock

NOMINAL_DENSE_BF16 = 989.0  # TFLOP/s, H100/H200 SXM datasheet, dense
BARE_REFERENCE = "bare grouped SwiGLU (balanced, pre-permuted): grouped_mm, eager SwiGLU (the issue's reference)"


TORCH_KERNELS = {  # three of moeloop.steps.model.kernels' torch paths (the router and expand-rows stay Triton on CUDA)
    "grouped_linear": kernels.grouped_linear_torch,
    "swiglu": kernels.swiglu_eager,
    "gather_sum": kernels.gather_sum_torch,
}


@contextlib.contextmanager
def torch_kernels(*names: str) -> Iterator[None]:
    """The named moeloop.steps.model.kernels functions (all without names) swapped for their torch versions, on any device."""
    swapped = {name: getattr(kernels, name) for name in names or TORCH_KERNELS}
    for name in swapped:
        setattr(kernels, name, TORCH_KERNELS[name])
    try:
        yield
    finally:
        for name, fn in swapped.items():
            setattr(kernels, name, fn)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn over reps, after warmup calls (CUDA events on a GPU, else the wall clock)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    sync(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


Row = tuple[str, Callable[[], Any], Callable[[], contextlib.AbstractContextManager[None]]]  # name, step, context


def time_interleaved(rows: list[Row], device: torch.device, warmup: int, reps: int, rounds: int) -> dict[str, float]:
    """Median milliseconds per step of each row, its reps timed in each of rounds, the rows taking turns.

    Under sustained load an H200 holds its power cap by lowering its clocks (nvidia-smi: 1980 MHz idle, 1185 to
    1620 MHz in this benchmark, "SW power cap"), so the same step runs ~10% slower after a few dozen iterations
    than on a cool chip. Timed one after the other, rows would be compared at different clocks; taking turns,
    they share them (benchmarks/moe_h200.md).
    """
    for _, step, context in rows:
        with context():
            for _ in range(warmup):
                step()
    times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for _ in range(rounds):
        for name, step, context in rows:
            with context():
                times[name].append(time_ms(step, device, 1, reps))
    return {name: statistics.median(values) for name, values in times.items()}


def fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, *extra: Any) -> Callable[[], torch.Tensor]:
    params = list(module.parameters())

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        x.grad = None
        out = module(x, *extra)
        out.backward(grad)
        return out

    return step


FAMILY_SHAPES = {  # the defaults of --hidden --intermediate --experts --top-k --tokens per --family
    "qwen3_moe": {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "tokens": 16384},
    "deepseek_v3": {"hidden": 7168, "intermediate": 2048, "experts": 256, "top_k": 8, "tokens": 8192},
}
DEEPSEEK_V3_ROUTING = {"n_group": 8, "topk_group": 4, "n_shared_experts": 1, "routed_scaling_factor": 2.5}


def hf_block(args: argparse.Namespace, device: torch.device, impl: str) -> nn.Module:
    """HF's own sparse block of args.family at the arguments' shape, its experts run by impl."""
    shape = {"hidden_size": args.hidden, "moe_intermediate_size": args.intermediate,
             "num_experts_per_tok": args.top_k, "norm_topk_prob": True}  # fmt: skip
    if args.family == "deepseek_v3":
        config = DeepseekV3Config(n_routed_experts=args.experts, **DEEPSEEK_V3_ROUTING, **shape)
        block_class: type[nn.Module] = DeepseekV3MoE
    else:
        config = Qwen3MoeConfig(num_experts=args.experts, **shape)
        block_class = Qwen3MoeSparseMoeBlock
    config._experts_implementation = impl
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):
        block = block_class(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=generator, device=device, dtype=torch.float32))
    assert block.experts.config._experts_implementation == impl
    return block


def dense_step(device: torch.device, size: int) -> Callable[[], torch.Tensor]:
    """One bf16 matmul size x size x size, 2 * size**3 FLOPs."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    return lambda: a @ b


def dense_tflops(device: torch.device, size: int, warmup: int, reps: int) -> float:
    return 2 * size**3 / time_ms(dense_step(device, size), device, warmup, reps) / 1e9


def dense_swiglu_step(pairs: int, H: int, I: int, device: torch.device) -> Callable[[], None]:
    """The experts' total shape as plain matmuls (no grouping): the best the same FLOPs could do as dense GEMMs."""
    x = torch.randn(pairs, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    w1 = (0.02 * torch.randn(2 * I, H, device=device)).to(torch.bfloat16).requires_grad_(True)
    w2 = (0.02 * torch.randn(H, I, device=device)).to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn(pairs, H, device=device, dtype=torch.bfloat16)

    def step() -> None:
        x.grad = w1.grad = w2.grad = None
        g, u = (x @ w1.t()).chunk(2, dim=-1)
        ((F.silu(g) * u) @ w2.t()).backward(grad)

    return step


def bare_rows(reference: nn.Module, pairs: int, E: int, H: int, device: torch.device) -> list[Row]:
    """Balanced, pre-permuted rows through the layer's own GroupedExperts: torch's grouped_mm and eager SwiGLU (the
    issue's reference), then with moeloop.steps.model.kernels' kernels one by one (on CUDA)."""
    experts = GroupedExperts.from_hf(reference.experts, family_of_block(reference), 0, 1, "grouped_mm")
    x_NH = torch.randn(pairs, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_NH = torch.randn(pairs, H, device=device, dtype=torch.bfloat16)
    balanced_E = torch.full((E,), pairs // E, device=device, dtype=torch.int64)
    bare = fwd_bwd(experts, x_NH, grad_NH, balanced_E)
    rows: list[Row] = [(BARE_REFERENCE, bare, torch_kernels)]
    if device.type == "cuda":
        rows += [
            ("bare grouped SwiGLU: grouped_mm, Triton SwiGLU", bare, partial(torch_kernels, "grouped_linear")),
            ("bare grouped SwiGLU: moeloop.steps.model.kernels (Triton SwiGLU and grouped GEMM)", bare, contextlib.nullcontext),
        ]
    return rows


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32, a slice of the first dimension at a time (DeepSeek-V3's expert gradients are 15 GB
    in bf16, and fp32 copies of both would not fit beside the model)."""
    diff_sq = ref_sq = 0.0
    for a_part, b_part in zip(a.split(8), b.split(8), strict=True):
        diff_sq += float((a_part.float() - b_part.float()).square().sum())
        ref_sq += float(b_part.float().square().sum())
    return (diff_sq / ref_sq) ** 0.5


def profile(name: str, fn: Callable[[], Any], out_dir: Path, device: torch.device) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(3):
            fn()
        sync(device)
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70)
    (out_dir / f"profile_{name}.txt").write_text(table)
    return table


def add_layer_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The layer's shape, the timing in turns and the device: what this script and expert_gemms.py both take."""
    parser.add_argument("--family", choices=sorted(FAMILY_SHAPES), default="qwen3_moe", help="the block's family")
    parser.add_argument("--tokens", type=int, default=None, help="default per family (FAMILY_SHAPES)")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=5, help="iterations of each row before the rounds")
    parser.add_argument("--reps", type=int, default=10, help="timed iterations of each row per round")
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds in which the rows take turns")
    parser.add_argument("--dense-size", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


# --smoke (benchmarks/smoke.py): a tiny layer on the CPU, one timed iteration of each row.
LAYER_SMOKE = {"tokens": 64, "hidden": 64, "intermediate": 32, "experts": 8, "top_k": 2, "warmup": 0, "reps": 1,
               "rounds": 1, "dense_size": 64, "device": "cpu"}  # fmt: skip


def layer_arguments(parser: argparse.ArgumentParser, **smoke_values: object) -> argparse.Namespace:
    """The parsed arguments (with --smoke, `LAYER_SMOKE` and smoke_values), the shape's unset ones taken from the
    family's defaults."""
    args = smoke.parse_args(parser, **LAYER_SMOKE, **smoke_values)
    for key, value in FAMILY_SHAPES[args.family].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_arguments(parser, rounds=5)
    parser.add_argument("--eager-reps", type=int, default=3, help="0 skips HF's eager loop")
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's, for the compiled block")
    args = layer_arguments(parser, eager_reps=1, compile_backend="aot_eager")
    device = torch.device(args.device)
    T, H, I, E, K = args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
    shared = DEEPSEEK_V3_ROUTING["n_shared_experts"] if args.family == "deepseek_v3" else 0
    pairs = T * (K + shared)  # the shared expert's intermediate is n_shared * I: as many pairs of width I
    flops = 18 * H * I * pairs  # forward 6*H*I per pair, backward twice that
    dense_name = f"dense bf16 matmul {args.dense_size}^3"

    torch.manual_seed(0)
    rows: list[Row] = [
        (dense_name, dense_step(device, args.dense_size), contextlib.nullcontext),
        ("dense SwiGLU, experts' total shape, no grouping", dense_swiglu_step(pairs, H, I, device),
         contextlib.nullcontext),
    ]  # fmt: skip
    reference = hf_block(args, device, "grouped_mm")
    hf_class = type(reference).__name__
    if not shared:
        rows += bare_rows(reference, pairs, E, H, device)
    x_BSH = torch.randn(1, T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_BSH = torch.randn(1, T, H, device=device, dtype=torch.bfloat16)

    # From a copy: the block takes its HF block's router over (its class swapped), and HF's row must stay HF's.
    ours = MoeBlock.from_hf_block(copy.deepcopy(reference), make_dispatcher("local", E), "grouped_mm")
    # The same parameters: no third copy of the experts.
    compiled = torch.compile(ours, fullgraph=True, backend=args.compile_backend)
    hf_name = f"HF {hf_class}, experts_implementation=grouped_mm"
    variants: list[tuple[str, nn.Module, Callable[[], contextlib.AbstractContextManager[None]]]] = [
        ("**ours: MoeBlock compiled whole** (local dispatcher, bf16; as `compile_decoder_layers` compiles it)",
         compiled, contextlib.nullcontext),
        ("ours, MoeBlock eager (moeloop.steps.model.kernels as on CUDA; the block under EP > 1)", ours, contextlib.nullcontext),
        ("ours, MoeBlock eager with torch's grouped_mm (the other kernels Triton)",
         ours, partial(torch_kernels, "grouped_linear")),
        ("ours, MoeBlock eager with grouped_mm, eager SwiGLU, index_select + sum (Triton router, expand-rows)",
         ours, torch_kernels),
        (hf_name, reference, contextlib.nullcontext),
    ]  # fmt: skip
    rows += [(name, fwd_bwd(module, x_BSH, grad_BSH), context) for name, module, context in variants]
    results = time_interleaved(rows, device, args.warmup, args.reps, args.rounds)
    dense = 2 * args.dense_size**3 / results.pop(dense_name) / 1e9

    def outputs_of(module: nn.Module, context: Callable[[], Any]) -> tuple[torch.Tensor, ...]:
        """One step's output, input gradient, and expert and router gradients (the module's own: not copied)."""
        with context():
            out = fwd_bwd(module, x_BSH, grad_BSH)()
        grads = dict(getattr(module, "_orig_mod", module).named_parameters())
        names = ("experts.gate_up_proj", "experts.down_proj", "gate.weight")
        return (out.detach(), x_BSH.grad.clone()) + tuple(grads[p].grad for p in names)

    ref = outputs_of(reference, contextlib.nullcontext)
    errors = {
        name: [rel_err(a, b) for a, b in zip(outputs_of(module, context), ref, strict=True)]
        for name, module, context in variants
        if module is not reference
    }

    if args.eager_reps:
        reference.experts.config._experts_implementation = "eager"
        eager_ms = time_ms(fwd_bwd(reference, x_BSH, grad_BSH), device, 1, args.eager_reps)
        results[f"HF {hf_class}, eager (per-expert loop), {args.eager_reps} iterations"] = eager_ms
        reference.experts.config._experts_implementation = "grouped_mm"

    with torch.no_grad():
        counts = torch.bincount(reference.gate(x_BSH.reshape(-1, H))[2].flatten(), minlength=E).float()
    balance = f"tokens per expert: mean {counts.mean():.0f}, min {counts.min():.0f}, max {counts.max():.0f}"

    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        for tag, module in (("ours_compiled", compiled), ("ours_eager", ours), ("hf_grouped_mm", reference)):
            table = profile(tag, fwd_bwd(module, x_BSH, grad_BSH), args.profile_dir, device)
            print(f"\n### profile: {tag} (3 iterations; top 12)\n" + "\n".join(table.splitlines()[:15]))

    bare_ms, hf_ms = results.get(BARE_REFERENCE), results[hf_name]
    routing = f", {DEEPSEEK_V3_ROUTING}" if shared else ""
    print(f"\n## MoE layer forward + backward ({args.family}): T={T} tokens, H={H}, I={I}, E={E}, top-{K}{routing}, bf16")
    print(
        f"\n{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}; expert FLOPs per fwd+bwd {flops / 1e12:.3f} T; "
        f"{balance}; median over {args.rounds} rounds of each row's median of {args.reps}, the rows taking turns\n"
    )
    print(f"| row | ms | TFLOP/s | % dense {args.dense_size}^3 | vs bare grouped (eager SwiGLU) | vs HF grouped_mm |")
    print("|---|---|---|---|---|---|")
    print(f"| dense bf16 matmul {args.dense_size}^3 | | {dense:.0f} | 100% | | |")
    for name, ms in results.items():
        tflops = flops / ms / 1e9
        print(
            f"| {name} | {ms:.2f} | {tflops:.0f} | {100 * tflops / dense:.0f}% | "
            f"{f'{bare_ms / ms:.2f}x' if bare_ms else ''} | {hf_ms / ms:.2f}x |"
        )
    print(
        f"\nnominal dense bf16 {NOMINAL_DENSE_BF16:.0f} TFLOP/s; measured dense is {100 * dense / NOMINAL_DENSE_BF16:.0f}% of it"
    )

    print("\n| vs HF grouped_mm (same weights, input, upstream grad; bf16) | out | x.grad | gate_up.grad | down.grad "
          "| router.grad | ok (all < 1e-2) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, row_errors in errors.items():
        print(f"| {name} | " + " | ".join(f"{e:.1e}" for e in row_errors) + f" | {max(row_errors) < 1e-2} |")

if __name__ == "__main__":
    main()
