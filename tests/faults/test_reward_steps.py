"""The reward and evaluate steps score through the reward workers (issue 36's silent exits, issue 37's time limits):
on a real run (start and iteration 1's rollout, in-process), a reward function that hangs past reward.timeout_s,
kills its process, calls sys.exit(0) or os._exit(0), or returns NaN stops the step as a process with exit 2 and one
line naming the function, the sample and the step, committing nothing; under `on_error: zero` the step commits with
the failures counted in its report and the metrics. Evaluate measures greedy pass@1 and sampled pass@k per
data_source into the metrics, the trackers' scalars and `moeloop report`."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from moeloop.steps.demo_task import make_prompts, write_jsonl
from moeloop.steps.evaluate import evaluate, iteration_metrics
from moeloop.steps.observe.scalars import iteration_scalars
from moeloop.steps.rollout import rollout
from moeloop.steps.start import start
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.report import print_report
from tests.conftest import small_config
from tests.faults.test_bad_input import snapshot
from tests.faults.test_hostile_input import TINY_SHAPE, one_line_error
from tests.processes import run_step
from tests.unit.test_reward_pool import FAULTS

# The eval set: two prompts of each data_source; record_says gives each its "reward"; c's first one is a fault.
EVAL_SOURCES = [("a", 1.0), ("a", 1.0), ("b", 0.0), ("b", 0.0), ("c", 1.0), ("c", 1.0)]


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run after start and iteration 1's one rollout shard: 4 train prompts x 2 samples, prompt 1 marked as a
    fault (tests/faulty_rewards.py)."""
    folder = tmp_path_factory.mktemp("reward-steps")
    rng = random.Random(0)
    held_out = make_prompts(len(EVAL_SOURCES), rng, set())
    train = make_prompts(4, rng, {r["answer"][::-1] for r in held_out})
    train[1]["fault"] = True
    evaluation = [
        {**record, "data_source": source, "reward": value, "fault": index == 4}
        for index, (record, (source, value)) in enumerate(zip(held_out, EVAL_SOURCES, strict=True))
    ]
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "eval.jsonl", evaluation)
    config = small_config(
        iterations=1,
        model={"sft": {"steps": 2}, "tiny": TINY_SHAPE},
        task={"train_prompts": str(folder / "train.jsonl"), "eval_prompts": str(folder / "eval.jsonl")},
        rollout={
            "engine": "transformers",
            "prompts_per_iteration": 4,
            "samples_per_prompt": 2,
            "num_shards": 1,
            "max_new_tokens": 6,
        },
        trainer={"minibatch_size": 8},
        eval={"max_prompts": len(EVAL_SOURCES)},
    )
    run = folder / "root" / config.run_name
    start(str(run), config)
    rollout(str(run), 1, 0, 1)
    return run


