"""The planner's rollout engines that live for a chunk (rollout.lifetime chunk, workflows/capacity/handoff.py): each
shard pays its engine's start and the whole checkpoint once a chunk, and every iteration the new policy's delta,
fetched, written in place and checked beside the generating; engines per iteration are planned as before."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moeloop.steps.errors import MoeloopError
from moeloop.workflows.capacity.explain import plan_json, plan_table
from tests.unit.test_capacity import BALANCED, CHECKPOINT_GB, stated_plan
from tests.unit.test_capacity_lifetime import SHAPED, STATE_GB, assert_same_options, chunk

# Engines start in 15 s (rollout_overhead_seconds), checkpoints and deltas are fetched at 0.5 s/GB; an engine writes
# a delta in place at 0.4 s/GB of checkpoint and checks its digest at 0.3 s/GB; 2% of elements change an update.
ENGINES = SHAPED | {
    "fetch_seconds_per_gb": 0.5,
    "delta_apply_seconds_per_gb": 0.4,
    "delta_check_seconds_per_gb": 0.3,
    "delta_changed_fraction": 0.02,
}
ROLLOUT_CHUNK = {"rollout": {"lifetime": "chunk"}}


def test_engines_per_chunk_pay_their_start_and_the_checkpoint_once_a_chunk(tmp_path: Path) -> None:
    """configs/tiny.yaml's chunk: 20 iterations at 2 shards and at 8 (5 tasks an iteration at any shard count, its
    shards one task of K items; 38 would fit beside the chunk's 5 and the engines' start task: (200 - 6) // 5). A
    shard pays 15 / C of engine start and 30.5 / C of checkpoint (its digest check after the load beside the
    generating, as a delta's), the delta's 2 x 2% of 61.06 GB at 0.5 s/GB and 61.06 GB x 0.4 s/GB of apply, then
    generates, the delta's digest check (18.3 s) beside it: only a check longer than the
    generating (61.06 GB at 1 s/GB against 40 s) adds what outlasts it. The delta's 15 files (61.06 GB in 4 GiB
    files) are fetched one after another and each written in as it arrives: of the fetch, shorter than the
    writing, only the first file's share is on the step's path."""
    for shards, c, generate, check in ((2, 20, 160, 0.3), (8, 20, 40, 0.3), (8, 20, 40, 1.0)):
        rates = ENGINES | {"delta_check_seconds_per_gb": check}
        plan = stated_plan(tmp_path, 0, rates, shards=shards, **ROLLOUT_CHUNK)
        best = plan.best
        assert plan.setup.rollout_lifetime == "chunk" and best.paid.chunk_iterations == c
        delta_gb = CHECKPOINT_GB * 2 * 0.02
        assert plan.setup.value("delta_gb") == pytest.approx(delta_gb)
        assert plan.setup.value("delta_files") == 15 == math.ceil(CHECKPOINT_GB * 1e9 / 2**32)
        rollout = {
            "engine_start": 15 / c,
            "checkpoint_fetch": CHECKPOINT_GB * 0.5 / c,  # its check, as a delta's, beside the generating
            "delta_fetch": delta_gb * 0.5 / 15,
            "delta_apply": CHECKPOINT_GB * 0.4,
            "delta_check": max(0.0, CHECKPOINT_GB * check - generate),
        }
        assert {part: best.paid.parts[part] for part in rollout} == pytest.approx(rollout)
        assert {part for part, step in best.paid.steps.items() if step == "rollout"} == set(rollout)
        assert best.step_seconds["rollout"] == pytest.approx(sum(rollout.values()) + generate)
        # The trainer is the config's, per iteration: its parts as ever, publish writing the checkpoint.
        assert best.paid.parts["trainer_state"] == pytest.approx(STATE_GB * 0.2)
        assert best.step_seconds["publish"] == pytest.approx(30)
        # A new engine after a reclaim pays its start and the whole checkpoint, not their share nor the delta.
        assert best.paid.restart == pytest.approx(
            15 + CHECKPOINT_GB * 0.5 * (1 - 1 / c) - 15 / c - delta_gb * 0.5 / 15
        )
        synchronous = 5 + best.step_seconds["rollout"] + 5 + 5 + 5 + best.step_seconds["train"] + 5 + 30
        assert best.period == pytest.approx(synchronous)
        assert best.handoff == pytest.approx(best.paid.parts)  # synchronous: every step once an iteration


def test_with_a_trainer_and_engines_per_chunk_the_checkpoints_commit_is_off_the_synchronous_path(
    tmp_path: Path,
) -> None:
    """The trainer answers train once the delta is committed, the engines take the delta, and the next rollouts
    hang off train: the checkpoint's commit (61.06 GB at 0.1 s/GB), which publish waits for, runs beside them. At
    staleness 0 the period is the round trip without publish, and the handoff on it lacks the commit; with engines
    per iteration the rollouts load the checkpoint after publish, and the commit is on the path."""
    shape = ROLLOUT_CHUNK | {"trainer": chunk(4)}
    best = stated_plan(tmp_path, 0, ENGINES, **shape).best
    commit = CHECKPOINT_GB * 0.1
    assert best.paid.steps["checkpoint_write"] == "publish" and best.paid.parts["checkpoint_write"] == pytest.approx(
        commit
    )
    assert best.step_seconds["publish"] == pytest.approx(commit)
    assert best.critical_path == "train -> rollout -> reward -> train"
    assert best.period == pytest.approx(5 + best.step_seconds["rollout"] + 5 + 5 + 5 + best.step_seconds["train"])
    assert best.handoff == pytest.approx(best.paid.parts | {"checkpoint_write": 0})
    loading = stated_plan(tmp_path, 0, ENGINES, trainer=chunk(4)).best
    assert loading.critical_path == "publish -> rollout -> reward -> train -> publish"
    assert loading.handoff["checkpoint_write"] == pytest.approx(commit)


def test_engines_per_iteration_pay_it_all_every_iteration_as_before(tmp_path: Path) -> None:
    """rollout.lifetime iteration, named or the config's: engine start and the whole checkpoint every iteration, no
    delta, the delta's rates not among the inputs even where stated, and the plans alike."""
    plain = stated_plan(tmp_path, 1, ENGINES)
    named = stated_plan(tmp_path, 1, ENGINES, rollout={"lifetime": "iteration"})
    assert plain.setup.rollout_lifetime == "iteration"
    assert plain.setup.rollout_lifetime_source.startswith("config: ")
    assert named.setup.rollout_lifetime_source.startswith("stated: ")
    best = plain.best
    assert best.paid.chunk_iterations is None and best.paid.restart == 0
    assert best.paid.parts == pytest.approx(
        {
            "trainer_state": STATE_GB * 0.2,
            "checkpoint_write": 30,
            "engine_start": 15,
            "checkpoint_fetch": CHECKPOINT_GB * 0.5,
        }
    )
    assert best.step_seconds["rollout"] == pytest.approx(15 + CHECKPOINT_GB * 0.5 + 40)
    assert_same_options(plain, named)
    delta_figures = {"delta_changed_fraction", "delta_apply_seconds_per_gb", "delta_check_seconds_per_gb", "delta_gb",
                     "delta_files"}  # fmt: skip
    assert not (delta_figures | {"chunk_iterations"}) & set(plain.setup.figures)


