"""The GPU path (skipped without CUDA; run on an H200 for the closing note): the flash varlen attention (FA2, and FA4
where flash-attn-4 is installed) against SDPA per sample, the compiled LM-head and router-loss passes against eager,
and a 2-iteration `moeloop run` on one GPU (the whole train step in bf16, packed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moeloop.steps.engines.weights import EngineWeights, Slot
from moeloop.steps.model import delta
from moeloop.steps.model.attention import PACKED_ATTENTION, flash4_missing, packed_attention
from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.model.logprobs import ChunkedTokenLogprobs
from moeloop.steps.model.policy import build_tokenizer, save_policy
from moeloop.steps.rl import update
from moeloop.steps.rl.batch import ExperienceBatch, frozen_logprobs
from moeloop.steps.rl.grpo import group_advantages
from moeloop.steps.rl.parallel import Parallel, init_parallel, mesh_parallel
from moeloop.steps.rl.state import load_trainer_model, reference_logprobs
from moeloop.steps.rl.router_loss import layer_routing
from tests.conftest import REPO
from tests.processes import moeloop_cli

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_flash_varlen_attention_equals_causal_sdpa_per_sample() -> None:
    """FA2's varlen kernel: see `flash_attention_equals_sdpa_per_sample`."""
    flash_attention_equals_sdpa_per_sample("flash2")


def test_flash4_varlen_attention_equals_causal_sdpa_per_sample() -> None:
    """trainer.attention flash4 (FA4's kernels as the custom op `moeloop::fa4_varlen`): the same check as FA2's."""
    if (reason := flash4_missing(torch.device("cuda"))) is not None:
        pytest.skip(reason)
    import moeloop.steps.model.fa4_kernels  # noqa: F401

    flash_attention_equals_sdpa_per_sample("flash4")


