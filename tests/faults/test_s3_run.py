"""Steps and `moeloop run` against a real S3 server (SeaweedFS): bad input and foreign data give one line,
`error: ...` naming the object, a non-zero exit, and nothing published; credentials never show."""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from moeloop.steps.errors import EXIT_USER_ERROR
from moeloop.steps.start import start
from moeloop.steps.storage.experience import EPISODE_COLUMNS, ROLLOUT_SCHEMA, table_bytes
from moeloop.steps.storage.run import RunStorage
from tests.conftest import small_config
from tests.seaweed import SeaweedS3
from tests.faults.test_bad_input import assert_user_error
from tests.processes import moeloop_cli, run_step

# Every test's processes find the checkpoint cache in its own folder.
pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture(scope="module")
def started_s3_run(s3_environment: dict[str, str], seaweed: SeaweedS3) -> str:
    """A run on S3 after its start step (checkpoint 0, LATEST), built in-process."""
    uri = f"s3://{seaweed.bucket}/started/{uuid.uuid4().hex[:8]}/small"
    start(uri, small_config(iterations=2))
    return uri


@pytest.fixture
def s3_run(started_s3_run: str, seaweed: SeaweedS3) -> str:
    """A private copy of the started run (server-side copies), for a test that damages it."""
    client = seaweed.client()
    source = started_s3_run.removeprefix(f"s3://{seaweed.bucket}/")
    target = f"copies/{uuid.uuid4().hex[:8]}/small"
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=seaweed.bucket, Prefix=f"{source}/"):
        for entry in page.get("Contents", []):
            client.copy_object(
                Bucket=seaweed.bucket,
                Key=target + entry["Key"].removeprefix(source),
                CopySource={"Bucket": seaweed.bucket, "Key": entry["Key"]},
            )
    return f"s3://{seaweed.bucket}/{target}"


def objects(seaweed: SeaweedS3, uri: str) -> dict[str, str]:
    """Every object under uri: {key: ETag}. Equal snapshots mean nothing was written."""
    prefix = uri.removeprefix(f"s3://{seaweed.bucket}/") + "/"
    pages = seaweed.client().get_paginator("list_objects_v2").paginate(Bucket=seaweed.bucket, Prefix=prefix)
    return {e["Key"]: e["ETag"] for page in pages for e in page.get("Contents", [])}


def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(small_config(iterations=1).model_dump_json())  # JSON is YAML
    return path


# -- `moeloop run` refuses before writing anything --------------------------------------------


def test_run_on_a_bucket_that_does_not_exist(
    s3_environment: dict[str, str], seaweed: SeaweedS3, tmp_path: Path
) -> None:
    result = moeloop_cli("run", str(config_file(tmp_path)), "--root", "s3://no-such-bucket/runs", cwd=tmp_path)

    assert result.returncode == EXIT_USER_ERROR
    assert_user_error(result, "bucket does not exist: s3://no-such-bucket", "s3://no-such-bucket/runs/tiny")
    assert not (tmp_path / ".moeloop").exists()
    assert "no-such-bucket" not in {b["Name"] for b in seaweed.client().list_buckets()["Buckets"]}


def test_run_with_a_wrong_secret_names_the_refusal_and_never_the_credentials(
    s3_environment: dict[str, str], seaweed: SeaweedS3, tmp_path: Path
) -> None:
    root = f"s3://{seaweed.bucket}/wrong-secret/{uuid.uuid4().hex[:8]}"
    wrong_secret = "wrong-" + seaweed.secret_key[6:]

    result = moeloop_cli(
        "run", str(config_file(tmp_path)), "--root", root, cwd=tmp_path, env={"AWS_SECRET_ACCESS_KEY": wrong_secret}
    )

    assert result.returncode == EXIT_USER_ERROR
    assert_user_error(result, "S3 rejected the credentials (SignatureDoesNotMatch)", f"{root}/tiny")
    for secret in (wrong_secret, seaweed.secret_key, seaweed.access_key):
        assert secret not in result.stdout + result.stderr
    assert objects(seaweed, root) == {}


def test_run_with_a_malformed_root_is_refused(tmp_path: Path) -> None:
    result = moeloop_cli("run", str(config_file(tmp_path)), "--root", "s3://bucket/a/../b", cwd=tmp_path)

    assert_user_error(result, "must not contain '..' path segments: s3://bucket/a/../b/tiny")
    assert not (tmp_path / ".moeloop").exists()


# -- steps on damaged or foreign data ------------------------------------------------------------