def with_settings(run: Path, tmp_path: Path, **sections: dict[str, Any]) -> Path:
    """A copy of the run whose stored config (what the steps read) has these sections instead."""
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    data = yaml.safe_load((copy / "config.yaml").read_text())
    data.update(sections)
    (copy / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return copy


@pytest.mark.parametrize("fault", ["hangs", "kills_its_process", "exits", "exits_at_once", "nan"])
def test_a_reward_that_fails_stops_the_reward_step_with_one_line(scored_run: Path, tmp_path: Path, fault: str) -> None:
    run = with_settings(
        scored_run, tmp_path, reward={"functions": [{"path": f"tests.faulty_rewards:{fault}"}], "timeout_s": 1}
    )
    before = snapshot(run)

    result = run_step("reward", run, 1, cwd=tmp_path)

    last = one_line_error(result, f"reward function tests.faulty_rewards:{fault} {FAULTS[fault]} on sample 1-1-")
    assert last.endswith(" in the reward step of iteration 1"), last
    assert snapshot(run) == before, "nothing committed, no report"


def test_a_reward_that_ends_its_process_stops_the_evaluate_step_with_one_line(scored_run: Path, tmp_path: Path) -> None:
    """Issue 36's os._exit(0) at eval-0: the step used to end with a worker's log line naming nothing."""
    run = with_settings(scored_run, tmp_path, reward={"functions": [{"path": "tests.faulty_rewards:exits_at_once"}]})

    result = run_step("evaluate", run, 0, cwd=tmp_path)

    one_line_error(
        result,
        "error: reward function tests.faulty_rewards:exits_at_once ended its worker process (exit code 0) on eval"
        " prompt 5 (response ",
        ") in the evaluate step of iteration 0",
    )
    assert not (run / "metrics").exists()


def test_under_on_error_zero_the_reward_step_commits_and_counts_the_failures(scored_run: Path, tmp_path: Path) -> None:
    functions = [{"path": f"tests.faulty_rewards:{name}"} for name in FAULTS]
    run = with_settings(scored_run, tmp_path, reward={"functions": functions, "timeout_s": 1, "on_error": "zero"})

    result = run_step("reward", run, 1, cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    failures = 2 * len(FAULTS)  # prompt 1's two samples, each function once
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert (
        len(warnings) == 10 + 1
        and warnings[-1] == f"warning: {failures} reward function calls failed in the reward step of iteration 1"
    )
    assert all(
        " on sample 1-1-" in line and line.endswith("counted as 0 (reward.on_error zero)") for line in warnings[:-1]
    )
    assert json.loads(result.stdout.splitlines()[-1])["reward_failures"] == failures
    table = pq.read_table(run / "experience" / "iter-000001" / "rewards.parquet").to_pylist()
    assert sorted((row["prompt_id"], row["reward"]) for row in table) == [
        (p, 0.0 if p == 1 else float(len(FAULTS))) for p in range(4) for _ in range(2)
    ]
    assert (run / "experience" / "iter-000001" / "COMMIT").exists()
    assert iteration_metrics(RunStorage(str(run)), 1, {})["reward_failures"] == failures


def test_evaluate_measures_pass_at_k_per_data_source(
    scored_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """record_says scores a and b whatever the response; c goes through `nan`, which fails on c's first prompt
    (counted as 0 under on_error zero): every figure is known by hand."""
    run = with_settings(
        scored_run,
        tmp_path,
        reward={
            "functions": [{"path": "tests.faulty_rewards:record_says"}],
            "by_source": {"c": [{"path": "tests.faulty_rewards:nan"}]},
            "on_error": "zero",
        },
        eval={"max_prompts": len(EVAL_SOURCES), "samples": 3, "k": [1, 3], "pass_threshold": 1.0},
    )

    metrics = evaluate(str(run), 0)

    def figures(mean: float) -> dict[str, Any]:
        return {"prompts": 2, "reward_mean": mean, "pass_at_1": mean, "pass_at_k": {"1": mean, "3": mean}}

    assert metrics["eval_by_source"] == {"a": figures(1.0), "b": figures(0.0), "c": figures(0.5)}
    assert metrics["eval_reward_mean"] == metrics["eval_pass_at_1"] == 0.5
    assert metrics["eval_pass_at_k"] == {"1": 0.5, "3": 0.5}
    assert metrics["eval_reward_failures"] == 1 + 3  # c's first prompt: its greedy response and its 3 samples
    scalars = iteration_scalars(RunStorage(str(run)), 0, metrics).values
    assert scalars["eval_by_source/c/pass_at_k/3"] == 0.5 and scalars["eval_pass_at_1"] == 0.5
    assert (run / "tensorboard" / "events.out.tfevents.000000.moeloop").exists()

    print_report(str(run))
    table, sources = capsys.readouterr().out.split("\n\neval by data_source\n")
    assert table.splitlines()[0].split()[-4:] == ["greedy", "pass@1", "pass@1", "pass@3"]
    assert table.splitlines()[1].split()[-4:] == ["0.500", "0.500", "0.500", "0.500"]
    assert [row.split()[1:] for row in sources.splitlines()[1:]] == [
        ["a", "2", "1.000", "1.000", "1.000", "1.000"],
        ["b", "2", "0.000", "0.000", "0.000", "0.000"],
        ["c", "2", "0.500", "0.500", "0.500", "0.500"],
    ]
