"""``replog compact --by-key``: keep only the newest event per ``(collection, key)`` below
a cleaner point, as Kafka's ``cleanup.policy=compact`` does, without hiding a change from
any registered consumer.

Per shard, the cleaner point is the smallest offset every registered consumer has
committed (the head when there are none): events at or below it have been read by every
consumer, so dropping superseded ones hides nothing from them, while a consumer starting
from earliest still sees the table's state and then every later change. The live entries
of a shard wholly at or below its cleaner point are read, the newest event of each key is
kept (a delete only if younger than ``keep_deletes_for``) and the kept rows are written,
with their sequences, as *holed* entries covering exactly the same range (FORMAT.md,
"Holes"). All shards go in one ordinary ``compact`` commit, under a staging lease like
:func:`replog.ops.compaction.compact`; sequences and heads do not change.

The pure part (:func:`kept_rows`, :func:`placed`) decides which rows stay and which
entries they become; :func:`compact_by_key` does the reading and committing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from replog.checkpoints import consumers
from replog.core import files, leases, staging
from replog.core.files import DecodedFiles
from replog.errors import CommitConflictError, InvalidOptionError
from replog.format.commits import CommitRecord
from replog.format.events import STORED_SCHEMA
from replog.format.gc import StagingStart
from replog.format.leases import Lease
from replog.format.segments import (
    HOLED_SCHEMA,
    MAX_SEGMENT_BYTES,
    MAX_SEGMENT_EVENTS,
    SEQUENCE_COLUMN,
    Part,
    SegmentInfo,
    cuts,
    entry_rows,
    given,
    row_sequences,
    row_sizes,
)
from replog.format.state import LogState
from replog.log import ReplicationLog
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

FilePieces = list[tuple[tuple[int, int], tuple[int, int]]]
"""Files to write for one shard: the rows ``[start, stop)`` of the kept rows each holds
and the sequence range ``(first, last)`` its entry covers."""

ATTEMPTS = 5
"""How often a key compaction whose sources another writer merged first is run again."""


# -- pure: which rows stay ----------------------------------------------------------------


def kept_rows(rows: pa.Table, *, drop_deletes_before_ms: int | None) -> tuple[np.ndarray, int]:
    """Indices (ascending) of the rows of one shard's range to keep: the last row of each
    ``(collection, key)`` (rows are in sequence order), unless it is a delete whose event
    time is before ``drop_deletes_before_ms`` (None: keep every delete); and how many
    such deletes were dropped."""
    import pyarrow.compute as pc  # noqa: PLC0415 (as segments.py: not on the planning path)

    from replog.tables.changes import EVENT_KEY, last_per_key  # noqa: PLC0415 (imports pc)

    newest = last_per_key(rows, EVENT_KEY)
    if drop_deletes_before_ms is None or not len(newest):
        return newest, 0
    chosen = rows.take(pa.array(newest))
    deleted = pc.equal(chosen.column("operation"), "delete").to_numpy(zero_copy_only=False)
    stamps = chosen.column("timestamp").cast(pa.int64()).to_numpy() // 1000
    old = deleted & (stamps < drop_deletes_before_ms)
    return newest[~old], int(old.sum())


def placed(
    first: int, last: int, sequences: np.ndarray, pieces: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The sequence range each piece ``[start, stop)`` of the kept rows covers, so the
    pieces tile ``[first, last]`` (the range the replaced entries covered): a piece
    ends at its last row's sequence, the last one at ``last``; no pieces: one, empty."""
    if not pieces:
        return [(first, last)]
    ranges = []
    low = first
    for index, (_, stop) in enumerate(pieces):
        high = last if index == len(pieces) - 1 else int(sequences[stop - 1])
        ranges.append((low, high))
        low = high + 1
    return ranges


def cleaner_points(state: LogState, committed: Mapping[str, Mapping[int, int]]) -> dict[int, int]:
    """Per shard, the last sequence key compaction may rewrite: the smallest offset any
    registered consumer committed (0 for one that never did), the head with none."""
    return {
        shard: min([head, *(offsets.get(shard, 0) for offsets in committed.values())])
        for shard, head in enumerate(state.heads)
    }


