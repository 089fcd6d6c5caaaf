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
import dataclasses
import json
import logging
from typing import Any

import pyarrow as pa
from pyarrow import ipc

from replog.errors import (
    CorruptionError,
    LogNotFoundError,
    LogRecreatedError,
    MissingCommitError,
    MissingFileError,
    StorageError,
    UnsupportedFormatError,
)
from replog.format.commits import (
    COMMITS_DIR,
    DESCRIPTOR_PATH,
    META_DIR,
    CommitRecord,
    LogDescriptor,
    commit_path,
)
from replog.format.gc import CLOCK_SKEW_MS
from replog.format.headers import ChangesEntry, SnapshotHeader
from replog.format.lanes import (
    Lanes,
    SegmentChanges,
    apply_segments,
    segments_from_table,
    segments_table,
    tombstones_from_table,
)
from replog.format.segments import SegmentInfo, sha256_hex
from replog.format.state import LogState, SinkMark, Snapshots
from replog.names import listed_versions
from replog.storage import Storage
from replog.storage.backends import Durability
from replog.storage.pointer import ForwardPointer, probe_forward
from replog.timeutil import monotonic_s, now_ms

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


class BaseMissing(Exception):  # noqa: N818 (a signal, not an error)
    """The commit a state was built up to is gone although the log is the same: retention
    removed it while this state was idle. The caller loads the state afresh."""


def check_identity(storage: Storage, log_id: str) -> None:
    """Raise if the descriptor at ``storage`` no longer names ``log_id``: the log was
    deleted (:class:`LogNotFoundError`) or deleted and re-created
    (:class:`LogRecreatedError`)."""
    data = storage.read_optional(DESCRIPTOR_PATH)
    if data is None:
        raise LogNotFoundError(
            f"{storage.url!r}: the log this process opened was deleted (no {DESCRIPTOR_PATH}); "
            f"nothing was written"
        )
    found = LogDescriptor.from_bytes(data, storage.path(DESCRIPTOR_PATH)).log_id
    if log_id and found != log_id:
        raise LogRecreatedError(storage.path(DESCRIPTOR_PATH), found, log_id)


def _base_members(base: bytes) -> tuple[str, str | None] | None:
    """The ``log_id`` and ``token`` of a commit record's raw bytes; None if they do not
    parse (damage is for the full read of the record to report). Only these members are
    looked at."""
    try:
        document = json.loads(base)
        return str(document.get("log_id", "")), document.get("token")
    except (ValueError, AttributeError):
        return None


def check_base(storage: Storage, state: LogState, base: bytes | None) -> None:
    """After finding no commit past ``state.version``: make sure the log still has the
    history the state was built from (``base``: commit ``state.version`` as read after
    that, None if missing).

    A log deleted and re-created with fewer commits would otherwise look idle; and
    retention deletes commits oldest first, one at a time, so while commit
    ``state.version`` is the record this state applied, no later commit was deleted: a
    missing one is one not written yet. At version 0, the same holds while retention
    never ran (:data:`EXPIRED_MARKER`). Otherwise a writer would commit into a range
    retention emptied, where no reader looks. Raises :class:`LogRecreatedError` or
    ``LogNotFoundError`` for another log, :class:`BaseMissing` for an expired base."""
    if state.version == 0:
        check_identity(storage, state.log_id)
        if storage.exists(EXPIRED_MARKER):
            raise BaseMissing(0)
        return
    members = _base_members(base) if base is not None else None
    found, token = members or ("", state.last_token)
    if found and state.log_id and found != state.log_id:
        check_identity(storage, state.log_id)  # raises if it is another log
    # gone: missing, or not the record the state applied (written there since)
    if base is None or (state.last_token is not None and token != state.last_token):
        check_identity(storage, state.log_id)  # raises if it is another log
        raise BaseMissing(state.version)


def landed_first(storage: Storage, record: CommitRecord, table_interval: int) -> bool | None:
    """After ``record`` landed at version v + 1 and commit v was then found gone
    (:class:`BaseMissing`): whether the record landed on the log's history and commit v
    expired after it (True), or it filled a slot retention had emptied before its put
    (False: it must be taken back); None if that cannot be told (the record is gone too).

    Retention deletes commits oldest first, each only for a table at or after it, by a
    writer at least S (the table interval) versions past that table, never the writer
    of v + 1 (which has not expired anything yet). So:

    * landed first: the expiring writer committed v + 2 or later on the record: commit
      v + 2 exists, and a header v + 1 (if v + 1 is a table) is missing or the record's;
    * filled an emptied slot: a table c >= v + 1 was expired. If c > v + 1, commit v + 2
      went with it; if c = v + 1 (so v + 1 is a table), header v + 1 is still there, the
      state of the other commit v + 1 (its token is not the record's).

    No clock, the storage's included, enters this."""
    data = storage.read_optional(commit_path(record.version))
    if data is None or _base_members(data) != (record.log_id, record.token):
        return None  # gone too: expired since, or deleted by an expiry that ran late
    if not storage.exists(commit_path(record.version + 1)):
        return False
    if record.version % table_interval:
        return True
    relative = header_path(record.version)
    header = storage.read_optional(relative)
    try:
        token = None if header is None else SnapshotHeader.from_bytes(header, relative).token
    except (CorruptionError, UnsupportedFormatError):
        return None
    if header is not None and not token:
        return None  # a header without a token (written by replog 0.4) tells nothing
    return header is None or token == record.token


