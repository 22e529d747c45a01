"""Fault injection: each writing step (rollout, reward, train, publish) is killed with SIGKILL at a uniformly
random moment between its start and its normal end, then run again, 50 times, alternately on a local folder and on
SeaweedFS. The killed steps are processes forked from one that has imported the steps
(tests/processes.py:start_forked_step), so that the moments fall in the step's work rather than in a fresh
interpreter's imports; the re-runs run in this process. After every kill, whatever a reader can see is whole and
verifies (committed folders against their COMMIT, shards by their rows, LATEST names a checkpoint that loads); after
every re-run the iteration holds exactly the expected experience rows and LATEST names a loadable checkpoint. The
same steps killed right after each of their writes, and one rank of a world-size-2 train step killed mid-save of its
sharded trainer state."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.model.policy import load_policy
from moeloop.steps.rl.checkpoint import OPTIMIZER_DIR, WEIGHTS_DIR
from moeloop.steps.publish import publish
from moeloop.steps.reward import reward
from moeloop.steps.engines.shards import iteration_prompt_ids, shard_prompt_ids
from moeloop.steps.rollout import rollout
from moeloop.steps.start import start
from moeloop.steps.storage.backends import CRASH_AFTER_WRITES, CRASH_RANK
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage.experience import committed_experience, read_rewards, read_rollout_shard, read_rollouts
from moeloop.steps.storage.prompt_set import prompt_count
from moeloop.steps.storage.run import RunStorage
from moeloop.steps.train import train
from tests.conftest import small_config
from moeloop.workflows.dag import TRAIN
from tests.processes import run_forked, start_forked_step, start_process, step_command
from tests.seaweed import SeaweedS3

pytestmark = pytest.mark.slow

# 50 trials; the cheap steps get as many as the expensive ones, so that the short windows between a
# step's data objects and its COMMIT (and between COMMIT and LATEST) are hit too.
TRIALS = {"rollout": 13, "reward": 13, "train": 12, "publish": 12}
STEPS = ("rollout", "reward", "train", "publish")
ITERATION = 1
STEP_TIMEOUT = 300


@dataclass(frozen=True)
class Baseline:
    """A run folder just before each step (`before[step]`), how long each step takes undisturbed, the config."""

    before: dict[str, Path]
    seconds: dict[str, float]
    config: MoeloopConfig


def fault_config() -> MoeloopConfig:
    # transformers rather than vLLM: a process that starts in seconds, so that 50 trials fit in minutes.
    rollout = {"engine": "transformers", "prompts_per_iteration": 8, "samples_per_prompt": 4, "num_shards": 2}
    return small_config(iterations=1, rollout=rollout)


def shard_args(step: str, config: MoeloopConfig, shard: int = 0) -> list[str]:
    """Rollout's shard 0; shard 1 is written beforehand, so that reward finds the iteration's experience."""
    return ["--shard", str(shard), "--num-shards", str(config.rollout.num_shards)] if step == "rollout" else []


def fault_step_command(step: str, uri: str, config: MoeloopConfig) -> list[str]:
    return step_command(step, uri, ITERATION, *shard_args(step, config))


def rerun(step: str, uri: str, config: MoeloopConfig) -> dict:
    """The killed step run again, in this process (what a retry finds does not depend on the process it runs in):
    its report."""
    if step == "rollout":
        return rollout(uri, ITERATION, 0, config.rollout.num_shards)
    return {"reward": reward, "train": train, "publish": publish}[step](uri, ITERATION)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, s3_environment: dict[str, str]) -> Baseline:
    """Runs the iteration once, step by step as forked processes, keeping a copy of the run before each step."""
    config = fault_config()
    work = tmp_path_factory.mktemp("baseline")
    run = work / "root" / config.run_name
    start(str(run), config)
    shard_1 = step_command("rollout", run, ITERATION, *shard_args("rollout", config, shard=1))
    assert run_forked(shard_1, work / "rollout-1.log") == 0, (work / "rollout-1.log").read_text()[-3000:]
    before, seconds = {}, {}
    for step in STEPS:
        before[step] = work / f"before-{step}"
        shutil.copytree(run, before[step])
        started = time.perf_counter()
        returncode = run_forked(fault_step_command(step, str(run), config), work / f"{step}.log")
        seconds[step] = time.perf_counter() - started
        assert returncode == 0, (work / f"{step}.log").read_text()[-3000:]
    return Baseline(before, seconds, config)


def place_run(source: Path, backend: str, tmp_path: Path, seaweed: SeaweedS3) -> str:
    """A fresh copy of a baseline run folder on the backend; returns its URI."""
    if backend == "local":
        target = tmp_path / uuid.uuid4().hex[:8] / source.name
        shutil.copytree(source, target)
        return str(target)
    prefix = f"faults/{uuid.uuid4().hex[:8]}/run"
    client = seaweed.client()
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        client.put_object(
            Bucket=seaweed.bucket, Key=f"{prefix}/{path.relative_to(source).as_posix()}", Body=path.read_bytes()
        )
    return f"s3://{seaweed.bucket}/{prefix}"


def expected_sample_ids(config: MoeloopConfig, storage: RunStorage, shards: list[int]) -> set[str]:
    batch = iteration_prompt_ids(config, prompt_count(storage, "train"), ITERATION)
    return {
        f"{ITERATION}-{prompt}-{sample}"
        for shard in shards
        for prompt in shard_prompt_ids(batch, shard, config.rollout.num_shards)
        for sample in range(config.rollout.samples_per_prompt)
    }


def check_what_readers_see(storage: RunStorage, config: MoeloopConfig, scratch: Path) -> dict[str, bool]:
    """Everything a reader could pick up is whole and verifies; returns which outputs are committed."""
    shards = config.rollout.num_shards
    for k in range(shards):
        if storage.exists(storage.rollout_shard(ITERATION, k, shards)):
            read_rollout_shard(storage, ITERATION, k, shards)  # parses, schema and rows its own
    experience = committed_experience(storage, ITERATION, shards) is not None
    if experience:
        rows = read_rollouts(storage, ITERATION, shards)
        assert set(rows["sample_id"].to_pylist()) == expected_sample_ids(config, storage, list(range(shards)))
        assert read_rewards(storage, ITERATION)["sample_id"].to_pylist() == rows["sample_id"].to_pylist()
    trainer = storage.is_committed(storage.trainer_state(ITERATION))
    if trainer:
        storage.fetch_folder(storage.trainer_state(ITERATION), scratch / uuid.uuid4().hex)
    for report in storage.list(storage.reports(ITERATION)):
        storage.read_json(f"{storage.reports(ITERATION)}/{report}")
    latest = storage.latest()
    assert latest is not None and latest["checkpoint"] == storage.checkpoint(latest["iteration"])
    load_policy(fetch_checkpoint(storage, latest["iteration"]))  # verified against its COMMIT, and loads
    return {"experience": experience, "trainer": trainer, "published": latest["iteration"] == ITERATION}


def state_after_kill(step: str, storage: RunStorage, config: MoeloopConfig) -> str:
    """How far the killed process got with its output."""
    if step == "rollout":
        if storage.exists(storage.rollout_shard(ITERATION, 0, config.rollout.num_shards)):
            return "committed"
        return "report only" if storage.exists(storage.report(ITERATION, "rollout-0")) else "nothing"
    folder = {
        "reward": storage.experience(ITERATION),
        "train": storage.trainer_state(ITERATION),
        "publish": storage.checkpoint(ITERATION),
    }[step]
    if storage.is_committed(folder):
        moved = step != "publish" or storage.latest()["iteration"] == ITERATION
        return "committed" if moved else "committed, LATEST not moved yet"
    written = {name for name in storage.sizes(folder) if not name.startswith("rollout-")}  # shards are inputs
    return "uncommitted objects" if written else "nothing"


def test_steps_killed_at_random_moments_leave_whole_data_and_finish_on_rerun(
    baseline: Baseline, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    config, rng = baseline.config, random.Random(5)
    plan = [step for step in STEPS for _ in range(TRIALS[step])]
    rng.shuffle(plan)
    outcomes: Counter[tuple[str, str, str]] = Counter()
    trials_of: Counter[str] = Counter()
    for trial, step in enumerate(plan):
        backend = "s3" if trials_of[step] % 2 == 0 else "local"  # each step alternates between the backends
        trials_of[step] += 1
        uri = place_run(baseline.before[step], backend, tmp_path, seaweed)
        storage = RunStorage(uri)
        process = start_forked_step(fault_step_command(step, uri, config), tmp_path / f"trial-{trial}.log")
        time.sleep(rng.uniform(0, baseline.seconds[step]))
        process.kill()
        process.join()
        killed = process.exitcode == -signal.SIGKILL
        outcome = state_after_kill(step, storage, config) if killed else "finished before the kill"

        seen = check_what_readers_see(storage, config, tmp_path / "scratch")
        report = rerun(step, uri, config)
        after = check_what_readers_see(storage, config, tmp_path / "scratch")

        shard_rows = read_rollout_shard(storage, ITERATION, 0, config.rollout.num_shards)[0]
        assert set(shard_rows["sample_id"].to_pylist()) == expected_sample_ids(config, storage, [0])
        assert shard_rows.num_rows == len(expected_sample_ids(config, storage, [0]))
        assert after["experience"] == (step != "rollout")
        assert after["trainer"] == (step in ("train", "publish"))
        assert after["published"] == (step == "publish")
        assert ("skipped" in report) == outcome.startswith(("committed", "finished")), (trial, step, outcome, report)
        outcomes[(step, backend, outcome)] += 1
        assert seen["published"] <= after["published"]

    summary = "\n".join(f"  {s:8} {b:6} {o}: {n}" for (s, b, o), n in sorted(outcomes.items()))
    print(f"\n{len(plan)} trials ({dict(Counter(plan))}), state at the kill:\n{summary}")
    print(f"undisturbed step seconds: { {s: round(t, 2) for s, t in baseline.seconds.items()} }")
    assert sum(n for (_, b, _), n in outcomes.items() if b == "s3") >= len(plan) // 2


# Crash points: the same step killed right after its 1st, 2nd, ... write, up to its last, on the backends
# given, so that the narrow windows (data objects without COMMIT, COMMIT before LATEST) are hit for sure.
CRASH_POINTS = {"reward": ("local", "s3"), "publish": ("local", "s3"), "train": ("s3",)}


def test_steps_killed_between_any_two_writes_leave_whole_data_and_finish_on_rerun(
    baseline: Baseline, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    config = baseline.config
    outcomes: Counter[str] = Counter()
    for step, backends in CRASH_POINTS.items():
        for backend in backends:
            for writes in range(1, 100):
                uri = place_run(baseline.before[step], backend, tmp_path, seaweed)
                storage = RunStorage(uri)
                log = tmp_path / f"{step}-{backend}-{writes}.log"
                crashed = run_forked(fault_step_command(step, uri, config), log, {CRASH_AFTER_WRITES: str(writes)})
                if crashed == 0:
                    break  # the step made fewer writes: every crash point of it was tried
                assert crashed == -signal.SIGKILL, log.read_text()[-3000:]
                outcome = state_after_kill(step, storage, config)
                outcomes[f"{step} {backend} after write {writes}: {outcome}"] += 1
                check_what_readers_see(storage, config, tmp_path / "scratch")
                rerun(step, uri, config)
                after = check_what_readers_see(storage, config, tmp_path / "scratch")
                assert after["trainer"] == (step in ("train", "publish"))
                assert after["published"] == (step == "publish")
    print("\n" + "\n".join(f"  {o}" for o in sorted(outcomes)))
    states = {o.split(": ", 1)[1] for o in outcomes}
    assert {"uncommitted objects", "committed, LATEST not moved yet"} <= states


# One rank of a sharded save killed: the train step at trainer.world_size 2 (EP 2) under torchrun, as the local
# runner starts it, with one rank SIGKILLed right after its N-th write. Rank 0 writes the report, its objects
# (config, tokenizer, DCP indexes, its shards) and COMMIT once it has gathered every rank's entries; rank 1 only
# its shards, one DCP file per folder. S3 uploads a rank's objects in one parallel put_objects (one write), a
# local folder one by one. Train never moves LATEST (publish does): every check below sees it at checkpoint 0.
WORLD_SIZE = 2
DCP_FOLDERS = (WEIGHTS_DIR, OPTIMIZER_DIR)


def rank_files(rank: int) -> set[str]:
    return {f"{folder}/__{rank}_0.distcp" for folder in DCP_FOLDERS}  # DCP's file of a rank's shards


def writes_of(rank: int, backend: str, files: set[str]) -> int:
    """How many writes a rank of an undisturbed save makes (files: the committed state's)."""
    if rank == 1:
        return 1 if backend == "s3" else len(rank_files(1))
    objects = 1 if backend == "s3" else len(files - rank_files(1))
    return objects + 2  # the report before its objects, COMMIT after them


def resubmitted(uri: str, config: MoeloopConfig) -> MoeloopConfig:
    """The run submitted again at trainer.world_size 2 (a field a resubmission may change): its stored config."""
    trainer = config.trainer.model_copy(update={"world_size": WORLD_SIZE, "expert_parallel": WORLD_SIZE})
    distributed = config.model_copy(update={"trainer": trainer})
    assert start(uri, distributed) == {"skipped": "checkpoint 0 already committed"}
    return distributed


def run_torchrun_train(uri: str, **crash: str) -> subprocess.CompletedProcess[str]:
    """The train step's own torchrun command; fails the test if a rank outlives its killed peer (a hang)."""
    command = [sys.executable, *TRAIN.argv({"run": uri, "iteration": str(ITERATION)}, WORLD_SIZE)[1:]]
    process = start_process(
        command,
        env=crash,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=STEP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its ranks
        process.communicate()
        pytest.fail(f"train at world size {WORLD_SIZE} with {crash} still running after {STEP_TIMEOUT}s")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def committed_files(storage: RunStorage) -> dict[str, dict]:
    return storage.manifest(storage.trainer_state(ITERATION))["files"]


def test_a_trainer_rank_killed_mid_save_leaves_no_partial_state_and_the_rerun_commits_it_whole(
    baseline: Baseline, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    def placed(backend: str) -> tuple[RunStorage, MoeloopConfig]:
        uri = place_run(baseline.before["train"], backend, tmp_path, seaweed)
        return RunStorage(uri), resubmitted(uri, baseline.config)

    def finishes_past_last_write(backend: str, rank: int, writes: int) -> dict[str, dict]:
        """The step with rank's crash one write past its last: it finishes undisturbed; its committed files."""
        storage, _ = placed(backend)
        run = run_torchrun_train(storage.uri, **{CRASH_AFTER_WRITES: str(writes + 1), CRASH_RANK: str(rank)})
        assert run.returncode == 0, f"rank {rank} on {backend}, {writes + 1} writes: {run.stderr[-3000:]}"
        return committed_files(storage)

    # The reference: undisturbed, and so rank 1 makes exactly its writes_of; every rank's shards are committed. Each
    # S3 re-run below commits these same digests.
    whole = finishes_past_last_write("local", 1, writes_of(1, "local", set()))
    assert rank_files(0) | rank_files(1) <= whole.keys()
    # Each window once: rank 1 killed with part of its shards written (local: a file at a time) and with all of
    # them (S3: one write); rank 0 after its report, its objects and its COMMIT (S3: one write each), and locally
    # after its COMMIT.
    plan = [("local", 1, 1), ("local", 0, writes_of(0, "local", set(whole)))]
    plan += [("s3", 1, 1)] + [("s3", 0, n) for n in range(1, writes_of(0, "s3", set(whole)) + 1)]
    assert writes_of(1, "local", set(whole)) > 1 and writes_of(1, "s3", set(whole)) == 1
    outcomes = []
    for backend, rank, crash_after in plan:
        storage, config = placed(backend)
        crashed = run_torchrun_train(storage.uri, **{CRASH_AFTER_WRITES: str(crash_after), CRASH_RANK: str(rank)})
        where = f"rank {rank} on {backend} killed after write {crash_after} of {writes_of(rank, backend, set(whole))}"
        # torchrun's agent sees the rank die by SIGKILL, stops the others and fails with 1.
        assert crashed.returncode == 1, f"{where}: {crashed.stderr[-3000:]}"
        assert f"rank      : {rank} (local_rank: {rank})" in crashed.stderr, crashed.stderr[-3000:]
        assert "Signal 9 (SIGKILL)" in crashed.stderr, crashed.stderr[-3000:]
        outcome = state_after_kill("train", storage, config)
        outcomes.append(f"{where}: {outcome}")
        # COMMIT is rank 0's last write, made once every rank's entries are in: no earlier kill leaves one.
        assert (outcome == "committed") == (rank == 0 and crash_after == writes_of(0, backend, set(whole))), where
        if outcome == "committed":
            assert committed_files(storage) == whole, where
        assert not check_what_readers_see(storage, config, tmp_path / "scratch")["published"], where
        rerun = run_torchrun_train(storage.uri)
        assert rerun.returncode == 0, f"{where}, re-run: {rerun.stderr[-3000:]}"
        report = json.loads(rerun.stdout.strip().splitlines()[-1])
        assert ("skipped" in report) == (outcome == "committed"), (where, report)
        assert committed_files(storage) == whole, where
        after = check_what_readers_see(storage, config, tmp_path / "scratch")
        assert after["trainer"] and not after["published"], where
    print("\n" + "\n".join(f"  {o}" for o in outcomes))
    assert {"uncommitted objects", "committed"} <= {o.split(": ", 1)[1] for o in outcomes}
