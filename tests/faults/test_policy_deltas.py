"""A kept rollout engine takes each policy version from its delta, in place, and holds exactly the version's
checkpoint; a missing, damaged or wrong delta falls back to the full checkpoint (steps/engines/versions.py); an
engine killed mid-iteration is replaced and its shard, retried once, has exactly an undisturbed engine's rows."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from moeloop.steps.engines.engine import Sampling, TransformersEngine, release_engine
from moeloop.steps.engines import versions as versions_module
from moeloop.steps.engines.versions import engine_at
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.delta import CheckpointTensors, checkpoint_digests, weights_digest, write_delta
from moeloop.steps.publish import publish
from moeloop.steps.reward import reward
from moeloop.steps.rollout import rollout
from moeloop.steps.storage.cache import fetch_checkpoint
from moeloop.steps.storage import commands, deltas
from moeloop.steps.storage.deltas import RECORD
from moeloop.steps.storage.run import RunStorage
from moeloop.steps.train import train
from moeloop.workflows.local.workers import StepWorker
from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT
from tests.policy_versions import bf16_run, next_version
from tests.processes import run_step, step_command

TRANSFORMERS = {"rollout": SMALL_TRANSFORMERS_ROLLOUT}


@pytest.fixture
def versions(run_root: Path) -> tuple[RunStorage, object]:
    uri, config = bf16_run(run_root, versions=3, **TRANSFORMERS)
    return RunStorage(uri), config


def digests_of(storage: RunStorage, version: int) -> dict[str, str]:
    return checkpoint_digests(CheckpointTensors(fetch_checkpoint(storage, version)))


def samples(engine: TransformersEngine) -> list:
    prompts = [engine.tokenizer(text)["input_ids"] for text in ("abcd=", "ba=", "dcab=")]
    completions = engine.generate(prompts, Sampling(n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=11))
    return [[(c.token_ids, c.logprobs) for c in group] for group in completions]


def test_a_kept_engine_takes_each_version_from_its_deltas_in_place_and_holds_its_checkpoint(versions) -> None:
    storage, config = versions
    engine, report = engine_at(storage, 0, config.rollout)
    assert report["policy_update"] == "full" and not report["engine_reused"]
    storages = {name: tensor.data_ptr() for name, tensor in engine.model.state_dict().items()}
    again, report = engine_at(storage, 2, config.rollout)  # versions 1 and 2, in order
    assert again is engine and report["policy_update"] == "delta" and report["deltas"] == 2, report
    checkpoint_bytes = sum(e["size"] for e in storage.manifest(storage.checkpoint(2))["files"].values())
    assert 0 < report["fetched_bytes"] < checkpoint_bytes / 4, report
    assert {name: tensor.data_ptr() for name, tensor in engine.model.state_dict().items()} == storages
    assert engine.weight_digests() == digests_of(storage, 2)
    assert engine_at(storage, 2, config.rollout)[1]["policy_update"] == "kept"
    by_deltas = samples(engine)
    release_engine()
    assert samples(TransformersEngine(fetch_checkpoint(storage, 2))) == by_deltas  # tokens and logprobs


def test_a_missing_delta_falls_back_to_the_full_checkpoint_and_the_next_delta_serves_again(versions) -> None:
    storage, config = versions
    engine_at(storage, 0, config.rollout)
    (Path(storage.root) / storage.delta(2) / "COMMIT").unlink()  # not (yet) committed
    engine, report = engine_at(storage, 2, config.rollout)
    assert report["policy_update"] == "full" and "version 2 has no committed delta" in report["fallback"], report
    assert engine.weight_digests() == digests_of(storage, 2)
    assert engine_at(storage, 3, config.rollout)[1]["policy_update"] == "delta"
    assert engine.weight_digests() == digests_of(storage, 3)


@pytest.mark.parametrize("files", [1, 2])
def test_a_damaged_delta_falls_back_to_the_full_checkpoint_and_its_shard_has_a_fresh_engines_rows(
    run_root: Path, files: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delta file that does not verify: the engine falls back to the full checkpoint, even where the delta's files
    before it were already written in (its last of two, the first written while it downloaded), and the shard's rows
    are a fresh engine's."""
    uri, config = bf16_run(run_root, versions=1, files=files, **TRANSFORMERS)
    storage, shards = RunStorage(uri), config.rollout.num_shards
    delta_files = sorted((Path(storage.root) / storage.delta(1)).glob("delta-*.safetensors"))
    assert len(delta_files) == files
    data = bytearray(delta_files[-1].read_bytes())
    data[-1] ^= 0xFF  # a value's byte: same size, another digest
    delta_files[-1].write_bytes(bytes(data))
    applied = spy_applies(monkeypatch)
    assert rollout(uri, 1, 0, shards)["policy_update"] == "full"  # the engine holds version 0
    report = rollout(uri, 2, 0, shards)
    assert report["policy_update"] == "full" and "delta of version 1 does not verify" in report["fallback"], report
    assert applied == [("1", path.name) for path in delta_files[:-1]]
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("delta-fetch")]
    assert engine_at(storage, 1, config.rollout)[0].weight_digests() == digests_of(storage, 1)
    shard = Path(storage.root) / storage.rollout_shard(2, 0, shards)
    rows = shard.read_bytes()
    release_engine()
    shard.unlink()
    assert rollout(uri, 2, 0, shards)["policy_update"] == "full"  # a fresh engine
    assert shard.read_bytes() == rows


