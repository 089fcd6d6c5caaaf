"""A log's history: reading commits, and the snapshots that let a reader skip most of them.

Every ``checkpoint_interval`` versions a *header* is written (heads, low watermarks, sink
marks: what finding the head and committing need); every ``snapshot_interval`` versions
the header comes with a *segment table* (every live segment), which readers that need
segments load. A hint names the newest header. So a state costs a hint, a header and
fewer than ``checkpoint_interval`` commits, and its segments a table and fewer than
``snapshot_interval`` commits (read in parallel), whatever the age of the log.

Damage is survived: an unreadable hint means probing, an unusable header or table means
falling back to an older one (or to the commits from version 1), with a warning.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
from pyarrow import ipc

from replog.errors import CorruptionError, MissingFileError, StorageError
from replog.format.commits import (
    FORMAT_VERSION,
    META_DIR,
    CommitRecord,
    LogDescriptor,
    commit_path,
)
from replog.format.sealed import seal, unseal
from replog.format.segments import SegmentInfo, sha256_hex
from replog.format.state import LogState, SinkMark, apply_segments, segments_from_table
from replog.storage import Storage
from replog.storage.pointer import ForwardPointer, probe_forward

logger = logging.getLogger(__name__)

SNAPSHOTS_DIR = f"{META_DIR}/snapshots"
SNAPSHOT_HINT_PATH = f"{META_DIR}/_last_snapshot"
READ_THREADS = 8


def header_path(version: int) -> str:
    return f"{SNAPSHOTS_DIR}/{version:020d}.json"


def table_path(version: int) -> str:
    return f"{SNAPSHOTS_DIR}/{version:020d}.segments.arrow"


def hint(storage: Storage) -> ForwardPointer:
    return ForwardPointer(storage, SNAPSHOT_HINT_PATH, "version")


# -- commits -------------------------------------------------------------------------------


def read_commit(storage: Storage, version: int) -> CommitRecord | None:
    """Commit ``version``, or None if it does not exist (yet)."""
    relative = commit_path(version)
    data = storage.read_optional(relative)
    if data is None:
        return None
    record = CommitRecord.from_bytes(data, storage.path(relative))
    if record.version != version:
        raise CorruptionError(storage.path(relative), f"holds version {record.version}")
    return record


def read_commits(storage: Storage, first: int, last: int) -> list[CommitRecord]:
    """Commits ``first..last``, which must all exist, read in parallel."""
    if last < first:
        return []
    versions = range(first, last + 1)
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(versions))) as pool:
        records = list(pool.map(lambda version: read_commit(storage, version), versions))
    for version, record in zip(versions, records, strict=True):
        if record is None:
            raise CorruptionError(
                storage.path(commit_path(version)),
                "commit is missing although a later snapshot or commit exists",
            )
    return [record for record in records if record is not None]


def catch_up(storage: Storage, state: LogState, *, limit: int | None = None) -> bool:
    """Apply the commits after ``state.version``; False if ``limit`` commits were applied
    and more may follow. Reads ahead in parallel when more than one commit is new."""
    applied = 0
    window = 1
    while limit is None or applied < limit:
        count = window if limit is None else min(window, limit - applied)
        first = state.version + 1
        if count == 1:
            records = [read_commit(storage, first)]
        else:
            with ThreadPoolExecutor(max_workers=count) as pool:
                records = list(
                    pool.map(lambda v: read_commit(storage, v), range(first, first + count))
                )
        for record in records:
            if record is None:
                return True
            state.apply(record)
            applied += 1
        window = min(window * 2, READ_THREADS)
    return False


# -- snapshots -------------------------------------------------------------------------------


def _is_due(version: int, interval: int) -> bool:
    return version > 0 and version % interval == 0


def write_checkpoint(storage: Storage, descriptor: LogDescriptor, state: LogState) -> None:
    """Write the header (and, when due, the segment table) for ``state``, then the hint.

    Best effort for the caller: a missing checkpoint only makes the next open read more
    commits. Both files are written put-if-absent; one already written by another writer
    is fine.
    """
    if not _is_due(state.version, descriptor.checkpoint_interval):
        return
    header: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "version": state.version,
        "timestamp_ms": state.timestamp_ms,
        "shards": descriptor.shards,
        "heads": state.heads_json(),
        "lows": state.lows_json(),
        "sinks": {name: mark.to_json() for name, mark in sorted(state.sinks.items())},
        "bytes": state.total_bytes,
        "segment_count": state.segment_count,
    }
    if _is_due(state.version, descriptor.snapshot_interval):
        sink = pa.BufferOutputStream()
        table = state.segments_table()
        with ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        data = bytes(sink.getvalue())
        try:
            storage.put_if_absent(table_path(state.version), data)
        except FileExistsError:
            data = storage.read(table_path(state.version))  # another writer's, for this version
        header["table_sha256"] = sha256_hex(data)
    with contextlib.suppress(FileExistsError):  # another writer's header for this version
        storage.put_if_absent(header_path(state.version), seal(header))
    hint(storage).advance(state.version)
    logger.debug("wrote checkpoint of %s at version %d", storage.url, state.version)


def _header_state(storage: Storage, descriptor: LogDescriptor, version: int) -> LogState:
    relative = header_path(version)
    path = storage.path(relative)
    body = unseal(storage.read(relative), path, max_version=FORMAT_VERSION)
    try:
        if int(body["version"]) != version or int(body["shards"]) != descriptor.shards:
            raise ValueError("version or shard count differs from its name and the log")
        shards = range(descriptor.shards)
        state = LogState(
            shards=descriptor.shards,
            version=version,
            heads=[int(body["heads"][str(s)]) for s in shards],
            lows=[int(body["lows"][str(s)]) for s in shards],
            sinks={name: SinkMark.from_json(mark) for name, mark in body["sinks"].items()},
            total_bytes=int(body["bytes"]),
            segment_count=int(body["segment_count"]),
            timestamp_ms=int(body["timestamp_ms"]),
            segment_loader=lambda: segments_at(storage, descriptor, version),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptionError(path, f"malformed snapshot header: {exc}") from exc
    return state


def _table(storage: Storage, descriptor: LogDescriptor, version: int) -> list[list[SegmentInfo]]:
    """The segment table of the full snapshot at ``version``, checked against its header."""
    relative = header_path(version)
    body = unseal(storage.read(relative), storage.path(relative), max_version=FORMAT_VERSION)
    # Format 1 named the table's checksum segments_sha256.
    expected = body.get("table_sha256", body.get("segments_sha256"))
    table_relative = table_path(version)
    try:
        data = storage.read(table_relative)
    except FileNotFoundError as exc:
        raise MissingFileError(storage.path(table_relative), "segment table is missing") from exc
    if sha256_hex(data) != expected:
        raise CorruptionError(
            storage.path(table_relative), f"checksum mismatch: expected sha256 {expected}"
        )
    try:
        table = ipc.open_file(pa.BufferReader(data)).read_all()
        return segments_from_table(table, descriptor.shards)
    except (pa.ArrowInvalid, KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptionError(
            storage.path(table_relative), f"unreadable segment table: {exc}"
        ) from exc


_UNUSABLE = (CorruptionError, FileNotFoundError, StorageError)


def segments_at(
    storage: Storage, descriptor: LogDescriptor, version: int
) -> list[list[SegmentInfo]]:
    """Live segments at ``version``: the newest usable segment table at or before it plus
    the commits after that table (from version 1 if no table is usable)."""
    interval = descriptor.snapshot_interval
    base = version - version % interval
    lanes: list[list[SegmentInfo]] = [[] for _ in range(descriptor.shards)]
    while base > 0:
        try:
            lanes = _table(storage, descriptor, base)
            break
        except _UNUSABLE as exc:
            logger.warning(
                "segment table of snapshot %d of %s is unusable (%s); falling back to an older one",
                base,
                storage.url,
                exc,
            )
            base -= interval
    for record in read_commits(storage, base + 1, version):
        apply_segments(lanes, record)
    return lanes


def _newest_header(storage: Storage, descriptor: LogDescriptor) -> int:
    """The newest header version known: the hint, probed forward. Without a usable hint,
    gallop forward (a missing checkpoint in between only costs commits to read)."""
    interval = descriptor.checkpoint_interval

    def exists(version: int) -> bool:
        return storage.exists(header_path(version))

    start = hint(storage).read()
    if start is None:
        start, step = 0, interval
        while exists(start + step):
            start += step
            step *= 2
    start -= start % interval
    return probe_forward(start, interval, exists)


def load_state(storage: Storage, descriptor: LogDescriptor) -> LogState:
    """The log's current state, from the newest usable header and the commits after it."""
    version = _newest_header(storage, descriptor)
    state: LogState | None = None
    while version > 0 and state is None:
        try:
            state = _header_state(storage, descriptor, version)
        except _UNUSABLE as exc:
            logger.warning(
                "snapshot header %d of %s is unusable (%s); trying an older one",
                version,
                storage.url,
                exc,
            )
            version -= descriptor.checkpoint_interval
    if state is None:
        state = LogState(shards=descriptor.shards)
    catch_up(storage, state)
    return state


def check_snapshot(storage: Storage, descriptor: LogDescriptor, version: int) -> None:
    """Read snapshot ``version``'s header (and its segment table, if it has one), raising
    :class:`CorruptionError` or ``FileNotFoundError`` for what is wrong (for ``verify``)."""
    _header_state(storage, descriptor, version)
    if _is_due(version, descriptor.snapshot_interval):
        _table(storage, descriptor, version)
