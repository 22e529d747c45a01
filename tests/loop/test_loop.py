"""The loop end to end: the local runner executes the rendered DAG, resumes from LATEST, and publishes
checkpoints that transformers loads with the trainer's logits."""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from moeloop.steps.publish import publish
from moeloop.steps.reward import reward
from moeloop.steps.rollout import rollout
from moeloop.steps.start import start
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.run import RunStorage
from moeloop.steps.rl.state import update_policy
from moeloop.steps.train import train
from tests.argo_substitution import expanded_tasks
from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, small_config
from moeloop.workflows.dag import loop_tasks, run_uri, run_values
from moeloop.workflows.local import launch
from moeloop.workflows.local.ready import worker_slot
from moeloop.workflows.local.runner import run_local
from moeloop.workflows.local.workers import StepWorker
from moeloop.workflows.render.chunk import node_name
from moeloop.workflows.render.loop import render
from moeloop.workflows.render.step_templates import step_placeholders

def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def rendered_commands(document: dict) -> dict[str, list[str]]:
    """Each step template's command and args, as the pod would run them."""
    templates = {t["name"]: t for t in document["spec"]["templates"] if "container" in t}
    return {name: t["container"]["command"] + t["container"].get("args", []) for name, t in templates.items()}


def rendered_chunk(document: dict) -> dict[str, dict]:
    [chunk] = [t for t in document["spec"]["templates"] if t["name"] == document["spec"]["entrypoint"]]
    return {task["name"]: task for task in chunk["dag"]["tasks"]}


def substitute(argv: list[str], values: dict[str, str]) -> list[str]:
    for name, value in values.items():
        argv = [
            a.replace(f"{{{{workflow.parameters.{name}}}}}", value).replace(f"{{{{inputs.parameters.{name}}}}}", value)
            for a in argv
        ]
    return argv


def run_data(root: Path) -> dict[str, str]:
    """A run's files but those that differ between two runs of the same data: step reports, metrics and their
    TensorBoard files carry timings, and config.yaml the workers setting itself."""
    return {
        path: digest
        for path, digest in snapshot(root).items()
        if path.split("/")[1] not in ("reports", "metrics", "tensorboard", "config.yaml")
    }


@dataclass
class WorkersRun:
    """A 2-iteration run by the local runner with its long-lived workers (local.workers, the default): the tasks
    it executed, the workers it started, its logs, and its data as the run left it."""

    root: Path
    uri: str
    executed: list
    started: list[StepWorker]
    logs: Path
    data: dict[str, str]


@pytest.fixture(scope="module")
def workers_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkersRun]:
    """The run both tests below look at (one run rather than one each): the first runs the same one again and
    extends it, the second compares its data, taken here, with a fresh process per task's."""
    folder = tmp_path_factory.mktemp("workers")
    started: list[StepWorker] = []

    class CountedWorker(StepWorker):
        def __init__(self, environment: dict[str, str]):
            super().__init__(environment)
            started.append(self)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("MOELOOP_CACHE", str(folder / "cache"))
    monkeypatch.setattr(launch, "StepWorker", CountedWorker)  # where the runner makes its workers
    try:
        config = small_config(iterations=2, rollout=SMALL_TRANSFORMERS_ROLLOUT, local={"workers": True})
        root = folder / "workers-True"
        uri = run_uri(config, str(root))
        executed = run_local(config, uri, folder / "logs-True", progress=False)
    finally:
        monkeypatch.undo()
    yield WorkersRun(root, uri, executed, list(started), folder / "logs-True", run_data(root))