def flash_attention_equals_sdpa_per_sample(backend: str) -> None:
    """Forward and gradients, GQA (8 query heads over 2 KV heads), bf16; against SDPA on each sample alone."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = [5, 130, 1, 77, 300]
    cu_seqlens = F.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    total = sum(lengths)
    q_1hND, k_1kND, v_1kND = (
        torch.randn(1, heads, total, 64, device="cuda", generator=generator, dtype=torch.bfloat16).requires_grad_()
        for heads in (8, 2, 2)
    )
    out_1NhD, _ = packed_attention(
        backend, torch.nn.Module(), q_1hND, k_1kND, v_1kND, None, scaling=0.125,
        cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max(lengths), max_length_k=max(lengths),
    )  # fmt: skip
    grad_1NhD = torch.randn(out_1NhD.shape, device="cuda", generator=generator, dtype=torch.bfloat16)
    got = [out_1NhD, *torch.autograd.grad(out_1NhD, (q_1hND, k_1kND, v_1kND), grad_1NhD)]
    pieces = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
        q, k, v = (t[:, :, start:end].float() for t in (q_1hND, k_1kND, v_1kND))
        pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True))
    want_1NhD = torch.cat(pieces, dim=2).transpose(1, 2)
    want = [want_1NhD, *torch.autograd.grad(want_1NhD, (q_1hND, k_1kND, v_1kND), grad_1NhD.float())]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert ((g.float() - w).norm() / w.norm()) < 1e-2, name


def test_fused_passes_equal_their_eager_selves() -> None:
    """The LM head's chunks and the routers' loss terms, compiled on CUDA (`moeloop.steps.model.kernels.fused_on_cuda`),
    against the same functions run eagerly on the CPU: forward and gradients, several chunks, the last one short."""
    generator = torch.Generator().manual_seed(0)
    hidden_NH, weight_VH = torch.randn(10, 8, generator=generator), torch.randn(32, 8, generator=generator)
    targets_N, grad_N = torch.randint(0, 32, (10,), generator=generator), torch.randn(10, generator=generator)
    logits_tE, mask_t = torch.randn(50, 16, generator=generator), (torch.rand(50, generator=generator) > 0.3).float()
    results = {}
    for device in ("cpu", "cuda"):
        hidden, weight = (t.detach().to(device).requires_grad_() for t in (hidden_NH, weight_VH))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("moeloop.steps.model.logprobs.CHUNK_ROWS", 3)
            logprobs_N, entropy_N = ChunkedTokenLogprobs.apply(hidden, weight, targets_N.to(device), 0.7)
            ((logprobs_N * grad_N.to(device)).sum() + (entropy_N * grad_N.flip(0).to(device)).sum()).backward()
        logits = logits_tE.detach().to(device).requires_grad_()
        assigned_E, probability_sum_E = layer_routing(logits, mask_t.to(device), 4)
        probability_sum_E.square().sum().backward()
        computed = (logprobs_N, entropy_N, hidden.grad, weight.grad, assigned_E, logits.grad)
        results[device] = [t.detach().cpu() for t in computed]
    for name, got, want in zip(("logprobs", "entropy", "d hidden", "d weight", "assigned", "d router logits"),
                               results["cuda"], results["cpu"], strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def bf16_trainer_case(
    tmp_path: Path, rows: int, max_tokens: int, **shape: int
) -> tuple[Qwen3MoeConfig, MoeloopConfig, Parallel, ExperienceBatch]:
    """A random bf16 Qwen3-MoE of the shape saved as tmp_path/checkpoint; `configs/tiny.yaml` with a bf16 trainer
    packing at most max_tokens a microbatch; this process's one-process group (made by the first test that asks);
    a batch of rows random 200-token samples in groups of 4, on the GPU."""
    tokenizer = build_tokenizer(["abcdefgh"])
    hf_config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), head_dim=64, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, **shape,
    )  # fmt: skip
    save_policy(Qwen3MoeForCausalLM(hf_config).to(torch.bfloat16), tokenizer, tmp_path / "checkpoint")
    data = load_config(REPO / "configs" / "tiny.yaml").model_dump()
    data["trainer"].update(precision="bf16", max_tokens_per_microbatch=max_tokens)
    config = MoeloopConfig.model_validate(data)
    parallel = mesh_parallel(1, "cuda") if dist.is_initialized() else init_parallel(config.trainer)
    width = 200
    batch = ExperienceBatch(
        torch.randint(2, len(tokenizer), (rows, width)), torch.ones(rows, width, dtype=torch.long),
        torch.ones(rows, width, dtype=torch.bool), torch.zeros(rows, width), torch.rand(rows),
        torch.arange(rows) // 4,
    ).to(parallel.device)  # fmt: skip
    return hf_config, config, parallel, batch


def test_the_reference_policy_leaves_nothing_on_the_gpu(tmp_path: Path) -> None:
    """`reference_logprobs` loads checkpoint 0 as the trainer holds it (FSDP2 bf16 over fp32 masters, compiled
    layers), runs its pass and frees it: the GPU holds no more than before but the logprobs (memory model: the
    reference adds nothing to the update's peak)."""
    hf_config, config, parallel, batch = bf16_trainer_case(
        tmp_path, rows=4, max_tokens=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
    )  # fmt: skip
    before = torch.cuda.memory_allocated()
    logprobs_BT = reference_logprobs(tmp_path / "checkpoint", batch, config, parallel)
    left = torch.cuda.memory_allocated() - before - logprobs_BT.nbytes
    weights = 4 * sum(p.numel() for p in Qwen3MoeForCausalLM(hf_config).parameters())  # fp32 masters
    assert torch.isfinite(logprobs_BT).all() and left < 0.01 * weights, (left, weights)


def test_the_update_queues_its_minibatches_without_waiting_for_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the update's one read of the rows' counts and its read of the steps' figures (steps/rl/update.py),
    the host queues each minibatch (packing, compiled forwards and backwards, the aux loss, router health, clipping,
    the optimizer step) without one synchronizing call: `torch.cuda.set_sync_debug_mode("error")` raises on any
    (a pageable host-to-device copy too). After one update unguarded: compiling and autotuning do wait."""
    _, config, parallel, batch = bf16_trainer_case(  # max_tokens 256: several microbatches a minibatch
        tmp_path, rows=8, max_tokens=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    model, _, optimizer = load_trainer_model(tmp_path / "checkpoint", config.trainer, parallel)
    rows = len(batch.rewards_B)
    old_logprobs_BT = frozen_logprobs(model, batch, 1.0, 256, parallel)
    advantages_B = group_advantages(batch.rewards_B, batch.group_ids_B, scale=True)
    schedule = [torch.arange(rows)[:4], torch.arange(rows)[4:]]
    arguments = (model, optimizer, batch, schedule, advantages_B, old_logprobs_BT, None, None, batch.response_mask_BT,
                 config, parallel)  # fmt: skip
    update.actor_steps(*arguments)  # compiles
    step = update.minibatch_step

    def strict_step(*args: object, **kwargs: object) -> torch.Tensor:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(update, "minibatch_step", strict_step)
    measured = update.actor_steps(*arguments)
    assert len(measured["loss"]) == 2 and all(map(math.isfinite, measured["loss"] + measured["grad_norm"]))


def test_moeloop_run_trains_on_the_gpu(tmp_path: Path) -> None:
    """configs/tiny.yaml, 2 iterations, as a user runs it: every train step computed on CUDA in bf16, packed, and
    reports it; the engine generated there too (the rollout report names its device)."""
    config = tmp_path / "tiny.yaml"
    text = (REPO / "configs" / "tiny.yaml").read_text().replace("data/", f"{REPO}/configs/data/")
    config.write_text(text)
    done = moeloop_cli("run", str(config), "--iterations", "2", "--root", str(tmp_path / "runs"), "--no-progress",
                       cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = tmp_path / "runs" / "tiny" / "reports"
    for iteration in (1, 2):
        train = json.loads(next(reports.glob(f"iter-*{iteration}/train.json")).read_text())
        assert train["device"].startswith("cuda") and train["precision"] == "bf16", train
        flash = PACKED_ATTENTION["flash2" if flash4_missing(torch.device("cuda")) else "flash4"]
        assert train["attention"] == flash and train["optimizer_steps"] > 0, train


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpu_trainer_state_commits_resumes_and_publishes(tmp_path: Path) -> None:
    """trainer.world_size 2 with EP 2 under torchrun on NCCL: each rank writes its DCP shards of the trainer state
    (the experts as DTensors over the (ep, dp) mesh), iteration 2 loads them back, and publish writes the checkpoint
    the rollouts load."""
    config = tmp_path / "tiny.yaml"
    text = (REPO / "configs" / "tiny.yaml").read_text().replace("data/", f"{REPO}/configs/data/")
    config.write_text(text.replace("trainer:\n", "trainer:\n  world_size: 2\n  expert_parallel: 2\n", 1))
    done = moeloop_cli("run", str(config), "--iterations", "2", "--root", str(tmp_path / "runs"), "--no-progress",
                       cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    for iteration in (1, 2):
        state = json.loads(next((run / "trainer").glob(f"iter-*{iteration}/COMMIT")).read_text())
        shards = [name for name in state["files"] if name.endswith(".distcp")]
        assert {"weights/__0_0.distcp", "weights/__1_0.distcp", "optimizer/__1_0.distcp"} <= set(shards), shards
        train = json.loads(next((run / "reports").glob(f"iter-*{iteration}/train.json")).read_text())
        assert train["device"].startswith("cuda") and train["optimizer_steps"] > 0, train
    assert json.loads((run / "LATEST").read_text())["iteration"] == 2


def test_gpu_tensors_digests_are_their_bytes_blake3(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU engine's digest check (`Digests`: through two pinned buffers in turn, the threads hashing one while the
    other fills) gives each tensor's BLAKE3 as the CPU does: tensors of several dtypes and sizes, more than two
    buffers' worth, one larger than a buffer, in an order that leaves each buffer part full."""
    import blake3

    monkeypatch.setattr(delta, "STAGING_BYTES", 1 << 16)
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        f"t{index}": torch.randn(numel, device="cuda", generator=generator).to(dtype)
        for index, (numel, dtype) in enumerate(
            [(7, torch.float32), (20_000, torch.bfloat16), (40_000, torch.bfloat16), (3, torch.int64),
             (100_000, torch.float32), (33_000, torch.float16), (1, torch.bfloat16)] * 3
        )
    }  # fmt: skip
    raw = {name: t.cpu().view(-1).view(torch.uint8).numpy() for name, t in tensors.items()}
    expected = {name: blake3.blake3(data).hexdigest() for name, data in raw.items()}
    assert delta.checkpoint_digests(tensors) == expected