def _check_not_overtaken(storage: Storage, state: LogState) -> None:
    """Raise :class:`BaseMissing` if a header of this log above ``state.version`` exists
    (the hint names it): the log went past the state's commit, so that commit, found with
    no commit after it, is not the head but one a writer put into a slot retention had
    emptied and could not take back (it died first). Only such a commit can be old and
    followed by nothing while headers above it exist."""
    entry = hint(storage).read_entry()
    if entry is None or entry.value <= state.version:
        return
    data = storage.read_optional(header_path(entry.value))
    if data is None:
        return
    try:
        found = SnapshotHeader.from_bytes(data, storage.path(header_path(entry.value)))
    except (CorruptionError, UnsupportedFormatError):
        return
    if found.version == entry.value and found.log_id in ("", state.log_id):
        logger.warning(
            "%s: commit %d is followed by nothing, yet header %d exists: it is a commit put "
            "into a slot retention had emptied (its writer died before taking it back); "
            "reading the log from its newest header",
            storage.url,
            state.version,
            entry.value,
        )
        raise BaseMissing(state.version)


def _check_head(storage: Storage, state: LogState, base: bytes | None, idle_ms: int | None) -> None:
    """:func:`check_base`, and for a state idle for ``idle_ms``,
    :func:`_check_not_overtaken`."""
    check_base(storage, state, base)
    if idle_ms is not None and state.timestamp_ms <= now_ms() - idle_ms:
        _check_not_overtaken(storage, state)


def _check_no_gap(
    storage: Storage, state: LogState, seen: dict[int, bool], probe: int
) -> None:
    """After commit ``state.version + 1`` was found missing: raise
    :class:`MissingCommitError` if one of the ``probe`` commits after it exists
    (``seen``: which of them the caller already looked at) and it is still missing when
    read again, with commit ``state.version`` still the state's.

    A writer puts commit v + 1 only once commit v exists, and retention deletes commits
    oldest first: a missing commit below one that exists, above a commit that is still
    the state's, was deleted or lost outside replog. Taking the commit before it as the
    head would show readers a prefix of the log as the whole, and let a writer fill the
    gap with other events. Commits written meanwhile (the missing one first) are told
    apart by reading the missing one again once a later one was seen, and retention
    racing the check (deleting the base too) by reading the base again."""
    missing = state.version + 1
    versions = range(missing + 1, missing + 1 + probe)
    unknown = [v for v in versions if v not in seen]
    found = storage.map(lambda v: storage.exists(commit_path(v)), unknown, threads=READ_THREADS)
    seen = {**seen, **dict(zip(unknown, found, strict=True))}
    later = next((v for v in versions if seen[v]), None)
    if later is None or storage.exists(commit_path(missing)):
        return  # no later commit, or the missing one was written since (with the later)
    base = storage.read_optional(commit_path(state.version)) if state.version else None
    check_base(storage, state, base)  # BaseMissing: retention ran meanwhile
    raise MissingCommitError(storage.path(commit_path(missing)), missing, later)


def catch_up(
    storage: Storage,
    state: LogState,
    *,
    limit: int | None = None,
    window: int = 1,
    verify_within: float | None = 0.0,
    idle_ms: int | None = None,
    probe: int = 1,
) -> bool:
    """Apply the commits after ``state.version``; False if ``limit`` commits were applied
    and more may follow. On remote storage reads ``window`` commits at once, then twice as
    many while all exist (in parallel); elsewhere one at a time, stopping at the first
    that does not exist.

    Finding nothing new also checks that the log is the one the state was built from
    (one more small read, in parallel on remote storage), unless ``verify_within`` is None
    or that was checked for this version less than ``verify_within`` seconds ago: raises
    :class:`LogRecreatedError` or :class:`LogNotFoundError` if not, and
    :class:`BaseMissing` if retention removed the state's commits meanwhile
    (:func:`check_base`). On remote storage the base is read alongside the first commits, so
    a deletion between the two reads can go unseen: a reader then stays behind until
    its next check, and a writer checks again after its commit lands
    (``ReplicationLog.commit``). A state whose commit is older than ``idle_ms`` (the
    retention less the clock skew) by this clock is also checked not to have been
    overtaken (:func:`_check_not_overtaken`: one more small read, on idle logs only).
    That check, and a miss after commits were applied in this call, also look at the
    ``probe`` commits after the missing one (those this round read, the first after it
    read alongside on remote storage, the others probed): one that exists makes the
    miss a gap, :class:`MissingCommitError` (:func:`_check_no_gap`).
    """
    parallel = storage.is_remote
    window = window if parallel else 1
    verify = verify_within is not None and not state.verified_within(verify_within)
    applied = 0
    while limit is None or applied < limit:
        count = window if limit is None else min(window, limit - applied)
        # The base alongside the first round only: in a later one it is a commit applied
        # just now, read again after a miss, which then proves the order (head_seen).
        found = _Round.read(storage, state, count, verify and parallel and applied == 0)
        for index, record in enumerate(found.records):
            if record is None:
                found.at_head(storage, state, index, verify=verify, applied=applied,
                              idle_ms=idle_ms, probe=probe)  # fmt: skip
                return True
            state.apply(record)
            applied += 1
        if parallel:
            window = max(min(window * 2, READ_THREADS), window)
    return False


