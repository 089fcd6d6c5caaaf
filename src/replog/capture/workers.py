"""Snapshot chunks read by several processes at once (``--snapshot-workers``).

DESIGN: a snapshot's cost is Python's, per row (a row's JSON from its text): one process
reads about 60,000 rows a second. With workers, each chunk between two watermarks is
several key ranges (cut at every ``--snapshot-chunk-rows``-th key), each read by a process
of its own on a session of its own, which makes the read events and hands them back. The
watermarks are the capture's, written before the first range is read and after the last
one is: the window holds every read, so the change stream reconciles them as one chunk.
Only tables read in key order are split; physical order stays one range at a time.

Every range has an upper key: the last one ends at the last key the cuts saw, so no row
that existed before the window is cut off by rows inserted inside it (those are the
stream's). A worker watches the capture process and ends (its session with it) as soon
as that process is gone: a capture killed by the OOM killer leaves no reader behind.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from replog.capture.events import ChunkRows, EventMaker
from replog.capture.options import CaptureOptions
from replog.capture.reads import Key, TableRows, last_key
from replog.capture.source import PostgresSource, Table

Range = tuple[Key | None, Key]
"""Keys after the first (None: from the first key) up to and including the second."""

PARENT_CHECK_S = 0.2
"""How often a worker looks whether the capture process that started it is still there."""

_WORKER: dict[str, Any] = {}
"""A worker process's own source session, row reader and event maker."""


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)  # the capture is gone: so is this reader (the server ends its session)


def _start_worker(options: CaptureOptions, parent: int) -> None:
    if os.getppid() != parent:  # the capture died while this process started
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    source = PostgresSource(options)
    _WORKER.update(
        source=source,
        rows=TableRows(source, source.connection),
        maker=EventMaker(source.database, options.slot, source.pg_type),
    )


def _read_range(
    table: Table, relation: int, key_range: Range, low: int
) -> tuple[ChunkRows, Key | None]:
    """In a worker: the read events of one key range, and its last key (None: empty)."""
    after, upto = key_range
    rows = _WORKER["rows"].key_range(table, relation, after, upto)
    return _WORKER["maker"].reads(table, rows, low), last_key(table, rows)


class RangeReaders:
    """A pool of ``count`` processes reading key ranges of snapshot chunks."""

    def __init__(self, options: CaptureOptions, count: int) -> None:
        self.count = count
        self._pool = ProcessPoolExecutor(
            max_workers=count,
            mp_context=multiprocessing.get_context("spawn"),  # no forked sessions or locks
            initializer=_start_worker,
            initargs=(options, os.getpid()),
        )

    def read(
        self, table: Table, relation: int, ranges: Sequence[Range], low: int
    ) -> list[tuple[ChunkRows, Key | None]]:
        """Each range's read events and last key, in the order of ``ranges``."""
        futures = [
            self._pool.submit(_read_range, table, relation, key_range, low) for key_range in ranges
        ]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
