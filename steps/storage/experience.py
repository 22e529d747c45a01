"""Experience as Parquet: the rollout shards and the rewards of one iteration (schemas in the README).

Each rollout step writes its shard as one object, whole. The reward step reads every shard, checks that
each holds rows of its own iteration and shard only, writes rewards.parquet, then commits the iteration's
experience: experience/iter-N/COMMIT names the K shards and the rewards with their sizes and digests. The
trainer reads experience only through that COMMIT, verified.
"""

from __future__ import annotations

import io
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.manifest import bytes_entry
from moeloop.steps.storage.run import RunStorage

REWARDS_FILE = "rewards.parquet"

ROLLOUT_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),  # "<iteration>-<prompt_id>-<sample_index>": unique in the run
        ("iteration", pa.int32()),
        ("shard", pa.int32()),
        ("prompt_id", pa.int64()),  # row in the run's train prompt set (steps/storage/prompt_set.py)
        ("sample_index", pa.int32()),  # 0..G-1 within the prompt's group
        ("prompt_text", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_text", pa.string()),
        ("behavior_logprobs", pa.list_(pa.float32())),  # the engine's sampling logprob per response token
        ("finish_reason", pa.string()),  # steps/engines/engine.py:FINISH_REASONS
        ("policy_version", pa.int32()),  # iteration of the checkpoint that generated it
        ("engine", pa.string()),
        # The engine's top-k experts per position and MoE layer, flattened [position][layer][k], from the prompt's
        # first or last position to the response's second to last (steps/engines/routes.py), as uint8 where the
        # model has at most 256 experts (`rollout_schema`). Null where the engine did not record them.
        ("routed_experts", pa.list_(pa.uint16())),
        # The decoder layer of each layer of routed_experts (the model's MoE layers); null where not recorded.
        ("routed_layers", pa.list_(pa.uint16())),
        # An episode's (rollout.environment, steps/episodes/); null for a completion. Its response holds the policy's
        # tokens and the environment's, in order: response_mask is 1 on the policy's (trained on), 0 on the
        # environment's (behavior_logprobs 0 there).
        ("response_mask", pa.list_(pa.uint8())),
        # Each of the policy's turns: the environment's tokens before it, its own, the engine's seconds (its
        # batch's) and the environment's (from the previous turn's end to this turn's request).
        ("turns", pa.list_(pa.struct([("environment_tokens", pa.int32()), ("policy_tokens", pa.int32()),
                                      ("model_seconds", pa.float32()), ("environment_seconds", pa.float32())]))),
        ("tool_results", pa.list_(pa.string())),  # the tool messages' contents, in order
        ("environment_reward", pa.float64()),  # the environment's rubric's, added to the reward with its weight
        ("episode_end", pa.string()),  # verifiers' stop condition (no_tools_called, max_turns_reached, ...)
    ]
)
EPISODE_COLUMNS = ("response_mask", "turns", "tool_results", "environment_reward", "episode_end")
# Columns that shards written before they existed lack: read as nulls.
LATER_COLUMNS = {"routed_experts", "routed_layers", *EPISODE_COLUMNS}
# The expert ids' types routed_experts comes in: the narrowest that holds the model's (`expert_id_type`).
ROUTE_TYPES = (pa.list_(pa.uint8()), pa.list_(pa.uint16()))


def expert_id_type(num_experts: int) -> pa.DataType:
    """The narrowest type that holds every expert id: uint8 up to 256 experts, else uint16 (as vLLM's capture)."""
    return pa.uint8() if num_experts <= 256 else pa.uint16()


def rollout_schema(num_experts: int) -> pa.Schema:
    """The rollout shards' schema for a model of num_experts experts: its routes' ids in the narrowest type."""
    return with_route_type(ROLLOUT_SCHEMA, pa.list_(expert_id_type(num_experts)))


def with_route_type(schema: pa.Schema, route_type: pa.DataType) -> pa.Schema:
    index = schema.get_field_index("routed_experts")
    return schema.set(index, pa.field("routed_experts", route_type))


REWARD_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("prompt_id", pa.int64()),
        ("reward", pa.float32()),  # weighted sum of the configured reward functions
    ]
)


def table_bytes(table: pa.Table) -> bytes:
    """The table as Parquet: dictionary-encoded (the default), zstd-compressed, which of the encodings measured keeps
    the routes smallest or as small as any (benchmarks/route_storage.md)."""
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()


