"""How much of a policy's bf16 weights one iteration changes, on real updates, and what a delta of them weighs.

    .venv/bin/python -m benchmarks.changed_fraction --run runs/tiny            # a run's checkpoints (the demo's, CPU)
    PYTHONPATH=/tmp/site:. python3 -m benchmarks.changed_fraction --model --learning-rates 1e-6 1e-5   # one H200
    .venv/bin/python -m benchmarks.changed_fraction --smoke                    # both, at toy sizes on CPU (CI)

--run: every pair of consecutive checkpoints of a run: the elements whose bytes changed in the checkpoint's dtype, and
in their bf16 casts (what a bf16 checkpoint of the same weights carries; the demo stores fp32).
--model: the ~1B Qwen3-MoE of benchmarks/policy_update.py (random init, bf16-representable), updated by the train
step's own functions (`load_trainer_model`, then `actor_steps` over one minibatch: one optimizer step per iteration),
each iteration on a fresh random-token batch with random rewards, at each learning rate; its bf16 weights compared
after each step (the tensors as the trainer holds them: experts fused per layer).

Each row: the changed fraction, overall and by kind of tensor; the share of changed values that moved by one bf16
step; the delta's bytes in the layouts weighed (values in the stored dtype in each, 2 bytes for bf16), and the
product's delta files (`moeloop.steps.model.delta.write_delta`, the blocks layout) against the checkpoint's bytes:
- positions: each changed element's flat position as int32 (int64 in a tensor of 2^31 elements or more);
- bitmask: one bit per element of each changed tensor;
- blocks: the product's, per block of 65,536 elements a count (int32), per changed element its uint16 offset;
- best of bitmask and blocks, tensor by tensor.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smoke  # noqa: E402

from moeloop.steps.model.delta import BLOCK, CheckpointTensors, changed_positions, write_delta  # noqa: E402

KINDS = ("experts", "attention", "embeddings", "norms", "routers")
LAYOUTS = ("positions", "bitmask", "blocks", "best of bitmask and blocks")


def kind_of(name: str) -> str:
    if ".experts." in name:
        return "experts"
    if "norm" in name:
        return "norms"
    if "embed_tokens" in name or "lm_head" in name:
        return "embeddings"
    if name.endswith(("mlp.gate.weight", "router.weight", "e_score_correction_bias")):
        return "routers"
    return "attention"


def compare(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, float]:
    """The figures of one pair of versions (same names; tensors in their stored dtype, on any device)."""
    changed, total, one_step = 0, 0, 0
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    sizes = dict.fromkeys(LAYOUTS, 0)
    for name in sorted(new):
        old, now = base[name], new[name]
        positions = changed_positions(old, now)
        k, n, value = len(positions), now.numel(), now.element_size()
        changed, total = changed + k, total + n
        by_kind[kind_of(name)][0] += k
        by_kind[kind_of(name)][1] += n
        if k == 0:
            continue
        if now.dtype == torch.bfloat16:  # neighbouring bf16 values of one sign are neighbouring int16s
            bits = [t.reshape(-1)[positions].view(torch.int16).int() for t in (old, now)]
            step = bits[1] - bits[0]
            one_step += int((step.abs() == 1).sum())
        bitmask, blocks = math.ceil(n / 8), 2 * k + 4 * math.ceil(n / BLOCK)
        sizes["positions"] += (4 if n < 2**31 else 8) * k + value * k
        sizes["bitmask"] += bitmask + value * k
        sizes["blocks"] += blocks + value * k
        sizes["best of bitmask and blocks"] += min(bitmask, blocks) + value * k
    figures = {"changed": changed / total, "one bf16 step": one_step / max(changed, 1)}
    figures |= {kind: by_kind[kind][0] / by_kind[kind][1] if by_kind[kind][1] else math.nan for kind in KINDS}
    return figures | {f"bytes {layout}": size for layout, size in sizes.items()}


def product_delta_bytes(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    with tempfile.TemporaryDirectory() as folder:
        return write_delta(base, new, Path(folder)).delta_bytes


def header() -> None:
    print("| versions | dtype | changed | " + " | ".join(KINDS) + " | one bf16 step | " + " | ".join(LAYOUTS)
          + " | delta files | checkpoint |")  # fmt: skip
    print("|---|---|" + "---:|" * (len(KINDS) + len(LAYOUTS) + 4))


def row(label: str, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    figures = compare(base, new)
    checkpoint = sum(t.numel() * t.element_size() for t in new.values())
    cpu = lambda state: {k: v.cpu() for k, v in state.items()}  # noqa: E731
    files = product_delta_bytes(cpu(base), cpu(new))
    mb = lambda size: f"{size / 1e6:,.1f} MB ({size / checkpoint:.1%})"  # noqa: E731
    dtype = str(next(iter(new.values())).dtype).removeprefix("torch.")
    print(f"| {label} | {dtype} | {figures['changed']:.2%} | "
          + " | ".join("-" if math.isnan(figures[kind]) else f"{figures[kind]:.2%}" for kind in KINDS)
          + f" | {figures['one bf16 step']:.1%} | " + " | ".join(mb(figures[f"bytes {layout}"]) for layout in LAYOUTS)
          + f" | {mb(files)} | {checkpoint / 1e6:,.1f} MB |", flush=True)  # fmt: skip


def measure_run(run: str) -> None:
    """Every consecutive pair of a run's committed checkpoints, in their dtype and as bf16."""
    from moeloop.steps.storage.cache import fetch_checkpoint
    from moeloop.steps.storage.run import RunStorage

    storage = RunStorage(run)
    versions = sorted(int(name.removeprefix("iter-")) for name in storage.list("checkpoints"))
    versions = [v for v in versions if storage.is_committed(storage.checkpoint(v))]
    print(f"\n### {run}: checkpoints {versions[0]}..{versions[-1]}\n")
    header()
    previous = None
    for version in versions:
        tensors = CheckpointTensors(fetch_checkpoint(storage, version))
        state = {name: tensors[name] for name in tensors}
        if previous is not None:
            row(f"{version - 1} -> {version}", previous, state)
            if next(iter(state.values())).dtype != torch.bfloat16:
                as_bf16 = lambda s: {k: v.to(torch.bfloat16) for k, v in s.items()}  # noqa: E731
                row(f"{version - 1} -> {version} as bf16", as_bf16(previous), as_bf16(state))
        previous = state


