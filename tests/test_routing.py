import numpy as np
import pyarrow as pa
import pytest

from replog.format import routing
from replog.format.routing import fnv1a_64, fnv1a_64_array, shard_of, shards_of


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # Published FNV-1a 64 test vectors.
        (b"", 0xCBF29CE484222325),
        (b"a", 0xAF63DC4C8601EC8C),
        (b"foobar", 0x85944171F73967E8),
    ],
)
def test_reference_vectors(data: bytes, expected: int) -> None:
    assert fnv1a_64(data) == expected


def test_vectorised_hash_matches_reference_for_mixed_lengths() -> None:
    keys = ["", "a", "foobar", "customer-42", "ü" * 50, "x" * 300, "order/1", "a"]
    hashed = fnv1a_64_array(pa.array(keys))
    assert [int(h) for h in hashed] == [fnv1a_64(k.encode()) for k in keys]


def test_vectorised_hash_matches_reference_for_many_random_keys() -> None:
    """Enough keys of every length that the vectorised steps (not only the tail loop)
    hash keys that end at different byte positions, multi-byte characters included."""
    import random

    rng = random.Random(3)
    alphabet = "abcxyz-/0123ü€𝄞"
    keys = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))) for _ in range(3000)]
    hashed = fnv1a_64_array(pa.array(keys))
    assert [int(h) for h in hashed] == [fnv1a_64(k.encode()) for k in keys]


def test_vectorised_hash_on_sliced_and_chunked_arrays() -> None:
    keys = [f"key-{i}" for i in range(1000)]
    sliced = pa.array(keys).slice(100, 50)
    assert [int(h) for h in fnv1a_64_array(sliced)] == [fnv1a_64(k.encode()) for k in keys[100:150]]
    chunked = pa.chunked_array([keys[:10], keys[10:20]])
    assert list(shards_of(chunked, 8)) == [shard_of(k, 8) for k in keys[:20]]


def test_routing_spreads_keys() -> None:
    shards = shards_of(pa.array([f"customer-{i}" for i in range(8000)]), 8)
    counts = [int((shards == s).sum()) for s in range(8)]
    assert min(counts) > 800, counts


def test_one_long_key_costs_its_bytes_not_bytes_times_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 200 kB key among 5,000 short ones: the vectorised loop must not take one numpy
    step per byte of the longest key (that was 15 s for a 2 MB key)."""
    steps = 0
    real = np.searchsorted

    def counting(*args: object, **kwargs: object) -> object:
        nonlocal steps
        steps += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(routing.np, "searchsorted", counting)
    keys = [f"customer-{i}" for i in range(5000)] + ["k" * 200_000] + ["m" * 70_000]
    hashed = fnv1a_64_array(pa.array(keys))
    assert steps < 100, steps  # one step per byte position shared by >= 32 keys
    for index in (0, 4999, 5000, 5001):
        assert int(hashed[index]) == fnv1a_64(keys[index].encode())