def parse_table(data: bytes, source: str, schema: pa.Schema) -> pa.Table:
    try:
        # One thread, and not through pq.read_table's dataset machinery: with torch loaded, the pyarrow
        # thread pools those start make about half the processes abort at exit ("terminate called without
        # an active exception", exit 134).
        table = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
    except (pa.ArrowInvalid, OSError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise MoeloopError(f"not a readable Parquet file: {source} ({reason})") from None
    for index, column in enumerate(schema):
        if column.name in LATER_COLUMNS and column.name not in table.schema.names and index == table.num_columns:
            table = table.append_column(column, pa.nulls(table.num_rows, column.type))
    if "routed_experts" in schema.names and table.schema.field("routed_experts").type in ROUTE_TYPES:
        schema = with_route_type(schema, table.schema.field("routed_experts").type)
    if not table.schema.equals(schema, check_metadata=False):
        raise MoeloopError(f"unexpected Parquet schema: {source}")
    return table


def rollout_columns(table: pa.Table) -> dict[str, list]:
    """The shards' columns as lists, the routes each row's numpy array of expert ids (None where not recorded), not
    a Python int per id."""
    columns = table.drop_columns(["routed_experts"]).to_pydict()
    columns["routed_experts"] = list(table["routed_experts"].to_numpy(zero_copy_only=False))
    return columns


def check_rollout_rows(table: pa.Table, source: str, iteration: int, shard: int) -> None:
    """A shard holds rows of its own iteration and shard, each sample once; anything else is foreign data."""
    iterations = set(pc.unique(table["iteration"]).to_pylist())
    shards = set(pc.unique(table["shard"]).to_pylist())
    if not iterations <= {iteration} or not shards <= {shard}:
        raise MoeloopError(
            f"{source} holds rows of iteration {sorted(iterations)} shard {sorted(shards)}, not of iteration"
            f" {iteration} shard {shard}: foreign data, refusing to use or overwrite it"
        )
    if pc.count_distinct(table["sample_id"]).as_py() != table.num_rows:
        raise MoeloopError(f"{source} holds a sample_id more than once: foreign or damaged data")


def shard_name(iteration: int, shard: int, num_shards: int) -> str:
    return RunStorage.rollout_shard(iteration, shard, num_shards).rsplit("/", 1)[1]


def read_rollout_shard(storage: RunStorage, iteration: int, shard: int, num_shards: int) -> tuple[pa.Table, bytes]:
    """One written shard, checked: (its rows, its bytes)."""
    relative = storage.rollout_shard(iteration, shard, num_shards)
    data = storage.read_bytes(relative)
    table = parse_table(data, storage.display(relative), ROLLOUT_SCHEMA)
    check_rollout_rows(table, storage.display(relative), iteration, shard)
    return table, data


def require_shards(storage: RunStorage, iteration: int, num_shards: int) -> None:
    """A missing shard is an error, not a smaller batch."""
    missing = [
        storage.display(storage.rollout_shard(iteration, k, num_shards))
        for k in range(num_shards)
        if not storage.exists(storage.rollout_shard(iteration, k, num_shards))
    ]
    if missing:
        raise MoeloopError(f"iteration {iteration} is missing {len(missing)} rollout shard(s), first: {missing[0]}")


def read_written_rollouts(storage: RunStorage, iteration: int, num_shards: int) -> tuple[pa.Table, dict[str, bytes]]:
    """Every shard of the iteration before its experience is committed (for the reward step), each checked:
    (all rows, {shard name: bytes})."""
    require_shards(storage, iteration, num_shards)
    tables, shards = [], {}
    for k in range(num_shards):
        table, data = read_rollout_shard(storage, iteration, k, num_shards)
        tables.append(table)
        shards[shard_name(iteration, k, num_shards)] = data
    return pa.concat_tables(tables, promote_options="permissive"), shards


def commit_experience(storage: RunStorage, iteration: int, shards: dict[str, bytes], rewards: pa.Table) -> None:
    """rewards.parquet, then the COMMIT naming it and the shards it was computed from."""
    folder = storage.experience(iteration)
    files = storage.put_objects(folder, {REWARDS_FILE: table_bytes(rewards)})
    files.update({name: bytes_entry(data) for name, data in shards.items()})
    storage.commit(folder, files, extra={"iteration": iteration, "samples": rewards.num_rows})


def committed_experience(storage: RunStorage, iteration: int, num_shards: int) -> dict[str, Any] | None:
    """The iteration's experience COMMIT (None before the reward step committed it), checked to name
    exactly the K shards and the rewards."""
    folder = storage.experience(iteration)
    manifest = storage.manifest(folder)
    if manifest is None:
        return None
    expected = {shard_name(iteration, k, num_shards) for k in range(num_shards)} | {REWARDS_FILE}
    if set(manifest["files"]) != expected or manifest.get("iteration") != iteration:
        raise MoeloopError(
            f"{storage.display(folder)}/COMMIT does not name the iteration's {num_shards} shards and rewards:"
            " foreign data, refusing to use or overwrite it"
        )
    return manifest


def read_rollouts(storage: RunStorage, iteration: int, num_shards: int) -> pa.Table:
    """Exactly the committed shards of the iteration, verified against the experience COMMIT."""
    manifest = committed_experience(storage, iteration, num_shards)
    if manifest is None:
        require_shards(storage, iteration, num_shards)
        raise MoeloopError(
            f"iteration {iteration}'s experience is not committed yet: {storage.display(storage.rewards(iteration))}"
        )
    folder = storage.experience(iteration)
    names = [shard_name(iteration, k, num_shards) for k in range(num_shards)]
    objects = storage.read_committed(folder, manifest, names)
    tables = []
    for k, name in enumerate(names):
        table = parse_table(objects[name], f"{storage.display(folder)}/{name}", ROLLOUT_SCHEMA)
        check_rollout_rows(table, f"{storage.display(folder)}/{name}", iteration, k)
        tables.append(table)
    return pa.concat_tables(tables, promote_options="permissive")  # shards of an older version: their route type


def read_rewards(storage: RunStorage, iteration: int) -> pa.Table:
    folder = storage.experience(iteration)
    manifest = storage.manifest(folder)
    if manifest is None or REWARDS_FILE not in manifest["files"]:
        raise MoeloopError(f"iteration {iteration} has no rewards yet: {storage.display(storage.rewards(iteration))}")
    data = storage.read_committed(folder, manifest, [REWARDS_FILE])[REWARDS_FILE]
    return parse_table(data, storage.display(storage.rewards(iteration)), REWARD_SCHEMA)