def bf16_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the trainer holds (one process: every tensor whole), cast to bf16 as publish casts it."""
    from moeloop.steps.model.sharding import local
    from moeloop.steps.rl.checkpoint import checkpointed

    return {name: local(tensor).detach().to(torch.bfloat16) for name, tensor in checkpointed(model).items()}


def measure_model(args: argparse.Namespace) -> None:
    """The ~1B Qwen3-MoE updated by the product's train step, at each learning rate."""
    from policy_update import build_config, experience, product_config, sample_lengths
    from transformers import Qwen3MoeForCausalLM

    from moeloop.steps.model.policy import build_tokenizer, save_policy
    from moeloop.steps.rl.batch import frozen_logprobs
    from moeloop.steps.rl.grpo import group_advantages
    from moeloop.steps.rl.parallel import init_parallel
    from moeloop.steps.rl.state import load_trainer_model
    from moeloop.steps.rl.update import actor_steps

    device = torch.device(args.device)
    model_config = build_config(args)
    torch.manual_seed(0)
    with torch.device(device):
        initial = Qwen3MoeForCausalLM(model_config)
    checkpoint = Path(tempfile.mkdtemp()) / "checkpoint"
    save_policy(initial.to(torch.bfloat16), build_tokenizer(["abc"]), checkpoint)
    del initial
    lengths = sample_lengths(args.batch)
    print(f"\n### Qwen3-MoE of benchmarks/policy_update.py ({args.layers} layers, {args.experts} experts, hidden "
          f"{args.hidden}), batch {args.batch}, {args.iterations} iterations per learning rate, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}\n")  # fmt: skip
    header()
    parallel = init_parallel(product_config(args, checkpointing=False).trainer)  # a one-process group: FSDP2's
    for learning_rate in args.learning_rates:
        config = product_config(args, checkpointing=False)
        trainer = config.trainer.model_copy(update={"learning_rate": learning_rate})
        config = config.model_copy(update={"trainer": trainer})
        model, _, optimizer = load_trainer_model(checkpoint, config.trainer, parallel)
        previous = bf16_weights(model)
        for iteration in range(1, args.iterations + 1):
            batch = experience(lengths, args.vocab, device, seed=iteration)
            rows_B = torch.arange(len(batch.rewards_B), device=device)
            advantages_B = group_advantages(batch.rewards_B, batch.group_ids_B, scale=True)
            old_BT = frozen_logprobs(model, batch, config.rollout.temperature, args.max_tokens, parallel)
            actor_steps(model, optimizer, batch, [rows_B], advantages_B, old_BT, None, None, batch.response_mask_BT,
                        config, parallel)  # fmt: skip
            state = bf16_weights(model)
            row(f"lr {learning_rate:g}, {iteration - 1} -> {iteration}", previous, state)
            previous = state
        del model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="a run's URI: compare its consecutive checkpoints")
    parser.add_argument("--model", action="store_true", help="update the ~1B Qwen3-MoE of policy_update.py")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[1e-6])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--batch", default="uniform", choices=["rl", "uniform"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default="auto", help="the product's trainer.attention (policy_update.py's)")
    sizes = {"vocab": 32768, "hidden": 1024, "intermediate": 384, "layers": 12, "heads": 16, "kv-heads": 4,
             "head-dim": 128, "experts": 64, "top-k": 8, "max-tokens": 32768}  # policy_update.py's defaults
    for name, default in sizes.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    # --smoke: a toy model on the CPU, and a one-iteration run of the demo's task.
    args = smoke.parse_args(parser, vocab=256, hidden=64, intermediate=32, layers=1, heads=2, kv_heads=1, head_dim=32,
                            experts=4, top_k=2, max_tokens=4096, device="cpu", iterations=2, model=True)  # fmt: skip
    if args.smoke:
        args.run = smoke_run()
    if args.run:
        measure_run(args.run)
    if args.model:
        measure_model(args)


def smoke_run() -> str:
    """A one-iteration run of the demo's task at small settings, its steps called in this process (the
    transformers engine, tests/conftest.py:run_in_process): checkpoints 0 and 1."""
    from moeloop.workflows.dag import run_uri
    from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, run_in_process, small_config

    config = small_config(iterations=1, rollout=SMALL_TRANSFORMERS_ROLLOUT)
    uri = run_uri(config, tempfile.mkdtemp(prefix="moeloop-changed-"))
    run_in_process(config, uri)
    return uri


if __name__ == "__main__":
    main()