@pytest.mark.usefixtures("private_cache")
def test_local_run_executes_the_rendered_dag_and_resumes_from_latest(workers_run: WorkersRun, tmp_path: Path) -> None:
    # small_config's with local.workers (its default) and the transformers engine; vLLM's runs: test_demo.py,
    # test_async.py
    config = small_config(iterations=2, rollout=SMALL_TRANSFORMERS_ROLLOUT)
    assert config == small_config(iterations=2, rollout=SMALL_TRANSFORMERS_ROLLOUT, local={"workers": True})
    run_root, uri, executed = workers_run.root, workers_run.uri, workers_run.executed

    # The Argo chunk (a WorkflowTemplate whose slot j runs LATEST + j; plan stands for what came before) has
    # the executed tasks, edges and commands: a new run's chunk runs iterations 1, 2, ... in slots 1, 2, ...
    document = render(config, uri)["workflow-template.yaml"]
    # Its nodes, as Argo expands them: an iteration's rollout shards are one task of K items, slot<i>-rollout(k:k).
    chunk = expanded_tasks(list(rendered_chunk(document).values()))

    def slot(name: str) -> str:
        return node_name(re.sub(r"^it(\d+)-", r"slot\1-", name))

    iterations = [t for t in executed if t.name not in ("start", "eval-0")]
    assert {
        slot(t.name): sorted(slot(d) if d.startswith("it") else "plan" for d in t.dependencies) for t in iterations
    } == {slot(t.name): sorted(chunk[slot(t.name)]["dependencies"]) for t in iterations}
    commands = rendered_commands(document)
    tasks = {t.name: t for t in loop_tasks(config)}
    values = run_values(config, uri)
    for done in executed:
        task = tasks[done.name]
        arguments = dict(task.arguments)
        if done.name.startswith("it"):
            assert chunk[slot(done.name)]["when"] == f"{{{{tasks.plan.outputs.parameters.count}}}} >= {task.iteration}"
        assert list(done.argv) == substitute(commands[task.step.name], {**values, **arguments})
    # Every step of the DAG has a template whose argv is the step's own.
    for task in tasks.values():
        assert commands[task.step.name] == task.step.argv(step_placeholders(task.step))

    storage = RunStorage(uri)
    assert storage.latest() == {"iteration": 2, "checkpoint": "checkpoints/iter-000002"}
    before = snapshot(run_root)
    # Started again on a finished run: only start and LATEST's evaluation are looked at, and nothing changes.
    again = run_local(config, uri, tmp_path / "logs", progress=False)
    assert [t.name for t in again] == ["start", "it2-eval"]
    assert snapshot(run_root) == before

    # Extended by one iteration: it continues from LATEST.
    longer = small_config(iterations=3, rollout=SMALL_TRANSFORMERS_ROLLOUT)
    extended = run_local(longer, uri, tmp_path / "logs", progress=False)
    assert next(t.name for t in extended) == "start"
    assert {t.name for t in extended} == {"start", "it2-eval"} | {
        t.name for t in loop_tasks(longer) if t.iteration == 3
    }
    for metrics_file in ("iter-000000.json", "iter-000003.json"):
        metrics = storage.read_json(f"metrics/{metrics_file}")
        assert 0.0 <= metrics["eval_reward_mean"] <= 1.0
    last = storage.read_json("metrics/iter-000003.json")
    assert {"iteration", "reward_mean", "eval_reward_mean", "kl", "loss", "step_seconds", "tokens_per_second"} <= set(
        last
    )
    assert set(last["step_seconds"]) == {"rollout-0", "rollout-1", "reward", "train", "publish", "evaluate"}


