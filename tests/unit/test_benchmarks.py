"""The benchmark scripts still run against the product's functions: a tiny CPU run of each that can run here (their
figures are measured on an H200; see benchmarks/). A row that raises prints `failed: ...`, which fails this test."""

from __future__ import annotations

import gzip
import json
import re
import sys

import pytest

from tests.processes import run_command

TINY_MODEL = ["--layers", "1", "--hidden", "64", "--intermediate", "32", "--heads", "2", "--kv-heads", "1",
              "--head-dim", "32", "--experts", "4", "--top-k", "2", "--vocab", "256"]  # fmt: skip


def test_policy_update_benchmark_times_careful_hf_and_the_product_on_cpu(tmp_path) -> None:
    command = [sys.executable, "benchmarks/policy_update.py", "--device", "cpu", "--batches", "uniform", "--rows",
               "careful", "product", *TINY_MODEL, "--warmup", "0", "--reps", "1", "--dense-size", "256",
               "--max-tokens", "4096", "--profile", "--trace", str(tmp_path)]  # fmt: skip
    done = run_command(command)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[1].split(" (")[0].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for row in ("careful", "product"):
        assert row in rows and "failed" not in rows[row], done.stdout
        assert float(rows[row].split("|")[2]) > 0, rows[row]  # seconds per update
        [trace] = tmp_path.glob(f"uniform-{row}-*.json.gz")  # the profiled update's trace, whole
        names = {event.get("name") for event in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
        assert "policy_update" in names, sorted(map(str, names))[:20]
    assert re.search(r"its logprob pass: [0-9.]+ s", rows["product"]), rows["product"]


def test_handoff_benchmark_runs_commit_publish_and_fetch_on_seaweedfs_at_a_toy_size() -> None:
    done = run_command([sys.executable, "-m", "benchmarks.handoff", "--smoke"])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[2].strip(): line.split("|") for line in done.stdout.splitlines() if line.startswith("| 0.")}
    assert set(rows) == {"trainer state upload + COMMIT", "publish", "rollout pod fetch"}, done.stdout
    for cells in rows.values():
        assert int(cells[9].strip(" %")) > 0, cells  # moeloop speed over boto3s: both timed (toy sizes print 0.0 s)
    shards = int(re.search(r"(\d+) shards", rows["publish"][10]).group(1))
    assert shards > 2 and re.search(r"peak RSS [0-9.]+ GB", rows["publish"][10]), rows["publish"]


def test_handoff_projection_is_the_hand_computed_one() -> None:
    """Qwen3-30B-A3B at the projection's defaults, by hand: 366 GB of state from 8 ranks at 1 GB/s; 183 GB through
    publish's 15 shards at 0.5 GB/s each; 32 pods x 61 GB at S3's 5,500 GETs/s of 8 MiB; 20.48M tokens x 8 x 3.3e9
    FLOPs on 8 GPUs at 34.5% of 989 TFLOPS."""
    from benchmarks.handoff_projection import MODELS, period, stage_seconds

    defaults = run_command([sys.executable, "-m", "benchmarks.handoff_projection"], timeout=60)
    assert defaults.returncode == 0, defaults.stderr
    import argparse

    args = argparse.Namespace(
        commit_gbs=1.0, publish_gbs=0.5, fetch_gbs=1.5, nic_gbs=12.5, s3_put_per_s=3500, s3_get_per_s=5500,
        part_mib=8, gpus_per_node=8, publish_cores=16, shard_bytes=4 << 30, prompts=512, samples=16,
        tokens_per_sample=2500, mfu=0.345, peak_tflops=989, rollout_over_train=1.0,
    )  # fmt: skip
    seconds = stage_seconds(MODELS[0], args)
    get_cap = 5500 * 8 * 2**20 / 1e9
    train = 512 * 16 * 2500 * 8 * 3.3e9 / (8 * 0.345 * 989e12)
    expected = {"commit": 366 / 8, "state fetch": 366 / 12, "publish": 183 / 7.5, "rollout fetch": 32 * 61 / get_cap,
                "train": train}  # fmt: skip
    assert seconds == {key: pytest.approx(value) for key, value in expected.items()}
    handoff = expected["publish"] + expected["rollout fetch"] + train
    assert period(seconds, train, 0) == pytest.approx(expected["commit"] + handoff + train)
    assert period(seconds, train, 1) == pytest.approx(expected["state fetch"] + train + expected["commit"])
    assert f"| {MODELS[0].name} | 8 | 32 | 46 | 30 | 24 | 42 | 198 |" in defaults.stdout


def test_trl_benchmark_measures_a_curve_as_its_table_defines() -> None:
    """benchmarks/trl_grpo.py's measures, on a hand-made curve (the benchmark itself needs TRL's own environment)."""
    from benchmarks.trl_grpo import measures

    evals = [0.50, 0.60, 0.69, 0.71, 0.74, 0.76, 0.75]  # SFT, then iterations 1-6
    curve = [{"iteration": i, "eval_reward_mean": e, "seconds": 10.0 + 4.0 * i} for i, e in enumerate(evals)]
    figures = measures(curve, total=40.0, cores=1.5)
    assert figures["seconds to SFT + 0.20"] == 22.0  # iteration 3 (0.71) is the first at 0.70 or above
    assert figures["seconds to SFT + 0.25"] == 30.0  # iteration 5
    assert (figures["iterations to SFT + 0.20"], figures["iterations to SFT + 0.25"]) == (3, 5)
    assert figures["total seconds, 6 iterations"] == 40.0
    assert figures["seconds per iteration, iterations 5-6"] == 4.0
    assert figures["mean eval over iterations 2-6"] == pytest.approx((0.69 + 0.71 + 0.74 + 0.76 + 0.75) / 5)
    assert figures["CPU cores used, on average"] == 1.5
    assert figures["seconds to iteration 1 (start-up and one iteration)"] == 14.0
    unreached = measures(curve[:3], total=20.0, cores=1.0)
    assert unreached["seconds to SFT + 0.20"] is None and unreached["iterations to SFT + 0.20"] is None


