"""start's model.checkpoint on a real S3 server (SeaweedFS): a moeloop checkpoint is verified against its
COMMIT; an HF checkpoint from outside moeloop is trusted as the run first finds it, pinned in
data/model-source.json, and verified against that record after; damaged sources publish nothing."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy
from moeloop.steps.start import fetch_model_source, start
from moeloop.steps.storage import s3
from moeloop.steps.storage.manifest import COMMIT, PART_SIZE
from moeloop.steps.storage.run import RunStorage
from tests.conftest import small_config
from tests.seaweed import SeaweedS3

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small HF checkpoint folder (the tiny Qwen3-MoE, untrained), as another tool would have saved it."""
    folder = tmp_path_factory.mktemp("hf") / "checkpoint"
    tokenizer = build_tokenizer(["abcdefghijklmnopqrstuvwxyz: "])
    save_policy(build_tiny_model(small_config().model.tiny, tokenizer, seed=1), tokenizer, folder)
    return folder


def upload_as_is(seaweed: SeaweedS3, uri: str, folder: Path) -> None:
    """Plain PUTs, as `aws s3 cp --recursive` would leave it: no COMMIT."""
    prefix = s3.parse_s3_uri(uri).key
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(folder).as_posix()}"
        seaweed.client().put_object(Bucket=seaweed.bucket, Key=key, Body=path.read_bytes())


def damage(seaweed: SeaweedS3, uri: str, how: str) -> None:
    key = f"{s3.parse_s3_uri(uri).key}/{WEIGHTS}"
    data = bytearray(seaweed.client().get_object(Bucket=seaweed.bucket, Key=key)["Body"].read())
    if how == "corrupted":
        data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the digest tells
    else:
        del data[-100:]
    seaweed.client().put_object(Bucket=seaweed.bucket, Key=key, Body=bytes(data))


def with_source(uri: str) -> object:
    return small_config(model={"checkpoint": uri})


def assert_nothing_published(run: str) -> None:
    storage = RunStorage(run)
    assert not storage.exists(f"{storage.checkpoint(0)}/{COMMIT}")
    assert storage.latest() is None


def blake3_of_parts(data: bytes) -> str:
    """The README's digest, written out here: BLAKE3 over the BLAKE3 of each 8 MiB part."""
    parts = [data[o : o + PART_SIZE] for o in range(0, len(data), PART_SIZE)] or [b""]
    return blake3.blake3(b"".join(blake3.blake3(part).digest() for part in parts)).hexdigest()


@pytest.mark.parametrize("how", ["corrupted", "truncated"])
def test_a_moeloop_checkpoint_as_source_is_verified_against_its_commit(
    s3_run_root: str,
    hf_checkpoint: Path,
    seaweed: SeaweedS3,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    how: str,
) -> None:
    source = RunStorage(f"{s3_run_root}/other-run")
    source.commit_folder(source.checkpoint(3), hf_checkpoint, extra={"iteration": 3})
    uri = source.display(source.checkpoint(3))

    assert start(f"{s3_run_root}/good", with_source(uri))["source"] == uri
    assert RunStorage(f"{s3_run_root}/good").latest()["iteration"] == 0
    assert not RunStorage(f"{s3_run_root}/good").exists(RunStorage.MODEL_SOURCE)  # its COMMIT is the record

    damage(seaweed, uri, how)
    monkeypatch.setenv("MOELOOP_CACHE", str(tmp_path / "fresh-cache"))
    expected = "object does not match its COMMIT: " if how == "corrupted" else rf"{WEIGHTS} does not match its COMMIT"
    with pytest.raises(MoeloopError, match=expected) as refused:
        start(f"{s3_run_root}/bad", with_source(uri))
    assert f"{uri}/{WEIGHTS}" in str(refused.value) and "\n" not in str(refused.value)
    assert_nothing_published(f"{s3_run_root}/bad")


def test_an_outside_checkpoint_is_pinned_at_first_fetch_and_verified_against_that_after(
    s3_run_root: str, hf_checkpoint: Path, seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    uri = f"{s3_run_root}/models/tiny-hf"
    upload_as_is(seaweed, uri, hf_checkpoint)
    run = f"{s3_run_root}/run"

    assert start(run, with_source(uri))["source"] == uri

    record = json.loads(RunStorage(run).read_bytes(RunStorage.MODEL_SOURCE))
    assert record["uri"] == uri
    expected = {p.relative_to(hf_checkpoint).as_posix(): p.read_bytes() for p in hf_checkpoint.rglob("*")}
    assert {name: entry["blake3_of_parts"] for name, entry in record["files"].items()} == {
        name: blake3_of_parts(data) for name, data in expected.items()
    }
    local, first_found = fetch_model_source(RunStorage(run), uri)  # from the cache, verified again
    assert first_found is None and (local / WEIGHTS).read_bytes() == expected[WEIGHTS]

    for how in ("corrupted", "truncated"):
        upload_as_is(seaweed, uri, hf_checkpoint)
        damage(seaweed, uri, how)
        monkeypatch.setenv("MOELOOP_CACHE", str(tmp_path / f"cache-{how}"))  # a re-run on another node
        with pytest.raises(MoeloopError, match=r"^model.checkpoint is not what this run first fetched") as refused:
            fetch_model_source(RunStorage(run), uri)
        assert f"{uri}/{WEIGHTS}" in str(refused.value) and "\n" not in str(refused.value)
        assert not list((tmp_path / f"cache-{how}").rglob(WEIGHTS))  # nothing unverified entered the cache


def test_a_truncated_outside_checkpoint_records_and_publishes_nothing(
    s3_run_root: str, hf_checkpoint: Path, seaweed: SeaweedS3
) -> None:
    uri = f"{s3_run_root}/models/truncated"
    upload_as_is(seaweed, uri, hf_checkpoint)
    damage(seaweed, uri, "truncated")  # an upload cut short: there is nothing to check it against but itself
    run = f"{s3_run_root}/run"

    with pytest.raises(MoeloopError, match=rf"^model.checkpoint {uri} does not load: .*incomplete metadata") as refused:
        start(run, with_source(uri))

    assert "\n" not in str(refused.value)
    assert_nothing_published(run)
    assert not RunStorage(run).exists(RunStorage.MODEL_SOURCE)  # a re-run, once the upload is whole, starts over


def test_a_bucket_is_not_a_model_folder(s3_run_root: str) -> None:
    with pytest.raises(MoeloopError, match="must name a folder"):
        start(f"{s3_run_root}/run", with_source("s3://moeloop"))