@dataclasses.dataclass
class _Round:
    """One round of :func:`catch_up`'s reads: commits ``first..`` (None: missing); with
    the base, also commit ``first - 1`` (its raw bytes) and whether the commit after the
    round exists (what a miss in it is checked against, :func:`_check_no_gap`)."""

    records: list[CommitRecord | None]
    with_base: bool
    base: bytes | None
    seen: dict[int, bool]
    """Which commits after the round's first are known to exist (True) or not."""
    asked: float
    """When (:func:`monotonic_s`) the reads began: a commit missing then was missing."""

    @classmethod
    def read(cls, storage: Storage, state: LogState, count: int, with_base: bool) -> _Round:
        first = state.version + 1
        with_base = with_base and state.version > 0
        base_version = state.version if with_base else -1
        peek = first + count if with_base else -1

        def get(version: int) -> Any:
            if version == base_version:
                return storage.read_optional(commit_path(version))  # only its id matters
            if version == peek:
                return storage.exists(commit_path(version))
            return read_commit(storage, version)

        around = [base_version, peek] if with_base else []
        wanted = around[:1] + list(range(first, first + count)) + around[1:]
        asked = monotonic_s()  # before any of these reads
        found = storage.map(get, wanted, threads=len(wanted))
        base = found.pop(0) if with_base else None
        peeked = found.pop() if with_base else False
        seen = {first + i: record is not None for i, record in enumerate(found)}
        if with_base:
            seen[peek] = bool(peeked)
        return cls(found, with_base, base, seen, asked)

    def at_head(
        self,
        storage: Storage,
        state: LogState,
        index: int,
        *,
        verify: bool,
        applied: int,
        idle_ms: int | None,
        probe: int,
    ) -> None:
        """Commit ``state.version + 1`` (the round's ``index``-th) is missing: with
        ``verify``, check that the log is the state's (:func:`_check_head`); then, or
        after commits were ``applied``, that the miss is no gap (:func:`_check_no_gap`)."""
        ordered = index > 0 or not self.with_base
        if verify:
            base = self.base
            if ordered:  # read after the miss (the base is a commit applied just now)
                base = storage.read_optional(commit_path(state.version))
            _check_head(storage, state, base, idle_ms)
        if verify or applied:  # a new version: is the miss a gap?
            _check_no_gap(storage, state, self.seen, probe)
        if verify:
            state.verified = (state.version, monotonic_s())
            if ordered:
                # The base was there after the miss, so the next commit was not expired
                # but not written yet. (A base read alongside the miss proves nothing
                # about the order: an earlier proof stands.)
                state.head_seen = self.asked


# -- snapshots -------------------------------------------------------------------------------


def _is_due(version: int, interval: int) -> bool:
    return version > 0 and version % interval == 0


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema, options=ipc.IpcWriteOptions(compression="lz4")) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


def _put_once(storage: Storage, relative: str, data: bytes, durability: Durability) -> bytes:
    """Write ``data`` put-if-absent; the bytes that are there afterwards (another writer's
    file for the same version, if it was first)."""
    try:
        storage.put_if_absent(relative, data, durability=durability)
    except FileExistsError:
        return storage.read(relative)
    return data


_UNUSABLE = (CorruptionError, FileNotFoundError, StorageError)


def _write_changes(
    storage: Storage, snapshots: Snapshots, state: LogState, interval: int
) -> ChangesEntry:
    """Write the changes file of ``state``'s version: the segments added and removed
    since the table below, and as dropped the other segments the commits since the
    previous checkpoint removed (with the table's removed ones, every segment removed
    between two checkpoints is named once: what expiry deletes). Returns the header's
    entry naming it."""
    changes = state.changes()
    since = state.version - interval
    recent = state.changes_since(since).tombstones
    dropped = [segment for segment in recent if segment.key not in changes.removed]
    table = changes.since
    encoded = _ipc_bytes(changes.to_table(dropped))
    # Best effort on disk: readers fall back past a changes file a crash tore.
    data = _put_once(storage, changes_path(state.version), encoded, Durability.BEST_EFFORT)
    return ChangesEntry(table, snapshots.table_sha256(table), sha256_hex(data), since)