def test_trl_benchmark_compares_run_for_run_and_reports_the_spread() -> None:
    """--draws: each moeloop run against TRL's of the same seed and draw; the ratio's median and range, and the runs
    where either never reached the gain."""
    from benchmarks.trl_grpo import cell, comparison

    def run(to_020: float | None, total: float) -> dict[str, float | None]:
        return {"seconds to SFT + 0.20": to_020, "seconds to SFT + 0.25": None, "total seconds, 4 iterations": total}

    results = {"TRL": [run(60, 100), run(90, 120), run(50, 90)], "moeloop (vllm)": [run(30, 80), run(100, 60), run(None, 45)]}
    lines = comparison(results, ["moeloop (vllm)"], 4)
    assert "- seconds to SFT + 0.20, moeloop (vllm): not reached by both in 1 of 3 runs" in lines
    assert "- seconds to SFT + 0.20, moeloop (vllm): ahead in 1 of 2 runs; TRL's seconds over ours, run for run:" \
        " median 1.45x, range 0.90-2.00x" in lines
    assert "- seconds to SFT + 0.25, moeloop (vllm): not reached by both in 3 of 3 runs" in lines
    assert "- total seconds, 4 iterations, moeloop (vllm): ahead in 3 of 3 runs; TRL's seconds over ours, run for" \
        " run: median 2.00x, range 1.25-2.00x" in lines
    assert cell([3.0, 1.0, 2.0]) == "3 / 1 / 2; **2**, 1-3"
    assert cell([3.0, None, 2.0]) == "3 / - / 2"


def test_trl_contender_gets_the_runs_optimizer_and_clip_settings_from_its_config(tmp_path) -> None:
    """What trl_grpo.py passes trl_contender.py is the config as moeloop reads it: its values where set, moeloop's
    defaults where not (betas (0.9, 0.99), where TRL's default beta2 is 0.999), never a restated number."""
    from benchmarks.trl_grpo import contender_settings, demo_config

    changes = {"trainer.learning_rate": 1e-4, "trainer.weight_decay": 0.01, "algorithm.clip_eps_high": 0.28}
    arguments = contender_settings(demo_config(tmp_path, "run", 0, 3, changes))
    assert arguments == [
        "--learning-rate", "0.0001", "--betas", "0.9", "0.99", "--weight-decay", "0.01", "--max-grad-norm", "1.0",
        "--clip-eps", "0.2", "--clip-eps-high", "0.28", "--max-new-tokens", "10",
    ]  # fmt: skip


def test_changed_fraction_benchmark_measures_a_runs_and_the_models_updates_at_toy_sizes() -> None:
    """--smoke: a one-iteration run of the demo's task (its checkpoints 0 and 1, as stored and as bf16) and two
    updates of the policy_update model at toy sizes on CPU; every row's fractions and sizes filled in."""
    done = run_command([sys.executable, "-m", "benchmarks.changed_fraction", "--smoke"])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "%" in line]
    assert [cells[0].strip() for cells in rows] == ["0 -> 1", "0 -> 1 as bf16", "lr 1e-06, 0 -> 1", "lr 1e-06, 1 -> 2"]
    for cells in rows:
        assert 0 < float(cells[2].strip(" %")) <= 100, cells  # the changed fraction
        assert re.fullmatch(r" [\d.,]+ MB \([\d.]+%\) ", cells[-2]), cells  # the product's delta files
    assert float(rows[2][2].strip(" %")) < 10  # an RL learning rate changes few bf16 elements


def test_delta_handoff_benchmark_times_the_full_and_the_delta_path_on_seaweedfs_at_a_toy_size() -> None:
    done = run_command([sys.executable, "-m", "benchmarks.delta_handoff", "--smoke"])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 4, done.stdout
    for cells in rows:
        assert float(cells[2]) >= 0 and float(cells[3]) >= 0, cells
    # Both paths timed; the last row (the in-place write alone) can round to 0.00 s at toy sizes.
    assert all(float(cells[2]) > 0 for cells in rows[:3]), rows
    assert "of elements changed" in rows[0][5] and "elements written" in rows[3][5]
def test_route_storage_benchmark_prints_both_shapes_before_and_now() -> None:
    done = run_command([sys.executable, "benchmarks/route_storage.py", "--smoke"])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith(("| Qwen3", "| Deep"))]
    labels = {(cells[1].strip(), cells[2].strip()) for cells in rows if len(cells) > 8}
    for shape in ("Qwen3-30B-A3B", "DeepSeek-V3"):
        assert {(shape, "before"), (shape, "now, prompt_routes last"), (shape, "now, prompt_routes all")} <= labels
    ids = {cells[2].strip(): cells[4].strip() for cells in rows if cells[1].strip() == "DeepSeek-V3" and len(cells) > 8}
    assert ids == {"before": "uint16", "now, prompt_routes last": "uint8", "now, prompt_routes all": "uint8"}
