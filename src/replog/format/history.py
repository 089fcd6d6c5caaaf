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

import logging
from typing import Any

import pyarrow as pa
from pyarrow import ipc

from replog.errors import (
    CorruptionError,
    MissingFileError,
    StorageError,
    UnsupportedFormatError,
)
from replog.format.commits import (
    FORMAT_VERSION,
    META_DIR,
    CommitRecord,
    LogDescriptor,
    commit_path,
)
from replog.format.lanes import (
    Lanes,
    SegmentChanges,
    apply_segments,
    segments_from_table,
    segments_table,
)
from replog.format.sealed import seal, unseal
from replog.format.segments import sha256_hex
from replog.format.state import LogState, SinkMark, Snapshots
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


def changes_path(version: int) -> str:
    return f"{SNAPSHOTS_DIR}/{version:020d}.changes.arrow"


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
    """Commits ``first..last``, which must all exist (read in parallel on remote storage)."""
    if last < first:
        return []
    versions = range(first, last + 1)
    records = storage.map(lambda v: read_commit(storage, v), versions, threads=READ_THREADS)
    for version, record in zip(versions, records, strict=True):
        if record is None:
            raise CorruptionError(
                storage.path(commit_path(version)),
                "commit is missing although a later snapshot or commit exists",
            )
    return [record for record in records if record is not None]


def catch_up(
    storage: Storage, state: LogState, *, limit: int | None = None, window: int = 1
) -> bool:
    """Apply the commits after ``state.version``; False if ``limit`` commits were applied
    and more may follow. On remote storage reads ``window`` commits at once, then twice as
    many while all exist (in parallel); elsewhere one at a time, stopping at the first
    that does not exist."""
    parallel = storage.is_remote
    window = window if parallel else 1
    applied = 0
    while limit is None or applied < limit:
        count = window if limit is None else min(window, limit - applied)
        first = state.version + 1
        versions = range(first, first + count)
        records = storage.map(lambda v: read_commit(storage, v), versions, threads=count)
        for record in records:
            if record is None:
                return True
            state.apply(record)
            applied += 1
        if parallel:
            window = max(min(window * 2, READ_THREADS), window)
    return False


# -- snapshots -------------------------------------------------------------------------------


def _is_due(version: int, interval: int) -> bool:
    return version > 0 and version % interval == 0


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


def _put_once(storage: Storage, relative: str, data: bytes) -> bytes:
    """Write ``data`` put-if-absent; the bytes that are there afterwards (another writer's
    file for the same version, if it was first)."""
    try:
        storage.put_if_absent(relative, data)
    except FileExistsError:
        return storage.read(relative)
    return data


_UNUSABLE = (CorruptionError, FileNotFoundError, StorageError)


def _write_changes(storage: Storage, snapshots: Snapshots, state: LogState) -> dict[str, Any]:
    """Write the changes file of ``state``'s version; the header's entry naming it."""
    changes = state.changes()
    table_sha256 = snapshots.table_sha256(changes.table_version)
    data = _put_once(storage, changes_path(state.version), _ipc_bytes(changes.to_table()))
    return {
        "table_version": changes.table_version,
        "table_sha256": table_sha256,
        "sha256": sha256_hex(data),
    }


def write_checkpoint(storage: Storage, descriptor: LogDescriptor, state: LogState) -> None:
    """Write the checkpoint for ``state`` when its version is due: the segment table or
    the changes since it, then the header, then the hint.

    Best effort for the caller: a missing checkpoint only makes the next open read more
    commits. Every file is written put-if-absent; one already there is fine.
    """
    version = state.version
    if not _is_due(version, descriptor.checkpoint_interval):
        return
    header: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "version": version,
        "timestamp_ms": state.timestamp_ms,
        "shards": descriptor.shards,
        "heads": state.heads_json(),
        "lows": state.lows_json(),
        "sinks": {name: mark.to_json() for name, mark in sorted(state.sinks.items())},
        "bytes": state.total_bytes,
        "segment_count": state.segment_count,
        "gc_marks": [[version, cutoff] for version, cutoff in state.gc_marks],
        "gc_known_since": state.gc_known_since,
    }
    snapshots = state.snapshots
    if _is_due(version, descriptor.snapshot_interval):
        data = _put_once(storage, table_path(version), _ipc_bytes(segments_table(state.segments)))
        header["table_sha256"] = sha256_hex(data)
        if snapshots is not None:
            snapshots.remember_table(version, header["table_sha256"])
    elif snapshots is not None:
        try:
            header["changes"] = _write_changes(storage, snapshots, state)
        except _UNUSABLE as exc:  # e.g. the table below was never written (a crash)
            logger.warning(
                "checkpoint %d of %s has no changes file (%s): readers will take its "
                "segments from the commits",
                version,
                storage.url,
                exc,
            )
    sealed = seal(header)
    copy: bytes | None = sealed
    try:
        storage.put_if_absent(header_path(version), sealed)
    except FileExistsError:  # another writer's header for this version: not ours to copy
        copy = None
    pointer = snapshots.hint if isinstance(snapshots, LogSnapshots) else hint(storage)
    pointer.advance(version, copy=copy)
    logger.debug("wrote checkpoint of %s at version %d", storage.url, version)


