"""The run's prompt sets, data/train/ and data/eval/: committed once by start, read a few rows at a time by the steps.

A set is Parquet shards (prompts-SSSSS-of-KKKKK.parquet, SHARD_ROWS rows each, in row groups of ROW_GROUP_ROWS)
under a COMMIT (README.md in this folder). A row is one record: `prompt_id` (its row in the set, from 0),
`data_source` (null where the record has none) and `record`, the whole record as JSON with its keys sorted, so a
record of any source and shape stores as it came, and the same records store as the same bytes. The COMMIT also
lists each shard's row groups and footer as [offset, length, BLAKE3] ranges: a step fetches the footers and the row
groups that hold its rows, each verified against its range's digest, and never the whole set.

A run started before prompt sets were committed holds data/{train,eval}.jsonl, read whole as it was.
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.manifest import bytes_entry, manifest_of, part_digest
from moeloop.steps.storage.run import RunStorage

PROMPT_SCHEMA = pa.schema([("prompt_id", pa.int64()), ("data_source", pa.string()), ("record", pa.string())])
SHARD_ROWS = 4096
# A step reads whole row groups: 64 rows keep that close to its own rows, and a shard's footer (which it reads too)
# to 64 row groups' metadata.
ROW_GROUP_ROWS = 64
SPLITS = ("train", "eval")


def record_json(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def shard_file(records: list[dict[str, Any]], first: int) -> tuple[bytes, dict[str, Any]]:
    """A shard's bytes (rows first, first + 1, ...) and its ranges: the footer's and every row group's."""
    table = pa.table(
        {
            "prompt_id": range(first, first + len(records)),
            "data_source": [record.get("data_source") for record in records],
            "record": [record_json(record) for record in records],
        },
        schema=PROMPT_SCHEMA,
    )
    buffer = io.BytesIO()
    # No column statistics: a string column's are its row groups' least and greatest records, whole, which no
    # reader uses and which would make the footer, which every reader fetches, as large as the rows.
    pq.write_table(table, buffer, row_group_size=ROW_GROUP_ROWS, write_statistics=False)
    data = buffer.getvalue()
    metadata = pq.ParquetFile(pa.BufferReader(data)).metadata
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")  # the metadata, its length, "PAR1"
    groups = [row_group_range(metadata.row_group(i)) for i in range(metadata.num_row_groups)]
    return data, {
        "footer": digested(data, footer, len(data) - footer),
        "row_groups": [digested(data, offset, length) for offset, length in groups],
    }


def row_group_range(group: pq.RowGroupMetaData) -> tuple[int, int]:
    """(offset, length) of the bytes of a row group's column chunks, which is what a reader of it fetches."""
    spans = []
    for index in range(group.num_columns):
        column = group.column(index)
        start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
        spans.append((start, start + column.total_compressed_size))
    start = min(span[0] for span in spans)
    return start, max(span[1] for span in spans) - start


def digested(data: bytes, offset: int, length: int) -> list[Any]:
    return [offset, length, part_digest(memoryview(data)[offset : offset + length]).hex()]