def test_a_gpu_engines_digests_read_beside_its_work_are_those_of_the_writes_queued_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`EngineWeights.digests_later` reads on a stream of its own while the engine goes on generating: it must see
    the delta's writes still queued behind a long kernel (a read on its own stream that did not wait would hash the
    old values), through the staged path and the one for a tensor larger than a buffer."""
    monkeypatch.setattr(delta, "STAGING_BYTES", 1 << 16)
    weights_tensor = torch.zeros(300_000, dtype=torch.bfloat16, device="cuda")
    slots = {"large": Slot("w", 0, 200_000, torch.bfloat16), "small": Slot("w", 200_000, 100_000, torch.bfloat16)}
    weights = EngineWeights({"w": weights_tensor}, slots, {})
    torch.cuda._sleep(1_000_000_000)  # the GPU busy for a while: the writes below wait behind it
    weights_tensor[:250_000].fill_(1.5)
    weights.digests_later()
    torch.cuda._sleep(1_000_000_000)  # the engine's work beside the read
    read = weights.digests()
    torch.cuda.synchronize()
    expected = delta.checkpoint_digests({name: weights.read(name).cpu() for name in slots})
    assert read == expected
    zeros = {name: torch.zeros(slot.numel, dtype=torch.bfloat16) for name, slot in slots.items()}
    assert read != delta.checkpoint_digests(zeros)
