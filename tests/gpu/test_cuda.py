"""The GPU path (skipped without CUDA; run on an H200 for the closing note): the varlen attention against SDPA per
sample, the compiled LM-head and router-loss passes against eager, and a 2-iteration `moeloop run` on one GPU (the
whole train step in bf16, packed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moeloop.steps.model.attention import VARLEN, varlen_attention
from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.model.logprobs import ChunkedTokenLogprobs
from moeloop.steps.model.policy import build_tokenizer, save_policy
from moeloop.steps.rl.batch import ExperienceBatch
from moeloop.steps.rl.parallel import init_parallel
from moeloop.steps.rl.state import reference_logprobs
from moeloop.steps.rl.router_loss import layer_routing
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_varlen_attention_equals_causal_sdpa_per_sample() -> None:
    """Forward and gradients, GQA (8 query heads over 2 KV heads), bf16; against SDPA on each sample alone."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = [5, 130, 1, 77, 300]
    cu_seqlens = F.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    total = sum(lengths)
    q_1hND, k_1kND, v_1kND = (
        torch.randn(1, heads, total, 64, device="cuda", generator=generator, dtype=torch.bfloat16).requires_grad_()
        for heads in (8, 2, 2)
    )
    out_1NhD, _ = varlen_attention(
        torch.nn.Module(), q_1hND, k_1kND, v_1kND, None, scaling=0.125,
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


def test_the_reference_policy_leaves_nothing_on_the_gpu(tmp_path: Path) -> None:
    """`reference_logprobs` loads checkpoint 0 as the trainer holds it (FSDP2 bf16 over fp32 masters, compiled
    layers), runs its pass and frees it: the GPU holds no more than before but the logprobs (memory model: the
    reference adds nothing to the update's peak)."""
    tokenizer = build_tokenizer(["abcdefgh"])
    hf_config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16,
        num_experts_per_tok=4, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    save_policy(Qwen3MoeForCausalLM(hf_config).to(torch.bfloat16), tokenizer, tmp_path / "checkpoint")
    data = load_config(REPO / "configs" / "tiny.yaml").model_dump()
    data["trainer"].update(precision="bf16", max_tokens_per_microbatch=512)
    config = MoeloopConfig.model_validate(data)
    parallel = init_parallel(config.trainer)
    rows, width = 4, 200
    batch = ExperienceBatch(
        torch.randint(2, len(tokenizer), (rows, width)), torch.ones(rows, width, dtype=torch.long),
        torch.ones(rows, width, dtype=torch.bool), torch.zeros(rows, width), torch.rand(rows),
        torch.zeros(rows, dtype=torch.long),
    ).to(parallel.device)  # fmt: skip
    before = torch.cuda.memory_allocated()
    logprobs_BT = reference_logprobs(tmp_path / "checkpoint", batch, config, parallel)
    left = torch.cuda.memory_allocated() - before - logprobs_BT.nbytes
    weights = 4 * sum(p.numel() for p in Qwen3MoeForCausalLM(hf_config).parameters())  # fp32 masters
    assert torch.isfinite(logprobs_BT).all() and left < 0.01 * weights, (left, weights)


def run_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=environment, capture_output=True, text=True)


def test_moeloop_run_trains_on_the_gpu(tmp_path: Path) -> None:
    """configs/tiny.yaml, 2 iterations, as a user runs it: every train step computed on CUDA in bf16, packed, and
    reports it; the engine generated there too (the rollout report names its device)."""
    config = tmp_path / "tiny.yaml"
    text = (REPO / "configs" / "tiny.yaml").read_text().replace("data/", f"{REPO}/configs/data/")
    config.write_text(text)
    done = run_cli("-m", "moeloop.workflows.cli", "run", str(config), "--iterations", "2", "--root", str(tmp_path / "runs"),
                   "--no-progress", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = tmp_path / "runs" / "tiny" / "reports"
    for iteration in (1, 2):
        train = json.loads(next(reports.glob(f"iter-*{iteration}/train.json")).read_text())
        assert train["device"].startswith("cuda") and train["precision"] == "bf16", train
        assert train["attention"] == VARLEN and train["optimizer_steps"] > 0, train


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpu_trainer_state_commits_resumes_and_publishes(tmp_path: Path) -> None:
    """trainer.world_size 2 with EP 2 under torchrun on NCCL: each rank writes its DCP shards of the trainer state
    (the experts as DTensors over the (ep, dp) mesh), iteration 2 loads them back, and publish writes the checkpoint
    the rollouts load."""
    config = tmp_path / "tiny.yaml"
    text = (REPO / "configs" / "tiny.yaml").read_text().replace("data/", f"{REPO}/configs/data/")
    config.write_text(text.replace("trainer:\n", "trainer:\n  world_size: 2\n  expert_parallel: 2\n", 1))
    done = run_cli("-m", "moeloop.workflows.cli", "run", str(config), "--iterations", "2", "--root", str(tmp_path / "runs"),
                   "--no-progress", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    for iteration in (1, 2):
        state = json.loads(next((run / "trainer").glob(f"iter-*{iteration}/COMMIT")).read_text())
        shards = [name for name in state["files"] if name.endswith(".distcp")]
        assert {"weights/__0_0.distcp", "weights/__1_0.distcp", "optimizer/__1_0.distcp"} <= set(shards), shards
        train = json.loads(next((run / "reports").glob(f"iter-*{iteration}/train.json")).read_text())
        assert train["device"].startswith("cuda") and train["optimizer_steps"] > 0, train
    assert json.loads((run / "LATEST").read_text())["iteration"] == 2
