"""The planner's trainer shapes (trainer.lifetime, workflows/capacity/handoff.py): a trainer per chunk pays its
start-up and its state's fetch once a chunk, where they outlast slot 1's generating, its state's commit once a chunk,
and its background commit only beyond the period; a trainer per iteration
is planned as before; the handoff column is the sum of its parts on the critical path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeloop.steps.errors import MoeloopError
from moeloop.workflows.capacity.explain import plan_json, plan_table
from tests.unit.test_capacity import BALANCED, CHECKPOINT_GB, rates, stated_plan

STATE_GB = 30_532_122_624 * 12 / 1e9  # fp32 weights and AdamW's two moments
# Qwen3-30B-A3B on one H200 node (tests/unit/test_capacity.py's hand-computed plans): overhead O = 47 s, of it
# o = 15 s every iteration and 32 s of start-up; update 400,000 / (1250 x 8) = 40 s; rollout 15 + 40 = 55 s, reward
# 5 s; publish 30 s (a trainer per iteration); the state at 0.2 s/GB a node, of it the commit 0.1 s/GB.
SHAPED = rates(1000, 15, 0.00625, 1250, 47, 30) | {
    "trainer_state_seconds_per_gb": 0.2,
    "trainer_commit_seconds_per_gb": 0.1,
    "delta_write_seconds_per_gb": 0.01,
    "train_iteration_overhead_seconds": 15,
}


def assert_same_options(plain, named) -> None:
    """Two plans whose every option has the same period, step times, critical path and handoff."""
    for a, b in zip(plain.evaluated, named.evaluated, strict=True):
        assert (a.period, a.step_seconds, a.critical_path, a.handoff) == (
            b.period,
            b.step_seconds,
            b.critical_path,
            b.handoff,
        )


def chunk(every: int = 1) -> dict:
    return {"lifetime": "chunk", "state_every": every}


def test_a_chunk_trainer_pays_its_start_up_and_state_once_a_chunk_and_commits_the_checkpoint(tmp_path: Path) -> None:
    """configs/tiny.yaml: cluster.chunk_iterations 20, which 2 shards' iterations fit and 8 shards' too: an
    iteration is 5 tasks at any shard count (its shards one task of K items), 20 x 5 + 7 <= 200."""
    for shards, c in ((2, 20), (8, 20)):
        plan = stated_plan(tmp_path, 0, SHAPED, shards=shards, trainer=chunk())
        best = plan.best
        assert best.paid.chunk_iterations == c
        # The trainer starts beside slot 1's rollouts, generating 40 s (8 shards) or 160 s (2): its 32 s start-up
        # fits either, and its state's 36.6 s fetch holds train 1 up by 28.6 s or not at all; the state's commit at
        # the chunk's end is on the path, once a chunk.
        fetch = background = STATE_GB * 0.1
        late_fetch = max(0.0, 32 + fetch - (40 if shards == 8 else 160))
        state = (late_fetch + background) / c
        commit = CHECKPOINT_GB * 0.1  # the checkpoint, from the trainer's memory, every iteration: publish waits
        delta = CHECKPOINT_GB * 0.01  # its delta, which answers the train step
        assert best.paid.trainer_overhead == pytest.approx(15)  # the train step's, not the handoff's
        assert best.paid.parts == pytest.approx(
            {
                "trainer_state": state,
                "checkpoint_write": commit,
                "delta_write": delta,
                "engine_start": 15,
                "checkpoint_fetch": 0,
            }
        )
        train = 15 + 40 + state + delta
        assert best.step_seconds["train"] == pytest.approx(train)
        assert best.step_seconds["publish"] == pytest.approx(commit)  # the engines per iteration load the checkpoint
        rollout = 55 if shards == 8 else 15 + 160  # 2 shards: 40 prompts x 10 x 400 tokens at 1000 tokens/s
        # Synchronous: the round trip of one iteration, every step after its 5 s start-up; no commit waited for
        # (its 36.6 s every iteration are less than the period).
        assert best.period == pytest.approx(5 + rollout + 5 + 5 + 5 + train + 5 + commit)
        assert best.paid.background_commit == pytest.approx(STATE_GB * 0.1)
        assert best.critical_path == "publish -> rollout -> reward -> train -> publish"
        assert best.handoff == pytest.approx(best.paid.parts)  # all of it on the path: each step once an iteration


def test_the_background_commit_is_on_the_path_only_beyond_state_every_periods(tmp_path: Path) -> None:
    """The state committed at 1 s/GB: 366.4 s a commit. Without waiting for it the period is 5 + 55 + 5 + 5 + 5 +
    train (15 + (32 + 73.3 - 40 + 366.4) / 20 + 0.61 + 40 = 77.2: the start-up and the fetch, once a chunk of 20
    iterations, beyond slot 1's 40 s of generating, and the commit at the chunk's end; the delta) + 5 + 61.06 (publish
    waits for the checkpoint's commit) = 218.3 s; every iteration (k = 1) the commit takes longer, and the trainer
    waits out the excess, 366.4 - 218.3 s an iteration; every 2 it keeps up."""
    slow = SHAPED | {"trainer_state_seconds_per_gb": 1.2, "trainer_commit_seconds_per_gb": 1.0}
    chunk_state = (32 + STATE_GB * 1.2 - 40) / 20
    train = 15 + chunk_state + CHECKPOINT_GB * 0.01 + 40
    unhurried = 5 + 55 + 5 + 5 + 5 + train + 5 + CHECKPOINT_GB * 1.0  # publish waits for the checkpoint's commit
    waiting = stated_plan(tmp_path, 0, slow, trainer=chunk(1)).best
    assert waiting.period == pytest.approx(STATE_GB)
    assert waiting.step_seconds["train"] == pytest.approx(train + STATE_GB - unhurried)
    assert waiting.paid.parts["trainer_state"] == pytest.approx(chunk_state + STATE_GB - unhurried)
    kept_up = stated_plan(tmp_path, 0, slow, trainer=chunk(2)).best
    assert kept_up.period == pytest.approx(unhurried) and kept_up.step_seconds["train"] == pytest.approx(train)
    # At staleness 1 the round trip spans two iterations: the wait lands on the train step until the period is the
    # commit's, 366.4 s an iteration, the train step's own cycle.
    ahead = stated_plan(tmp_path, 1, slow, trainer=chunk(1)).best
    assert ahead.period == pytest.approx(STATE_GB, rel=1e-6)
    assert ahead.critical_path == "train -> train"
    assert ahead.step_seconds["train"] == pytest.approx(STATE_GB - 5, rel=1e-6)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_larger_state_every_never_makes_the_handoff_larger(tmp_path: Path, staleness: int) -> None:
    slow = SHAPED | {"trainer_state_seconds_per_gb": 1.2, "trainer_commit_seconds_per_gb": 1.0}
    plans = [stated_plan(tmp_path, staleness, slow, trainer=chunk(k)).best for k in (1, 2, 3, 4, 10)]
    handoffs, periods = [e.handoff_seconds for e in plans], [e.period for e in plans]
    assert handoffs == sorted(handoffs, reverse=True) and periods == sorted(periods, reverse=True)
    assert handoffs[0] > handoffs[-1]  # every iteration the commit binds; every 10 it does not


def test_a_trainer_per_iteration_is_planned_as_before(tmp_path: Path) -> None:
    """The default shape: every step time as the planner had it (overhead + update + the whole state's I/O; publish
    reads the state and writes the checkpoint), whatever the chunk shape's rates say; the plan equals the one that
    names its lifetime, and those rates are not among its inputs."""
    plain = stated_plan(tmp_path, 1, SHAPED)
    named = stated_plan(tmp_path, 1, SHAPED, trainer={"lifetime": "iteration"})
    assert plain.setup.lifetime == "iteration" and plain.setup.lifetime_source.startswith("config: ")
    best = plain.best
    assert best.step_seconds == pytest.approx(
        {"rollout": 55, "reward": 5, "train": 47 + 40 + STATE_GB * 0.2, "publish": 30, "evaluate": 0}
    )
    assert best.paid.chunk_iterations is None and best.paid.background_commit == 0
    assert_same_options(plain, named)
    trainer_rates = {"trainer_commit_seconds_per_gb", "delta_write_seconds_per_gb", "train_iteration_overhead_seconds"}
    assert not (trainer_rates | {"state_every"}) & set(plain.setup.figures)


def test_a_chunk_trainers_unstated_delta_write_is_assumed_as_measured_and_said_so(tmp_path: Path) -> None:
    """Each rank writes its share's delta: one rank's measured 3.03 s for its 7.48 GB, a node's 8 side by side."""
    unstated = {k: v for k, v in SHAPED.items() if k != "delta_write_seconds_per_gb"}
    plan = stated_plan(tmp_path, 0, unstated, trainer=chunk())
    figure = plan.setup.figures["delta_write_seconds_per_gb"]
    assert figure.value == pytest.approx(3.03 / 7.48 / 8) and figure.source.startswith("assumed: ")
    assert plan.best.paid.parts["delta_write"] == pytest.approx(CHECKPOINT_GB * 3.03 / 7.48 / 8)


def test_the_handoff_column_is_the_sum_of_its_parts_on_the_critical_path(tmp_path: Path) -> None:
    """Each part counts as often as its step comes on the critical cycle, over the iterations the cycle spans."""
    paths = set()
    for staleness, shape in ((0, None), (1, None), (0, chunk(4)), (1, chunk(4))):
        target = {"trainer": shape} if shape else {}
        plan = stated_plan(tmp_path, staleness, SHAPED, **target)
        data = plan_json(plan)
        for e, option in zip(plan.evaluated, data["options"], strict=True):
            assert e.handoff_seconds == pytest.approx(sum(e.handoff.values()))
            handoff = option["handoff"]
            assert handoff["seconds_on_critical_path"] == pytest.approx(sum(handoff["parts_on_critical_path"].values()))
            assert handoff["paid_per_iteration"] == pytest.approx(e.paid.parts)
        header = next(line for line in plan_table(plan).splitlines() if "period s" in line)
        assert header.split().index("handoff") == header.split().index("period") + 2
        best = plan.best
        if best.critical_path.endswith("(over 2 iterations)"):  # the round trip at staleness 1: every part, halved
            assert best.handoff == pytest.approx({part: s / 2 for part, s in best.paid.parts.items()})
        elif best.critical_path == "train -> train":  # the trainer's parts alone
            on_train = {part: s if best.paid.steps[part] == "train" else 0 for part, s in best.paid.parts.items()}
            assert best.handoff == pytest.approx(on_train)
        else:
            assert best.handoff == pytest.approx(best.paid.parts)  # synchronous: each step once an iteration
        paths.add(best.critical_path)
        json.dumps(data)  # the JSON output is plain data
    assert paths == {
        "publish -> rollout -> reward -> train -> publish",
        "publish -> rollout -> reward -> train -> publish (over 2 iterations)",
        "train -> train",
    }
    # A pool's own cycle holds that step's parts alone: rollout-bound, the rollout's; train-bound, the trainer's.
    rollout_bound = stated_plan(tmp_path, 1, rates(400, 12, 0.0125, 12500, 16, 0)).best
    assert rollout_bound.critical_path == "rollout ~> rollout"
    assert rollout_bound.handoff == {
        "trainer_state": 0,
        "checkpoint_write": 0,
        "engine_start": 12,
        "checkpoint_fetch": 0,
    }
    train_bound = stated_plan(tmp_path, 1, rates(4000, 10, 0.0125, 1250, 60, 0)).best
    assert train_bound.critical_path == "train -> train"
    # Its 60 s of overhead are the train step's compute and set-up: on the path, but not handoff (no state rate).
    assert train_bound.handoff_seconds == 0 and train_bound.paid.trainer_overhead == 60


@pytest.mark.parametrize("shape", [None, chunk(4)])
def test_the_trainers_start_up_and_overhead_are_not_handoff(tmp_path: Path, shape: dict | None) -> None:
    """Issue 38's handoff is state I/O, engine start and the policy's way: 100 s more of trainer overhead lengthen
    the train step by 100 s and leave every part of the handoff as it was. A chunk trainer's start-up grows by 100 s
    once a chunk: its 132 s outlast slot 1's 40 s of generating by 92 s, the train step's overhead, and delay the
    state's fetch, which ended 28.6 s after it and now 36.6 s, by 8 s, state I/O's."""
    target = {"trainer": shape} if shape else {}
    plans = [stated_plan(tmp_path, 0, SHAPED | {"train_overhead_seconds": o}, **target).best for o in (47, 147)]
    less, more = plans
    c = less.paid.chunk_iterations or 1
    assert more.step_seconds["train"] == pytest.approx(less.step_seconds["train"] + 100 / c)
    late_fetch = 8 / c if shape else 0
    assert more.paid.trainer_overhead == pytest.approx(less.paid.trainer_overhead + 100 / c - late_fetch)
    assert more.paid.parts == pytest.approx(
        less.paid.parts | {"trainer_state": less.paid.parts["trainer_state"] + late_fetch}
    )
    assert "trainer_overhead" not in less.paid.parts and less.handoff_seconds == pytest.approx(
        sum(less.paid.parts.values())
    )


def test_locally_a_chunk_is_the_whole_run(tmp_path: Path) -> None:
    stated = BALANCED | {
        "publish_seconds_per_gb": 0,
        "trainer_state_seconds_per_gb": 0.02,
        "trainer_commit_seconds_per_gb": 0.01,
        "train_iteration_overhead_seconds": 5,
        "train_overhead_seconds": 29,
    }
    plan = stated_plan(tmp_path, 0, stated, gpu="local", shards=2, cores=2, trainer=chunk(), iterations=12)
    best = plan.best
    assert best.paid.chunk_iterations == 12 and plan.setup.figures["chunk_iterations"].value == 12
    assert best.paid.trainer_overhead == pytest.approx(5 + 24 / 12)
    assert best.handoff_seconds == pytest.approx(sum(best.handoff.values())) and best.handoff_seconds > 0


def test_bad_shapes_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(MoeloopError, match="trainer.state_every 4 needs trainer.lifetime chunk"):
        stated_plan(tmp_path, 0, SHAPED, trainer={"state_every": 4})
    unsplit = {k: v for k, v in SHAPED.items() if k != "trainer_commit_seconds_per_gb"}
    with pytest.raises(
        MoeloopError, match="needs the trainer state's I/O apart .*: state trainer_commit_seconds_per_gb"
    ):
        stated_plan(tmp_path, 0, unsplit, trainer=chunk())
    with pytest.raises(
        MoeloopError, match="train_iteration_overhead_seconds 50 is more than train_overhead_seconds 47"
    ):
        stated_plan(tmp_path, 0, SHAPED | {"train_iteration_overhead_seconds": 50}, trainer=chunk())
    with pytest.raises(MoeloopError, match="the commit half of trainer_state_seconds_per_gb"):
        stated_plan(tmp_path, 0, SHAPED | {"trainer_commit_seconds_per_gb": 0.3}, trainer=chunk())
    # Unstated, the overhead that recurs is all of it: the start-up saved is not credited, and the source says so.
    plain = {k: v for k, v in SHAPED.items() if k != "train_iteration_overhead_seconds"}
    plan = stated_plan(tmp_path, 0, plain, trainer=chunk())
    assert plan.setup.figures["train_iteration_overhead_seconds"].source.startswith("assumed: all of")
    assert plan.best.paid.trainer_overhead == pytest.approx(47)
