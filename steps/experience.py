"""Experience as Parquet: the rollout shards and the rewards of one iteration (schemas in the README)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from steps.errors import MoeloopError
from steps.storage import RunStorage

ROLLOUT_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),  # "<iteration>-<prompt_id>-<sample_index>": unique in the run
        ("iteration", pa.int32()),
        ("shard", pa.int32()),
        ("prompt_id", pa.int64()),  # line number in the run's data/train.jsonl
        ("sample_index", pa.int32()),  # 0..G-1 within the prompt's group
        ("prompt_text", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_text", pa.string()),
        ("behavior_logprobs", pa.list_(pa.float32())),  # the engine's sampling logprob per response token
        ("finish_reason", pa.string()),  # "stop" or "length"
        ("policy_version", pa.int32()),  # iteration of the checkpoint that generated it
        ("engine", pa.string()),
    ]
)

REWARD_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("prompt_id", pa.int64()),
        ("reward", pa.float32()),  # weighted sum of the configured reward functions
    ]
)


def table_bytes(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def read_table(storage: RunStorage, relative: str, schema: pa.Schema) -> pa.Table:
    data = storage.read_bytes(relative)
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowInvalid, OSError) as error:
        raise MoeloopError(f"not a readable Parquet file: {storage.display(relative)} ({error})") from None
    if not table.schema.equals(schema, check_metadata=False):
        raise MoeloopError(f"unexpected Parquet schema: {storage.display(relative)}")
    return table


def read_rollouts(storage: RunStorage, iteration: int, num_shards: int) -> pa.Table:
    """Exactly the committed shards of the iteration; a missing shard is an error, not a smaller batch."""
    missing = [
        storage.display(storage.rollout_shard(iteration, k, num_shards))
        for k in range(num_shards)
        if not storage.exists(storage.rollout_shard(iteration, k, num_shards))
    ]
    if missing:
        raise MoeloopError(f"iteration {iteration} is missing {len(missing)} rollout shard(s), first: {missing[0]}")
    return pa.concat_tables(
        read_table(storage, storage.rollout_shard(iteration, k, num_shards), ROLLOUT_SCHEMA) for k in range(num_shards)
    )


def read_rewards(storage: RunStorage, iteration: int) -> pa.Table:
    if not storage.exists(storage.rewards(iteration)):
        raise MoeloopError(f"iteration {iteration} has no rewards yet: {storage.display(storage.rewards(iteration))}")
    return read_table(storage, storage.rewards(iteration), REWARD_SCHEMA)
