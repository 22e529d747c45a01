"""The GPU path (skipped without CUDA; run on an H200 for the closing note): the varlen attention against SDPA per
sample, the packed bf16 update against fp32, the whole train step and a 2-iteration `moeloop run` on one GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from steps.model.attention import VARLEN, varlen_attention
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


def run_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=environment, capture_output=True, text=True)


def test_moeloop_run_trains_on_the_gpu(tmp_path: Path) -> None:
    """configs/tiny.yaml, 2 iterations, as a user runs it: every train step computed on CUDA in bf16, packed, and
    reports it; the engine generated there too (the rollout report names its device)."""
    config = tmp_path / "tiny.yaml"
    text = (REPO / "configs" / "tiny.yaml").read_text().replace("data/", f"{REPO}/configs/data/")
    config.write_text(text)
    done = run_cli("-m", "workflows.cli", "run", str(config), "--iterations", "2", "--root", str(tmp_path / "runs"),
                   "--no-progress", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = tmp_path / "runs" / "tiny" / "reports"
    for iteration in (1, 2):
        train = json.loads(next(reports.glob(f"iter-*{iteration}/train.json")).read_text())
        assert train["device"].startswith("cuda") and train["precision"] == "bf16", train
        assert train["attention"] == VARLEN and train["optimizer_steps"] > 0, train
