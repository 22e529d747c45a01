"""The asynchronous loop (`rollout.max_staleness`): the DAG and its render, which policy a rollout samples
with, the local runner overlapping rollout and train, the metrics' staleness and balance, `moeloop report`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.compute as pc
import pytest

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.publish import publish
from moeloop.steps.reward import reward
from moeloop.steps.rollout import rollout
from moeloop.steps.start import start
from moeloop.steps.storage.experience import read_rollouts
from moeloop.steps.storage.run import RunStorage
from moeloop.steps.train import train
from tests.conftest import REPO, SMALL_TRANSFORMERS_ROLLOUT, eval_reward_gain, small_config
from tests.processes import moeloop_cli
from moeloop.workflows.dag import loop_tasks, run_uri
from moeloop.workflows.local.runner import run_local
from moeloop.workflows.render.chunk import chunk_tasks, dag_tasks
from moeloop.workflows.render.loop import render


def dependencies(config, iterations: int) -> dict[str, set[str]]:
    return {t.name: set(t.dependencies) for t in loop_tasks(config, iterations)}


def ancestors(graph: dict[str, set[str]], name: str) -> set[str]:
    found, todo = set(), list(graph[name])
    while todo:
        if (task := todo.pop()) not in found:
            found.add(task)
            todo += graph[task]
    return found


def test_synchronous_dag_is_unchanged() -> None:
    graph = dependencies(small_config(rollout={"num_shards": 2}), 3)
    for i in range(1, 4):
        policy = "start" if i == 1 else f"it{i - 1}-publish"
        assert graph[f"it{i}-rollout-0"] == graph[f"it{i}-rollout-1"] == {policy}
        assert graph[f"it{i}-reward"] == {f"it{i}-rollout-0", f"it{i}-rollout-1"}
        assert graph[f"it{i}-train"] == {f"it{i}-reward"}
        assert graph[f"it{i}-publish"] == {f"it{i}-train"}
        assert graph[f"it{i}-eval"] == {f"it{i}-publish"}


@pytest.mark.parametrize("staleness", [1, 2])
def test_rollouts_run_ahead_of_training_by_the_staleness(staleness: int) -> None:
    config = small_config(rollout={"num_shards": 2, "max_staleness": staleness})
    graph = dependencies(config, 6)
    for i in range(1, 7):
        version = max(0, i - 1 - staleness)
        assert config.rollout.policy_version(i) == version
        assert graph[f"it{i}-rollout-1"] == {f"it{version}-publish" if version else "start"}
        # Rollout i+1 does not wait for train i: they can run at the same time.
        assert f"it{i - 1}-train" not in ancestors(graph, f"it{i}-rollout-0")
        if i > 1:  # train and publish follow their predecessors, which the rollouts no longer imply
            assert graph[f"it{i}-train"] == {f"it{i}-reward", f"it{i - 1}-train"}
            assert graph[f"it{i}-publish"] == {f"it{i}-train", f"it{i - 1}-publish"}


def test_rendered_chunk_shows_rollout_after_publish_i_minus_1_not_train_i() -> None:
    config = small_config(iterations=4, rollout={"num_shards": 2, "max_staleness": 1})
    rendered = dag_tasks(render(config, "s3://bucket/runs/tiny")["workflow-template.yaml"])
    slots = {t.name: tuple(sorted(t.dependencies)) for t in chunk_tasks(config)}
    assert {name: rendered[name] for name in slots} == slots
    graph = {name: set(deps) for name, deps in rendered.items()}
    assert graph["slot3-rollout"] == {"slot1-publish"}
    assert "slot2-train" not in ancestors(graph, "slot3-rollout")
    assert "slot2-train" in ancestors(graph, "slot3-train")


def test_staleness_is_validated() -> None:
    data = small_config().model_dump()
    data["rollout"]["max_staleness"] = -1
    with pytest.raises(ValueError, match="max_staleness"):
        MoeloopConfig.model_validate(data)


def test_rollout_samples_with_the_stale_policy_whatever_is_published_later(run_root: Path) -> None:
    """With staleness 1, rollout 3 samples with checkpoint 1, also when it runs again after checkpoint 2 exists.
    The steps run in this process (which policy a rollout takes does not depend on the process it runs in)."""
    shards = {**SMALL_TRANSFORMERS_ROLLOUT, "num_shards": 1, "max_staleness": 1}  # small_config's batch, one shard
    config = small_config(iterations=3, rollout=shards)
    uri = run_uri(config, str(run_root))
    storage = RunStorage(uri)
    steps = {"reward": reward, "train": train, "publish": publish}
    start(uri, config)
    rollout(uri, 1, 0, 1)
    rollout(uri, 2, 0, 1)  # before any publish: version 0
    for name in ("reward", "train", "publish"):
        steps[name](uri, 1)
    rollout(uri, 3, 0, 1)  # before checkpoint 2 exists
    first = storage.read_bytes(storage.rollout_shard(3, 0, 1))
    for name, iteration in (("reward", 2), ("reward", 3), ("train", 2), ("publish", 2)):
        steps[name](uri, iteration)
    assert storage.latest()["iteration"] == 2
    (run_root / config.run_name / storage.rollout_shard(3, 0, 1)).unlink()
    rollout(uri, 3, 0, 1)  # again, with checkpoint 2 published: the same version, the same samples
    assert storage.read_bytes(storage.rollout_shard(3, 0, 1)) == first
    assert storage.read_json(storage.report(3, "rollout-0"))["policy_version"] == 1
    for i, version in ((1, 0), (2, 0), (3, 1)):
        assert set(read_rollouts(storage, i, 1)["policy_version"].to_pylist()) == {version}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    """A finished 3-iteration run with staleness 1, by the local runner, three steps at a time."""
    folder = tmp_path_factory.mktemp("async")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("MOELOOP_CACHE", str(folder / "cache"))
    # small_config's batch: train 2 starts as train 1 ends and rollout 3 once publish 1 has, a second later, so the
    # two overlap at this size too
    config = small_config(
        iterations=3, rollout={**SMALL_TRANSFORMERS_ROLLOUT, "max_staleness": 1}, local={"parallelism": 3}
    )
    uri = run_uri(config, str(folder / "runs"))
    try:
        executed = run_local(config, uri, folder / "logs", progress=False)
    finally:
        monkeypatch.undo()
    return uri, executed


def test_local_runner_overlaps_rollout_and_train(async_run: tuple[str, list]) -> None:
    uri, executed = async_run
    by_name = {t.name: t for t in executed}
    assert set(by_name) == {t.name for t in loop_tasks(small_config(iterations=3))}
    train_2, rollout_3 = by_name["it2-train"], by_name["it3-rollout-0"]
    # Rollout 3 (policy 1) started before train 2 ended: the two ran at the same time.
    assert rollout_3.started_at < train_2.started_at + train_2.seconds
    assert by_name["it1-publish"].started_at + by_name["it1-publish"].seconds <= rollout_3.started_at
    # Each shard's worker kept its engine across iterations, loading checkpoint 1 in place for iteration 3.
    storage = RunStorage(uri)
    for i in (2, 3):
        assert storage.read_json(storage.report(i, "rollout-0"))["engine_reused"] is True


def test_metrics_record_staleness_durations_and_waits(async_run: tuple[str, list]) -> None:
    uri, _ = async_run
    storage = RunStorage(uri)
    metrics = [storage.read_json(storage.metrics(i)) for i in range(4)]
    assert [m["staleness"] for m in metrics] == [None, 0, 1, 1]
    for i in (1, 2, 3):
        versions = pc.unique(read_rollouts(storage, i, 2)["policy_version"]).to_pylist()
        assert [metrics[i]["staleness"]] == [i - 1 - v for v in versions]

    def report(i: int, name: str) -> dict:
        return storage.read_json(storage.report(i, name))

    for i in (1, 2, 3):
        m = metrics[i]
        reports = {name: report(i, name) for name in ("rollout-0", "rollout-1", "reward", "train", "publish")}
        for r in reports.values():
            assert r["started_at"] <= r["ended_at"]
            assert r["ended_at"] - r["started_at"] == pytest.approx(r["seconds"], abs=2e-3)
        assert m["rollout_seconds"] == max(reports["rollout-0"]["seconds"], reports["rollout-1"]["seconds"])
        assert m["step_seconds"]["train"] == reports["train"]["seconds"]
        # A step's wait: from its own end one iteration earlier (the start's, at iteration 1) to its start.
        for name in ("rollout-0", "rollout-1", "reward", "train"):
            before = report(i - 1, name if i > 1 else "start")
            assert m["wait_seconds"][name] == pytest.approx(
                max(0.0, reports[name]["started_at"] - before["ended_at"]), abs=2e-3
            )
        assert m["rollout_wait_seconds"] == min(m["wait_seconds"]["rollout-0"], m["wait_seconds"]["rollout-1"])
        before = report(i - 1, "publish" if i > 1 else "start")
        assert m["iteration_seconds"] == pytest.approx(reports["publish"]["ended_at"] - before["ended_at"], abs=2e-3)
    assert metrics[0]["wait_seconds"] is None and metrics[0]["iteration_seconds"] is None


def test_report_prints_each_iteration(async_run: tuple[str, list]) -> None:
    uri, _ = async_run
    storage = RunStorage(uri)
    done = moeloop_cli("report", uri, check=True)
    header, *rows = done.stdout.splitlines()
    assert header.split()[:2] == ["iter", "staleness"] and header.split()[-4:] == ["eval", "reward", "greedy", "pass@1"]
    assert [row.split()[:2] for row in rows] == [["0", "-"], ["1", "0"], ["2", "1"], ["3", "1"]]
    for i, row in enumerate(rows):
        metrics = storage.read_json(storage.metrics(i))
        assert row.split()[-2:] == [f"{metrics['eval_reward_mean']:.3f}", f"{metrics['eval_pass_at_1']:.3f}"]
        if i:
            assert row.split()[4] == f"{metrics['step_seconds']['train']:.1f}"
            assert row.split()[7] == f"{metrics['wait_seconds']['train']:.1f}"


def test_report_reads_only_committed_metrics(async_run: tuple[str, list], tmp_path: Path) -> None:
    """A copy of the run whose iteration 3 is being evaluated (its metrics half-written under a temporary
    name): the table stops at iteration 2."""
    uri, _ = async_run
    copy = tmp_path / "copy"
    shutil.copytree(uri, copy)
    metrics = copy / "metrics" / "iter-000003.json"
    metrics.with_name(f"{metrics.name}.tmp-0123").write_bytes(metrics.read_bytes()[:20])
    metrics.unlink()
    done = moeloop_cli("report", str(copy))
    assert done.returncode == 0, done.stderr
    assert [row.split()[0] for row in done.stdout.splitlines()[1:]] == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("run", "message"),
    [("runs/no-such-run", "run does not exist"), ("ftp://host/run", "unsupported storage URI scheme")],
)
def test_report_of_a_bad_run_is_one_line(tmp_path: Path, run: str, message: str) -> None:
    done = moeloop_cli("report", run, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith(f"error: {message}") and done.stderr.count("\n") == 1


# The demo at staleness 1 learns in these of its 24 iterations: greedy eval_reward_mean from the SFT checkpoint's
# 0.509 to 0.773 after 16, a gain of 0.264 against the 0.2 asked (measured in a CI run of `make test`; after 12:
# 0.736, after 20: 0.796, after 24: 0.787).
STALE_DEMO_ITERATIONS = 16


def test_demo_learns_with_staleness_1(run_root: Path) -> None:
    """The loop issue's measure with rollouts one iteration ahead: after STALE_DEMO_ITERATIONS of the demo's,
    eval_reward_mean beats the SFT checkpoint's by 0.2. At half the demo's learning rate: at the demo's own the
    stale updates overshoot (workflows/README.md, "The asynchronous loop")."""
    config = load_config(REPO / "configs" / "tiny.yaml")
    data = config.model_dump()
    data["iterations"] = STALE_DEMO_ITERATIONS
    data["rollout"]["max_staleness"] = 1
    data["trainer"]["learning_rate"] = config.trainer.learning_rate / 2
    config = MoeloopConfig.model_validate(data)
    uri = run_uri(config, str(run_root))
    run_local(config, uri, run_root / "logs", progress=False)
    storage = RunStorage(uri)
    start, last = eval_reward_gain(storage, config.iterations, "tiny.yaml at staleness 1")
    assert storage.read_json(storage.metrics(config.iterations))["staleness"] == 1
    assert last >= start + 0.2
