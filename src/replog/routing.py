"""Key-to-shard routing: FNV-1a 64 of the key's UTF-8 bytes, modulo the shard count.

The hash is part of the storage format (FORMAT.md): every writer in every language
must route a key to the same shard, or per-key order breaks. The vectorised version
hashes all keys of a batch at once with numpy (uint64 arithmetic wraps, which is
exactly FNV's mod 2**64).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_MASK64 = 0xFFFFFFFFFFFFFFFF


def fnv1a_64(data: bytes) -> int:
    """FNV-1a 64 of ``data`` (the reference definition; slow, for single keys and tests)."""
    value = FNV64_OFFSET
    for byte in data:
        value = ((value ^ byte) * FNV64_PRIME) & _MASK64
    return value


def shard_of(key: str, shards: int) -> int:
    """The shard that ``key`` routes to."""
    return fnv1a_64(key.encode("utf-8")) % shards


def fnv1a_64_array(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """FNV-1a 64 of every (non-null) string in ``keys``, as a ``uint64`` numpy array."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    binary = keys.cast(pa.binary())
    count = len(binary)
    hashes = np.full(count, FNV64_OFFSET, dtype=np.uint64)
    if count == 0:
        return hashes
    offsets_buffer, data_buffer = binary.buffers()[1], binary.buffers()[2]
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32)[
        binary.offset : binary.offset + count + 1
    ].astype(np.int64)
    data = (
        np.frombuffer(data_buffer, dtype=np.uint8)
        if data_buffer is not None
        else np.zeros(0, dtype=np.uint8)
    )
    starts = offsets[:-1]
    lengths = offsets[1:] - starts
    # Longest keys first, so the keys still being hashed at byte j are a prefix.
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    prime = np.uint64(FNV64_PRIME)
    max_length = int(sorted_lengths[0]) if count else 0
    for j in range(max_length):
        active = int(np.searchsorted(-sorted_lengths, -j, side="left"))
        rows = order[:active]
        hashes[rows] ^= data[starts[rows] + j].astype(np.uint64)
        hashes[rows] *= prime
    return hashes


def shards_of(keys: pa.Array | pa.ChunkedArray, shards: int) -> np.ndarray:
    """The shard of every key in ``keys``, as an ``int32`` numpy array."""
    return (fnv1a_64_array(keys) % np.uint64(shards)).astype(np.int32)