class LogSnapshots:
    """A log's snapshot files, read with fallbacks (the :class:`Snapshots` a state loads
    from). Remembers the headers it has read: a header is immutable."""

    def __init__(self, storage: Storage, descriptor: LogDescriptor) -> None:
        self.storage = storage
        self.descriptor = descriptor
        self._headers: dict[int, dict[str, Any]] = {}
        self._table_sha256: dict[int, str | None] = {0: None}
        self.hint = hint(storage)

    @property
    def table_interval(self) -> int:
        return self.descriptor.snapshot_interval

    def has_header(self, version: int) -> bool:
        return self.storage.exists(header_path(version))

    def header(self, version: int) -> dict[str, Any]:
        if version not in self._headers:
            relative = header_path(version)
            data = self.storage.read(relative)
            self._remember_header(
                version, unseal(data, self.storage.path(relative), max_version=FORMAT_VERSION)
            )
        return self._headers[version]

    def offer_header(self, version: int, copy: bytes) -> None:
        """Take the hint's copy of header ``version`` instead of reading the file, if its
        seal holds and it is that version's (otherwise the file is read when needed)."""
        try:
            body = unseal(copy, self.storage.path(SNAPSHOT_HINT_PATH), max_version=FORMAT_VERSION)
        except (CorruptionError, UnsupportedFormatError) as exc:
            logger.debug("ignoring the hint's copy of header %d: %s", version, exc)
            return
        if body.get("version") == version:
            self._remember_header(version, body)

    def _remember_header(self, version: int, body: dict[str, Any]) -> None:
        self._headers[version] = body
        changes = body.get("changes")
        if isinstance(changes, dict) and "table_sha256" in changes:
            self._table_sha256.setdefault(changes["table_version"], changes["table_sha256"])

    def remember_table(self, version: int, sha256: str) -> None:
        self._table_sha256[version] = sha256

    def table_sha256(self, version: int) -> str | None:
        """The checksum of the segment table at ``version`` (None for the empty log's), as
        its header or a later header's changes entry records it."""
        if version not in self._table_sha256:
            body = self.header(version)
            # Format 1 named it segments_sha256.
            self._table_sha256[version] = body.get("table_sha256", body.get("segments_sha256"))
        return self._table_sha256[version]

    def state(self, version: int) -> LogState:
        """The state at header ``version`` (segments and changes loaded on demand)."""
        path = self.storage.path(header_path(version))
        body = self.header(version)
        shards = self.descriptor.shards
        try:
            if int(body["version"]) != version or int(body["shards"]) != shards:
                raise ValueError("version or shard count differs from its name and the log")
            marks_known = "gc_marks" in body
            return LogState(
                shards=shards,
                version=version,
                heads=[int(body["heads"][str(s)]) for s in range(shards)],
                lows=[int(body["lows"][str(s)]) for s in range(shards)],
                sinks={name: SinkMark.from_json(mark) for name, mark in body["sinks"].items()},
                total_bytes=int(body["bytes"]),
                segment_count=int(body["segment_count"]),
                timestamp_ms=int(body["timestamp_ms"]),
                # A header written before gc marks: any mark may lie below it.
                gc_marks=[(int(v), int(c)) for v, c in body["gc_marks"]] if marks_known else (),
                gc_known_since=int(body["gc_known_since"]) if marks_known else version,
                snapshots=self,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(path, f"malformed snapshot header: {exc}") from exc

    def table(self, version: int) -> Lanes:
        """The segment table at ``version`` (a multiple of the table interval; 0 is the
        empty log), checked against its header."""
        if version == 0:
            return [[] for _ in range(self.descriptor.shards)]
        data = self._checked(table_path(version), self.table_sha256(version), "segment table")
        try:
            table = ipc.open_file(pa.BufferReader(data)).read_all()
            return segments_from_table(table, self.descriptor.shards)
        except (pa.ArrowInvalid, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CorruptionError(
                self.storage.path(table_path(version)), f"unreadable segment table: {exc}"
            ) from exc

    def changes_file(self, version: int) -> SegmentChanges | None:
        """The changes file of header ``version``, checked against the header; None if the
        header has none (written before changes files existed)."""
        entry = self.header(version).get("changes")
        if entry is None:
            return None
        relative = changes_path(version)
        data = self._checked(relative, entry.get("sha256"), "changes file")
        table_version = version - version % self.table_interval
        try:
            if int(entry["table_version"]) != table_version:
                raise ValueError(f"is based on version {entry['table_version']}")
            table = ipc.open_file(pa.BufferReader(data)).read_all()
            return SegmentChanges.from_table(table, table_version)
        except (pa.ArrowInvalid, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CorruptionError(
                self.storage.path(relative), f"unreadable changes file: {exc}"
            ) from exc

    def _checked(self, relative: str, expected: object, what: str) -> bytes:
        try:
            data = self.storage.read(relative)
        except FileNotFoundError as exc:
            raise MissingFileError(self.storage.path(relative), f"{what} is missing") from exc
        if sha256_hex(data) != expected:
            raise CorruptionError(
                self.storage.path(relative), f"checksum mismatch: expected sha256 {expected}"
            )
        return data

    def segments(self, version: int) -> Lanes:
        """Live segments at checkpoint ``version``: its table, or the table below it plus
        the header's changes; falling back to older tables and the commits after them."""
        table_version = version - version % self.table_interval
        if version > table_version:
            try:
                changes = self.changes_file(version)
                if changes is not None:
                    return changes.applied_to(
                        self.table(table_version), self.storage.path(changes_path(version))
                    )
            except _UNUSABLE as exc:
                self._fallback(f"snapshot {version}'s segments", exc)
        return self._segments_from_commits(version)

    def changes(self, version: int) -> SegmentChanges:
        """Changes at header ``version`` since the table below it: its changes file, or
        the commits in between."""
        table_version = version - version % self.table_interval
        try:
            changes = self.changes_file(version)
            if changes is not None:
                return changes
        except _UNUSABLE as exc:
            self._fallback(f"the changes file of snapshot {version}", exc)
        changes = SegmentChanges(table_version)
        for record in read_commits(self.storage, table_version + 1, version):
            changes.apply(record)
        return changes

    def _segments_from_commits(self, version: int) -> Lanes:
        """The newest usable table at or before ``version`` plus the commits after it."""
        base = version - version % self.table_interval
        while True:
            try:
                lanes = self.table(base)
                break
            except _UNUSABLE as exc:
                self._fallback(f"the segment table of snapshot {base}", exc)
                base -= self.table_interval
        for record in read_commits(self.storage, base + 1, version):
            apply_segments(lanes, record)
        return lanes

    def _fallback(self, what: str, exc: Exception) -> None:
        logger.warning(
            "%s of %s is unusable (%s); reading older snapshots and commits instead",
            what,
            self.storage.url,
            exc,
        )


def _hinted_header(snapshots: LogSnapshots) -> int:
    """The header version the hint names (not probed past: see :func:`load_state`).
    Without a usable hint, gallop forward over existing headers."""
    interval = snapshots.descriptor.checkpoint_interval
    entry = snapshots.hint.read_entry()
    start = None
    if entry is not None:
        start = entry.value
        if entry.copy is not None:
            snapshots.offer_header(start, entry.copy)
    if start is None:
        start, step = 0, interval
        while snapshots.has_header(start + step):
            start += step
            step *= 2
    return start - start % interval


def _usable_state(snapshots: LogSnapshots, version: int, floor: int = 0) -> LogState | None:
    """The state at the newest usable header from ``version`` down to above ``floor``
    (unusable ones are skipped with a warning); None if there is none."""
    while version > floor:
        try:
            return snapshots.state(version)
        except _UNUSABLE as exc:
            logger.warning(
                "snapshot header %d of %s is unusable (%s); trying an older one",
                version,
                snapshots.storage.url,
                exc,
            )
            version -= snapshots.descriptor.checkpoint_interval
    return None


def load_state(storage: Storage, descriptor: LogDescriptor) -> LogState:
    """The log's current state, from the newest usable header and the commits after it.

    Fewer than ``checkpoint_interval`` commits follow the newest header, so that many are
    read at once (in parallel on remote storage). The hint is not probed past first: it
    lags only after a crash or a slow writer, a full window reveals that, and only then
    are newer headers looked for.
    """
    snapshots = LogSnapshots(storage, descriptor)
    interval = descriptor.checkpoint_interval
    state = _usable_state(snapshots, _hinted_header(snapshots))
    if state is None:
        state = LogState(shards=descriptor.shards, snapshots=snapshots)
    while not catch_up(storage, state, limit=interval, window=interval):
        newest = probe_forward(
            state.version - state.version % interval, interval, snapshots.has_header
        )
        if newest > state.version:
            state = _usable_state(snapshots, newest, floor=state.version) or state
    return state


def check_snapshot(storage: Storage, descriptor: LogDescriptor, version: int) -> None:
    """Read snapshot ``version``'s header and its segment table or changes file, raising
    :class:`CorruptionError` or ``FileNotFoundError`` for what is wrong (for ``verify``)."""
    snapshots = LogSnapshots(storage, descriptor)
    snapshots.state(version)
    if _is_due(version, descriptor.snapshot_interval):
        snapshots.table(version)
    else:
        snapshots.changes_file(version)
