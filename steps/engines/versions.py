"""How a kept rollout engine takes each iteration's policy version: from deltas, else from the full checkpoint.

The engine a process keeps (`moeloop.steps.engines.engine.engine_for`: a local runner's worker, a long-lived rollout
pod) holds one version of one run, with its weights' digest. Asked for a later version, it applies the deltas of the
versions between, in order (each one's base must be what it holds), each written into its weights in place, file by
file as each arrives while the next downloads (`DeltaFetches`), and then reads its weights' digest back out of them:
it must be the one the new version's checkpoint COMMIT records, as its delta's COMMIT does too: a chunk's trainer
commits the delta first and the checkpoint after, in the background (steps/rl/held.py), and an engine moves by the
delta without waiting for the checkpoint. A rollout shard reads the digest back beside its generating
(`engine_at(check_later=True)`, then `checked` before its rows are kept): the check, 3 of a GPU engine's 4.7 s at
Qwen3-30B-A3B (benchmarks/handoff.md), leaves the policy's way to the rollouts; where it fails, the rows are dropped
and the shard generated again after a full load. Anything else falls back to the full checkpoint, fetched and loaded
as a new engine is: a delta missing (not yet published, or left out by publish as no smaller than the checkpoint),
damaged (its COMMIT does not verify), of another base or leading elsewhere; the digest differing; an engine that
cannot take deltas (why: `Engine.map_weights`); an older version. A full load waits for the checkpoint's commit
while the trainer is heard. After every full load the engine checks its weights' digest too (a shard: beside its
generating, the rows standing whatever it finds): an engine whose layout deltas are not written in finds out on its
first load, and then takes full checkpoints only. A rollout pod or worker that lives across iterations calls
`engine_at(storage, version, ...)` each iteration and generates with the engine it returns.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from moeloop.steps.config import RolloutConfig
from moeloop.steps.engines.engine import (
    Engine,
    engine_for,
    engine_key,
    kept_engine,
    starts_beside_fetch,
    vllm_beside_fetch,
)
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.delta import CheckpointTensors, checkpoint_digests, weights_digest
from moeloop.steps.storage.cache import fetch_checkpoint, fetch_verified, local_scratch
from moeloop.steps.storage.commands import wait_while_heard
from moeloop.steps.storage.deltas import ARCHITECTURE, delta_files, fetch_delta, recorded_digests
from moeloop.steps.storage.run import RunStorage


@dataclass(frozen=True)
class Held:
    """The policy version an engine holds: run, version, and its weights' digest, verified (None: the engine cannot
    read it back, and takes full checkpoints only)."""

    run: str
    version: int
    digest: str | None


@dataclass(frozen=True)
class Checking:
    """A version a kept engine moved to by deltas, or loaded whole, its weights' digest being read back beside what
    it does next (engine_at's check_later). Moved by deltas, the engine holds the version once `checked` finds the
    digest the version's. Loaded whole (loaded), it holds the version already, the rows it samples are the version's
    whatever the check finds: the check tells whether it can read its weights back, so take deltas."""

    held: Held
    expected: dict[str, str]  # the version's record of each tensor's digest: names the first that differs
    loaded: bool = False


class DeltaUnusable(Exception):
    """Why an engine could not move to a version by deltas: it falls back to the full checkpoint."""


def engine_at(
    storage: RunStorage, version: int, settings: RolloutConfig, record_routing: bool = False, check_later: bool = False
) -> tuple[Engine, dict[str, Any]]:
    """This process's engine holding the run's checkpoint `version`, and how it got there: `policy_update` kept (it
    held it), delta (applied in place), or full (the checkpoint fetched and loaded, with `fallback`: why no delta
    served, where the engine held an earlier version), and the seconds and bytes it took. A new vLLM engine on a GPU
    starts beside the checkpoint's fetch (`starts_beside_fetch`). check_later: a delta's digest check (after a delta or
    a full load) runs beside what the caller does next, and `checked` finishes it."""
    started = time.perf_counter()
    folder, manifest, architecture = committed_architecture(storage, version)
    engine = kept_engine(engine_key(architecture, settings, record_routing))
    if engine is not None and engine.checking is not None:  # left by a shard that failed before its check
        engine.weight_digests()  # the read ends before the weights change; unchecked, the engine holds no version
        engine.checking, engine.held = None, None
    held = engine.held if engine is not None else None
    fallback = None
    if held is not None and held.run == storage.uri:
        if held.version == version:
            return engine, {"policy_update": "kept", "engine_reused": True, "fetch_seconds": 0.0, "fetched_bytes": 0,
                            "fetch_wait_seconds": 0.0, "engine_seconds": 0.0}  # fmt: skip
        try:
            return engine, advance(engine, storage, version, manifest.get("weights_digest"), started, check_later)
        except DeltaUnusable as why:
            fallback = str(why)
    if folder != storage.checkpoint(version):
        manifest = committed_checkpoint(storage, version)
    waiting = time.perf_counter()
    if engine is None and starts_beside_fetch(settings.engine, architecture):  # a new engine: its start hides it
        fetch = partial(fetch_checkpoint, storage, version)
        settings_dir = checkpoint_settings(storage, version, manifest)
        engine, checkpoint_dir, fetched, waited = vllm_beside_fetch(settings_dir, fetch, settings, record_routing)
        reused = False
    else:
        checkpoint_dir = fetch_checkpoint(storage, version)
        fetched = waited = time.perf_counter() - waiting  # fetched before the load: all of it waited for
        engine, reused = engine_for(checkpoint_dir, settings, record_routing)
    if engine.held is None or engine.held.run != storage.uri or engine.held.version != version:
        verify_full_load(engine, storage, version, checkpoint_dir, check_later)
    report = {"policy_update": "full", "engine_reused": reused, "fetch_seconds": round(fetched, 3),
              "fetched_bytes": sum(entry["size"] for entry in manifest["files"].values()),
              "fetch_wait_seconds": round(waited, 3),
              "engine_seconds": round(time.perf_counter() - started - waited, 3)}  # fmt: skip
    return engine, report | ({"fallback": fallback} if fallback else {})


def committed_architecture(storage: RunStorage, version: int) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Where version's weights digest and config.json are read from, its COMMIT manifest and the config, read from
    the run (its weights need not be fetched: a kept engine may take deltas): the committed checkpoint's, or where
    only its delta is committed yet (a chunk's trainer commits the checkpoint after it, steps/rl/held.py), the
    delta's."""
    for folder in (storage.checkpoint(version), storage.delta(version)):
        manifest = storage.manifest(folder)
        if manifest is not None and ARCHITECTURE in manifest["files"]:
            config = storage.read_committed(folder, manifest, [ARCHITECTURE])[ARCHITECTURE]
            return folder, manifest, json.loads(config)
    checkpoint = storage.display(storage.checkpoint(version))
    raise MoeloopError(f"checkpoint of iteration {version} is not committed: {checkpoint}")


def checkpoint_settings(storage: RunStorage, version: int, manifest: dict[str, Any]) -> Path:
    """The committed checkpoint's files but its weights (its config and tokenizer), fetched: what a new vLLM engine
    starts from before the weights have come (`vllm_beside_fetch`)."""
    files = {name: entry for name, entry in manifest["files"].items() if not name.endswith(".safetensors")}
    return fetch_verified(storage, storage.checkpoint(version), files)


def committed_checkpoint(storage: RunStorage, version: int) -> dict[str, Any]:
    """The checkpoint's COMMIT manifest, once committed: where only its delta is yet, the chunk's trainer commits it
    next; waited for while the trainer is heard."""
    folder = storage.checkpoint(version)
    waiter = f"a rollout engine waits for checkpoint {version} from the chunk's trainer"
    wait_while_heard(storage, lambda: storage.is_committed(folder), storage.TRAINER_HEARTBEAT, waiter)
    return storage.manifest(folder)


def advance(
    engine: Engine, storage: RunStorage, version: int, target: str | None, started: float, check_later: bool
) -> dict[str, Any]:
    """Move a kept engine from the version it holds to a later one (target: its weights' digest, as its checkpoint's
    COMMIT records it, or its delta's before the checkpoint is committed), by the deltas between, and check its
    weights' digest, or start the check (check_later): its report. Every delta's record is read and the chain checked
    before any weight is written; then the files are fetched on a thread (`DeltaFetches`) and each is written in
    as soon as it has arrived. The report's fetch_seconds: what that thread spent fetching; fetch_wait_seconds: what
    the writing waited for a file to arrive; engine_seconds: the wall time since `started` (engine_at's start) less
    fetch_wait_seconds, i.e. the records' reads, the in-place writes and the digest check (or its start)."""
    held = engine.held
    if version < held.version:
        raise DeltaUnusable(f"the engine holds version {held.version}, later than {version}")
    if held.digest is None:
        raise DeltaUnusable(engine.delta_refusal)
    if target is None:
        raise DeltaUnusable(f"version {version}'s COMMIT records no weights digest to check a delta against")
    chain, digest, expected = [], held.digest, {}
    for step in range(held.version + 1, version + 1):
        record, files = delta_of(storage, step, digest)
        chain.append((step, files))
        digest, expected = record["digest"], record["tensors"]
    if digest != target:
        raise DeltaUnusable(f"the delta of version {version} leads to other weights than its checkpoint's")
    engine.held = None  # from the first write on, until the digest is checked, it holds no known version
    with local_scratch() as scratch, DeltaFetches(storage, chain, scratch) as fetches:
        for step, path in fetches:
            try:
                engine.apply_delta([path])
            except (KeyError, ValueError) as error:  # verified, yet not of this model: a publisher's error
                raise DeltaUnusable(f"the delta of version {step} does not fit the engine's weights: {error}") from None
    engine.checking = Checking(Held(storage.uri, version, target), expected)
    if check_later:
        engine.start_weight_digests()
    else:
        checked(engine)
    fetched_bytes = sum(entry["size"] for _, files in chain for entry in files.values())
    return {"policy_update": "delta", "engine_reused": True, "deltas": version - held.version,
            "fetch_seconds": round(fetches.fetch_seconds, 3), "fetched_bytes": fetched_bytes,
            "fetch_wait_seconds": round(fetches.wait_seconds, 3),
            "engine_seconds": round(time.perf_counter() - started - fetches.wait_seconds, 3)}  # fmt: skip


class DeltaFetches:
    """The files of a chain of deltas ([(version, its files' COMMIT entries)]), fetched into scratch one after
    another, in (version, name) order, on a thread of their own, and handed out in that order as each arrives
    verified: (version, path). Why: the engine writes one file in while the next downloads, so a version's fetch and
    in-place write overlap instead of adding up on the policy's way to the rollouts (issue 38; ~0.9 s and ~1.7 s
    at Qwen3-30B-A3B). A file that does not verify is DeltaUnusable when its turn comes. Leaving the context cancels
    the fetches not started and waits for the one running: no thread writes into scratch after it."""

    def __init__(self, storage: RunStorage, chain: list[tuple[int, dict[str, Any]]], scratch: Path) -> None:
        self.fetch_seconds = 0.0  # the fetching thread's, once the context is left
        self.wait_seconds = 0.0  # the caller's, waiting for a file to arrive
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="delta-fetch")
        self._pending = [
            (step, self._thread.submit(self._fetch, storage, step, name, files[name], scratch / str(step)))
            for step, files in chain
            for name in sorted(files)
        ]

    def _fetch(self, storage: RunStorage, step: int, name: str, entry: dict[str, Any], folder: Path) -> Path:
        started = time.perf_counter()
        try:
            return fetch_delta(storage, step, {name: entry}, folder)[0]
        finally:
            self.fetch_seconds += time.perf_counter() - started

    def __enter__(self) -> DeltaFetches:
        return self

    def __exit__(self, *_: object) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    def __iter__(self) -> Iterator[tuple[int, Path]]:
        for step, fetched in self._pending:
            started = time.perf_counter()
            try:
                path = fetched.result()
            except MoeloopError as error:
                raise DeltaUnusable(f"the delta of version {step} does not verify: {error}") from None
            finally:
                self.wait_seconds += time.perf_counter() - started
            yield step, path


