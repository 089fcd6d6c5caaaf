"""Forward-only pointer files (:mod:`replog.storage.pointer`): what a pointer holds, the
fallbacks for a missing or unreadable one, moving it forward only, and probing past it."""

from __future__ import annotations

import json
import logging

import pytest

from replog.storage import Storage
from replog.storage.pointer import ForwardPointer, PointerEntry, probe_forward

POINTER = "_meta/latest.json"


@pytest.fixture
def storage(memory_url: str) -> Storage:
    return Storage(memory_url)


def pointer(storage: Storage) -> ForwardPointer:
    return ForwardPointer(storage, POINTER, "version")


def test_a_missing_pointer_reads_as_none_without_a_warning(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert pointer(storage).read_entry() is None
        assert pointer(storage).read() is None
    assert not caplog.records


def test_advance_writes_the_value_and_read_gets_it_back(storage: Storage) -> None:
    pointer(storage).advance(7)
    assert json.loads(storage.read(POINTER)) == {"version": 7}
    assert pointer(storage).read_entry() == PointerEntry(7, None)
    assert pointer(storage).read() == 7


def test_a_copy_travels_with_the_pointer(storage: Storage) -> None:
    record = json.dumps({"version": 3, "body": [1, 2]}).encode()
    pointer(storage).advance(3, copy=record)
    assert json.loads(storage.read(POINTER)) == {"version": 3, "copy": json.loads(record)}
    entry = pointer(storage).read_entry()
    assert entry is not None and entry.value == 3
    assert entry.copy is not None and json.loads(entry.copy) == json.loads(record)


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"",
        b"[7]",
        b'{"other": 7}',
        b'{"version": "7"}',
        b'{"version": -1}',
        b'{"version": true}',
        b'{"version": 1.5}',
    ],
)
def test_an_unreadable_pointer_reads_as_none_with_a_warning(
    storage: Storage, caplog: pytest.LogCaptureFixture, data: bytes
) -> None:
    storage.write(POINTER, data)
    with caplog.at_level(logging.WARNING, logger="replog.storage.pointer"):
        assert pointer(storage).read_entry() is None
    assert any("ignoring unreadable pointer" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("copy", ['"text"', "[1]", "null", "3"])
def test_a_copy_that_is_not_a_record_is_dropped(storage: Storage, copy: str) -> None:
    storage.write(POINTER, f'{{"version": 4, "copy": {copy}}}'.encode())
    assert pointer(storage).read_entry() == PointerEntry(4, None)


def test_an_unreadable_pointer_is_overwritten_by_the_next_advance(storage: Storage) -> None:
    storage.write(POINTER, b"{torn")
    pointer(storage).advance(2)
    assert pointer(storage).read() == 2


def test_advance_never_moves_back_what_it_read(storage: Storage) -> None:
    pointer(storage).advance(10)
    behind = pointer(storage)
    behind.advance(5)  # reads 10 first: nothing written
    assert pointer(storage).read() == 10
    behind.advance(10)
    assert pointer(storage).read() == 10
    behind.advance(11)
    assert pointer(storage).read() == 11


def test_a_warm_pointer_reads_only_once(storage: Storage) -> None:
    reads: list[str] = []
    real = storage.read_optional

    def read_optional(relative: str) -> bytes | None:
        reads.append(relative)
        return real(relative)

    storage.read_optional = read_optional  # type: ignore[method-assign]
    warm = pointer(storage)
    warm.advance(1)
    warm.advance(2)
    warm.advance(2)
    assert reads == [POINTER]
    assert pointer(storage).read() == 2


def test_a_warm_pointer_moves_back_one_another_writer_moved_on(storage: Storage) -> None:
    """Its own last value stands for the file: another writer's later value is
    overwritten (harmless: readers probe forward from wherever it points)."""
    warm = pointer(storage)
    warm.advance(3)
    pointer(storage).advance(9)
    warm.advance(4)
    assert pointer(storage).read() == 4


@pytest.mark.parametrize(
    ("start", "step", "present", "found"),
    [
        (5, 1, set(), 5),
        (5, 1, {6, 7, 8}, 8),
        (5, 1, {6, 8}, 6),  # stops at the first gap
        (10, 10, {20, 30, 35}, 30),
        (0, 1, {1, 2}, 2),
    ],
)
def test_probe_forward_finds_the_last_present_step(
    start: int, step: int, present: set[int], found: int
) -> None:
    assert probe_forward(start, step, present.__contains__) == found
