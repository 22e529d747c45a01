"""DeepEP against NCCL all-to-all for the expert-parallel MoE layer and policy update, on the GPUs of one host.

    torchrun --standalone --nproc-per-node 8 benchmarks/ep_dispatch.py            # EP = 8, NCCL
    torchrun --standalone --nproc-per-node 2 benchmarks/ep_dispatch.py --device cpu --tokens 64 --hidden 64 \\
        --intermediate 32 --experts 8 --top-k 2 --dispatchers all_to_all --update-layers 0   # gloo, tiny
    python benchmarks/ep_dispatch.py --smoke                                      # one CPU process, EP = 1 (CI)

EP = the number of processes (every rank one EP rank, DP = 1 for the experts). Defaults: Qwen3-30B-A3B's MoE
shapes (hidden 2048, expert intermediate 768, 128 experts, top-8), bf16, 4096 and 16384 tokens per rank, a
random router (near-balanced). Three parts, one table each, printed by rank 0:

1. Dispatch + combine, forward only, as the MoE layer calls them (`moeloop.steps.model.dispatch`: routing metadata, the
   permutation by expert and the host syncs included), identity experts. Latency is the slowest rank's median;
   GB/s counts, like DeepEP's own tests, the bf16 hidden states a rank receives, once per (token, rank) pair
   that needs it (all-to-all sends a token once per expert instead, which is its handicap), averaged over
   ranks, over the dispatch + combine time. A plain `all_to_all_single` of the same bytes with even splits
   is the NCCL baseline.
2. Numerics: the MoE block (forward + backward) with each dispatcher on this rank's tokens, against the
   `local` dispatcher on all ranks' tokens in one process (every rank holds the whole reference block):
   relative errors of the output, the input gradient, the router gradient (summed over ranks) and the expert
   gradients (gathered); "ok" below 1e-2 (bf16).
3. The policy update (benchmarks/policy_update.py's ~1B Qwen3-MoE: its own layer shape, --update-hidden,
   --update-intermediate, --update-experts, not part 1's; --update-layers layers): tokens/s over all ranks with
   each dispatcher, the experts sharded over the ranks, dense gradients all-reduced, fused AdamW,
   `compile_decoder_layers` as the trainer runs it (CUDA). --update-local adds the same update without expert
   parallelism (every rank all experts, every gradient all-reduced: plain data parallelism), the like-for-like
   reference; --profile adds, per row and rank, where an update's time goes (`profile_summary`).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are
set here, before NCCL or DeepEP start). `--dispatchers deepep` where DeepEP cannot run (not installed, CPU,
EP = 1) stops with a one-line error. Imports neither hera, boto3, s3fs nor vllm.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Before torch.distributed, NCCL or NVSHMEM read them: multicast on these hosts can take the GPUs out of service.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import smoke
from moe_layer import rel_err
from policy_update import build_config
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.dispatch import TokenDispatcher, make_dispatcher
from moeloop.steps.model.moe import MoeBlock, compile_decoder_layers, gather_over, replace_moe_blocks


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """This rank's median wall-clock ms of fn (synchronized; fn includes collectives, so ranks run in step)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def progress(text: str) -> None:
    """Rank 0 shows a result as soon as it has it (stderr), should a later part not finish."""
    if dist.get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


def slowest(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def mean_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor) / dist.get_world_size()


def hf_block(args: argparse.Namespace, device: torch.device) -> Qwen3MoeSparseMoeBlock:
    """The same random block (all experts) on every rank: N(0, 0.02) weights from a fixed seed."""
    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = "grouped_mm"
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):
        block = Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=generator, device=device, dtype=torch.float32))
    return block


