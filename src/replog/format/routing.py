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
    return _fnv1a_64_continue(FNV64_OFFSET, data)


def shard_of(key: str, shards: int) -> int:
    """The shard that ``key`` routes to."""
    return fnv1a_64(key.encode("utf-8")) % shards


VECTOR_MIN_KEYS = 32
"""Below this many keys still being hashed, the rest are finished one by one: a numpy
step costs microseconds whatever its size, so one very long key among short ones would
otherwise cost a step per byte (2 MB key: 15 s). Either way the cost is linear in the
total key bytes."""


def _fnv1a_64_continue(value: int, data: bytes) -> int:
    for byte in data:
        value = ((value ^ byte) * FNV64_PRIME) & _MASK64
    return value


def fnv1a_64_array(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """FNV-1a 64 of every (non-null) string in ``keys``, as a ``uint64`` numpy array."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks() if keys.num_chunks else pa.array([], pa.string())
    binary = keys.cast(pa.large_binary())  # 64-bit offsets: no 2 GiB limit
    count = len(binary)
    hashes = np.full(count, FNV64_OFFSET, dtype=np.uint64)
    if count == 0:
        return hashes
    offsets_buffer, data_buffer = binary.buffers()[1], binary.buffers()[2]
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[
        binary.offset : binary.offset + count + 1
    ]
    data = (
        np.frombuffer(data_buffer, dtype=np.uint8)
        if data_buffer is not None
        else np.zeros(0, dtype=np.uint8)
    )
    starts = offsets[:-1]
    lengths = offsets[1:] - starts
    # Longest keys first, so the keys still being hashed at byte j are a prefix: each step
    # works on a contiguous slice (no scatter), and the order is undone once at the end.
    order = np.argsort(-lengths, kind="stable")
    sorted_starts = starts[order]
    descending = -lengths[order]
    running = np.full(count, FNV64_OFFSET, dtype=np.uint64)
    prime = np.uint64(FNV64_PRIME)
    longest = int(-descending[0])
    position = 0
    active = count
    while position < longest:
        active = int(np.searchsorted(descending, -position, side="left"))
        if active < VECTOR_MIN_KEYS:
            break
        head = running[:active]
        head ^= data[sorted_starts[:active] + position]
        head *= prime
        position += 1
    else:
        active = 0
    for index in range(active):
        start = int(sorted_starts[index])
        tail = data[start + position : start - int(descending[index])].tobytes()
        running[index] = _fnv1a_64_continue(int(running[index]), tail)
    hashes[order] = running
    return hashes


def shards_of(keys: pa.Array | pa.ChunkedArray, shards: int) -> np.ndarray:
    """The shard of every key in ``keys``, as an ``int32`` numpy array."""
    return (fnv1a_64_array(keys) % np.uint64(shards)).astype(np.int32)