def rollout_table(iteration: int, shard: int, rows: int = 2) -> pa.Table:
    columns = {
        "sample_id": [f"{iteration}-{shard}-{i}" for i in range(rows)],
        "iteration": [iteration] * rows,
        "shard": [shard] * rows,
        "prompt_id": [shard] * rows,
        "sample_index": list(range(rows)),
        "prompt_text": ["abc"] * rows,
        "prompt_token_ids": [[1, 2]] * rows,
        "response_token_ids": [[3]] * rows,
        "response_text": ["c"] * rows,
        "behavior_logprobs": [[-0.5]] * rows,
        "finish_reason": ["stop"] * rows,
        "policy_version": [iteration - 1] * rows,
        "engine": ["transformers"] * rows,
        "routed_experts": [None] * rows,
        "routed_layers": [None] * rows,
        **{name: [None] * rows for name in EPISODE_COLUMNS},  # completions, not episodes
    }
    return pa.table(columns, schema=ROLLOUT_SCHEMA)


def test_reward_on_a_truncated_shard_names_it_and_commits_nothing(
    s3_run: str, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    storage = RunStorage(s3_run)
    whole = table_bytes(rollout_table(1, 0))
    storage.write_bytes(storage.rollout_shard(1, 0, 2), whole[: len(whole) // 2])
    storage.write_bytes(storage.rollout_shard(1, 1, 2), table_bytes(rollout_table(1, 1)))
    before = objects(seaweed, s3_run)

    result = run_step("reward", s3_run, 1)

    assert_user_error(
        result, f"not a readable Parquet file: {s3_run}/experience/iter-000001/rollout-00000-of-00002.parquet"
    )
    assert objects(seaweed, s3_run) == before


def test_reward_refuses_a_shard_of_another_iteration(s3_run: str, seaweed: SeaweedS3, tmp_path: Path) -> None:
    storage = RunStorage(s3_run)
    storage.write_bytes(storage.rollout_shard(1, 0, 2), table_bytes(rollout_table(2, 0)))
    storage.write_bytes(storage.rollout_shard(1, 1, 2), table_bytes(rollout_table(1, 1)))
    before = objects(seaweed, s3_run)

    result = run_step("reward", s3_run, 1)

    assert_user_error(result, "rollout-00000-of-00002.parquet holds rows of iteration [2] shard [0]", "foreign data")
    assert objects(seaweed, s3_run) == before


@pytest.mark.slow
def test_rollout_finding_a_foreign_shard_at_its_output_stops_without_overwriting(
    s3_run: str, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    storage = RunStorage(s3_run)
    storage.write_bytes(storage.rollout_shard(1, 0, 2), table_bytes(rollout_table(1, 3)))
    before = objects(seaweed, s3_run)

    result = run_step("rollout", s3_run, 1, "--shard", "0", "--num-shards", "2")

    assert_user_error(
        result, f"{s3_run}/experience/iter-000001/rollout-00000-of-00002.parquet holds rows of", "foreign data"
    )
    assert objects(seaweed, s3_run) == before


@pytest.mark.slow
def test_a_checkpoint_whose_manifest_does_not_match_is_never_used(
    s3_run: str, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    storage = RunStorage(s3_run)
    weights = f"{storage.checkpoint(0)}/model.safetensors"
    data = bytearray(storage.read_bytes(weights))
    data[-1] ^= 0xFF  # same size, other bytes: only the sha256 tells
    storage.write_bytes(weights, bytes(data))
    before = objects(seaweed, s3_run)

    result = run_step("evaluate", s3_run, 0)

    assert_user_error(result, f"object does not match its COMMIT: {s3_run}/checkpoints/iter-000000/model.safetensors")
    assert objects(seaweed, s3_run) == before  # no metrics, no report
    assert not list((tmp_path / "cache").rglob("model.safetensors"))  # and nothing entered the cache


def test_publish_refuses_a_trainer_state_whose_objects_do_not_match(
    s3_run: str, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    storage = RunStorage(s3_run)
    state = storage.trainer_state(1)
    storage.commit(state, storage.put_objects(state, {"model.safetensors": b"weights", "optimizer.pt": b"moments"}))
    storage.write_bytes(f"{state}/model.safetensors", b"truncated")
    before = objects(seaweed, s3_run)

    result = run_step("publish", s3_run, 1)

    assert_user_error(result, f"{s3_run}/trainer/iter-000001/model.safetensors does not match its COMMIT (size 9")
    assert objects(seaweed, s3_run) == before
    assert storage.latest()["iteration"] == 0
