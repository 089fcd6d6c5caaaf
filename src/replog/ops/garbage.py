"""Garbage: segment files no commit references, and when they may be deleted.

Readers never list directories; only garbage collection does (FORMAT.md, "Garbage"). A
file is garbage, and may be deleted, when every rule below holds:

* no live segment entry names it (checked again on a fresh state just before deleting);
* it is older than the grace period: by its last-modified time, or, on a backend that
  reports none, by when an earlier ``recover`` first saw it unreferenced
  (``_replog/gc/first_seen.json``);
* no commit made within the grace period removed it (a reader may have planned a task
  on it just before a compaction or truncation);
* it was written before every live staging lease was acquired, less the clock skew (a
  batch job or a compaction may still commit it, however long it runs);
* no Pending sink manifest names it (the caller passes those).

Before deleting anything, a collection commits a gc mark (:func:`begin`) naming its
cut-off, and it deletes only files stamped before both that cut-off and the mark's own
storage time stamp minus the grace: writers rely on it (:mod:`replog.format.gc`). Time
stamps of files first seen are taken after the listing that found them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from replog.core import leases as lease_store
from replog.core.history import read_commit
from replog.format.commits import APPEND, META_DIR, CommitRecord, commit_path
from replog.format.gc import CLOCK_SKEW_MS, GcMark
from replog.format.segments import SEGMENT_SUFFIX, SHARDS_DIR
from replog.format.state import LogState
from replog.log import ReplicationLog
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

FIRST_SEEN_PATH = f"{META_DIR}/gc/first_seen.json"


@dataclass
class GarbageScan:
    """What one scan found: files to delete, and why others were kept."""

    garbage: list[str] = field(default_factory=list)
    kept_young: int = 0
    kept_leased: int = 0
    kept_removed_recently: int = 0
    kept_pending: int = 0
    expired_leases: list[str] = field(default_factory=list)
    """Lease files (relative paths) past their expiry, readable or not: removed."""


def removed_since(
    log: ReplicationLog, state: LogState, cutoff_ms: int, file_cutoff_ms: int | None = None
) -> set[str]:
    """Paths removed by commits made after ``cutoff_ms``.

    Commit times come from each writer's clock, but versions are in real order: a commit
    is at least as recent as any commit before it. So a commit counts as made after the
    cut-off if it, or one before it, is stamped after it (a lagging writer's append
    right after a compaction does not hide the compaction). A commit that removes
    segments is also judged by its file's time on storage, against ``file_cutoff_ms``
    (the cut-off in storage time; default ``cutoff_ms``): a writer whose clock lags
    cannot shorten the grace its removed files get. Reads commits backwards until one
    is older than the cut-off by more than the clock skew.
    """
    file_cutoff = cutoff_ms if file_cutoff_ms is None else file_cutoff_ms
    records = []
    for version in range(state.version, 0, -1):
        record = read_commit(log.storage, version)
        if record is None or record.timestamp_ms <= cutoff_ms - CLOCK_SKEW_MS:
            break
        records.append(record)
    removed: set[str] = set()
    newest_stamp = cutoff_ms - CLOCK_SKEW_MS
    for record in reversed(records):  # oldest first
        newest_stamp = max(newest_stamp, record.timestamp_ms)
        if record.remove and (
            newest_stamp > cutoff_ms or _landed_after(log, record.version, file_cutoff)
        ):
            removed.update(segment.path for segment in record.remove)
    return removed


def _landed_after(log: ReplicationLog, version: int, file_cutoff_ms: int) -> bool:
    """Whether commit ``version``'s file was written after ``file_cutoff_ms`` (storage
    time; unknown times count as after: keeping a file longer is the safe side)."""
    stamp = log.storage.modified_ms(commit_path(version))
    return stamp is None or stamp > file_cutoff_ms


def read_first_seen(log: ReplicationLog) -> dict[str, int]:
    """The first-seen notes of earlier collections (backends without file times)."""
    data = log.storage.read_optional(FIRST_SEEN_PATH)
    if data is None:
        return {}
    try:
        seen = json.loads(data)
        return {str(path): int(stamp) for path, stamp in seen.items()}
    except (ValueError, TypeError, AttributeError):
        logger.warning("ignoring unreadable %s", log.storage.path(FIRST_SEEN_PATH))
        return {}


def begin(log: ReplicationLog, cutoff_ms: int) -> int | None:
    """Commit the gc mark that must precede deleting files stamped before ``cutoff_ms``
    (not later than now); returns the mark's storage time stamp (None if the backend
    reports none), to pass to :func:`scan`."""
    record = log.commit(
        lambda state: CommitRecord.after(state.version, APPEND, gc=GcMark(cutoff_ms))
    )
    assert record is not None
    return log.storage.modified_ms(commit_path(record.version))


def scan(
    log: ReplicationLog,
    grace_ms: int,
    *,
    now: int | None = None,
    mark_stamp_ms: int | None = None,
    first_seen: dict[str, int] | None = None,
    pending: Collection[str] = (),
    remember: bool = True,
) -> GarbageScan:
    """Find garbage as of ``now`` (default: the present; lists ``shards/``): files stamped
    before ``now - grace_ms``, which a gc mark with that cut-off must precede deleting.

    ``mark_stamp_ms`` is the storage's time stamp of that mark (from :func:`begin`): file
    times come from the storage's clock, so they must also be older than it minus the
    grace. A collector whose clock runs ahead then never takes a file written after its
    mark for an old one, and whole-second stamps stay on the right side of it.

    ``first_seen``: the first-seen notes as read before the mark (default: read now).
    Notes written after the mark, by another collector (on another clock), may describe
    files written after it. With ``remember``, record first-seen times of unreferenced
    files whose backend gives no modification time."""
    now = now_ms() if now is None else now
    state = log.refresh()
    cutoff = now - grace_ms
    file_cutoff = cutoff if mark_stamp_ms is None else min(cutoff, mark_stamp_ms - grace_ms)
    found = lease_store.leases(log.storage)
    live_leases = [lease for lease in found.readable if lease.live(now)]
    guarding_unreadable = any(lease.live(now) for lease in found.unreadable)
    rules = _Rules(
        protected=state.live_paths(),
        pending=set(pending),
        recently_removed=removed_since(log, state, cutoff, file_cutoff),
        cutoff=cutoff,
        file_cutoff=file_cutoff,
        # an unreadable lease may have been taken at any time: it guards every file
        lease_cutoff=0
        if guarding_unreadable
        else min((lease.acquired_ms for lease in live_leases), default=None),
        seen=read_first_seen(log) if first_seen is None else first_seen,
    )
    result = GarbageScan(
        expired_leases=[lease.relative for lease in found.readable if not lease.live(now)]
        + [lease.relative for lease in found.unreadable if not lease.live(now)]
    )
    candidates = []
    for shard_dir in log.storage.listdir(SHARDS_DIR):
        names = log.storage.listdir(f"{SHARDS_DIR}/{shard_dir}")
        listed_ms = now_ms()  # a file first seen now existed before: never stamped early
        for name in names:
            relative = f"{SHARDS_DIR}/{shard_dir}/{name}"
            if name.endswith(SEGMENT_SUFFIX) and rules.is_garbage(log, relative, listed_ms, result):
                candidates.append(relative)
    # A commit may have landed since the listing began: look once more, just before deleting.
    live_now = log.refresh().live_paths()
    result.garbage = [path for path in candidates if path not in live_now]
    if remember and (rules.still_seen or rules.seen):
        kept = {p: stamp for p, stamp in rules.still_seen.items() if p not in result.garbage}
        log.storage.write(FIRST_SEEN_PATH, json.dumps(kept, sort_keys=True).encode())
    return result


@dataclass
class _Rules:
    """What a listed segment file must pass to be garbage (module docstring), fixed for
    one scan; first-seen stamps given meanwhile are collected in :attr:`still_seen`."""

    protected: set[str]
    pending: set[str]
    recently_removed: set[str]
    cutoff: int
    file_cutoff: int
    lease_cutoff: int | None
    seen: dict[str, int]
    still_seen: dict[str, int] = field(default_factory=dict)

    def is_garbage(
        self, log: ReplicationLog, relative: str, listed_ms: int, result: GarbageScan
    ) -> bool:
        """Whether ``relative`` may be deleted; counts in ``result`` why not."""
        if relative in self.protected:
            return False
        if relative in self.pending:
            result.kept_pending += 1
            return False
        if relative in self.recently_removed:
            result.kept_removed_recently += 1
            return False
        stamp = log.storage.modified_ms(relative)
        young = self.file_cutoff
        if stamp is None:  # no file times: first sight on this clock
            stamp = self.still_seen[relative] = self.seen.get(relative, listed_ms)
            young = self.cutoff
        if stamp >= young:  # garbage is stamped strictly before the cut-off
            result.kept_young += 1
            return False
        # A lease's time is its writer's clock, file times the storage's: allow skew.
        if self.lease_cutoff is not None and stamp >= self.lease_cutoff - CLOCK_SKEW_MS:
            result.kept_leased += 1
            return False
        return True
