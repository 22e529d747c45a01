"""The storage module's commit protocol on both backends (a local folder and a real S3 server, SeaweedFS),
the server's own guarantees that the protocol relies on, and storage URIs that are refused."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import blake3
import botocore.exceptions
import pytest

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.manifest import COMMIT, PART_SIZE
from moeloop.steps.storage.run import RunStorage
from tests.seaweed import SeaweedS3


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunStorage]:
    """An empty run folder on each backend."""
    if request.param == "local":
        yield RunStorage(str(tmp_path / "run"))
    else:
        yield RunStorage(request.getfixturevalue("s3_run_root") + "/run")


def checkpoint_files(folder: Path, big: bool = False) -> Path:
    """A few files like a checkpoint's; with big, one spans several multipart parts (3.5 x 8 MiB)."""
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "config.json").write_text('{"hidden_size": 64}')
    (folder / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    (folder / "empty.bin").write_bytes(b"")
    size = 7 * PART_SIZE // 2 if big else 1000
    (folder / "model.safetensors").write_bytes(os.urandom(size))
    return folder


def sha256_tree(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def blake3_of_parts(data: bytes, part_size: int = PART_SIZE) -> str:
    """The digest as the README defines it, written out here independently of steps/storage/run.py."""
    parts = [data[offset : offset + part_size] for offset in range(0, len(data), part_size)] or [b""]
    return blake3.blake3(b"".join(blake3.blake3(part).digest() for part in parts)).hexdigest()


# -- the server: what the protocol relies on ------------------------------------------------------


def test_seaweedfs_checks_credentials_and_refuses_unknown_buckets(seaweed: SeaweedS3) -> None:
    client = seaweed.client()
    client.put_object(Bucket=seaweed.bucket, Key="facts/object", Body=b"one")
    wrong = SeaweedS3(seaweed.endpoint, seaweed.access_key, "not-the-secret", seaweed.bucket, [], seaweed.process)
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        wrong.client().get_object(Bucket=seaweed.bucket, Key="facts/object")
    assert refused.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    with pytest.raises(botocore.exceptions.ClientError) as missing:
        client.put_object(Bucket="no-such-bucket", Key="x", Body=b"x")
    assert missing.value.response["Error"]["Code"] == "NoSuchBucket"


def test_seaweedfs_honours_if_none_match_with_exactly_one_winner(seaweed: SeaweedS3) -> None:
    """The COMMIT marker's conditional put: of 8 concurrent creators exactly one wins, and its bytes stay."""
    client = seaweed.client()
    client.put_object(Bucket=seaweed.bucket, Key="facts/existing", Body=b"first")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        client.put_object(Bucket=seaweed.bucket, Key="facts/existing", Body=b"second", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert client.get_object(Bucket=seaweed.bucket, Key="facts/existing")["Body"].read() == b"first"

    barrier, outcomes = threading.Barrier(8), {}

    def create(writer: int) -> None:
        barrier.wait()
        try:
            client.put_object(
                Bucket=seaweed.bucket, Key="facts/race", Body=f"writer {writer}".encode(), IfNoneMatch="*"
            )
            outcomes[writer] = "created"
        except botocore.exceptions.ClientError as error:
            outcomes[writer] = error.response["Error"]["Code"]

    threads = [threading.Thread(target=create, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [w for w, outcome in outcomes.items() if outcome == "created"]
    assert len(winners) == 1, outcomes
    assert {o for o in outcomes.values() if o != "created"} == {"PreconditionFailed"}
    assert client.get_object(Bucket=seaweed.bucket, Key="facts/race")["Body"].read() == f"writer {winners[0]}".encode()


# -- the commit protocol, on both backends ------------------------------------------------------


def test_folder_commits_only_with_its_manifest_and_round_trips_verified(storage: RunStorage, tmp_path: Path) -> None:
    source = checkpoint_files(tmp_path / "source", big=storage.uri.startswith("s3://"))
    folder = storage.checkpoint(1)
    storage.put_objects(folder, {"model.safetensors": source / "model.safetensors"})
    assert not storage.is_committed(folder)  # data objects alone are not a commit
    with pytest.raises(MoeloopError, match="not committed"):
        storage.fetch_folder(folder, tmp_path / "early")

    manifest = storage.commit_folder(folder, source, extra={"iteration": 1})

    assert manifest == storage.manifest(folder)
    assert manifest["iteration"] == 1
    assert {n: e["blake3_of_parts"] for n, e in manifest["files"].items()} == {
        p.relative_to(source).as_posix(): blake3_of_parts(p.read_bytes()) for p in source.rglob("*") if p.is_file()
    }
    assert manifest["files"]["model.safetensors"]["size"] == (source / "model.safetensors").stat().st_size
    storage.fetch_folder(folder, tmp_path / "copy")
    assert sha256_tree(tmp_path / "copy") == sha256_tree(source)
    storage.fetch_folder(folder, tmp_path / "without", exclude={"model.safetensors"})
    assert set(sha256_tree(tmp_path / "without")) == set(sha256_tree(source)) - {"model.safetensors"}


def test_committing_again_is_a_no_op_and_different_content_is_refused(storage: RunStorage, tmp_path: Path) -> None:
    source = checkpoint_files(tmp_path / "source")
    folder = storage.trainer_state(1)
    first = storage.commit_folder(folder, source, extra={"iteration": 1})
    marker = storage.read_bytes(f"{folder}/{COMMIT}")

    assert storage.commit_folder(folder, source, extra={"iteration": 1}) == first
    (source / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(MoeloopError, match="already committed with different content"):
        storage.commit_folder(folder, source, extra={"iteration": 1})
    assert storage.read_bytes(f"{folder}/{COMMIT}") == marker
    storage.fetch_folder(folder, tmp_path / "copy")  # the committed objects are untouched


def test_a_concurrent_commit_with_the_same_files_is_the_same_commit(storage: RunStorage) -> None:
    files = storage.put_objects("trainer/iter-000002", {"a.bin": b"alpha"})
    assert storage.commit("trainer/iter-000002", files, {"iteration": 2}) == storage.commit(
        "trainer/iter-000002", files, {"iteration": 2}
    )
    with pytest.raises(MoeloopError, match="different content"):
        storage.commit("trainer/iter-000002", files, {"iteration": 3})


def test_a_manifest_that_does_not_match_its_objects_is_refused_naming_the_object(
    storage: RunStorage, tmp_path: Path
) -> None:
    folder = storage.checkpoint(3)
    storage.commit_folder(folder, checkpoint_files(tmp_path / "source"))

    storage.write_bytes(f"{folder}/config.json", b'{"hidden_size": 65}')  # same size, other bytes
    with pytest.raises(MoeloopError, match=rf"object does not match its COMMIT: .*{folder}/config.json$"):
        storage.fetch_folder(folder, tmp_path / "copy")
    storage.write_bytes(f"{folder}/config.json", b"{}")  # another size: caught by the listing alone
    with pytest.raises(MoeloopError, match=rf"{folder}/config.json does not match its COMMIT \(size 2"):
        storage.is_committed(folder)
    storage.write_bytes(f"{folder}/{COMMIT}", b"not json")
    with pytest.raises(MoeloopError, match=rf"not a valid COMMIT manifest: .*{folder}/COMMIT"):
        storage.is_committed(folder)


def test_large_objects_round_trip_through_parallel_parts(storage: RunStorage) -> None:
    data = os.urandom(5 * PART_SIZE // 2)
    storage.write_bytes("experience/iter-000001/rewards.parquet", data)
    assert storage.read_bytes("experience/iter-000001/rewards.parquet") == data
    files = storage.put_objects("experience/iter-000001", {"big.parquet": data})
    manifest = storage.commit("experience/iter-000001", files)
    assert storage.read_committed("experience/iter-000001", manifest, ["big.parquet"]) == {"big.parquet": data}


@pytest.mark.parametrize("part", [0, 1, 2])
def test_a_damaged_part_of_a_large_object_is_caught_whichever_part_it_is(storage: RunStorage, part: int) -> None:
    """Each part is hashed by the thread that fetched it; a change in any one of them fails the object."""
    data = os.urandom(5 * PART_SIZE // 2)
    folder = "experience/iter-000001"
    manifest = storage.commit(folder, storage.put_objects(folder, {"big.parquet": data}))
    damaged = bytearray(data)
    damaged[part * PART_SIZE + 12345] ^= 0x01
    storage.write_bytes(f"{folder}/big.parquet", bytes(damaged))  # same size: only the digest tells

    with pytest.raises(MoeloopError, match=rf"^object does not match its COMMIT: .*{folder}/big.parquet$"):
        storage.read_committed(folder, manifest, ["big.parquet"])


def test_a_first_format_commit_is_refused_by_name(storage: RunStorage) -> None:
    files = {"w.bin": {"size": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}}
    storage.write_bytes("checkpoints/iter-000001/w.bin", b"weights")
    storage.write_bytes("checkpoints/iter-000001/COMMIT", json.dumps({"files": files, "iteration": 1}).encode())
    with pytest.raises(MoeloopError, match=r"COMMIT is in the first COMMIT format .* start a new run") as refused:
        storage.is_committed("checkpoints/iter-000001")
    assert "\n" not in str(refused.value)


def test_conditional_create_keeps_the_first_object(storage: RunStorage) -> None:
    assert storage.create_bytes("metrics/iter-000001.json", b"first")
    assert not storage.create_bytes("metrics/iter-000001.json", b"second")
    assert storage.read_bytes("metrics/iter-000001.json") == b"first"


def test_latest_moves_only_forward_under_concurrent_publishers(storage: RunStorage, tmp_path: Path) -> None:
    source = checkpoint_files(tmp_path / "source")
    for iteration in range(1, 9):
        storage.commit_folder(storage.checkpoint(iteration), source)
    publishers = [
        threading.Thread(target=RunStorage(storage.uri).move_latest, args=(iteration,)) for iteration in range(1, 9)
    ]
    for thread in publishers:
        thread.start()
    for thread in publishers:
        thread.join()
    assert storage.latest() == {"iteration": 8, "checkpoint": "checkpoints/iter-000008"}
    storage.move_latest(3)  # a re-run of an older publish
    assert storage.latest()["iteration"] == 8


def test_listing_skips_local_writes_in_progress(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    storage.write_json("reports/iter-000001/train.json", {"seconds": 1})
    (tmp_path / "run" / "reports" / "iter-000001" / "reward.json.tmp-0123abcd").write_text('{"sec')  # a crash's
    assert storage.list("reports/iter-000001") == ["train.json"]


# -- refused storage URIs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://", "needs a bucket"),
        ("s3:///prefix", "needs a bucket"),
        ("s3://Not_A_Bucket/runs", "not a valid S3 bucket name: 'Not_A_Bucket'"),
        ("s3://bucket/runs/../other", "must not contain '..' path segments: s3://bucket/runs/../other"),
        ("s3://bucket/runs//tiny", "must not contain 'empty' path segments"),
        ("s3://bucket/runs?versionId=3", "takes no query or fragment"),
        ("gs://bucket/runs", "unsupported storage URI scheme 'gs'"),
        ("/tmp/runs/../elsewhere", "must not contain '..' path segments"),
        ("", "storage URI is empty"),
    ],
)
def test_malformed_storage_uris_are_refused_before_any_request(uri: str, message: str) -> None:
    with pytest.raises(MoeloopError) as refused:
        RunStorage(uri)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_credentials_in_a_uri_are_refused_without_echoing_them() -> None:
    with pytest.raises(MoeloopError) as refused:
        RunStorage("s3://AKIAEXAMPLE:hunter2secret@bucket/runs")
    assert "credentials in a URI are refused" in str(refused.value)
    assert "hunter2secret" not in str(refused.value) and "AKIAEXAMPLE" not in str(refused.value)


def test_a_missing_bucket_is_named_on_first_use(s3_run_root: str) -> None:
    storage = RunStorage("s3://no-such-bucket/runs/tiny")
    with pytest.raises(MoeloopError, match=r"^bucket does not exist: s3://no-such-bucket "):
        storage.exists("config.yaml")


def test_manifest_lists_sizes_and_checksums_in_json(storage: RunStorage) -> None:
    """The COMMIT format that other tools can read: JSON, names relative to the folder."""
    files = storage.put_objects("checkpoints/iter-000004", {"w.bin": b"weights"})
    storage.commit("checkpoints/iter-000004", files, {"iteration": 4})
    marker = json.loads(storage.read_bytes("checkpoints/iter-000004/COMMIT"))
    assert marker == {
        "format": 2,
        "files": {"w.bin": {"size": 7, "part_size": PART_SIZE, "blake3_of_parts": blake3_of_parts(b"weights")}},
        "iteration": 4,
    }