def _header(state: LogState, descriptor: LogDescriptor) -> SnapshotHeader:
    """The header of ``state`` (without its table digest or changes entry)."""
    return SnapshotHeader(
        version=state.version,
        timestamp_ms=state.timestamp_ms,
        shards=descriptor.shards,
        heads=tuple(state.heads),
        lows=tuple(state.lows),
        sinks={name: mark.to_json() for name, mark in state.sinks.items()},
        total_bytes=state.total_bytes,
        segment_count=state.segment_count,
        gc_marks=tuple(state.gc_marks),
        gc_known_since=state.gc_known_since,
        log_id=descriptor.log_id,
        retained_from=state.retained_from,
        token=state.last_token,
    )


def write_checkpoint(storage: Storage, descriptor: LogDescriptor, state: LogState) -> None:
    """Write the checkpoint for ``state`` when its version is due: the segment table (with
    the tombstones of the segments its last interval removed) or the changes since it,
    then the header, then the hint. After a table, the writer expires what is older than
    the log's retention (:func:`expire`).

    Best effort for the caller: a missing checkpoint only makes the next open read more
    commits. Every file is written put-if-absent; one already there is fine.
    """
    version = state.version
    if not _is_due(version, descriptor.checkpoint_interval):
        return
    header = _header(state, descriptor)
    snapshots = state.snapshots
    at_table = _is_due(version, descriptor.snapshot_interval)
    interval = descriptor.checkpoint_interval
    if at_table:
        tombstones = []
        if snapshots is not None:
            tombstones = state.changes_since(version - interval).tombstones
        table = segments_table(state.segments, tombstones)
        # Durable: once retention deleted the commits below it, a table is irreplaceable.
        data = _put_once(storage, table_path(version), _ipc_bytes(table), Durability.SYNC)
        header = dataclasses.replace(header, table_sha256=sha256_hex(data))
        if snapshots is not None:
            snapshots.remember_table(version, sha256_hex(data))
    elif snapshots is not None:
        try:
            changes = _write_changes(storage, snapshots, state, interval)
            header = dataclasses.replace(header, changes=changes)
        except _UNUSABLE as exc:  # e.g. the table below was never written (a crash)
            logger.warning(
                "checkpoint %d of %s has no changes file (%s): readers will take its "
                "segments from the commits",
                version,
                storage.url,
                exc,
            )
    sealed = header.to_bytes()
    copy: bytes | None = sealed
    try:
        storage.put_if_absent(  # readers fall back
            header_path(version), sealed, durability=Durability.BEST_EFFORT
        )
    except FileExistsError:  # another writer's header for this version: not ours to copy
        copy = None
    pointer = snapshots.hint if isinstance(snapshots, LogSnapshots) else hint(storage)
    pointer.advance(version, copy=copy)
    logger.debug("wrote checkpoint of %s at version %d", storage.url, version)


WHOLE_SECOND_MS = 1_000
"""Storage time stamps may be whole seconds (S3's ``Last-Modified``, truncated): an age
measured from a stamp without milliseconds is taken as a second shorter."""


class _Ages:
    """How old a header is, for expiry: by storage time where the backend gives file
    times (the header file's time stamp against that of the expiring writer's own commit
    ``version``, both from the storage's clock, so no writer's clock enters it); by the
    header's ``timestamp_ms`` against the writer's clock ``now_ms`` otherwise (then the
    clocks of the header's writer and of the expiring writer must agree within the clock
    skew writers allow)."""

    def __init__(self, storage: Storage, version: int, now_ms: float) -> None:
        self.storage = storage
        self.now_ms = now_ms
        self._version = version
        self._storage_now: int | bool | None = False  # False: not asked yet

    def storage_now(self) -> int | None:
        if self._storage_now is False:
            self._storage_now = self.storage.modified_ms(commit_path(self._version))
        assert self._storage_now is not True
        return self._storage_now

    def expired(self, header: SnapshotHeader, retention_ms: int) -> bool:
        """Whether ``header`` is older than ``retention_ms``: by storage time and by the
        clocks, both (a clock that steps forward, the storage's as much as a writer's,
        then delays expiry instead of emptying a slot a writer is about to fill)."""
        by_clocks = header.timestamp_ms <= self.now_ms - retention_ms
        now = self.storage_now()
        stamp = self.storage.modified_ms(header_path(header.version)) if now is not None else None
        if now is None or stamp is None:
            return by_clocks
        slack = WHOLE_SECOND_MS if stamp % WHOLE_SECOND_MS == 0 else 0
        by_storage = now - stamp >= retention_ms + slack
        disagree = abs((now - stamp) - (self.now_ms - header.timestamp_ms)) > CLOCK_SKEW_MS
        if by_storage != by_clocks and disagree:
            logger.warning(
                "%s: header %d is %d s old by storage time but %d s by the writers' clocks: "
                "a clock is off by more than %d minutes; not expired until both agree",
                self.storage.url,
                header.version,
                (now - stamp) // 1000,
                (self.now_ms - header.timestamp_ms) // 1000,
                CLOCK_SKEW_MS // 60_000,
            )
        return by_storage and by_clocks


