"""The MoE layer's forward + backward on one GPU at Qwen3-30B-A3B expert shapes, in expert-matmul TFLOP/s.

    PYTHONPATH=. python3 benchmarks/moe_layer.py [--tokens 16384] [--profile-dir DIR]

Defaults: hidden 2048, expert intermediate 768, 128 experts, top-8, 16384 tokens, bf16, random init
(router and experts ~ N(0, 0.02), inputs ~ N(0, 1)). FLOPs count the expert matmuls only: per routed
(token, expert) pair 2*H*2I (gate+up) + 2*I*H (down) forward, and twice that backward (input and weight
gradients), so 18*H*I per pair for forward + backward. Each row is the median of --reps timed iterations
(CUDA events) after --warmup; every iteration sets the parameter and input gradients to None first.

Rows, all measured in the same run:
- dense: one bf16 matmul 8192 x 8192 x 8192 (the chip's practical ceiling), and one of the experts' total
  shape, [T*K, H] @ [H, 2I] then [T*K, I] @ [I, H] forward + backward as plain matmuls (no grouping);
- bare grouped SwiGLU: `steps.moe.GroupedExperts` on T*K rows already sorted by expert, perfectly balanced
  (T*K/E rows each): what the experts cost with no routing at all;
- ours: `steps.moe.MoeBlock` with the `local` dispatcher and `grouped_mm` experts (HF's router included);
- ours, fused permutation (benchmark-only `FastMoeBlock` below, same parameters): the fixes proposed for
  steps/moe.py and steps/dispatch.py, measured here by substitution;
- HF transformers' `Qwen3MoeSparseMoeBlock` with `experts_implementation="grouped_mm"`, and "eager".
Prints Markdown tables; with --profile-dir, writes torch.profiler kernel tables there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `steps` without installing the package

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from steps import dispatch as dispatch_module
from steps.dispatch import ExpertRows, make_dispatcher, permute_rows, sort_by_expert, sum_by_token
from steps.moe import GroupedExperts, MoeBlock

NOMINAL_DENSE_BF16 = 989.0  # TFLOP/s, H100/H200 SXM datasheet, dense


# ---------------------------------------------------------------------------------------------------------------
# The proposed fix, as a benchmark-only block: permutation and combine as pure gathers (no atomics, no sort in
# backward, no host sync), the routing weight folded into the SwiGLU output (I wide, not H wide).
# ---------------------------------------------------------------------------------------------------------------


_gather_sum_kernel: Any = None


def _build_gather_sum_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gather_sum_kernel(rows_ptr, row_of_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(row_of_ptr + token * K + k).to(tl.int64)
            acc += tl.load(rows_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return gather_sum_kernel


def _gather_sum_triton(rows_NH: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    """The same sum in one pass (reads the K rows, writes the token; fp32 accumulation), no T*K intermediate."""
    global _gather_sum_kernel
    if _gather_sum_kernel is None:
        _gather_sum_kernel = _build_gather_sum_kernel()
    rows_NH, row_of_TK = rows_NH.contiguous(), row_of_TK.contiguous()
    num_tokens, top_k = row_of_TK.shape
    hidden = rows_NH.shape[1]
    out_TH = torch.empty(num_tokens, hidden, device=rows_NH.device, dtype=rows_NH.dtype)
    block_h = min(1024, 1 << (hidden - 1).bit_length())
    grid = (num_tokens, -(-hidden // block_h))
    _gather_sum_kernel[grid](rows_NH, row_of_TK, out_TH, hidden, K=top_k, BLOCK_H=block_h, num_warps=4)
    return out_TH


# steps.dispatch's permutation calls its module-level gather_sum: FastMoeBlock swaps in the one it measures.
GATHER_SUM = {"torch": dispatch_module.gather_sum, "triton": _gather_sum_triton}


def swiglu_weighted(gate_up_N2I: torch.Tensor, weight_N: torch.Tensor) -> torch.Tensor:
    gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
    return F.silu(gate_NI) * up_NI * weight_N.unsqueeze(1).to(gate_up_N2I.dtype)


class FastMoeBlock(nn.Module):
    """MoeBlock's function (HF router, grouped_mm experts, weighted combine) with the cheap fixes applied.

    Shares the router and expert parameters of the MoeBlock it is made from.
    """

    def __init__(
        self, block: MoeBlock, swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], gather_sum: str = "torch"
    ) -> None:
        super().__init__()
        self.gate, self.experts, self.swiglu, self.gather_sum = block.gate, block.experts, swiglu, gather_sum
        self.num_experts = block.experts.gate_up_proj.shape[0]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dispatch_module.gather_sum = GATHER_SUM[self.gather_sum]
        x_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, weight_TK, expert_TK = self.gate(x_TH)
        token_N, row_of_TK, weight_N, tokens_per_expert_E = sort_by_expert(
            expert_TK, weight_TK, self.num_experts, expert_TK.numel()
        )
        rows = ExpertRows(token_N, row_of_TK, weight_N, x_TH.shape[0])
        offs_E = torch.cumsum(tokens_per_expert_E, 0).to(torch.int32)
        x_NH = permute_rows(x_TH, rows)
        gate_up_N2I = F.grouped_mm(x_NH, self.experts.gate_up_proj.transpose(1, 2), offs=offs_E)
        h_NI = self.swiglu(gate_up_N2I, weight_N)
        y_NH = F.grouped_mm(h_NI, self.experts.down_proj.transpose(1, 2), offs=offs_E)
        return sum_by_token(y_NH, rows).reshape(hidden_states.shape)


# ---------------------------------------------------------------------------------------------------------------


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


def hf_block(args: argparse.Namespace, device: torch.device, impl: str) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = impl
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):
        block = Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=generator, device=device, dtype=torch.float32))
    assert block.experts.config._experts_implementation == impl
    return block


def dense_tflops(device: torch.device, size: int, warmup: int, reps: int) -> float:
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * size**3 / time_ms(lambda: a @ b, device, warmup, reps) / 1e9


def dense_swiglu_ms(pairs: int, H: int, I: int, device: torch.device, warmup: int, reps: int) -> float:
    """The experts' total shape as plain matmuls (no grouping): the best the same FLOPs could do as dense GEMMs."""
    x = torch.randn(pairs, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    w1 = (0.02 * torch.randn(2 * I, H, device=device)).to(torch.bfloat16).requires_grad_(True)
    w2 = (0.02 * torch.randn(H, I, device=device)).to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn(pairs, H, device=device, dtype=torch.bfloat16)

    def step() -> None:
        x.grad = w1.grad = w2.grad = None
        g, u = (x @ w1.t()).chunk(2, dim=-1)
        ((F.silu(g) * u) @ w2.t()).backward(grad)

    return time_ms(step, device, warmup, reps)


def bare_rows(
    reference: Qwen3MoeSparseMoeBlock,
    pairs: int,
    E: int,
    H: int,
    compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    device: torch.device,
    warmup: int,
    reps: int,
) -> list[tuple[str, float]]:
    """Balanced, pre-permuted rows through the layer's own GroupedExperts; and with the compiled SwiGLU."""
    experts = GroupedExperts.from_hf(reference.experts, 0, 1, "grouped_mm")
    x_NH = torch.randn(pairs, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_NH = torch.randn(pairs, H, device=device, dtype=torch.bfloat16)
    balanced_E = torch.full((E,), pairs // E, device=device, dtype=torch.int64)
    bare = fwd_bwd(experts, x_NH, grad_NH, balanced_E)
    rows = [("bare grouped SwiGLU (balanced, pre-permuted)", time_ms(bare, device, warmup, reps))]
    if compiled is not None:
        offs_E = torch.cumsum(balanced_E, 0, dtype=torch.int32)
        ones_N = torch.ones(pairs, device=device, dtype=torch.bfloat16)

        def bare_fused() -> None:
            x_NH.grad = experts.gate_up_proj.grad = experts.down_proj.grad = None
            gate_up = F.grouped_mm(x_NH, experts.gate_up_proj.transpose(1, 2), offs=offs_E)
            F.grouped_mm(compiled(gate_up, ones_N), experts.down_proj.transpose(1, 2), offs=offs_E).backward(grad_NH)

        rows.append(("bare grouped SwiGLU, torch.compile'd SwiGLU", time_ms(bare_fused, device, warmup, reps)))
    return rows


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dense-size", type=int, default=8192)
    parser.add_argument("--eager-reps", type=int, default=3, help="0 skips HF's eager loop")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd SwiGLU variant")
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    T, H, I, E, K = args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
    pairs = T * K
    flops = 18 * H * I * pairs  # forward 6*H*I per pair, backward twice that
    w, r = args.warmup, args.reps

    results: list[tuple[str, float]] = []  # (row, ms)

    dense = dense_tflops(device, args.dense_size, w, r)
    torch.manual_seed(0)

    compiled = None
    if not args.no_compile and device.type == "cuda":
        compiled = torch.compile(swiglu_weighted, dynamic=False, fullgraph=True)
    results.append(("dense SwiGLU, experts' total shape, no grouping", dense_swiglu_ms(pairs, H, I, device, w, r)))
    reference = hf_block(args, device, "grouped_mm")
    results += bare_rows(reference, pairs, E, H, compiled, device, w, r)
    x_BSH = torch.randn(1, T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_BSH = torch.randn(1, T, H, device=device, dtype=torch.bfloat16)

    ours = MoeBlock.from_hf_block(reference, make_dispatcher("local", E), "grouped_mm")
    fast = FastMoeBlock(ours, swiglu_weighted)
    variants: list[tuple[str, nn.Module]] = [
        ("ours: MoeBlock, local dispatcher, grouped_mm (as landed)", ours),
        ("ours + gather permutation, weight folded into SwiGLU (FastMoeBlock)", fast),
    ]
    if compiled is not None:
        variants.append(("... + torch.compile'd SwiGLU", FastMoeBlock(ours, compiled)))
        variants.append(
            ("... + Triton one-pass gather-sum (combine, permute backward)", FastMoeBlock(ours, compiled, "triton"))
        )
    variants.append(("HF Qwen3MoeSparseMoeBlock, experts_implementation=grouped_mm", reference))

    outputs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for name, module in variants:
        step = fwd_bwd(module, x_BSH, grad_BSH)
        try:
            results.append((name, time_ms(step, device, w, r)))
        except Exception as error:  # noqa: BLE001 -- e.g. a compile failure: report, keep the other rows
            print(f"{name}: failed: {type(error).__name__}: {str(error).splitlines()[0]}", file=sys.stderr)
            continue
        out = step()
        gate_up = next(p for n, p in module.named_parameters() if n.endswith("gate_up_proj"))
        outputs[name] = (out.detach().clone(), x_BSH.grad.clone(), gate_up.grad.clone())

    if args.eager_reps:
        reference.experts.config._experts_implementation = "eager"
        eager_ms = time_ms(fwd_bwd(reference, x_BSH, grad_BSH), device, 1, args.eager_reps)
        results.append(("HF Qwen3MoeSparseMoeBlock, eager (per-expert loop)", eager_ms))
        reference.experts.config._experts_implementation = "grouped_mm"

    with torch.no_grad():
        counts = torch.bincount(reference.gate(x_BSH.reshape(-1, H))[2].flatten(), minlength=E).float()
    balance = f"tokens per expert: mean {counts.mean():.0f}, min {counts.min():.0f}, max {counts.max():.0f}"

    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        for tag, module in (("ours", ours), ("fastest", variants[-2][1]), ("hf_grouped_mm", reference)):
            table = profile(tag, fwd_bwd(module, x_BSH, grad_BSH), args.profile_dir, device)
            print(f"\n### profile: {tag} (3 iterations; top 12)\n" + "\n".join(table.splitlines()[:15]))

    ref_name = variants[-1][0]
    bare_ms = results[1][1]
    hf_ms = dict(results)[ref_name]
    print(f"\n## MoE layer forward + backward: T={T} tokens, H={H}, I={I}, E={E}, top-{K}, bf16")
    print(
        f"\n{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}; expert FLOPs per fwd+bwd {flops / 1e12:.3f} T; "
        f"{balance}; median of {r} after {w} warm-up\n"
    )
    print("| row | ms | TFLOP/s | % dense 8192^3 | vs bare grouped | vs HF grouped_mm |")
    print("|---|---|---|---|---|---|")
    print(f"| dense bf16 matmul {args.dense_size}^3 | | {dense:.0f} | 100% | | |")
    for name, ms in results:
        tflops = flops / ms / 1e9
        print(
            f"| {name} | {ms:.2f} | {tflops:.0f} | {100 * tflops / dense:.0f}% | {bare_ms / ms:.2f}x | {hf_ms / ms:.2f}x |"
        )
    print(
        f"\nnominal dense bf16 {NOMINAL_DENSE_BF16:.0f} TFLOP/s; measured dense is {100 * dense / NOMINAL_DENSE_BF16:.0f}% of it"
    )

    if ref_name in outputs:
        ref = outputs[ref_name]
        print(
            "\n| vs HF grouped_mm (same weights, input, upstream grad) | rel err out | rel err x.grad | rel err gate_up.grad |"
        )
        print("|---|---|---|---|")
        for name, got in outputs.items():
            if name != ref_name:
                print(
                    f"| {name} | {rel_err(got[0], ref[0]):.1e} | {rel_err(got[1], ref[1]):.1e} | {rel_err(got[2], ref[2]):.1e} |"
                )


if __name__ == "__main__":
    main()