@pytest.mark.parametrize("trainer", [None, chunk(4)])
def test_the_delta_scales_with_the_changed_fraction(tmp_path: Path, trainer: dict | None) -> None:
    """Twice the elements changed, twice the delta's bytes and fetch (its first file's share on the path, the rest
    beside the writing); its in-place write and digest check are per GB of checkpoint (the digest reads every weight),
    and nothing else moves. A delta of half the elements or more is no smaller than the checkpoint: publish leaves it
    out, and the engines fetch the whole checkpoint's bytes, a fetch now longer than the writing: all of it on the
    path, and of the writing only the last file's share."""
    shape = ROLLOUT_CHUNK | ({"trainer": trainer} if trainer else {})
    paid = {}
    for fraction in (0.01, 0.02, 0.04, 0.6):
        plan = stated_plan(tmp_path, 0, ENGINES | {"delta_changed_fraction": fraction}, **shape)
        paid[fraction] = plan.best.paid.parts
        assert plan.setup.figures["delta_changed_fraction"].source.startswith("stated: ")
    for fraction in (0.01, 0.02, 0.04):
        assert paid[fraction]["delta_fetch"] == pytest.approx(CHECKPOINT_GB * 2 * fraction * 0.5 / 15)
        others = {part: s for part, s in paid[fraction].items() if part != "delta_fetch"}
        assert others == pytest.approx({part: s for part, s in paid[0.01].items() if part != "delta_fetch"})
    assert paid[0.04]["delta_fetch"] == pytest.approx(4 * paid[0.01]["delta_fetch"])
    assert paid[0.6]["delta_fetch"] == pytest.approx(CHECKPOINT_GB * 0.5)
    assert paid[0.6]["delta_apply"] == pytest.approx(CHECKPOINT_GB * 0.4 / 15)


def test_unstated_delta_rates_are_assumed_as_measured_and_say_so(tmp_path: Path) -> None:
    stated = {k: v for k, v in ENGINES.items() if not k.startswith("delta_")}
    figures = stated_plan(tmp_path, 0, stated, **ROLLOUT_CHUNK).setup.figures
    assert figures["delta_changed_fraction"].value == 0.015
    assert "issue 38" in figures["delta_changed_fraction"].source and "1e-6" in figures["delta_changed_fraction"].source
    assert figures["delta_apply_seconds_per_gb"].value == pytest.approx(1.73 / 61.06)
    assert figures["delta_check_seconds_per_gb"].value == pytest.approx(2.99 / 61.06)
    for rate in ("delta_apply_seconds_per_gb", "delta_check_seconds_per_gb"):
        source = figures[rate].source
        assert source.startswith("assumed: benchmarks/handoff.md") and "measured" in source and "H100" in source
    with pytest.raises(MoeloopError, match="rates.delta_changed_fraction"):
        stated_plan(tmp_path, 0, ENGINES | {"delta_changed_fraction": 1.5}, **ROLLOUT_CHUNK)