EXPIRE_STEPS = 2
"""Tables a writer of a table expires at most (one per table written keeps up; two catch
up after a pause)."""


EXPIRED_MARKER = f"{SNAPSHOTS_DIR}/expired"
"""Created (empty) before retention deletes anything for the first time: a state at
version 0 that finds no commit 1 is an empty log's only while this file is absent."""


def expired_files(descriptor: LogDescriptor, retained: int, table: int) -> list[str]:
    """The headers, tables and changes files a log needs no more once table ``table`` is
    its oldest (from ``retained``); the commits up to it go too (:func:`expire`)."""
    checkpoints = range(retained - retained % descriptor.checkpoint_interval, table,
                        descriptor.checkpoint_interval)  # fmt: skip
    files = []
    for version in checkpoints:
        if version > 0:
            files.append(header_path(version))
            is_table = version % descriptor.snapshot_interval == 0
            files.append(table_path(version) if is_table else changes_path(version))
    return files


def _delete_commits(storage: Storage, first: int, last: int) -> None:
    """Delete commits ``first..last`` one at a time, oldest first, stopping at the first
    failure: the deleted commits are always a prefix of the log. That is what lets a
    writer that finds commit ``v + 1`` missing and then commit ``v`` present know that
    ``v + 1`` was never written, rather than expired (see :func:`check_base`)."""
    for version in range(first, last + 1):
        storage.delete(commit_path(version))


def _expire_step(snapshots: LogSnapshots, retained: int, table: int, live: set[str]) -> None:
    """Make table ``table`` the oldest: delete the files of the segments removed since
    ``retained`` that no live segment names, then the commits up to ``table`` (in order),
    then the snapshot files below it. Raises on the first failure."""
    descriptor, storage = snapshots.descriptor, snapshots.storage
    tombstones = snapshots.tombstones_between(retained, table)
    doomed = [path for path in dict.fromkeys(t.path for t in tombstones) if path not in live]
    storage.delete_many(doomed)
    if retained == 0:
        with contextlib.suppress(FileExistsError):
            storage.put_if_absent(EXPIRED_MARKER, b"")
    _delete_commits(storage, retained + 1, table)
    storage.delete_many(expired_files(descriptor, retained, table))
    logger.info(
        "expired %s below version %d: %d removed segment files, commits %d..%d",
        storage.url,
        table,
        len(doomed),
        retained + 1,
        table,
    )


def expire(
    snapshots: LogSnapshots, *, version: int, retained_from: int, live: set[str], now_ms: float
) -> int:
    """Delete what is older than the log's retention, a table at a time (best effort), for
    a writer at ``version`` whose state keeps history from ``retained_from`` and whose
    live files are ``live``; returns the oldest version kept now.

    The oldest retained table moves to the next table whose header is older than the
    retention, while the newest two tables stay. The segments removed in between (the
    tombstones of the changes files below it and of its table) have their files
    deleted unless a live segment still names them, and the commits, headers, tables
    and changes files below it are deleted. Readers never need them: a state comes from
    the newest header, and a reader whose commits are gone loads it afresh. Costs what
    it deletes, never a listing. ``live`` may be older than the state it came from: a
    removed segment never becomes live again, so it only ever keeps too much.

    A table whose header is missing or unusable (a writer died before writing it, or a
    crash tore it) is stepped over to the next one; the state ``retained_from`` came
    from may also be older than another writer's expiry, so commits already deleted are
    fine to delete again.
    """
    descriptor, storage = snapshots.descriptor, snapshots.storage
    interval = descriptor.snapshot_interval
    retained = retained_from
    table = retained - retained % interval + interval
    steps = 0
    ages = _Ages(storage, version, now_ms)
    while steps < EXPIRE_STEPS and table <= version - interval:
        try:
            if not ages.expired(snapshots.header(table), descriptor.retention_ms):
                break
            _expire_step(snapshots, retained, table, live)
        except (CorruptionError, FileNotFoundError) as exc:
            logger.info("stepping over table %d of %s (%s)", table, storage.url, exc)
            table += interval
            continue
        except (StorageError, OSError) as exc:  # tried again after the next table
            logger.warning("could not expire %s below version %d: %s", storage.url, table, exc)
            break
        retained = table
        table += interval
        steps += 1
    return retained


