"""The benchmark scripts still run against the product's functions: a tiny CPU run of each that can run here (their
figures are measured on an H200; see benchmarks/). A row that raises prints `failed: ...`, which fails this test."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO

TINY_MODEL = ["--layers", "1", "--hidden", "64", "--intermediate", "32", "--heads", "2", "--kv-heads", "1",
              "--head-dim", "32", "--experts", "4", "--top-k", "2", "--vocab", "256"]  # fmt: skip


def test_policy_update_benchmark_times_careful_hf_and_the_product_on_cpu() -> None:
    command = [sys.executable, "benchmarks/policy_update.py", "--device", "cpu", "--batches", "uniform", "--rows",
               "careful", "product", *TINY_MODEL, "--warmup", "0", "--reps", "1", "--dense-size", "256",
               "--max-tokens", "4096"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[1].split(" (")[0].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for row in ("careful", "product"):
        assert row in rows and "failed" not in rows[row], done.stdout
        assert float(rows[row].split("|")[2]) > 0, rows[row]  # seconds per update
    assert re.search(r"its logprob pass: [0-9.]+ s", rows["product"]), rows["product"]
