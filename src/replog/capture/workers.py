"""Snapshot chunks read by several processes at once (``--snapshot-workers``).

DESIGN: a snapshot's cost is Python's, per row (a row's JSON from its text): one process
reads about 60,000 rows a second. With workers, each chunk between two watermarks is
several key ranges (cut at every ``--snapshot-chunk-rows``-th key), each read by a process
of its own on a session of its own, which makes the read events and hands them back. The
watermarks are the capture's, written before the first range is read and after the last
one is: the window holds every read, so the change stream reconciles them as one chunk.
Only tables read in key order are split; physical order stays one range at a time.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from replog.capture.events import EventMaker, Read
from replog.capture.options import CaptureOptions
from replog.capture.source import PostgresSource, Table

Range = tuple[list[str | None] | None, list[str | None] | None]
"""Keys after the first (None: from the first key) up to and including the second (None:
to the end)."""

_WORKER: dict[str, Any] = {}
"""A worker process's own source session, chunk reader and event maker."""


def _start_worker(options: CaptureOptions) -> None:
    from replog.capture.snapshot import ChunkReader  # noqa: PLC0415 - a cycle otherwise

    source = PostgresSource(options)
    maker = EventMaker(source.database, options.slot, source.pg_type)
    reader = ChunkReader(source, maker, options.snapshot_chunk_rows)
    _WORKER.update(source=source, maker=maker, reader=reader)


def _read_range(
    table: Table, key_range: Range, low: int
) -> tuple[dict[str, Read], list[str | None] | None]:
    """In a worker: the read events of one key range, and its last key (None: empty). The
    open-ended range at the table's end reads at most a chunk: it held less when it was
    cut, so any row past that was inserted inside the window, and the stream carries it."""
    source: PostgresSource = _WORKER["source"]
    reader = _WORKER["reader"]
    after, upto = key_range
    limit = None if upto is not None else reader.chunk_rows
    rows = reader.key_range(table, source.connection, after, upto, limit)
    return _WORKER["maker"].reads(table, rows, low), table.key_of(rows[-1]) if rows else None


class RangeReaders:
    """A pool of ``count`` processes reading key ranges of snapshot chunks."""

    def __init__(self, options: CaptureOptions, count: int) -> None:
        self.count = count
        self._pool = ProcessPoolExecutor(
            max_workers=count,
            mp_context=multiprocessing.get_context("spawn"),  # no forked sessions or locks
            initializer=_start_worker,
            initargs=(options,),
        )

    def read(
        self, table: Table, ranges: Sequence[Range], low: int
    ) -> list[tuple[dict[str, Read], list[str | None] | None]]:
        """Each range's read events and last key, in the order of ``ranges``."""
        futures = [self._pool.submit(_read_range, table, key_range, low) for key_range in ranges]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
