"""Policy-update tokens/s of a ~1B-parameter Qwen3-MoE on one GPU: ours against HF transformers' grouped_mm experts.

    PYTHONPATH=. python3 benchmarks/policy_update.py [--batch 8] [--seq 2048]

The model is a `Qwen3MoeForCausalLM` built from a `Qwen3MoeConfig` sized to ~1B parameters (Qwen3-30B-A3B's
shape scaled down: hidden 1024, 12 layers, 64 experts of intermediate 384, top-8, 16 query heads and 4 KV
heads of 128, every layer sparse, untied embeddings, vocabulary 32768), random init, bf16 weights, SDPA
attention. One update = zero_grad, forward with labels (HF's causal-LM loss), backward, fused
`torch.optim.AdamW` step (bf16 states, as the parameters). Same batch, loss and optimizer for every row:
- HF: transformers' model with `experts_implementation="grouped_mm"`;
- ours: the same model after `steps.moe.replace_moe_blocks(model, make_dispatcher("local", E), "grouped_mm")`;
- ours + fixes: the MoE blocks swapped for benchmarks/moe_layer.py's `FastMoeBlock` (the proposed fixes).
tokens/s is batch * seq over the median update time of --reps after --warmup. MFU = model FLOPs per update /
time / peak, model FLOPs = 6 * active parameters * tokens (active: every matmul weight except the expert
weights, plus top_k / num_experts of those; the embedding lookup is not a matmul) + causal attention
6 * layers * batch * seq^2 * heads * head_dim (QK^T and PV, half the square, forward + backward). The peak
is the dense bf16 matmul measured in the same run, and the 989 TFLOP/s datasheet figure.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from moe_layer import NOMINAL_DENSE_BF16, FastMoeBlock, dense_tflops, profile, swiglu_weighted, time_ms
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from steps.dispatch import make_dispatcher
from steps.moe import MoeBlock, replace_moe_blocks


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
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
        output_router_logits=False,
        use_cache=False,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dense-size", type=int, default=8192)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd SwiGLU variant")
    parser.add_argument(
        "--profile-dir", type=Path, default=None, help="kernel tables of HF's and the last row's update"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = build_config(args)

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.train()
    assert model.config._experts_implementation == "grouped_mm", model.config._experts_implementation
    total, active = active_parameters(model, config)
    tokens = args.batch * args.seq
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    model_flops = 6 * active * tokens + 6 * args.layers * args.batch * args.seq**2 * args.heads * args.head_dim
    dense = dense_tflops(device, args.dense_size, 3, 10)

    rows: list[tuple[str, float, float, float]] = []  # (name, ms, loss, peak GiB)

    def measure(name: str, tag: str) -> None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        losses = []

        def update() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ms = time_ms(update, device, args.warmup, args.reps)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        rows.append((name, ms, float(losses[0]), peak))
        if args.profile_dir is not None and tag in ("hf", "last"):
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            profile(f"update_{tag}", update, args.profile_dir, device)
        model.zero_grad(set_to_none=True)
        gc.collect()

    measure("HF transformers, experts_implementation=grouped_mm", "hf")
    replace_moe_blocks(model, make_dispatcher("local", args.experts), "grouped_mm")
    measure("ours: replace_moe_blocks(local, grouped_mm), as landed", "ours")
    landed = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(block, MoeBlock) for block in landed)
    fixes = [("ours + gather permutation, weight folded into SwiGLU (FastMoeBlock)", swiglu_weighted, "torch")]
    if not args.no_compile and device.type == "cuda":
        compiled = torch.compile(swiglu_weighted, dynamic=False, fullgraph=True)
        fixes.append(("... + torch.compile'd SwiGLU + Triton one-pass gather-sum", compiled, "triton"))
    for index, (name, swiglu, gather_sum) in enumerate(fixes):
        for layer, block in zip(model.model.layers, landed, strict=True):
            layer.mlp = FastMoeBlock(block, swiglu, gather_sum)
        measure(name, "last" if index == len(fixes) - 1 else "fix")

    print(
        f"\n## Policy update: Qwen3-MoE {total / 1e9:.2f} B parameters ({active / 1e6:.0f} M active), "
        f"batch {args.batch} x {args.seq} tokens, bf16, fused AdamW"
    )
    print(
        f"\nH={args.hidden}, {args.layers} layers, {args.experts} experts x I={args.intermediate}, top-{args.top_k}, "
        f"{args.heads} q / {args.kv_heads} kv heads x {args.head_dim}, vocab {args.vocab}; model FLOPs per update "
        f"{model_flops / 1e12:.1f} T; dense bf16 {args.dense_size}^3 measured {dense:.0f} TFLOP/s; "
        f"median of {args.reps} updates after {args.warmup}; "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}\n"
    )
    print(
        "| model | ms / update | tokens/s | vs HF | TFLOP/s | MFU (measured dense) | MFU (989 nominal) | loss, 1st warm-up update | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    hf_ms = rows[0][1]
    for name, ms, loss, peak in rows:
        tflops = model_flops / ms / 1e9
        print(
            f"| {name} | {ms:.1f} | {tokens / ms * 1e3:,.0f} | {hf_ms / ms:.2f}x | {tflops:.0f} | "
            f"{100 * tflops / dense:.1f}% | {100 * tflops / NOMINAL_DENSE_BF16:.1f}% | {loss:.4f} | {peak:.1f} |"
        )


if __name__ == "__main__":
    main()