def checked(engine: Engine) -> float:
    """Finish the digest check engine_at(check_later=True) left running. After deltas, the engine then holds the
    version it moved to (DeltaUnusable, and it holds none, where its weights' digest is not the version's). After a
    full load it holds the version either way, with the digest where its weights read back as the checkpoint's, else
    none and why in `engine.delta_refusal`: it takes full checkpoints from then on. The seconds waited for it; 0
    where none was pending."""
    checking, engine.checking = engine.checking, None
    if checking is None:
        return 0.0
    started = time.perf_counter()
    actual = engine.weight_digests()
    differing = sorted(name for name in checking.expected if actual.get(name) != checking.expected[name])
    if checking.loaded:
        if differing:  # it keeps holding the version, with no digest
            engine.delta_refusal = f"after a full load its weights differ from the checkpoint's at {differing[0]}"
            return time.perf_counter() - started
    elif weights_digest(actual) != checking.held.digest:
        version = checking.held.version
        raise DeltaUnusable(f"after the deltas its weights' digest differs from version {version}'s at {differing[:1]}")
    engine.held = checking.held
    return time.perf_counter() - started


def delta_of(storage: RunStorage, version: int, base_digest: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Version's delta record and files, checked to start from base_digest."""
    try:
        found = delta_files(storage, version)
    except MoeloopError as error:
        raise DeltaUnusable(f"the delta of version {version} is damaged: {error}") from None
    if found is None:
        raise DeltaUnusable(f"version {version} has no committed delta")
    record, files = found
    if not files:
        raise DeltaUnusable(f"publish left version {version}'s delta out (no smaller than the checkpoint)")
    if record.get("base") != version - 1 or record.get("base_digest") != base_digest:
        raise DeltaUnusable(f"the delta of version {version} starts from other weights than the engine holds")
    return record, files


def verify_full_load(
    engine: Engine, storage: RunStorage, version: int, checkpoint_dir: Path, check_later: bool = False
) -> None:
    """After a full load: the version the engine holds, and whether it can read its weights back as the
    checkpoint's (their digest, against the version's record, else the files'): if not, why, in
    `engine.delta_refusal`, and it takes full checkpoints from then on. check_later: the read runs beside what the
    caller does next (the shard's generating: the rows are the version's whatever it finds), and `checked` ends it."""
    engine.delta_refusal = engine.map_weights(checkpoint_dir)
    engine.held = Held(storage.uri, version, None)  # its digest once the check finds it
    if engine.delta_refusal is not None:
        return
    expected = recorded_digests(storage, version) or checkpoint_digests(CheckpointTensors(checkpoint_dir))
    engine.checking = Checking(Held(storage.uri, version, weights_digest(expected)), expected, loaded=True)
    if check_later:
        engine.start_weight_digests()
    else:
        checked(engine)