def test_workers_run_each_step_as_a_fresh_process_does(
    workers_run: WorkersRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """local.workers: one long-lived process per rollout shard and per other step serves every iteration, and
    what it commits is byte for byte what a fresh process per task commits."""
    # start, evaluate, reward, train, publish and one per rollout shard: 7 processes for 14 tasks.
    assert len(workers_run.executed) == 2 + 2 * 6
    assert len(workers_run.started) == 7
    assert not any(worker.alive() for worker in workers_run.started)  # none outlives the run
    config = small_config(iterations=2, rollout=SMALL_TRANSFORMERS_ROLLOUT, local={"workers": True})
    check_warmed_workers(workers_run.logs, config)

    started: list[StepWorker] = []

    class CountedWorker(StepWorker):
        def __init__(self, environment: dict[str, str]):
            super().__init__(environment)
            started.append(self)

    monkeypatch.setattr(launch, "StepWorker", CountedWorker)
    monkeypatch.setenv("MOELOOP_CACHE", str(tmp_path / "cache"))
    config = small_config(iterations=2, rollout=SMALL_TRANSFORMERS_ROLLOUT, local={"workers": False})
    root = tmp_path / "workers-False"
    executed = run_local(config, run_uri(config, str(root)), tmp_path / "logs-False", progress=False)
    assert len(executed) == 2 + 2 * 6
    assert not started  # a fresh process per task: no worker
    assert workers_run.data == run_data(root)
    assert any(path.endswith(".safetensors") for path in workers_run.data)


def check_warmed_workers(log_dir: Path, config) -> None:
    """Every worker but start's imported its step's module before its first command (warm-SLOT.log), and ran
    every command of its slot: the pid each command's log names is the warmed worker's."""
    warmed = {}
    for log in log_dir.glob("warm-*.log"):
        lines = log.read_text().splitlines()
        slot = log.stem.removeprefix("warm-")
        module = "moeloop.steps.rollout" if slot.startswith("rollout-") else f"moeloop.steps.{slot}"
        imported = [line for line in lines if re.fullmatch(rf"worker (\d+): imported {module} in [\d.]+ s", line)]
        assert imported, (log, lines)
        warmed[slot] = imported[0].split()[1].rstrip(":")
    assert set(warmed) == {"evaluate", "reward", "train", "publish", "rollout-0", "rollout-1"}
    for task in loop_tasks(config):
        if task.name != "start":
            first = (log_dir / f"{task.name}.log").read_text().splitlines()[0]
            assert first.startswith(f"worker {warmed[worker_slot(task)]}: -m moeloop.steps."), (task.name, first)


def test_published_checkpoint_loads_with_the_trainers_logits(run_root: Path, tmp_path: Path) -> None:
    config = small_config(iterations=1, rollout=SMALL_TRANSFORMERS_ROLLOUT)
    uri = run_uri(config, str(run_root))
    start(uri, config)
    for shard in range(config.rollout.num_shards):
        rollout(uri, 1, shard, config.rollout.num_shards)
    reward(uri, 1)
    storage = RunStorage(uri)
    updated = update_policy(storage, config, 1, tmp_path / "scratch")
    trainer_model, tokenizer = updated.model, updated.tokenizer
    train(uri, 1)
    publish(uri, 1)
    assert storage.latest()["iteration"] == 1

    published = AutoModelForCausalLM.from_pretrained(fetch_checkpoint(storage, 1), dtype=torch.float32)
    input_ids = torch.tensor([tokenizer("abcdef=hgf")["input_ids"], tokenizer("hgfedc=abc")["input_ids"]])
    trainer_model.eval()
    published.eval()
    with torch.no_grad():
        expected = trainer_model(input_ids=input_ids).logits
        got = published(input_ids=input_ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The update changed the policy: checkpoint 1 is not checkpoint 0.
    initial = AutoModelForCausalLM.from_pretrained(fetch_checkpoint(storage, 0), dtype=torch.float32)
    with torch.no_grad():
        assert not torch.allclose(initial(input_ids=input_ids).logits, got)


def test_checkpoint_cache_is_keyed_by_run(run_root: Path) -> None:
    """A copy of a run elsewhere gets its own cache entry: checkpoints are cached by run and COMMIT."""
    config = small_config(iterations=1)
    uri = run_uri(config, str(run_root))
    start(uri, config)
    copy = run_root.parent / "copy"
    shutil.copytree(run_root, copy)
    original = fetch_checkpoint(RunStorage(uri), 0)
    copied = fetch_checkpoint(RunStorage(run_uri(config, str(copy))), 0)
    assert original != copied
    assert (original / "model.safetensors").read_bytes() == (copied / "model.safetensors").read_bytes()
