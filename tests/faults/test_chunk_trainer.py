"""The chunk's trainer (`trainer.lifetime: chunk`, steps/trainer.py) against trainers of one iteration each, on the
same committed experience: SIGKILLed between iterations and during one, and started again (as a Job restarts its
pod), it publishes bit-identical checkpoints and deltas, and commits bit-identical trainer states every
`state_every` iterations and after its last; a replay that would make other weights is refused; a train step whose
trainer is silent fails with a line that says so."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from moeloop.steps.storage import commands
from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.publish import publish
from moeloop.steps.storage.run import RunStorage
from moeloop.steps.train import ask_trainer
from moeloop.workflows.local.logs import log_folder
from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, run_in_process, small_config
from tests.policy_versions import bf16_start
from tests.processes import cli_command, start_forked_step, start_process, step_command

pytestmark = pytest.mark.slow

ITERATIONS = 3
STATE_EVERY = 2


def chunk_run_of(baseline: str, root: Path) -> RunStorage:
    """A copy of the baseline run up to its committed experience: what the trainers of the baseline made is gone
    (checkpoints and deltas after 0, trainer states, train and publish reports), LATEST is checkpoint 0, and its
    config says lifetime chunk."""
    source = Path(baseline)
    target = root / "chunk" / source.name
    shutil.copytree(source, target)
    for i in range(1, ITERATIONS + 1):
        for folder in (RunStorage.checkpoint(i), RunStorage.delta(i), RunStorage.trainer_state(i)):
            shutil.rmtree(target / folder, ignore_errors=True)
        for step in ("train", "publish"):
            (target / RunStorage.report(i, step)).unlink()
    (target / RunStorage.LATEST).write_text('{"iteration": 0, "checkpoint": "checkpoints/iter-000000"}')
    data = yaml.safe_load((target / RunStorage.CONFIG).read_text())
    data["trainer"] |= {"lifetime": "chunk", "state_every": STATE_EVERY}
    MoeloopConfig.model_validate(data)
    (target / RunStorage.CONFIG).write_text(yaml.safe_dump(data, sort_keys=False))
    return RunStorage(str(target))


def files_of(storage: RunStorage, folder: str) -> dict[str, dict]:
    """The committed folder's files, each with its size and digests, by name."""
    return storage.manifest(folder)["files"]


def start_trainer(storage: RunStorage, logs: Path, attempt: int):
    return start_forked_step(
        step_command("trainer", storage.uri, None, "--last", str(ITERATIONS)), logs / f"trainer-{attempt}.log"
    )


