"""The MoE layer's six expert GEMMs one by one, grouped by expert as the layer runs them, against the same FLOPs as
one dense matmul: where the layer stands against its GEMMs' practical ceiling.

    PYTHONPATH=. python3 benchmarks/expert_gemms.py [--tokens 16384] [--smoke]

Shapes as benchmarks/moe_layer.py's (a): T tokens, hidden H, expert intermediate I, E experts, top-K, bf16; the
group sizes come from the same random router (`moe_layer.hf_block`'s) on N(0, 1) inputs. For each of the forward
and the two gradients of gate_up ([T*K, H] x [H, 2I]) and down ([T*K, I] x [I, H]), three rows, timed in turns
(`time_interleaved`):
- the layer's kernel: `moeloop.steps.model.kernels`' Triton grouped GEMM for the forward and input gradients (where
  `grouped_mm_triton_runs`, else torch's grouped_mm), torch's grouped_mm for the weight gradients;
- torch's grouped_mm (CUTLASS) for all six;
- one dense matmul of the same FLOPs with no grouping: [T*K, H] @ [H, 2I] and so on, the weight gradients as one
  [2I, T*K] @ [T*K, H] (all rows' outer products summed into one weight; K = T*K instead of a group's rows).
The operands are random; the Triton GEMM's outputs are checked against grouped_mm's (relative error below 1e-2).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from moe_layer import add_layer_arguments, dense_step, hf_block, layer_arguments, rel_err, time_interleaved

from moeloop.steps.model import kernels


def layer_kernel(a_NK: torch.Tensor, b_eXY: torch.Tensor, offs_e: torch.Tensor, b_transposed: bool) -> torch.Tensor:
    """What the layer runs: `grouped_linear` for a forward (b_transposed, nn.Linear weights); for an input gradient,
    the Triton GEMM where its forward took it (the same size gate, on the weight as the forward sees it)."""
    if b_transposed:
        return kernels.grouped_linear(a_NK, b_eXY, offs_e)
    if kernels.grouped_mm_triton_runs(a_NK, b_eXY.transpose(1, 2)):
        return kernels.grouped_mm_triton(a_NK, b_eXY, offs_e, False)
    return F.grouped_mm(a_NK, b_eXY, offs=offs_e)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_arguments(parser, rounds=7)
    args = layer_arguments(parser)
    device = torch.device(args.device)
    T, H, I, E, K = args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
    N, bf16 = T * K, torch.bfloat16

    router = hf_block(args, device, "grouped_mm").gate
    torch.manual_seed(0)
    with torch.no_grad():
        experts_TK = router(torch.randn(T, H, device=device, dtype=bf16))[2]
    counts_E = torch.bincount(experts_TK.flatten(), minlength=E)
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)

    def operand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=bf16)

    x_NH, hidden_NI, grad_out_NH, grad_gate_up_N2I = operand(N, H), operand(N, I), operand(N, H), operand(N, 2 * I)
    gate_up_E2IH, down_EHI = 0.02 * operand(E, 2 * I, H), 0.02 * operand(E, H, I)
    gate_up_2IH, down_HI = gate_up_E2IH[0].contiguous(), down_EHI[0].contiguous()

    # (name, FLOPs, the layer's kernel, torch's grouped_mm where the layer runs another kernel, the dense matmul)
    Gemm = tuple[str, int, Callable[[], torch.Tensor], Callable[[], torch.Tensor] | None, Callable[[], torch.Tensor]]
    flops_gate_up, flops_down = 2 * N * 2 * I * H, 2 * N * H * I
    gemms: list[Gemm] = []
    for name, flops, a, b, transposed, dense_b in (
        ("gate_up forward", flops_gate_up, x_NH, gate_up_E2IH, True, gate_up_2IH.t()),
        ("down forward", flops_down, hidden_NI, down_EHI, True, down_HI.t()),
        ("down input gradient", flops_down, grad_out_NH, down_EHI, False, down_HI),
        ("gate_up input gradient", flops_gate_up, grad_gate_up_N2I, gate_up_E2IH, False, gate_up_2IH),
    ):
        ours = partial(layer_kernel, a, b, offs_E, transposed)
        torch_grouped = partial(F.grouped_mm, a, b.transpose(1, 2) if transposed else b, offs=offs_E)
        error = rel_err(ours(), torch_grouped())
        assert error < 1e-2, f"{name}: the layer's kernel differs from grouped_mm by {error:.1e}"
        gemms.append((name, flops, ours, torch_grouped, partial(torch.matmul, a, dense_b)))
    for name, flops, left, right in (
        ("down weight gradient", flops_down, grad_out_NH, hidden_NI),
        ("gate_up weight gradient", flops_gate_up, grad_gate_up_N2I, x_NH),
    ):
        gemms.append((name, flops, partial(F.grouped_mm, left.t(), right, offs=offs_E), None,
                      partial(torch.matmul, left.t(), right)))  # fmt: skip

    dense_name = f"dense bf16 matmul {args.dense_size}^3"
    rows = [(dense_name, dense_step(device, args.dense_size), contextlib.nullcontext)]
    for name, _, ours, torch_grouped, dense in gemms:
        rows += [(f"{name} layer", ours, contextlib.nullcontext), (f"{name} dense", dense, contextlib.nullcontext)]
        if torch_grouped is not None:
            rows.append((f"{name} grouped_mm", torch_grouped, contextlib.nullcontext))
    ms = time_interleaved(rows, device, args.warmup, args.reps, args.rounds)
    dense_tflops = 2 * args.dense_size**3 / ms[dense_name] / 1e9

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n## The expert GEMMs: T={T}, H={H}, I={I}, E={E}, top-{K}, bf16")
    print(
        f"\n{device_name}, torch {torch.__version__}; tokens per expert: min {counts_E.min()}, "
        f"max {counts_E.max()}; median over {args.rounds} rounds of each row's median of {args.reps}, in turns; "
        f"{dense_name}: {dense_tflops:.0f} TFLOP/s\n"
    )
    print("| GEMM | layer's kernel ms | torch grouped_mm ms | dense, same FLOPs, ms | dense / layer | layer TFLOP/s |")
    print("|---|---|---|---|---|---|")
    table = [
        (name, flops, ms[f"{name} layer"], ms.get(f"{name} grouped_mm", ms[f"{name} layer"]), ms[f"{name} dense"])
        for name, flops, *_ in gemms
    ]
    total = ("**all six**", *(sum(column) for column in list(zip(*table))[1:]))
    for name, flops, layer, torch_ms, dense in [*table, total]:
        tflops = flops / layer / 1e9
        print(f"| {name} | {layer:.3f} | {torch_ms:.3f} | {dense:.3f} | {dense / layer:.2f} | {tflops:.0f} |")
    print(f"\nall six with the layer's kernels: {100 * total[1] / total[2] / 1e9 / dense_tflops:.0f}% of {dense_name}")


if __name__ == "__main__":
    main()
