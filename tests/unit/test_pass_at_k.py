"""pass@k as evaluate measures it (steps/evaluate.py): Chen et al. 2021's unbiased estimator and the per-data_source
figures against values computed by hand; the eval settings' checks; the figures in `moeloop report`'s tables, the
plots and MLflow (a data_source's characters that MLflow refuses in a metric name replaced)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
from pydantic import ValidationError

from moeloop.steps.config import EvalConfig
from moeloop.steps.evaluate import eval_figures, pass_at_k
from moeloop.steps.observe.trackers import begin_trackers, record_iteration
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import run_uri
from moeloop.workflows.report import format_sources_table, format_table
from tests.conftest import small_config


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, Fraction(2, 5)),  # pass@1 is the share that passes
        (5, 2, 2, 1 - Fraction(3, 10)),  # 1 - C(3,2)/C(5,2)
        (5, 2, 3, 1 - Fraction(1, 10)),  # 1 - C(3,3)/C(5,3)
        (5, 2, 4, Fraction(1)),  # fewer failing than k: some draw passes
        (10, 3, 5, 1 - Fraction(21, 252)),  # 1 - C(7,5)/C(10,5)
        (10, 0, 10, Fraction(0)),
        (4, 4, 1, Fraction(1)),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int, expected: Fraction) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12)


def test_eval_figures_per_data_source_by_hand() -> None:
    records = [{"data_source": "a"}, {"data_source": "a"}, {"data_source": "b"}, {"prompt": "no source"}]
    greedy = [1.0, 0.5, 1.0, 0.0]
    sampled = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.2, 0.0, 0.0], [1.0, 1.0, 1.0, 1.5], [0.0, 0.0, 0.0, 1.0]]

    overall, sources = eval_figures(records, greedy, sampled, threshold=1.0, ks=[1, 2, 4])

    a_pass_2 = (1 - 1 / 6 + 0) / 2  # c = 2 of 4: 1 - C(2,2)/C(4,2); c = 0: 0
    assert sources["a"] == {
        "prompts": 2,
        "reward_mean": 0.75,
        "pass_at_1": 0.5,
        "pass_at_k": {"1": 0.25, "2": pytest.approx(a_pass_2), "4": 0.5},
    }
    assert sources["b"] == {
        "prompts": 1,
        "reward_mean": 1.0,
        "pass_at_1": 1.0,
        "pass_at_k": {"1": 1.0, "2": 1.0, "4": 1.0},
    }
    assert sources["default"] == {
        "prompts": 1,
        "reward_mean": 0.0,
        "pass_at_1": 0.0,
        "pass_at_k": {"1": 0.25, "2": 0.5, "4": 1.0},  # c = 1 of 4: 1 - C(3,2)/C(4,2) = 0.5
    }
    assert list(sources) == ["a", "b", "default"]
    assert overall == {
        "prompts": 4,
        "reward_mean": 0.625,
        "pass_at_1": 0.5,
        "pass_at_k": {"1": 0.4375, "2": pytest.approx((a_pass_2 * 2 + 1 + 0.5) / 4), "4": 0.75},
    }
    lenient, _ = eval_figures(records, greedy, None, threshold=0.5, ks=[])
    assert lenient == {"prompts": 4, "reward_mean": 0.625, "pass_at_1": 0.75, "pass_at_k": None}


def test_eval_settings() -> None:
    assert EvalConfig().pass_ks() == [] and EvalConfig(samples=8).pass_ks() == [1, 8]
    assert EvalConfig(samples=8, k=[4, 1, 4]).pass_ks() == [1, 4]
    with pytest.raises(ValidationError, match="k needs samples > 0"):
        EvalConfig(k=[1])
    with pytest.raises(ValidationError, match=r"k \[0, 9\]: each must be between 1 and samples 8"):
        EvalConfig(samples=8, k=[0, 1, 9])


SOURCES = {
    "gsm8k": {"prompts": 3, "reward_mean": 0.5, "pass_at_1": 1 / 3, "pass_at_k": {"1": 0.25, "8": 0.75}},
    "math (hard)@v2": {"prompts": 1, "reward_mean": 0.0, "pass_at_1": 0.0, "pass_at_k": {"1": 0.0, "8": 0.125}},
}


def test_report_prints_the_pass_columns_and_a_table_per_data_source() -> None:
    metrics = [
        {"iteration": 0, "eval_reward_mean": 0.5, "eval_pass_at_1": 0.25, "eval_pass_at_k": None},
        {"iteration": 1, "eval_reward_mean": 0.6, "eval_pass_at_1": 0.5, "eval_pass_at_k": {"1": 0.4, "8": 0.9}},
    ]
    header, first, second = format_table(metrics).splitlines()
    assert header.split()[-6:] == ["eval", "reward", "greedy", "pass@1", "pass@1", "pass@8"]
    assert first.split()[-4:] == ["0.500", "0.250", "-", "-"]
    assert second.split()[-4:] == ["0.600", "0.500", "0.400", "0.900"]

    assert format_sources_table([{**m, "eval_by_source": {"gsm8k": SOURCES["gsm8k"]}} for m in metrics]) is None
    table = format_sources_table([{"iteration": 1, "eval_by_source": SOURCES}]).splitlines()
    assert table[0].split() == [
        "iter",
        "data_source",
        "prompts",
        "eval",
        "reward",
        "greedy",
        "pass@1",
        "pass@1",
        "pass@8",
    ]
    assert table[1].split() == ["1", "gsm8k", "3", "0.500", "0.333", "0.250", "0.750"]
    assert table[2].split() == ["1", "math", "(hard)@v2", "1", "0.000", "0.000", "0.000", "0.125"]


def test_report_plots_pass_at_k_per_data_source(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from moeloop.steps.observe.plots import write_plots

    metrics = [{"iteration": i, "eval_reward_mean": 0.1 * i, "eval_by_source": SOURCES} for i in (0, 1, 2)]
    written = write_plots(metrics, tmp_path)
    assert written[-1].name == "pass_at_k.png" and written[-1].read_bytes().startswith(b"\x89PNG")
    assert "pass_at_k.png" not in [p.name for p in write_plots([{"iteration": 0}], tmp_path / "none")]


def test_mlflow_gets_every_eval_figure_under_a_name_it_accepts(run_root: Path, tmp_path: Path) -> None:
    mlflow_client = pytest.importorskip("mlflow.tracking")
    store = str(tmp_path / "mlruns")
    config = small_config(iterations=1, observe={"trackers": ["mlflow"], "mlflow": {"tracking_uri": store}})
    storage = RunStorage(run_uri(config, str(run_root)))
    storage.write_bytes(RunStorage.CONFIG, b"run_name: x\n")
    begin_trackers(storage, config)
    storage.write_json(storage.report(0, "evaluate"), {"seconds": 1.0, "started_at": 1.0, "ended_at": 2.0})
    storage.write_json(storage.metrics(0), {"iteration": 0, "eval_reward_mean": 0.5, "eval_by_source": SOURCES})

    record_iteration(storage, config, 0)

    client = mlflow_client.MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name(config.run_name).experiment_id])
    assert run.data.metrics["eval_by_source/math _hard__v2/pass_at_k/8"] == 0.125
    assert run.data.metrics["eval_by_source/gsm8k/pass_at_1"] == pytest.approx(1 / 3)