# -- the operation ------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardCompaction:
    """What key compaction did to one shard's range ``first .. last``."""

    shard: int
    first: int
    last: int
    events_before: int
    events_after: int
    deletes_dropped: int

    def to_json(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "first_sequence": self.first,
            "last_sequence": self.last,
            "events_before": self.events_before,
            "events_after": self.events_after,
            "deletes_dropped": self.deletes_dropped,
        }


@dataclass(frozen=True)
class KeyCompactionResult:
    cleaner_points: dict[int, int]
    shards: tuple[ShardCompaction, ...] = ()
    record: CommitRecord | None = None
    consumers: tuple[str, ...] = field(default=())

    @property
    def events_before(self) -> int:
        return sum(s.events_before for s in self.shards)

    @property
    def events_after(self) -> int:
        return sum(s.events_after for s in self.shards)

    def to_json(self, dry_run: bool = False) -> dict[str, Any]:
        return {
            "dry_run": dry_run,
            "by_key": True,
            "version": self.record.version if self.record else None,
            "consumers": list(self.consumers),
            "cleaner_points": {str(s): p for s, p in sorted(self.cleaner_points.items())},
            "events_before": self.events_before,
            "events_after": self.events_after,
            "shards": [s.to_json() for s in self.shards],
        }


def check_keep_deletes_for(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise InvalidOptionError(f"--keep-deletes-for must not be negative, got {value} ms")
    return value


def _shard_rows(
    log: ReplicationLog,
    entries: Sequence[SegmentInfo],
    low: int,
    cache: DecodedFiles,
    beat: Callable[[], None],
) -> tuple[pa.Table, np.ndarray]:
    """The rows of ``entries`` (one shard's, consecutive) at or above ``low``, in the
    stored schema, and their sequences; ``beat`` is called before each entry is read."""
    tables, sequences = [], []
    for entry in entries:
        beat()
        rows = entry_rows(files.read_file(log.storage, entry, cache), entry)
        found = row_sequences(rows, entry)
        if SEQUENCE_COLUMN in rows.column_names:
            rows = rows.drop_columns([SEQUENCE_COLUMN])
        start = int(np.searchsorted(found, low, side="left"))
        tables.append(rows.slice(start))
        sequences.append(found[start:])
    table = pa.concat_tables(tables).combine_chunks() if tables else STORED_SCHEMA.empty_table()
    return table, np.concatenate(sequences) if sequences else np.zeros(0, dtype=np.int64)


def _plan_shard(
    log: ReplicationLog,
    state: LogState,
    shard: int,
    *,
    cleaner: int,
    drop_deletes_before_ms: int | None,
    cache: DecodedFiles,
    beat: Callable[[], None],
) -> tuple[list[SegmentInfo], pa.Table, FilePieces, ShardCompaction] | None:
    """The entries of ``shard`` to replace, the kept rows (holed schema), the range of
    each file to write, and a summary; None when nothing would be dropped."""
    lane = state.segments[shard]
    entries = []
    for entry in lane:
        if entry.last_sequence > cleaner:
            break
        entries.append(entry)
    if not entries:
        return None
    rows, sequences = _shard_rows(log, entries, state.lows[shard], cache, beat)
    keep, deletes_dropped = kept_rows(rows, drop_deletes_before_ms=drop_deletes_before_ms)
    if len(keep) == rows.num_rows:
        return None  # nothing superseded: rewriting would only add holes' bookkeeping
    kept = rows.take(pa.array(keep)).append_column(
        HOLED_SCHEMA.field(SEQUENCE_COLUMN), pa.array(sequences[keep], type=pa.int64())
    )
    first, last = entries[0].first_sequence, entries[-1].last_sequence
    pieces = cuts(row_sizes(kept), MAX_SEGMENT_EVENTS, MAX_SEGMENT_BYTES) if len(keep) else []
    summary = ShardCompaction(
        shard, first, last, rows.num_rows, len(keep), deletes_dropped=deletes_dropped
    )
    ranges = placed(first, last, sequences[keep], pieces)
    return entries, kept, list(zip(pieces or [(0, 0)], ranges, strict=True)), summary


def _write_shard(
    log: ReplicationLog, shard: int, kept: pa.Table, plan: FilePieces
) -> list[SegmentInfo]:
    """Write one shard's kept rows (one file per piece) and place each as a holed entry."""
    plans = [
        ([Part(shard, 0, stop - start)], functools.partial(given, kept.slice(start, stop - start)))
        for (start, stop), _ in plan
    ]  # each file's event times are found as it is written, in parallel
    staged = files.write_files(log.storage, plans)
    return [  # a holed entry: its rows cover the range [low, high], holes included
        s.at(low)._replace(last_sequence=high, rows=s.events)
        for s, (_, (low, high)) in zip(staged, plan, strict=True)
    ]


def _rewrite(
    log: ReplicationLog,
    state: LogState,
    points: Mapping[int, int],
    *,
    drop_deletes_before_ms: int | None,
    dry_run: bool,
    beat: Callable[[], None],
) -> tuple[list[ShardCompaction], list[SegmentInfo], list[SegmentInfo]]:
    """Plan every shard and (unless ``dry_run``) write its kept rows: the summaries, the
    entries to remove and the entries written. If anything fails, planning a later shard
    included, the files written are deleted (no commit names them yet)."""
    cache = DecodedFiles()
    summaries: list[ShardCompaction] = []
    removed: list[SegmentInfo] = []
    added: list[SegmentInfo] = []
    try:
        for shard in range(log.shards):
            planned = _plan_shard(
                log,
                state,
                shard,
                cleaner=points[shard],
                drop_deletes_before_ms=drop_deletes_before_ms,
                cache=cache,
                beat=beat,
            )
            if planned is None:
                continue
            entries, kept, plan, summary = planned
            summaries.append(summary)
            removed.extend(entries)
            if not dry_run:
                added.extend(_write_shard(log, shard, kept, plan))
    except BaseException:
        staging.discard(log.storage, added)
        raise
    return summaries, removed, added


def compact_by_key(
    log: ReplicationLog,
    *,
    keep_deletes_for_ms: int | None = None,
    dry_run: bool = False,
) -> KeyCompactionResult:
    """Keep, below each shard's cleaner point, only the newest event per ``(collection,
    key)``, dropping deletes older than ``keep_deletes_for_ms`` (None: keep them all), in
    one ``compact`` commit.

    A shard where nothing is superseded is left as it is. If a concurrent merge or
    truncation removed an entry meanwhile, the written files are deleted and the
    compaction run again, up to :data:`ATTEMPTS` times; then :class:`CommitConflictError`.
    """
    check_keep_deletes_for(keep_deletes_for_ms)
    owner = f"key compaction of {log.url}"
    with leases.compacting(log.storage, owner) as (lease, beat):
        return _compact_by_key(log, lease, beat, keep_deletes_for_ms, dry_run)


def _compact_by_key(
    log: ReplicationLog,
    lease: Lease,
    beat: leases.Heartbeat,
    keep_deletes_for_ms: int | None,
    dry_run: bool,
) -> KeyCompactionResult:
    """:func:`compact_by_key` under its lease."""
    for attempt in range(1, ATTEMPTS + 1):
        beat()
        state = log.refresh()
        since = StagingStart(state.version, now_ms())
        committed = consumers.all_committed(log)
        points = cleaner_points(state, committed)
        cutoff = None if keep_deletes_for_ms is None else now_ms() - keep_deletes_for_ms
        try:
            summaries, removed, added = _rewrite(
                log, state, points, drop_deletes_before_ms=cutoff, dry_run=dry_run, beat=beat
            )
            result = KeyCompactionResult(points, tuple(summaries), None, tuple(committed))
            if dry_run or not summaries:
                return result
            # A consumer registered or set back while the ranges were rewritten (which
            # can take minutes) needs what the old cleaner points would drop: look
            # again just before committing, and plan again if one went back.
            again = cleaner_points(state, consumers.all_committed(log))
            moved_back = [s.shard for s in summaries if s.last > again[s.shard]]
            if moved_back:
                staging.discard(log.storage, added)
                raise CommitConflictError(
                    f"{log.url}: a consumer was registered or set back on shards "
                    f"{moved_back} during key compaction; nothing was rewritten"
                )
            record = log.replace(added, removed, since, lease=lease)
        except CommitConflictError:
            if attempt == ATTEMPTS:
                raise
            logger.info(
                "%s: a source or a cleaner point moved during key compaction; again", log.url
            )
            continue
        logger.info(
            "key-compacted %s at version %d: %d events -> %d (cleaner points %s)",
            log.url,
            record.version,
            result.events_before,
            result.events_after,
            points,
        )
        return KeyCompactionResult(points, tuple(summaries), record, tuple(committed))
    raise AssertionError("unreachable")