def spy_applies(monkeypatch: pytest.MonkeyPatch, then=None) -> list[tuple[str, str]]:
    """The delta files the engine writes in, (version, name) each, in order; then: called with each after it."""
    applied = []
    apply_delta = TransformersEngine.apply_delta

    def spied(engine: TransformersEngine, files: list[Path]) -> None:
        applied.extend((path.parent.name, path.name) for path in files)
        if then is not None:
            then(files)
        apply_delta(engine, files)

    monkeypatch.setattr(TransformersEngine, "apply_delta", spied)
    return applied


def test_an_engine_writes_each_delta_file_in_while_the_next_downloads(
    run_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: the deltas' files are fetched one after another on a thread, and each is written in as it arrives:
    a file's fetch does not end before the file ahead of it is being written (it waits for that, here; fetched
    all before any is written, it never would), in (version, name) order, and the engine holds each version's
    checkpoint. A write that fails falls back to the full checkpoint, the fetching thread stopped."""
    uri, config = bf16_run(run_root, versions=3, files=3, **TRANSFORMERS)
    storage = RunStorage(uri)
    events, writing = [], threading.Event()
    fetch_files = RunStorage.fetch_files

    def slow(self: RunStorage, folder: str, files: dict, local_dir: Path) -> None:
        for name in sorted(files):
            if events:  # not the first file: its fetch ends only once a file is being written
                writing.wait(timeout=10)
            fetch_files(self, folder, {name: files[name]}, local_dir)
            events.append(("fetched", local_dir.name, name))

    def applying(files: list[Path]) -> None:
        events.extend(("applying", path.parent.name, path.name) for path in files)
        writing.set()

    engine_at(storage, 0, config.rollout)
    monkeypatch.setattr(RunStorage, "fetch_files", slow)
    applied = spy_applies(monkeypatch, applying)
    engine, report = engine_at(storage, 2, config.rollout)
    assert report["policy_update"] == "delta" and report["deltas"] == 2, report
    names = sorted(path.name for path in (Path(storage.root) / storage.delta(1)).glob("delta-*.safetensors"))
    assert len(names) == 3 and applied == [(version, name) for version in "12" for name in names]
    assert events.index(("applying", "1", names[0])) < events.index(("fetched", "1", names[1])), events
    assert report["fetch_seconds"] >= 0 and report["fetch_wait_seconds"] >= 0 and report["engine_seconds"] > 0, report
    assert engine.weight_digests() == digests_of(storage, 2)

    def refuse(files: list[Path]) -> None:
        raise ValueError("not this model's")

    spy_applies(monkeypatch, refuse)
    engine, report = engine_at(storage, 3, config.rollout)
    assert report["policy_update"] == "full" and "version 3 does not fit the engine's weights" in report["fallback"]
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("delta-fetch")]
    assert engine.weight_digests() == digests_of(storage, 3)


def recommit(storage: RunStorage, version: int, folder: Path) -> None:
    """Replace version's committed delta folder by folder's files (a publisher's bug, or foreign data)."""
    target = Path(storage.root) / storage.delta(version)
    for path in target.iterdir():
        path.unlink()
    storage.commit_folder(storage.delta(version), folder, extra={"iteration": version})


def test_a_delta_that_verifies_but_is_not_the_versions_falls_back_to_the_full_checkpoint(
    versions, tmp_path: Path
) -> None:
    """Whole, committed, but wrong: a delta from another base; one leading elsewhere; one whose record is right but
    whose elements are another delta's. The engine checks bases and digests, never trusting the delta alone."""
    storage, config = versions
    checkpoints = [CheckpointTensors(fetch_checkpoint(storage, v)) for v in range(4)]
    record = (Path(storage.root) / storage.delta(2) / RECORD).read_bytes()
    wrong_elements = tmp_path / "wrong-elements"
    write_delta(checkpoints[1], checkpoints[3], wrong_elements)  # 1 -> 3's elements ...
    (wrong_elements / RECORD).write_bytes(record)  # ... under 1 -> 2's record
    other_base = tmp_path / "other-base"
    write_delta(checkpoints[0], checkpoints[2], other_base)
    (other_base / RECORD).write_bytes(record.replace(b'"base": 1', b'"base": 0'))
    expected = {"wrong-elements": "differs from version 2", "other-base": "starts from other weights"}
    for folder, why in expected.items():
        release_engine()
        engine_at(storage, 1, config.rollout)
        recommit(storage, 2, tmp_path / folder)
        engine, report = engine_at(storage, 2, config.rollout)
        assert report["policy_update"] == "full" and why in report["fallback"], (folder, report)
        assert engine.weight_digests() == digests_of(storage, 2)


def test_a_shard_checks_the_deltas_digest_beside_its_generating_and_generates_again_where_it_differs(
    versions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout step reads the weights' digest back while it generates (off the policy's way to the rollouts):
    the check is still running when generate starts, and the step waits for it before any row is kept. Under a
    delta whose elements are not its record's, the rows sampled with those weights are dropped: the shard, generated
    again after a full load, is byte for byte a fresh engine's, and its report says why."""
    storage, config = versions
    shards = config.rollout.num_shards
    wrong_elements = tmp_path / "wrong-elements"
    checkpoints = [CheckpointTensors(fetch_checkpoint(storage, v)) for v in (1, 3)]
    write_delta(*checkpoints, wrong_elements)  # 1 -> 3's elements under 1 -> 2's record
    (wrong_elements / RECORD).write_bytes((Path(storage.root) / storage.delta(2) / RECORD).read_bytes())
    pending_at_generate = []
    generate = TransformersEngine.generate

    def watched(engine: TransformersEngine, *args, **kwargs):
        pending_at_generate.append(engine.checking is not None and engine.weights.reading is not None)
        return generate(engine, *args, **kwargs)

    monkeypatch.setattr(TransformersEngine, "generate", watched)
    assert rollout(storage.uri, 2, 0, shards)["policy_update"] == "full"  # the engine holds version 1
    report = rollout(storage.uri, 3, 0, shards)  # version 2, by its right delta
    assert report["policy_update"] == "delta" and report["digest_wait_seconds"] >= 0, report
    assert pending_at_generate == [True, True]  # a full load's check runs beside the generating too
    recommit(storage, 2, wrong_elements)
    shard = Path(storage.root) / storage.rollout_shard(3, 0, shards)
    rows_by_delta = shard.read_bytes()
    shard.unlink()
    engine_at(storage, 1, config.rollout)
    report = rollout(storage.uri, 3, 0, shards)
    assert pending_at_generate[2:] == [True, False], pending_at_generate  # sampled beside the check, then again
    assert report["policy_update"] == "full", report
    assert "differs from version 2" in report["fallback"] and "generated again" in report["fallback"], report
    assert shard.read_bytes() == rows_by_delta
    release_engine()
    shard.unlink()
    assert rollout(storage.uri, 3, 0, shards)["policy_update"] == "full"  # a fresh engine
    assert shard.read_bytes() == rows_by_delta


def test_a_full_loads_check_beside_the_generating_keeps_the_rows_and_where_it_differs_the_engine_takes_no_delta(
    versions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a full load the shard reads the weights' digest back beside its generating too: the rows are the
    version's whatever it finds (the engine loaded the checkpoint itself). Where the weights do not read back as the
    version's record says, the engine keeps the version with no digest, and the next version comes whole, saying
    why; where they do, the next comes by its delta."""
    storage, config = versions
    shards = config.rollout.num_shards
    shard = Path(storage.root) / storage.rollout_shard(2, 0, shards)
    assert rollout(storage.uri, 2, 0, shards)["policy_update"] == "full"
    rows = shard.read_bytes()
    release_engine()
    shard.unlink()
    recorded = deltas.recorded_digests

    def misrecorded(storage: RunStorage, version: int) -> dict[str, str] | None:
        found = recorded(storage, version)
        return found and found | {min(found): "0" * 64}

    pending_at_generate = []
    generate = TransformersEngine.generate

    def watched(engine: TransformersEngine, *args, **kwargs):
        pending_at_generate.append(engine.checking is not None and engine.weights.reading is not None)
        return generate(engine, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(TransformersEngine, "generate", watched)
        patched.setattr(versions_module, "recorded_digests", misrecorded)
        report = rollout(storage.uri, 2, 0, shards)  # version 1, the check beside the generating finding it off
    assert pending_at_generate == [True]
    assert report["policy_update"] == "full" and "fallback" not in report, report
    assert shard.read_bytes() == rows
    engine, report = engine_at(storage, 2, config.rollout)
    assert report["policy_update"] == "full" and "after a full load its weights differ" in report["fallback"], report
    assert engine.held.version == 2 and engine.held.digest == weights_digest(digests_of(storage, 2))
    assert engine_at(storage, 3, config.rollout)[1]["policy_update"] == "delta"


def test_an_engine_moves_by_a_delta_whose_checkpoint_is_not_committed_and_a_full_load_waits_for_the_checkpoint(
    versions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a chunk's trainer leaves a version while it commits the checkpoint after the delta: a kept engine takes
    the delta (its COMMIT holds the weights' digest, its folder the config); a new engine needs the checkpoint, and
    waits for it while the trainer is heard, failing with a line that says so when it is not."""
    storage, config = versions
    expected = {version: digests_of(storage, version) for version in (2, 3)}
    commits = {version: Path(storage.root) / storage.checkpoint(version) / "COMMIT" for version in (2, 3)}
    held_back = {version: commit.read_bytes() for version, commit in commits.items()}
    engine_at(storage, 1, config.rollout)
    for commit in commits.values():
        commit.unlink()
    engine, report = engine_at(storage, 2, config.rollout)
    assert report["policy_update"] == "delta" and engine.weight_digests() == expected[2], report
    release_engine()
    monkeypatch.setattr(commands, "SILENT_SECONDS", 1.0)
    silent = "a rollout engine waits for checkpoint 3 from the chunk's trainer, which has not been heard from at all"
    with pytest.raises(MoeloopError, match=silent):
        engine_at(storage, 3, config.rollout)
    monkeypatch.setattr(commands, "SILENT_SECONDS", 60.0)
    heartbeat = commands.Heartbeat(storage, storage.TRAINER_HEARTBEAT)
    committed_later = threading.Timer(1.0, commits[3].write_bytes, [held_back[3]])
    committed_later.start()
    try:
        engine, report = engine_at(storage, 3, config.rollout)
    finally:
        committed_later.join()
        heartbeat.stop()
    assert report["policy_update"] == "full" and engine.weight_digests() == expected[3], report


def test_an_older_version_is_a_full_load(versions) -> None:
    storage, config = versions
    engine_at(storage, 2, config.rollout)
    engine, report = engine_at(storage, 1, config.rollout)
    assert report["policy_update"] == "full" and "later than 1" in report["fallback"]
    assert engine.weight_digests() == digests_of(storage, 1)


def test_publish_writes_the_delta_that_the_next_rollout_takes_and_its_rows_are_a_fresh_processs(run_root: Path) -> None:
    """The real steps from a bf16 start at an RL learning rate: publish commits checkpoint 1 with its weights' digest
    and deltas/iter-1; iteration 2's rollout, in the process that ran iteration 1's, takes the delta; its shard is
    byte for byte what a fresh process, loading the full checkpoint, writes."""
    uri, config = bf16_run(run_root, versions=0, iterations=2, trainer={"learning_rate": 1e-6}, **TRANSFORMERS)
    storage, shards = RunStorage(uri), config.rollout.num_shards
    for shard in range(shards):
        rollout(uri, 1, shard, shards)
    reward(uri, 1)
    train(uri, 1)
    published = publish(uri, 1)
    assert 0 < published["delta_bytes"] and 0 < published["delta_changed_fraction"] < 0.2, published
    assert storage.manifest(storage.checkpoint(1))["weights_digest"] == published["weights_digest"]
    report = rollout(uri, 2, 0, shards)
    assert report["policy_update"] == "delta" and report["deltas"] == 1, report
    shard = Path(storage.root) / storage.rollout_shard(2, 0, shards)
    by_delta = shard.read_bytes()
    shard.unlink()
    threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}  # as this process sampled: the same reductions
    run_step("rollout", uri, 2, "--shard", "0", "--num-shards", str(shards), env=threads, check=True)
    assert shard.read_bytes() == by_delta


@pytest.mark.slow
def test_an_engine_killed_mid_iteration_is_replaced_and_the_shard_retried_once_has_exact_rows(
    run_root: Path, tmp_path: Path
) -> None:
    """Two long-lived rollout processes (the local runner's workers, as long-lived rollout pods) serve one shard of
    two identical runs over iterations 1-3, moving by deltas; one is SIGKILLed in the middle of iteration 3 and a
    new one, built on the full checkpoint, retries that shard once: it commits exactly once, and its rows are the
    undisturbed process's."""
    sizes = {"rollout": {**SMALL_TRANSFORMERS_ROLLOUT, "prompts_per_iteration": 32, "samples_per_prompt": 8}}
    runs = [bf16_run(run_root / name, versions=2, **sizes) for name in ("undisturbed", "killed")]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}

    def command(uri: str, iteration: int) -> list[str]:
        return step_command("rollout", uri, iteration, "--shard", "0", "--num-shards", "2")

    def run(worker: StepWorker, uri: str, iteration: int) -> int:
        worker.start(command(uri, iteration), tmp_path / f"{Path(uri).parent.parent.name}-{iteration}.log")
        while worker.poll() is None:
            time.sleep(0.05)
        return worker.poll()

    undisturbed, killed = StepWorker(environment), StepWorker(environment)
    try:
        for worker, (uri, _) in ((undisturbed, runs[0]), (killed, runs[1])):
            assert [run(worker, uri, i) for i in (1, 2)] == [0, 0]
        started = time.perf_counter()
        assert run(undisturbed, runs[0][0], 3) == 0
        seconds = time.perf_counter() - started
        killed.start(command(runs[1][0], 3), tmp_path / "killed-3.log")
        time.sleep(seconds / 4)  # the worker is warm: the step's time is its engine's update and generation
        assert killed.poll() is None, "the shard finished before it could be killed"
        os.kill(killed.pid, signal.SIGKILL)
        killed.process.join()
        storages = [RunStorage(uri) for uri, _ in runs]
        shard = [Path(s.root) / s.rollout_shard(3, 0, 2) for s in storages]
        assert not shard[1].exists() and not list(shard[1].parent.glob("*.tmp-*"))
        replacement = StepWorker(environment)
        try:
            assert run(replacement, runs[1][0], 3) == 0
        finally:
            replacement.close()
    finally:
        undisturbed.close()
        killed.close()
    reports = [s.read_json(s.report(3, "rollout-0")) for s in storages]
    assert reports[0]["policy_update"] == "delta" and reports[1]["policy_update"] == "full", reports
    assert pq.read_table(shard[1]).equals(pq.read_table(shard[0]))
    assert pq.read_table(shard[1]).num_rows == 32 // 2 * 8


def test_a_delta_takes_its_bases_digests_from_the_bases_committed_record(versions, monkeypatch, tmp_path) -> None:
    """commit_delta does not hash version N-1 again: its committed record holds its tensors' digests (publish fetched
    the version verified against its COMMIT; a chunk trainer wrote and committed it), and the new record chains."""
    storage, _ = versions
    taken = []

    def recording(base, new, output, files=None, base_digests=None):
        taken.append(base_digests)
        return write_delta(base, new, output, files, base_digests)

    monkeypatch.setattr(deltas, "write_delta", recording)
    base = fetch_checkpoint(storage, 3)
    new = next_version(base, tmp_path / "version-4", seed=4)
    report = deltas.commit_delta(storage, 4, CheckpointTensors(base), CheckpointTensors(new), new / "config.json")
    record_3, record_4 = deltas.delta_files(storage, 3)[0], deltas.delta_files(storage, 4)[0]
    assert taken == [record_3["tensors"]]
    assert record_4["base_digest"] == record_3["digest"]
    assert record_4["digest"] == report["weights_digest"] == weights_digest(checkpoint_digests(CheckpointTensors(new)))
