"""TensorBoard event files, written without TensorBoard: TFRecord framing around `Event` protobufs.

A record is: uint64 length, uint32 masked CRC-32C of the length, the data, uint32 masked CRC-32C of the data
(little-endian). An Event here is wall_time (field 1, double), step (2, int64), file_version (3) or a Summary
(5) of Values, each a tag (1) and a simple_value (2, float32). TensorBoard's reader checks it all
(tests/unit/test_observe.py reads these files back with it).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


CRC32C_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + body


def _record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def event_file(step: int, wall_time: float, scalars: Iterable[tuple[str, float]]) -> bytes:
    """A whole event file: the version header, then one event at `step` holding every scalar."""
    values = b"".join(
        _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)) for tag, value in scalars
    )
    return _record(_event(wall_time, 0, _field(3, b"brain.Event:2"))) + _record(
        _event(wall_time, step, _field(5, values))
    )
