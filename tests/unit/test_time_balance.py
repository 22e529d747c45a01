"""time_balance.png (`moeloop report --plot`): each iteration's period and each role's busy and idle time in it, with
nothing stacked across roles, whose work and waits overlap in time. The metrics are those of an iteration of the
demo at staleness 0 where the waits overlap: summed, steps and waits made a 55 s bar for a 16.6 s iteration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moeloop.steps.observe import plots

PERIODS = {1: 20.4, 2: 16.6}
BUSY = {
    1: {"rollout": 9.1, "reward": 0.6, "train": 6.2, "publish": 2.3},
    2: {"rollout": 7.9, "reward": 0.5, "train": 5.4, "publish": 2.1},
}


def iteration(i: int) -> dict[str, Any]:
    busy = BUSY[i]
    return {
        "iteration": i,
        "iteration_seconds": PERIODS[i],
        "rollout_seconds": busy["rollout"],
        "step_seconds": {"reward": busy["reward"], "train": busy["train"], "publish": busy["publish"], "evaluate": 3.0},
        # Each role waits while the others work: the rollouts on train and publish, train on the rollouts and reward.
        "rollout_wait_seconds": 8.4,
        "wait_seconds": {"reward": 7.9, "train": 8.4},
    }


def test_each_roles_bar_is_its_busy_time_and_the_rest_of_the_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    drawn: list[Any] = []
    monkeypatch.setattr(plots, "save", lambda plt, figure, path: drawn.append(figure))
    plt = plots.pyplot()
    plots.time_balance(plt, [{"iteration": 0, "eval_reward_mean": 0.5}, iteration(1), iteration(2)], tmp_path / "x.png")
    [axes] = drawn[0].axes
    bars = [(round(p.get_x() + p.get_width() / 2), p.get_y(), p.get_height()) for p in axes.patches]
    assert len(bars) == 2 * 4 * 2  # busy and idle, four roles, two iterations
    for i, period in PERIODS.items():
        mine = [(bottom, height) for x, bottom, height in bars if x == i]
        tops = [bottom + height for bottom, height in mine]
        assert max(tops) == pytest.approx(period)  # no bar reaches past the period: nothing is counted twice
        busy = sorted(height for bottom, height in mine if bottom == 0)
        assert busy == pytest.approx(sorted(BUSY[i].values()))
    periods = axes.collections[0].get_segments()
    assert [segment[0][1] for segment in periods] == pytest.approx(list(PERIODS.values()))
    plt.close(drawn[0])


def test_the_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written = plots.write_plots([{"iteration": 0, "eval_reward_mean": 0.5}, iteration(1), iteration(2)], tmp_path)
    assert (tmp_path / "time_balance.png") in written
    assert (tmp_path / "time_balance.png").read_bytes().startswith(b"\x89PNG")