def commit_prompt_set(storage: RunStorage, split: str, records: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    """Commit split's records as the run's prompt set. A set already committed with the same records is left as it
    is; another is an error: a run's prompts are fixed once committed."""
    count = -(-len(records) // SHARD_ROWS)
    files, shards = {}, {}
    for k in range(count):
        name = f"prompts-{k:05d}-of-{count:05d}.parquet"
        files[name], shards[name] = shard_file(records[k * SHARD_ROWS : (k + 1) * SHARD_ROWS], k * SHARD_ROWS)
    extra = extra | {"rows": len(records), "shard_rows": SHARD_ROWS, "row_group_rows": ROW_GROUP_ROWS, "shards": shards}
    folder = storage.prompt_set(split)
    existing = storage.manifest(folder)
    if existing is None:
        storage.commit(folder, storage.put_objects(folder, files), extra)
    elif existing != manifest_of({name: bytes_entry(data) for name, data in files.items()}, extra):
        raise MoeloopError(
            f"{storage.display(folder)} already holds other prompts (committed by an earlier start of this run): a"
            " run's prompts are fixed once committed; start a new run for these"
        )


def prompt_count(storage: RunStorage, split: str) -> int:
    manifest = storage.manifest(storage.prompt_set(split))
    return manifest["rows"] if manifest is not None else len(prompt_lines(storage, split))


def read_prompts(storage: RunStorage, split: str, prompt_ids: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The records of split's prompt set at prompt_ids, by prompt_id: only the row groups that hold them are read."""
    wanted = sorted(set(prompt_ids))
    manifest = storage.manifest(storage.prompt_set(split))
    if manifest is None:
        lines = prompt_lines(storage, split)
        require_rows(wanted, len(lines), storage, split)
        return {prompt_id: lines[prompt_id] for prompt_id in wanted}
    require_rows(wanted, manifest["rows"], storage, split)
    groups: dict[str, set[int]] = defaultdict(set)
    names = sorted(manifest["shards"])
    for prompt_id in wanted:
        shard, row = divmod(prompt_id, manifest["shard_rows"])
        groups[names[shard]].add(row // manifest["row_group_rows"])
    ranges = []
    for name, indices in groups.items():
        shard = manifest["shards"][name]
        ranges += [(name, *shard["footer"]), *((name, *shard["row_groups"][i]) for i in sorted(indices))]
    pieces = iter(storage.read_verified_ranges(storage.prompt_set(split), manifest, ranges))
    records = {}
    for name, indices in groups.items():
        footer = next(pieces)
        fetched = {manifest["shards"][name]["row_groups"][i][0]: next(pieces) for i in sorted(indices)}
        table = read_row_groups(footer, fetched, manifest["files"][name]["size"], sorted(indices))
        for prompt_id, text in zip(table["prompt_id"].to_pylist(), table["record"].to_pylist(), strict=True):
            records[prompt_id] = json.loads(text)
    return {prompt_id: records[prompt_id] for prompt_id in wanted}


def require_rows(wanted: list[int], rows: int, storage: RunStorage, split: str) -> None:
    """prompt_ids (sorted) all within a set of rows prompts: any other is not of this run."""
    if wanted and not 0 <= wanted[0] <= wanted[-1] < rows:
        outside = wanted[0] if wanted[0] < 0 else wanted[-1]
        raise MoeloopError(f"prompt {outside} is not in {storage.display(storage.prompt_set(split))} ({rows} prompts)")


def read_row_groups(footer: bytes, pieces: dict[int, bytes], size: int, groups: list[int]) -> pa.Table:
    """Row groups of a Parquet file of size bytes, from its footer and their bytes (by offset) alone."""
    metadata = pq.read_metadata(pa.BufferReader(b"PAR1" + footer))
    source = FetchedRanges(size, pieces)
    return pq.ParquetFile(source, metadata=metadata, pre_buffer=False).read_row_groups(groups, use_threads=False)


class FetchedRanges(io.RawIOBase):
    """A file of which only some byte ranges were fetched (and verified); reading anything else is an error."""

    def __init__(self, size: int, pieces: dict[int, bytes]) -> None:
        super().__init__()
        self.size, self.pieces, self.position = size, pieces, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        if self.position >= self.size:
            return 0
        for start, data in self.pieces.items():
            if start <= self.position < start + len(data):
                chunk = data[self.position - start : self.position - start + len(buffer)]
                buffer[: len(chunk)] = chunk
                self.position += len(chunk)
                return len(chunk)
        raise OSError(f"byte {self.position} was not fetched")


def prompt_lines(storage: RunStorage, split: str) -> list[dict[str, Any]]:
    """The prompts of a run started before prompt sets were committed: data/<split>.jsonl, one record a line."""
    relative = storage.prompt_lines(split)
    records = []
    for number, line in enumerate(storage.read_bytes(relative).decode().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise MoeloopError(f"{storage.display(relative)}:{number}: not valid JSON") from None
    return records