def test_a_reclaimed_shard_starts_a_new_engine(tmp_path: Path) -> None:
    """0.5 reclaims an hour on the one rollout node: the shard (5 s start + its run R) is lost with probability
    1 - exp(-0.5 (5 + R) / 3600) and ends (5 + R) / 2 + 330 s of restart + the new engine's start and checkpoint
    beyond R's share of them later."""
    best = stated_plan(tmp_path, 0, ENGINES, interruptions=0.5, **ROLLOUT_CHUNK).best
    run = sum(s for part, s in best.paid.parts.items() if best.paid.steps[part] == "rollout") + 40
    lost = 1 - math.exp(-0.5 * (5 + run) / 3600)
    assert best.spot_retry_seconds == pytest.approx(lost * ((5 + run) / 2 + 330 + best.paid.restart))
    assert best.paid.restart > 0


def test_the_column_is_the_sum_of_its_parts_with_every_shape(tmp_path: Path) -> None:
    """Engines and trainer, each per iteration or per chunk, at staleness 0 and 1: the column is the sum of its
    parts on the path, in the table, the JSON and the lines under it."""
    for staleness in (0, 1):
        for trainer in (None, chunk(4)):
            for engines in ("iteration", "chunk"):
                shape = {"rollout": {"lifetime": engines}} | ({"trainer": trainer} if trainer else {})
                plan = stated_plan(tmp_path, staleness, ENGINES, **shape)
                data = plan_json(plan)
                for e, option in zip(plan.evaluated, data["options"], strict=True):
                    assert e.handoff_seconds == pytest.approx(sum(e.handoff.values()))
                    assert set(e.handoff) == set(e.paid.parts)
                    handoff = option["handoff"]
                    assert handoff["seconds_on_critical_path"] == pytest.approx(
                        sum(handoff["parts_on_critical_path"].values())
                    )
                assert data["rollout"]["lifetime"] == engines
                json.dumps(data)
                table = plan_table(plan)
                line = next(line for line in table.splitlines() if "handoff on the critical path" in line)
                total, parts = line.split(": ", 1)[1].split(" = ")
                assert float(total) == pytest.approx(
                    sum(float(p.rsplit(" ", 1)[1]) for p in parts.split(" + ")), abs=0.3
                )
                assert f"rollout engines: lifetime {engines}" in table


def test_locally_the_engines_live_for_the_run(tmp_path: Path) -> None:
    stated = BALANCED | {"delta_apply_seconds_per_gb": 0.01, "delta_changed_fraction": 0.015}
    plan = stated_plan(tmp_path, 0, stated, gpu="local", shards=2, cores=2, iterations=12, **ROLLOUT_CHUNK)
    best = plan.best
    assert best.paid.chunk_iterations == 12 and plan.setup.figures["chunk_iterations"].value == 12
    assert best.paid.parts["engine_start"] == pytest.approx(15 / 12)
    assert best.handoff_seconds == pytest.approx(sum(best.handoff.values())) and best.handoff_seconds > 0


def test_a_new_engines_start_hides_its_checkpoints_fetch_but_for_a_load_as_long_as_the_fetch(tmp_path: Path) -> None:
    """A new engine starts on dummy weights beside its checkpoint's fetch (30.53 s: 61.06 GB at 0.5 s/GB) and loads
    them after: the load, within the start E and taken as long as the fetch, is what the start cannot hide. A 15 s
    start hides none of the fetch, a 45 s one 30 s of it (the start's 45 - 30.53 s before the load), one of twice
    the fetch or more all of it. Engines per chunk pay the same once a chunk; a reclaimed shard's new engine again. A
    local plan's engines, on CPUs, hide none."""
    fetch = CHECKPOINT_GB * 0.5
    for start, unhidden in ((15, fetch), (45, 2 * fetch - 45), (2 * fetch, 0.0), (120, 0.0)):
        rates = ENGINES | {"rollout_overhead_seconds": start}
        best = stated_plan(tmp_path, 1, rates).best
        assert best.paid.parts["engine_start"] == pytest.approx(start)
        assert best.paid.parts["checkpoint_fetch"] == pytest.approx(unhidden)
        assert best.step_seconds["rollout"] == pytest.approx(start + unhidden + 40)
        per_chunk = stated_plan(tmp_path, 0, rates, shards=8, **ROLLOUT_CHUNK).best.paid
        c = per_chunk.chunk_iterations
        assert per_chunk.parts["checkpoint_fetch"] == pytest.approx(unhidden / c)
        delta_fetch = per_chunk.parts["delta_fetch"]
        assert per_chunk.restart == pytest.approx(max(0.0, (start + unhidden) * (1 - 1 / c) - delta_fetch))
    # Locally, on CPUs, an engine starts after its fetch (steps/engines/engine.py `starts_beside_fetch`): none hidden.
    rates = ENGINES | {"rollout_overhead_seconds": 120}
    local = stated_plan(tmp_path, 0, rates, gpu="local", shards=2, cores=2, iterations=12, **ROLLOUT_CHUNK).best.paid
    assert local.parts["checkpoint_fetch"] == pytest.approx(fetch / 12)