class LogSnapshots:
    """A log's snapshot files, read with fallbacks (the :class:`Snapshots` a state loads
    from). Remembers the headers it has read: a header is immutable."""

    def __init__(self, storage: Storage, descriptor: LogDescriptor) -> None:
        self.storage = storage
        self.descriptor = descriptor
        self._headers: dict[int, SnapshotHeader] = {}
        self._rejected: dict[int, str] = {}
        self._table_sha256: dict[int, str | None] = {0: None}
        self.hint = hint(storage)

    @property
    def table_interval(self) -> int:
        return self.descriptor.snapshot_interval

    def has_header(self, version: int) -> bool:
        return self.storage.exists(header_path(version))

    def header(self, version: int) -> SnapshotHeader:
        """Header ``version``, checked to belong to this log (and not rejected)."""
        if version in self._rejected:
            raise CorruptionError(self.storage.path(header_path(version)), self._rejected[version])
        if version not in self._headers:
            relative = header_path(version)
            path = self.storage.path(relative)
            header = SnapshotHeader.from_bytes(self.storage.read(relative), path)
            if header.version != version:  # a copy under another name (a partial restore)
                raise CorruptionError(
                    path, f"holds the header of version {header.version}, not {version}"
                )
            self._remember_header(header)
        return self._headers[version]

    def reject(self, version: int, reason: str) -> None:
        """Treat header ``version`` as unusable from now on although it reads well: what it
        says is not the history of the commits (its own commit is gone or another's)."""
        self._rejected[version] = reason
        self._headers.pop(version, None)
        self._table_sha256.pop(version, None)

    def offer_header(self, version: int, copy: bytes) -> None:
        """Take the hint's copy of header ``version`` instead of reading the file, if its
        seal holds and it is that version's (otherwise the file is read when needed)."""
        try:
            header = SnapshotHeader.from_bytes(copy, self.storage.path(SNAPSHOT_HINT_PATH))
        except (CorruptionError, UnsupportedFormatError) as exc:
            logger.debug("ignoring the hint's copy of header %d: %s", version, exc)
            return
        if header.version == version and not self._foreign(header):
            self._remember_header(header)

    def _foreign(self, header: SnapshotHeader) -> bool:
        return bool(header.log_id) and header.log_id != self.descriptor.log_id

    def _remember_header(self, header: SnapshotHeader) -> None:
        """Keep ``header``; one of another log is unusable (:class:`CorruptionError`: a
        writer of a log deleted and re-created at this URL wrote it late), unless this log
        is the one that was re-created (then :class:`LogRecreatedError`)."""
        if self._foreign(header):
            check_identity(self.storage, self.descriptor.log_id)
            raise CorruptionError(
                self.storage.path(header_path(header.version)),
                f"snapshot header of another log (log_id {header.log_id!r}, this log is "
                f"{self.descriptor.log_id!r}): written late by a writer of a log deleted "
                f"here before; ignored",
            )
        self._headers[header.version] = header
        if header.changes is not None:
            self._table_sha256.setdefault(header.changes.table_version, header.changes.table_sha256)

    def remember_table(self, version: int, sha256: str) -> None:
        self._table_sha256[version] = sha256

    def table_sha256(self, version: int) -> str | None:
        """The checksum of the segment table at ``version`` (None for the empty log's), as
        its header or a later header's changes entry records it."""
        if version not in self._table_sha256:
            self._table_sha256[version] = self.header(version).table_sha256
        return self._table_sha256[version]

    def state(self, version: int) -> LogState:
        """The state at header ``version`` (segments and changes loaded on demand)."""
        path = self.storage.path(header_path(version))
        header = self.header(version)
        shards = self.descriptor.shards
        if header.version != version or header.shards != shards:
            raise CorruptionError(
                path, "malformed snapshot header: version or shard count differs from its "
                "name and the log"
            )  # fmt: skip
        try:
            sinks = {name: SinkMark.from_json(dict(mark)) for name, mark in header.sinks.items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(path, f"malformed snapshot header: {exc}") from exc
        state = LogState(
            shards=shards,
            version=version,
            heads=list(header.heads),
            lows=list(header.lows),
            sinks=sinks,
            total_bytes=header.total_bytes,
            segment_count=header.segment_count,
            timestamp_ms=header.timestamp_ms,
            gc_marks=header.gc_marks,
            gc_known_since=header.gc_known_since,
            snapshots=self,
            log_id=self.descriptor.log_id,
            retained_from=header.retained_from,
        )
        state.last_token = header.token
        return state

    def _table(self, version: int) -> pa.Table:
        data = self._checked(table_path(version), self.table_sha256(version), "segment table")
        try:
            return ipc.open_file(pa.BufferReader(data)).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorruptionError(
                self.storage.path(table_path(version)), f"unreadable segment table: {exc}"
            ) from exc

    def table(self, version: int) -> Lanes:
        """The segment table at ``version`` (a multiple of the table interval; 0 is the
        empty log), checked against its header."""
        if version == 0:
            return [[] for _ in range(self.descriptor.shards)]
        table = self._table(version)
        try:
            return segments_from_table(table, self.descriptor.shards)
        except (pa.ArrowInvalid, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CorruptionError(
                self.storage.path(table_path(version)), f"unreadable segment table: {exc}"
            ) from exc

    def tombstones(self, version: int) -> list[SegmentInfo]:
        """The segments table ``version`` records as removed since the table before it."""
        try:
            return tombstones_from_table(self._table(version))
        except (pa.ArrowInvalid, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CorruptionError(
                self.storage.path(table_path(version)), f"unreadable segment table: {exc}"
            ) from exc

    def changes_file(self, version: int) -> SegmentChanges | None:
        """The changes file of header ``version`` (added and removed since the table
        below; dropped since the checkpoint before), checked against the header; None if
        the header has none (written before changes files existed)."""
        entry = self.header(version).changes
        if entry is None:
            return None
        relative = changes_path(version)
        data = self._checked(relative, entry.sha256, "changes file")
        table_version = version - version % self.table_interval
        try:
            if entry.table_version != table_version or not table_version <= entry.since < version:
                raise ValueError(f"is based on version {entry.table_version} since {entry.since}")
            table = ipc.open_file(pa.BufferReader(data)).read_all()
            return SegmentChanges.from_table(table, table_version)
        except (pa.ArrowInvalid, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CorruptionError(
                self.storage.path(relative), f"unreadable changes file: {exc}"
            ) from exc

    def tombstones_between(self, older: int, table: int) -> list[SegmentInfo]:
        """Segments removed by the commits after table ``older`` up to table ``table``:
        the table's tombstones (its last interval), the older table's segments the last
        changes file before it says are removed, and the dropped segments of every
        changes file in between. Checkpoints without a readable changes file contribute
        none (their files are left to ``recover``)."""
        found = self.tombstones(table)
        interval = self.descriptor.checkpoint_interval
        last = table - interval
        for version in range(older + interval, table, interval):
            try:
                changes = self.changes_file(version)
            except _UNUSABLE as exc:
                logger.debug("no tombstones from checkpoint %d: %s", version, exc)
                continue
            if changes is None:
                continue
            found.extend(changes.dropped.values())
            if version == last:
                found.extend(changes.removed.values())
        return found

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
                    lanes = self.table(table_version)
                    changes.apply_to(lanes, self.storage.path(changes_path(version)))
                    return lanes
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


def _newest_listed_header(snapshots: LogSnapshots) -> int:
    """The newest header found by listing (repair: only when the hint is gone and the
    headers from the start were expired)."""
    return max(listed_versions(snapshots.storage.listdir(SNAPSHOTS_DIR)), default=0)


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


def _repair_start(snapshots: LogSnapshots) -> LogState | None:
    """Where to start when the hinted headers are unusable and commit 1 is gone, or the
    hinted header's commit is gone: the hint named a header retention deleted (a slow
    writer moved it back), or every retained header is damaged. Lists the snapshots (a
    repair path) for the newest usable header; None to start from the empty state (no
    commit yet, or commit 1 landed after the caller looked for it). Raises
    :class:`CorruptionError` if the log has commits but cannot be rebuilt: the marker
    :data:`EXPIRED_MARKER` exists, or commits do but commit 1 does not."""
    newest = _newest_listed_header(snapshots)
    state = _usable_state(snapshots, newest)
    if state is not None:
        logger.warning(
            "the snapshot hint of %s named no usable header; found header %d by listing",
            snapshots.storage.url,
            state.version,
        )
        return state
    storage = snapshots.storage
    if storage.exists(EXPIRED_MARKER):
        raise _unrebuildable(storage)
    # commits without the first: expired, unmarked (a writer's temporary file is no commit)
    if listed_versions(storage.listdir(COMMITS_DIR)) and not storage.exists(commit_path(1)):
        raise _unrebuildable(storage)
    # No commit yet, or the first landed since the caller looked (a log just created):
    # start from the empty state; headers only of another log (written late) are ignored.
    return None


def _unrebuildable(storage: Storage) -> CorruptionError:
    return CorruptionError(
        storage.path(SNAPSHOTS_DIR),
        "no usable snapshot header, and the commits from version 1 were removed by "
        "retention: the log cannot be rebuilt (restore the snapshot files)",
    )


def _below_rejected(snapshots: LogSnapshots, version: int) -> LogState | None:
    """Where to start once header ``version`` is rejected: the newest usable header below
    it, else the empty state while commit 1 exists, else the repair path."""
    state = _usable_state(snapshots, version - snapshots.descriptor.checkpoint_interval)
    if state is None and not snapshots.storage.exists(commit_path(1)):
        state = _repair_start(snapshots)
    return state


def _after_base_missing(snapshots: LogSnapshots, state: LogState, header: int) -> LogState | None:
    """Where to start again when ``state``, loaded from header ``header`` (0: the empty
    state), found the commit it reached gone or another's (:class:`BaseMissing`).

    If it reached no commit past a header, the header's own commit is gone or carries
    another token: retention overtook the header (a newer one exists: listing finds it),
    or, when no newer header is found, the header is not this log's history (damaged, or
    written late by a stalled writer): it is rejected like a corrupt one and the header
    below it is used. Otherwise a commit read moments ago went (retention racing the
    open): start again from the newest listed header. None: from the empty state."""
    if state.version == header > 0:
        newest = _newest_listed_header(snapshots)
        newer = _usable_state(snapshots, newest, floor=header) if newest > header else None
        if newer is not None:
            logger.warning(
                "header %d of %s was overtaken by retention; found header %d by listing",
                header,
                snapshots.storage.url,
                newer.version,
            )
            return newer
        reason = (
            f"commit {header} is missing or does not carry this header's token, and no "
            f"newer header exists: the header is not the log's history"
        )
        logger.warning(
            "snapshot header %d of %s is unusable: %s", header, snapshots.storage.url, reason
        )
        snapshots.reject(header, reason)
        return _below_rejected(snapshots, header)
    return _repair_start(snapshots)


def _past_gap(snapshots: LogSnapshots, gap: MissingCommitError) -> LogState:
    """The state at the newest usable header at or above a missing commit (listed: a
    repair path), with a warning: it holds what the commits up to it made, so nothing is
    lost to readers, and ``verify`` names the missing commit. Raises ``gap`` if there is
    none: the log cannot be read past it."""
    newest = _newest_listed_header(snapshots)
    state = _usable_state(snapshots, newest, floor=gap.version - 1)
    if state is None:
        raise gap
    logger.warning(
        "%s: commit %d is missing (commit %d exists), but header %d holds the state past "
        "it: reading from there ('replog verify' names the damage)",
        snapshots.storage.url,
        gap.version,
        gap.later,
        state.version,
    )
    return state


REPAIRS = 3
"""How often opening a log starts again after a commit it had read went (retention racing
the open can expire the commits just read; more than this means damage)."""


def load_state(storage: Storage, descriptor: LogDescriptor) -> LogState:
    """The log's current state, from the newest usable header and the commits after it.

    Fewer than ``checkpoint_interval`` commits follow the newest header, so that many are
    read at once (in parallel on remote storage). The hint is not probed past first: it
    lags only after a crash or a slow writer, a full window reveals that, and only then
    are newer headers looked for. The commit the state ends at is checked to be the one
    it applied (:func:`check_base`), and a header the state ends at to be its commit's:
    a hint moved back to a header retention deleted would otherwise show the log as it
    was then (see :func:`_after_base_missing`).

    Raises :class:`CorruptionError` if every header that retention kept is unusable and
    the commits before them are gone (the log cannot be rebuilt: restore the files), or
    if commits read during the open kept disappearing.
    """
    snapshots = LogSnapshots(storage, descriptor)
    interval = descriptor.checkpoint_interval
    state = _usable_state(snapshots, _hinted_header(snapshots))
    if state is None and not storage.exists(commit_path(1)):
        state = _repair_start(snapshots)

    def empty() -> LogState:
        return LogState(shards=descriptor.shards, snapshots=snapshots, log_id=descriptor.log_id)

    state = state or empty()
    header = state.version  # the header the state was loaded from (0: the empty state)
    races = 0
    idle_ms = descriptor.surely_kept_ms
    while True:
        try:
            if catch_up(
                storage, state, limit=interval, window=interval, idle_ms=idle_ms, probe=interval
            ):
                return state
        except MissingCommitError as gap:
            state = _past_gap(snapshots, gap)
            header = state.version
            continue
        except BaseMissing:
            if not state.version == header > 0:
                races += 1
                if races > REPAIRS:
                    raise CorruptionError(
                        storage.path(COMMITS_DIR),
                        f"commit {state.version} went while the log was opened, "
                        f"{REPAIRS + 1} times: commits are being deleted outside retention",
                    ) from None
            state = _after_base_missing(snapshots, state, header) or empty()
            header = state.version
            continue
        newer = _past_lagging_hint(snapshots, state)
        if newer is not None:
            state, header = newer, newer.version


def _past_lagging_hint(snapshots: LogSnapshots, state: LogState) -> LogState | None:
    """After a full window of commits past ``state``'s header: the newest usable header
    above ``state`` (the hint lags), None if there is none."""
    interval = snapshots.descriptor.checkpoint_interval
    newest = probe_forward(state.version - state.version % interval, interval, snapshots.has_header)
    if newest <= state.version:
        return None
    return _usable_state(snapshots, newest, floor=state.version)


def check_snapshot(storage: Storage, descriptor: LogDescriptor, version: int) -> None:
    """Read snapshot ``version``'s header and its segment table or changes file, raising
    :class:`CorruptionError` or ``FileNotFoundError`` for what is wrong (for ``verify``)."""
    snapshots = LogSnapshots(storage, descriptor)
    snapshots.state(version)
    if _is_due(version, descriptor.snapshot_interval):
        snapshots.table(version)
        snapshots.tombstones(version)
    else:
        snapshots.changes_file(version)