def routed_inputs(
    tokens: int, args: argparse.Namespace, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_TH (bf16), topk_idx_TK, topk_weights_TK of a random router with softmax top-k, renormalized."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x_TH = torch.randn(tokens, args.hidden, generator=generator, device=device).to(torch.bfloat16)
    logits_TE = torch.randn(tokens, args.experts, generator=generator, device=device)
    weights_TK, topk_idx_TK = torch.softmax(logits_TE, -1).topk(args.top_k, dim=-1)
    return x_TH, topk_idx_TK, weights_TK / weights_TK.sum(-1, keepdim=True)


def dispatch_rows(
    args: argparse.Namespace, device: torch.device, dispatchers: dict[str, TokenDispatcher[Any]]
) -> list[str]:
    """Part 1: one Markdown row per (tokens per rank, dispatcher), and the NCCL/gloo all_to_all_single baseline."""
    world, rank = dist.get_world_size(), dist.get_rank()
    experts_per_rank = args.experts // world
    rows = []
    for tokens in args.tokens:
        x_TH, topk_idx_TK, weights_TK = routed_inputs(tokens, args, device, seed=100 + rank)
        # Bytes a rank receives, once per (token, rank) pair: what DeepEP moves, and what its tests count.
        ranks_TK = topk_idx_TK // experts_per_rank
        token_rank_pairs = int(
            torch.zeros(tokens, world, device=device, dtype=torch.bool).scatter_(1, ranks_TK, True).sum()
        )
        recv_bytes = mean_over_ranks(token_rank_pairs * args.hidden * 2, device)
        for name, dispatcher in dispatchers.items():
            step = functools.partial(dispatch_combine, dispatcher, x_TH, topk_idx_TK, weights_TK)
            with torch.no_grad():
                ms = slowest(median_ms(step, device, args.warmup, args.reps), device)
            rows.append(f"| {tokens} | {name} (moeloop.steps.model.dispatch) | {ms:.3f} | {recv_bytes / ms / 1e6:.2f} |")
        # Baseline: the same bytes each way through one even all_to_all_single, no routing work.
        rows_per_rank = -(-round(recv_bytes / (args.hidden * 2)) // world)  # the same on every rank
        send_PH = torch.empty(rows_per_rank * world, args.hidden, device=device, dtype=torch.bfloat16)
        recv_PH = torch.empty_like(send_PH)

        ms = slowest(
            median_ms(functools.partial(even_all_to_all, send_PH, recv_PH), device, args.warmup, args.reps), device
        )
        rows.append(
            f"| {tokens} | all_to_all_single x2, even splits, same bytes | {ms:.3f} | {recv_bytes / ms / 1e6:.2f} |"
        )
    return rows


def dispatch_combine(
    dispatcher: TokenDispatcher[Any], x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    expert_x_NH, _, meta = dispatcher.dispatch(x_TH, topk_idx_TK, weights_TK)
    return dispatcher.combine(expert_x_NH, meta)  # identity experts


def even_all_to_all(send_PH: torch.Tensor, recv_PH: torch.Tensor) -> None:
    dist.all_to_all_single(recv_PH, send_PH)
    dist.all_to_all_single(send_PH, recv_PH)


def numerics_rows(
    args: argparse.Namespace, device: torch.device, dispatchers: dict[str, TokenDispatcher[Any]]
) -> list[str]:
    """Part 2: each dispatcher's block on this rank's tokens against the local block on every rank's tokens."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tokens = args.tokens[0]
    reference_hf = hf_block(args, device)
    reference = MoeBlock.from_hf_block(reference_hf, make_dispatcher("local", args.experts), "grouped_mm")
    generator = torch.Generator(device=device).manual_seed(7)
    x_WTH = torch.randn(world * tokens, args.hidden, generator=generator, device=device).to(torch.bfloat16)
    grad_WTH = torch.randn(world * tokens, args.hidden, generator=generator, device=device).to(torch.bfloat16)
    mine = slice(rank * tokens, (rank + 1) * tokens)

    def forward_backward(block: MoeBlock, x_TH: torch.Tensor, grad_TH: torch.Tensor) -> list[torch.Tensor]:
        x_TH = x_TH.clone().requires_grad_(True)
        out_TH = block(x_TH)
        out_TH.backward(grad_TH)
        grads = [block.gate.weight.grad.clone()] + [p.grad.clone() for p in block.experts.parameters()]
        block.zero_grad(set_to_none=True)
        return [out_TH.detach(), x_TH.grad] + grads

    expected = forward_backward(reference, x_WTH, grad_WTH)
    expected[:2] = [expected[0][mine], expected[1][mine]]
    rows = []
    for name, dispatcher in dispatchers.items():
        block = MoeBlock.from_hf_block(hf_block(args, device), dispatcher)
        got = forward_backward(block, x_WTH[mine], grad_WTH[mine])
        dist.all_reduce(got[2])  # the router is replicated: its gradient is the sum over ranks
        got[3:] = [gather_over(grad, dist.group.WORLD) for grad in got[3:]]
        errors = [slowest(rel_err(a, b), device) for a, b in zip(got, expected, strict=True)]
        verdict = "ok" if max(errors) < 1e-2 else "MISMATCH"
        rows.append(f"| {name} | " + " | ".join(f"{e:.1e}" for e in errors) + f" | {verdict} |")
    return rows


def update_rows(args: argparse.Namespace, device: torch.device) -> tuple[list[str], list[str]]:
    """Part 3: policy-update tokens/s over all ranks, per dispatcher, from the same initial weights; and with
    --profile, each row's profile summary (every rank's). The model is policy_update.py's (its own layer shape,
    the --update-* arguments), not the dispatch part's."""
    world = dist.get_world_size()
    update_args = argparse.Namespace(
        **{
            **vars(args),
            "layers": args.update_layers,
            "hidden": args.update_hidden,
            "intermediate": args.update_intermediate,
            "experts": args.update_experts,
        }
    )
    config = build_config(update_args)
    dispatchers = {name: make_dispatcher(name, args.update_experts, dist.group.WORLD) for name in args.dispatchers}
    input_ids = torch.randint(
        0,
        args.vocab,
        (args.batch, args.seq),
        device=device,
        generator=torch.Generator(device).manual_seed(dist.get_rank()),
    )
    if args.update_local:  # no expert parallelism: every rank all experts, every gradient all-reduced
        dispatchers = {**dispatchers, "local (no EP, data-parallel)": make_dispatcher("local", args.update_experts)}
    rows, profiles = [], []
    for name, dispatcher in dispatchers.items():
        torch.manual_seed(0)  # every rank builds the same model, then keeps its experts
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        replace_moe_blocks(model, dispatcher, "grouped_mm")
        compile_decoder_layers(model)
        experts = {p for m in model.modules() if isinstance(m, MoeBlock) for p in m.experts.parameters()}
        # Sharded experts keep their own gradients; replicated ones (the local row) are data-parallel too.
        replicated = [p for p in model.parameters() if p not in experts or dispatcher.ep_size == 1]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

        update = functools.partial(dp_update, model, optimizer, replicated, input_ids)
        ms = slowest(median_ms(update, device, args.update_warmup, args.update_reps), device)
        tokens = world * args.batch * args.seq
        rows.append(f"| {name} | {ms:.1f} | {tokens / ms * 1e3:,.0f} |")
        progress(rows[-1])
        if args.profile:
            summaries: list[Any] = [None] * world
            dist.all_gather_object(summaries, profile_summary(update, device))
            profiles += [f"\n### {name}, rank {rank}\n\n{summary}" for rank, summary in enumerate(summaries)]
            progress("\n".join(profiles[-world:]))
        del model, optimizer, update
    first_ms = float(rows[0].split("|")[2])
    first = next(iter(dispatchers))
    rows += [
        f"| {row.split('|')[1].strip()} vs {first} | | {first_ms / float(row.split('|')[2]):.2f}x |" for row in rows[1:]
    ]
    return rows, profiles


PROFILED_UPDATES = 2


def profile_summary(update: Callable[[], Any], device: torch.device) -> str:
    """Where an update's time goes on this rank, from torch.profiler over PROFILED_UPDATES updates (per update):
    the GPU's busy time (kernels of any stream, overlaps counted once) and NCCL's share, the longest GPU idle
    gaps with the kernels around them, the CUDA runtime calls the host waited in, and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        sync(device)
        started = time.perf_counter()
        for _ in range(PROFILED_UPDATES):
            update()
        sync(device)
        wall_ms = (time.perf_counter() - started) * 1e3 / PROFILED_UPDATES
    events = prof.events()
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    per = 1e3 * PROFILED_UPDATES  # profiler times are in us

    def union_ms(spans: list[Any]) -> float:
        busy, end = 0.0, float("-inf")
        for e in spans:
            start, stop = max(e.time_range.start, end), e.time_range.end
            busy += max(stop - start, 0)
            end = max(end, stop)
        return busy / per

    nccl = [e for e in kernels if "nccl" in e.name.lower()]
    other = [e for e in kernels if "nccl" not in e.name.lower()]
    lines = [
        f"wall {wall_ms:.1f} ms/update (profiled); GPU busy {union_ms(kernels):.1f} ms: NCCL kernels "
        + f"{union_ms(nccl):.1f} ms, other kernels {union_ms(other):.1f} ms"
    ]
    gaps, end, last = [], float("-inf"), None
    for e in kernels:
        if last is not None and e.time_range.start > end:
            gaps.append((e.time_range.start - end, last.name, e.name))
        if e.time_range.end > end:
            end, last = e.time_range.end, e
    lines.append(f"GPU idle gaps: {len(gaps)}, {sum(g[0] for g in gaps) / per:.1f} ms/update; longest:")
    lines += [f"  {us:,.0f} us after {a[:60]!r} before {b[:60]!r}" for us, a, b in sorted(gaps, reverse=True)[:8]]
    averages = prof.key_averages()
    waits = [a for a in averages if (a.key.startswith("cuda") and "Synchronize" in a.key) or a.key == "cudaMemcpyAsync"]
    lines.append(
        "host waits (CUDA runtime): "
        + ", ".join(f"{a.key} {a.count // PROFILED_UPDATES}x {a.cpu_time_total / per:.1f} ms" for a in waits)
    )
    top = sorted((a for a in averages if a.device_type == DeviceType.CUDA), key=lambda a: -a.device_time_total)
    lines.append("top kernels (ms/update, calls/update):")
    lines += [f"  {a.device_time_total / per:7.2f} {a.count // PROFILED_UPDATES:5d}  {a.key[:90]}" for a in top[:14]]
    host = sorted((a for a in averages if a.device_type == DeviceType.CPU), key=lambda a: -a.self_cpu_time_total)
    lines.append("top host ops by self time (ms/update, calls/update):")
    lines += [f"  {a.self_cpu_time_total / per:7.2f} {a.count // PROFILED_UPDATES:5d}  {a.key[:90]}" for a in host[:10]]
    return "\n".join(lines)


def dp_update(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, replicated: list[torch.Tensor], input_ids: torch.Tensor
) -> None:
    """One update; the replicated parameters are data-parallel over the ranks: gradients averaged in one bucket."""
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    grads = [p.grad for p in replicated]
    bucket = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(bucket)
    bucket /= dist.get_world_size()
    parts = bucket.split([grad.numel() for grad in grads])
    torch._foreach_copy_(grads, [part.view_as(grad) for part, grad in zip(parts, grads, strict=True)])
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dispatchers", nargs="+", default=["all_to_all", "deepep"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--update-layers", type=int, default=12, help="0 skips the policy update")
    parser.add_argument("--update-hidden", type=int, default=1024, help="the update's model: policy_update.py's")
    parser.add_argument("--update-intermediate", type=int, default=384)
    parser.add_argument("--update-experts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank in the update")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--update-warmup", type=int, default=3)
    parser.add_argument("--update-reps", type=int, default=10)
    parser.add_argument(
        "--update-local", action="store_true", help="also the update without EP: every rank all experts (DP)"
    )
    parser.add_argument("--profile", action="store_true", help="a profile summary of each update row, every rank")
    args = smoke.parse_args(
        parser, device="cpu", dispatchers=["all_to_all"], tokens=[64], hidden=64, intermediate=32, experts=8, top_k=2,
        warmup=0, reps=1, update_layers=1, update_hidden=64, update_intermediate=32, update_experts=8, batch=2,
        seq=64, vocab=256, heads=2, kv_heads=1, head_dim=32, update_warmup=0, update_reps=1,
    )  # fmt: skip
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:  # one process, EP = 1 (--smoke)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        run(args, device)
    except MoeloopError as error:
        if dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> None:
    # Fails fast, before any measurement, on a dispatcher that cannot run here.
    dispatchers = {name: make_dispatcher(name, args.experts, dist.group.WORLD) for name in args.dispatchers}
    world = dist.get_world_size()
    header = (
        f"EP {world} ({device.type}, {dist.get_backend()}), H={args.hidden}, I={args.intermediate}, "
        f"E={args.experts}, top-{args.top_k}, bf16, torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    )
    dispatch = dispatch_rows(args, device, dispatchers)
    numerics = numerics_rows(args, device, dispatchers)
    update, profiles = update_rows(args, device) if args.update_layers else ([], [])
    if dist.get_rank() != 0:
        return
    print(f"\n## Dispatch + combine (forward), {header}; median of {args.reps} after {args.warmup}, slowest rank\n")
    print("| tokens per rank | path | ms | GB/s (received per rank, once per token and rank) |")
    print("|---|---|---|---|")
    print("\n".join(dispatch))
    print(f"\n## Numerics, MoE block fwd+bwd vs the local dispatcher on all {world * args.tokens[0]} tokens\n")
    print("| dispatcher | out | x.grad | router.grad | gate_up.grad | down.grad | |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(numerics))
    if update:
        print(
            f"\n## Policy update, {args.update_layers} layers of H={args.update_hidden}, "
            f"E={args.update_experts} x I={args.update_intermediate}, {args.batch} x {args.seq} tokens per rank, "
            f"{world} ranks, median of {args.update_reps} after {args.update_warmup}, slowest rank\n"
        )
        print("| dispatcher | ms / update | tokens/s (all ranks) |")
        print("|---|---|---|")
        print("\n".join(update))
    if profiles:
        print(f"\n## Profiles of the policy update, {PROFILED_UPDATES} updates each, per update")
        print("\n".join(profiles))


if __name__ == "__main__":
    main()