def wait_for(condition, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> RunStorage:
    root = tmp_path_factory.mktemp("baseline")
    config = small_config(ITERATIONS, rollout={"prompts_per_iteration": 4, "samples_per_prompt": 4, "num_shards": 1})
    uri = f"{root}/{config.run_name}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the forked trainers run: a float sum's order follows the threads that add it
    try:
        run_in_process(config, uri)
    finally:
        torch.set_num_threads(threads)
    return RunStorage(uri)


def test_a_chunk_trainer_killed_between_and_during_iterations_publishes_what_trainers_of_one_iteration_did(
    baseline: RunStorage, tmp_path: Path
) -> None:
    storage = chunk_run_of(baseline.uri, tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    trainer = start_trainer(storage, logs, 1)
    ask_trainer(storage, 1)
    publish(storage.uri, 1)
    trainer.kill()  # between iterations: it holds iteration 1, no trainer state is committed yet
    trainer.join()
    trainer = start_trainer(storage, logs, 2)
    report = ask_trainer(storage, 2)  # it resumes from checkpoint 0 and replays iteration 1 first
    publish(storage.uri, 2)
    wait_for(lambda: storage.is_committed(storage.trainer_state(2)), "the trainer state of iteration 2")
    storage.create_bytes(storage.train_command(3), b'{"iteration": 3}')
    time.sleep(random.uniform(0.1, 0.9) * report["seconds"])  # during iteration 3's update
    assert not storage.is_committed(storage.checkpoint(3)), "the kill came after the update: no fault injected"
    trainer.kill()
    trainer.join()
    trainer = start_trainer(storage, logs, 3)
    ask_trainer(storage, 3)  # it resumes from the trainer state of iteration 2
    publish(storage.uri, 3)
    trainer.join(300)
    assert trainer.exitcode == 0, (logs / "trainer-3.log").read_text()[-2000:]
    served = (logs / "trainer-3.log").read_text()
    assert '"resumed_at": 2' in served and '"replayed": 0' in served and '"served": [3]' in served
    for i in range(1, ITERATIONS + 1):
        assert files_of(storage, storage.checkpoint(i)) == files_of(baseline, baseline.checkpoint(i)), i
        assert files_of(storage, storage.delta(i)) == files_of(baseline, baseline.delta(i)), i
    for i in (STATE_EVERY, ITERATIONS):
        assert files_of(storage, storage.trainer_state(i)) == files_of(baseline, baseline.trainer_state(i)), i
    assert not storage.exists(storage.trainer_state(1))
    assert storage.latest()["iteration"] == ITERATIONS


def test_a_chunk_trainer_answers_train_with_the_delta_and_one_whose_checkpoint_commit_failed_commits_the_same(
    baseline: RunStorage, tmp_path: Path
) -> None:
    """The train step is answered once the delta is committed; the checkpoint's commit follows in the background.
    That commit failing (a file where its folder goes), the trainer fails while it waits for the next command; the
    one started again replays the iteration, finds its delta committed with the same bytes, and commits the
    checkpoint, which publish waited for."""
    storage = chunk_run_of(baseline.uri, tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    in_the_way = Path(storage.uri) / storage.checkpoint(1)
    in_the_way.write_bytes(b"")
    trainer = start_trainer(storage, logs, 1)
    ask_trainer(storage, 1)
    assert storage.is_committed(storage.delta(1)) and storage.exists(storage.report(1, "train"))
    trainer.join(300)
    assert trainer.exitcode != 0 and not storage.is_committed(storage.checkpoint(1))
    in_the_way.unlink()
    trainer = start_trainer(storage, logs, 2)
    for i in range(1, ITERATIONS + 1):
        ask_trainer(storage, i)
        publish(storage.uri, i)
    trainer.join(300)
    assert trainer.exitcode == 0, (logs / "trainer-2.log").read_text()[-2000:]
    assert '"resumed_at": 0' in (logs / "trainer-2.log").read_text()
    for i in range(1, ITERATIONS + 1):
        assert files_of(storage, storage.checkpoint(i)) == files_of(baseline, baseline.checkpoint(i)), i
        assert files_of(storage, storage.delta(i)) == files_of(baseline, baseline.delta(i)), i
    assert storage.latest()["iteration"] == ITERATIONS


def test_a_replay_that_makes_other_weights_is_refused(baseline: RunStorage, tmp_path: Path) -> None:
    storage = chunk_run_of(baseline.uri, tmp_path)
    shutil.copytree(Path(baseline.uri) / baseline.checkpoint(1), Path(storage.uri) / storage.checkpoint(1))
    shutil.copytree(Path(baseline.uri) / baseline.delta(1), Path(storage.uri) / storage.delta(1))
    commit = Path(storage.uri) / storage.checkpoint(1) / "COMMIT"
    manifest = json.loads(commit.read_text())
    manifest["weights_digest"] = "0" * 64  # what a nondeterministic update would meet: another policy committed
    commit.write_text(json.dumps(manifest))
    logs = tmp_path / "logs"
    logs.mkdir()
    trainer = start_trainer(storage, logs, 1)
    trainer.join(300)
    assert trainer.exitcode == 2
    last = (logs / "trainer-1.log").read_text().strip().splitlines()[-1]
    assert last.startswith(
        "error: the trainer's replay of iteration 1 made other weights than its committed checkpoint"
    )


def test_a_train_step_whose_trainer_is_silent_fails_saying_so(
    baseline: RunStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = chunk_run_of(baseline.uri, tmp_path)
    monkeypatch.setattr(commands, "SILENT_SECONDS", 1.0)
    with pytest.raises(
        MoeloopError, match="asked the chunk's trainer for its update, which has not been heard from at all"
    ):
        ask_trainer(storage, 1)
    assert storage.exists(storage.train_command(1))


def run_chunk_lifetime(tmp_path: Path, name: str, kills: bool) -> RunStorage:
    """`moeloop run` of a small config whose trainer and rollout engines live for the run; with kills, three
    processes are SIGKILLed, each found by the pid in its heartbeat: the trainer after checkpoint 1 is committed
    (between iterations); shard 0's engine once iteration 2's shard 0 is asked for and before it is committed; the
    trainer once iteration 3's update is asked for and before its checkpoint is committed. The runner starts each
    again."""
    sections = {"trainer": {"lifetime": "chunk", "state_every": 2}, "rollout": {"lifetime": "chunk"}}
    config = small_config(3, eval={"max_prompts": 4}, **sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    storage = RunStorage(str(tmp_path / name / config.run_name))
    # On one core every step runs one thread, whatever overlaps it: the floats of both runs are summed alike.
    core = {min(os.sched_getaffinity(0))}
    command = cli_command("run", str(path), "--root", str(tmp_path / name), "--no-progress")
    run = start_process(command, cwd=tmp_path, preexec_fn=lambda: os.sched_setaffinity(0, core))
    shard, checkpoint = storage.rollout_shard(2, 0, config.rollout.num_shards), storage.checkpoint(3)
    trainer, engine = storage.TRAINER_HEARTBEAT, storage.engine_heartbeat(0)
    kills = [
        (lambda: storage.is_committed(storage.checkpoint(1)), trainer),
        (lambda: storage.exists(storage.rollout_command(2, 0)) and not storage.exists(shard), engine),
        (lambda: storage.exists(storage.train_command(3)) and not storage.is_committed(checkpoint), trainer),
    ] if kills else []  # fmt: skip
    for moment, heartbeat in kills:
        wait_for(lambda: moment() or run.poll() is not None, "the moment to kill")
        assert run.poll() is None and moment(), "the run ended, or the moment passed, before the kill"
        os.kill(storage.read_json(heartbeat)["pid"], signal.SIGKILL)
    assert run.wait(600) == 0
    return storage


def test_moeloop_run_starts_its_killed_trainer_and_engine_again_and_publishes_what_an_undisturbed_run_did(
    tmp_path: Path,
) -> None:
    undisturbed, killed = (
        run_chunk_lifetime(tmp_path, "undisturbed", False),
        run_chunk_lifetime(tmp_path, "killed", True),
    )
    for i in range(1, 4):
        assert files_of(killed, killed.experience(i)) == files_of(undisturbed, undisturbed.experience(i)), i
        assert files_of(killed, killed.checkpoint(i)) == files_of(undisturbed, undisturbed.checkpoint(i)), i
    assert [i for i in range(1, 4) if killed.is_committed(killed.trainer_state(i))] == [2, 3]
    logs = tmp_path / log_folder(killed.uri)
    assert (logs / "trainer.log").read_text().count("moeloop run: trainer exited with") == 2
    assert (logs / "rollout-engine-0.log").read_text().count("moeloop run: rollout-engine-0 exited with") == 1


def test_a_chunk_trainer_of_two_ranks_publishes_and_commits_what_trainers_of_one_iteration_do(tmp_path: Path) -> None:
    """World size 2, EP 2 (torchrun, gloo), one iteration: the checkpoint and delta that the ranks write and commit
    side by side, each its share of the checkpoint's files, and the trainer state committed in the background over
    its own gloo group equal what a per-iteration train step and publish commit."""
    runs = {}
    for lifetime in ("iteration", "chunk"):
        # checkpoint files of at most 20 KiB, several, so that both ranks write some; a bf16 start and an RL learning
        # rate, so that few elements change and the delta is not left out
        trainer = {"world_size": 2, "expert_parallel": 2, "lifetime": lifetime, "checkpoint_shard_bytes": 20 << 10}
        # transformers generates: what the ranks commit does not depend on the engine, and it starts in far less
        # time than vLLM, whose rollout and evaluate started an engine of their own in each run
        sections = {"rollout": SMALL_TRANSFORMERS_ROLLOUT, "eval": {"max_prompts": 4}}
        config = small_config(1, trainer=trainer | {"learning_rate": 1e-5}, **sections)
        start = bf16_start(tmp_path / f"{lifetime}-start", config)
        config = config.model_copy(update={"model": config.model.model_copy(update={"checkpoint": str(start)})})
        path = tmp_path / f"{lifetime}.yaml"
        path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        core = {min(os.sched_getaffinity(0))}  # one thread a rank in both runs
        command = cli_command("run", str(path), "--root", str(tmp_path / lifetime), "--no-progress")
        assert start_process(command, cwd=tmp_path, preexec_fn=lambda: os.sched_setaffinity(0, core)).wait(600) == 0
        runs[lifetime] = RunStorage(str(tmp_path / lifetime / config.run_name))
    per_iteration, chunk = runs["iteration"], runs["chunk"]
    assert len([name for name in files_of(chunk, chunk.delta(1)) if name.startswith("delta-")]) >= 4
    assert files_of(chunk, chunk.checkpoint(1)) == files_of(per_iteration, per_iteration.checkpoint(1))
    assert files_of(chunk, chunk.delta(1)) == files_of(per_iteration, per_iteration.delta(1))
    assert files_of(chunk, chunk.trainer_state(1)) == files_of(per_iteration, per_iteration.trainer_state(1))
