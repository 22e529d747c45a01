"""Policy-update tokens/s of a ~1B-parameter Qwen3-MoE on one GPU: ours against HF transformers' grouped_mm experts.

    PYTHONPATH=. python3 benchmarks/policy_update.py [--batch 8] [--seq 2048]

The model is a `Qwen3MoeForCausalLM` built from a `Qwen3MoeConfig` sized to ~1B parameters (Qwen3-30B-A3B's
shape scaled down: hidden 1024, 12 layers, 64 experts of intermediate 384, top-8, 16 query heads and 4 KV
heads of 128, every layer sparse, untied embeddings, vocabulary 32768), random init, bf16 weights, SDPA
attention. One update = zero_grad, forward with labels (HF's causal-LM loss), backward, fused
`torch.optim.AdamW` step (bf16 states, as the parameters). Same initial weights (each row updates its own
copy), batch, loss and optimizer for every row:
- HF: transformers' model with `experts_implementation="grouped_mm"`; and the same with every decoder layer
  `torch.compile`'d (`layer.compile()`, HF's MoE block inside the compiled layer);
- ours: the same model after `steps.model.moe.replace_moe_blocks(model, make_dispatcher("local", E), "grouped_mm")`
  (on an H200: `steps.model.kernels`' Triton SwiGLU, router top-k, expand-rows and gather-sum; at this model's
  shapes the experts' GEMMs stay grouped_mm); the same after `steps.model.moe.compile_decoder_layers(model)` with the
  MoE blocks kept eager (the layer graph-breaks around them, as under EP > 1); and after
  `compile_decoder_layers(model)` as it compiles a bf16 model at EP = 1: each layer whole, MoE block included.
Each row's model is first checked against HF's on the first batch: the loss, and the relative error of all
gradients together (‖g − g_HF‖ / ‖g_HF‖ over every parameter, bf16).
tokens/s is batch * seq over the median update time of --reps after --warmup. MFU = model FLOPs per update /
time / peak, model FLOPs = 6 * active parameters * tokens (active: every matmul weight except the expert
weights, plus top_k / num_experts of those; the embedding lookup is not a matmul) + causal attention
6 * layers * batch * seq^2 * heads * head_dim (QK^T and PV, half the square, forward + backward). The peak
is the dense bf16 matmul measured in the same run, and the 989 TFLOP/s datasheet figure.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from moe_layer import NOMINAL_DENSE_BF16, dense_tflops, profile, time_ms
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from steps.model.dispatch import make_dispatcher
from steps.model.moe import compile_decoder_layers, replace_moe_blocks


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
    parser.add_argument("--no-compile", action="store_true", help="skip the rows with compiled decoder layers")
    parser.add_argument(
        "--profile-dir", type=Path, default=None, help="kernel tables of HF's update and of ours, compiled two ways"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = build_config(args)

    torch.manual_seed(0)
    with torch.device(device):
        initial = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    initial.train()
    assert initial.config._experts_implementation == "grouped_mm", initial.config._experts_implementation
    total, active = active_parameters(initial, config)
    tokens = args.batch * args.seq
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    model_flops = 6 * active * tokens + 6 * args.layers * args.batch * args.seq**2 * args.heads * args.head_dim
    dense = dense_tflops(device, args.dense_size, 3, 10)

    def hf(model: torch.nn.Module) -> None:
        pass

    def hf_compiled(model: torch.nn.Module) -> None:
        for layer in model.model.layers:
            layer.compile()

    def ours(model: torch.nn.Module) -> None:
        replace_moe_blocks(model, make_dispatcher("local", args.experts), "grouped_mm")

    def ours_compiled(model: torch.nn.Module) -> None:
        ours(model)
        assert compile_decoder_layers(model) == args.layers

    def ours_compiled_block_eager(model: torch.nn.Module) -> None:
        dispatcher = make_dispatcher("local", args.experts)
        dispatcher.traceable = False  # the block stays out of the compiled layer, as with the EP dispatchers
        replace_moe_blocks(model, dispatcher, "grouped_mm")
        assert compile_decoder_layers(model) == args.layers

    configurations: list[tuple[str, str, Callable[[torch.nn.Module], None]]] = [
        ("HF transformers, experts_implementation=grouped_mm", "hf", hf),
        ("ours: replace_moe_blocks(local, grouped_mm), as landed", "ours", ours),
    ]
    if not args.no_compile and device.type == "cuda":
        configurations.insert(1, ("HF grouped_mm, decoder layers torch.compile'd", "hf_compiled", hf_compiled))
        configurations += [
            ("ours + compile_decoder_layers, MoE blocks kept eager (as under EP > 1)", "ours_block_eager",
             ours_compiled_block_eager),
            ("**ours + compile_decoder_layers, MoE blocks compiled too (EP = 1, bf16)**", "last",
             ours_compiled),
        ]  # fmt: skip

    rows: list[tuple[str, float, float, str]] = []  # (name, ms, peak GiB, check)
    reference_grads: dict[str, torch.Tensor] = {}
    for name, tag, prepare in configurations:
        model = copy.deepcopy(initial)
        try:
            prepare(model)
            check = check_against(model, input_ids, reference_grads)
        except Exception as error:  # noqa: BLE001 -- e.g. a compile failure: report it, keep the other rows
            print(f"{name}: failed: {type(error).__name__}: {str(error).splitlines()[0]}", file=sys.stderr)
            continue
        ms, peak = time_updates(
            model, input_ids, args, device, tag if tag in ("hf", "ours_block_eager", "last") else None
        )
        rows.append((name, ms, peak, check))
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

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
        "| model | ms / update | tokens/s | vs HF | TFLOP/s | MFU (measured dense) | MFU (989 nominal) | peak GiB "
        "| check vs HF: loss, grad rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    hf_ms = rows[0][1]
    for name, ms, peak, check in rows:
        tflops = model_flops / ms / 1e9
        print(
            f"| {name} | {ms:.1f} | {tokens / ms * 1e3:,.0f} | {hf_ms / ms:.2f}x | {tflops:.0f} | "
            f"{100 * tflops / dense:.1f}% | {100 * tflops / NOMINAL_DENSE_BF16:.1f}% | {peak:.1f} | {check} |"
        )


def time_updates(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
    profile_tag: str | None,
) -> tuple[float, float]:
    """Median ms per update (zero_grad, forward with labels, backward, fused AdamW step) and peak GiB; with a
    profile_tag and --profile-dir, a kernel table of 3 more updates."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def update() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = time_ms(update, device, args.warmup, args.reps)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    if profile_tag is not None and args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        profile(f"update_{profile_tag}", update, args.profile_dir, device)
    return ms, peak


def check_against(model: torch.nn.Module, input_ids: torch.Tensor, reference_grads: dict[str, torch.Tensor]) -> str:
    """Loss and gradients of model on the batch; the first call stores them as the reference (HF's)."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    loss = loss.detach()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    if not reference_grads:
        reference_grads.update(grads, loss=loss.detach().float())
        return f"{float(loss):.4f} (reference)"
    assert grads.keys() == reference_grads.keys() - {"loss"}, "parameter names differ from HF's"
    squared_error = sum(float((grads[n] - reference_grads[n]).square().sum()) for n in grads)
    squared_norm = sum(float(reference_grads[n].square().sum()) for n in grads)
    relative = (squared_error / squared_norm) ** 0.5
    loss_error = abs(float(loss) - float(reference_grads["loss"]))
    verdict = "ok" if relative < 2e-2 and loss_error < 1e-2 else "MISMATCH"
    return f"{float(loss):.4f}, {relative:.1e}: {verdict}"


if __name__ == "__main__":
    main()
