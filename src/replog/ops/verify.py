"""``replog verify``: every checksummed file of a log, checked.

That is the commit records (and that they apply, in order, to a consistent state), every
snapshot header and segment table, every live segment file, and every checkpoint manifest
of the log's consumers and sinks. Verification lists directories (snapshots, manifest
stores); it is a repair tool, not a reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from replog.checkpoints.consumers import CONSUMERS_DIR, consumer_store
from replog.checkpoints.sinks import SINKS_DIR, sink_store
from replog.checkpoints.store import ManifestStore, manifest_name, named_stores
from replog.core import history, leases
from replog.core.files import read_file
from replog.errors import CorruptionError, ReplogError
from replog.format.commits import COMMITS_DIR, commit_path
from replog.format.segments import SegmentInfo, entry_rows, row_sequences
from replog.format.state import LogState, retained_events
from replog.log import ReplicationLog
from replog.names import listed_versions
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

READ_THREADS = 8


@dataclass(frozen=True)
class Problem:
    """A defect ``verify`` found: the file at fault and what is wrong with it."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    url: str
    commits: int
    snapshots: int
    segments: int
    manifests: int
    events: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "ok": self.ok,
            "checked": {
                "commits": self.commits,
                "snapshots": self.snapshots,
                "segments": self.segments,
                "manifests": self.manifests,
            },
            "events": self.events,
            "problems": [{"path": p.path, "message": p.message} for p in self.problems],
        }


def _problem(exc: BaseException, fallback_path: str) -> Problem:
    path = exc.path if isinstance(exc, CorruptionError) else fallback_path
    return Problem(path, str(exc).removeprefix(f"{path}: "))


def _missing(version: int, headers: list[int], stop: int) -> str:
    """What a commit missing below later ones means, given the usable ``headers``
    (``stop``: the version readers stop at, before the first commit they need)."""
    above = [header for header in headers if header >= version]
    if above:
        return (
            f"commit is missing (later commits exist); readers do not need it (snapshot "
            f"{min(above)} holds the state past it), but 'replog history' lacks it: restore "
            f"it from a backup"
        )
    return (
        f"commit is missing (later commits exist): readers and writers stop at version "
        f"{stop} with an error naming the first missing commit, and 'replog recover' "
        f"deletes nothing; "
        f"restore it from a backup (or the object's previous version)"
    )


def _commits(
    log: ReplicationLog, problems: list[Problem], headers: list[int]
) -> tuple[int, LogState]:
    """Check every commit record (listed: a missing one in the middle is found too;
    ``headers``, the usable snapshot headers, say what it means). Returns how many there
    are and the state they build up to the first broken one."""
    versions = listed_versions(log.storage.listdir(COMMITS_DIR))
    last = versions[-1] if versions else 0
    oldest = _oldest_retained(log, versions)
    state, applied_from = _replay_start(log, oldest - 1, problems)
    broken = False
    stop: int | None = None
    for version in range(oldest, last + 1):
        path = log.storage.path(commit_path(version))
        try:
            record = history.read_commit(log.storage, version)
            if record is None:
                if stop is None and not any(header >= version for header in headers):
                    stop = version - 1
                raise CorruptionError(path, _missing(version, headers, stop or version - 1))
            if not broken and version >= applied_from:
                state.apply(record)
        except (ReplogError, OSError) as exc:
            problems.append(_problem(exc, path))
            broken = True  # later commits are still checked for their checksums
    return last, state


def _oldest_retained(log: ReplicationLog, versions: list[int]) -> int:
    """The oldest commit to check: the first of the run of commits that ends at the
    newest, if the commits below the gap before it are ones retention left (the gap ends
    below a table older than the retention: a deletion that stopped part-way, or a commit
    a writer put into a deleted range and could not take back); else the oldest listed
    (the gap is damage, reported as missing commits)."""
    if not versions:
        return 1
    start = len(versions) - 1
    while start > 0 and versions[start - 1] == versions[start] - 1:
        start -= 1
    if start == 0:
        return versions[0]
    run_start, interval = versions[start], log.descriptor.snapshot_interval
    table = -(-(run_start - 1) // interval) * interval
    try:
        header = history.LogSnapshots(log.storage, log.descriptor).header(table)
    except (ReplogError, OSError):
        return versions[0]
    if header.timestamp_ms > now_ms() - log.descriptor.retention_ms:
        return versions[0]
    logger.warning(
        "%s: %d commit(s) below version %d are left over from retention (not checked; "
        "'replog recover' does not need them either)",
        log.url,
        start,
        run_start,
    )
    return run_start


def _replay_start(
    log: ReplicationLog, retained: int, problems: list[Problem]
) -> tuple[LogState, int]:
    """Where replaying the commits starts: version 0, or the table at or after
    ``retained`` (the version below the oldest commit checked; the commits up to the
    table, which retention is deleting, are checked but not replayed). Returns the
    state and the first version to apply."""
    if retained > 0:
        interval = log.descriptor.snapshot_interval
        table = -(-retained // interval) * interval
        snapshots = history.LogSnapshots(log.storage, log.descriptor)
        try:
            state = snapshots.state(table)
            if table != retained and state.timestamp_ms > now_ms() - log.descriptor.retention_ms:
                raise CorruptionError(
                    log.storage.path(commit_path(retained)),
                    f"commit is missing, and retention did not delete it (the table after "
                    f"it, {table}, is younger than the retention)",
                )
            state.segments  # noqa: B018 (loads the table: the replay needs its segments)
            return state, table + 1
        except (ReplogError, OSError) as exc:
            problems.append(_problem(exc, log.storage.path(history.header_path(table))))
    return LogState(shards=log.shards, log_id=log.log_id), 1


def _snapshots(log: ReplicationLog, problems: list[Problem]) -> list[int]:
    """Check every snapshot; the versions of those that hold."""
    usable = []
    for version in listed_versions(log.storage.listdir(history.SNAPSHOTS_DIR)):
        try:
            history.check_snapshot(log.storage, log.descriptor, version)
            usable.append(version)
        except (ReplogError, OSError) as exc:
            problems.append(_problem(exc, log.storage.path(history.header_path(version))))
    return usable


def _past_the_commits(log: ReplicationLog, headers: list[int], last: int) -> Iterator[Problem]:
    """Usable headers past the newest commit ``last`` (listed after them: a header is
    written after its commit): the newest commits were deleted or lost. Readers pass
    over such a header and read up to ``last``, which no reader can tell from a log that
    never went further."""
    for version in headers:
        if version > last:
            yield Problem(
                log.storage.path(history.header_path(version)),
                f"snapshot of version {version}, past the newest commit ({last}): commits "
                f"{last + 1}..{version} are missing, and readers read the log up to version "
                f"{last}, without their events; restore the commits from a backup",
            )


def _checkpointed_segments(log: ReplicationLog, state: LogState, problems: list[Problem]) -> None:
    """Compare the live segments a reader gets (newest checkpoint plus the commits after
    it) with those the commits add up to: well-formed, checksummed snapshot files can
    still be wrong."""
    try:
        reader = history.load_state(log.storage, log.descriptor)
        if reader.version != state.version:
            return  # a broken commit stopped the replay: reported already
        found = {s.key: s for lane in reader.segments for s in lane}
    except (ReplogError, OSError):
        return  # unreadable snapshot files: reported by _snapshots
    expected = {s.key: s for lane in state.segments for s in lane}
    if found == expected:
        return
    missing = sorted({path for path, _ in set(expected) - set(found)})
    extra = sorted({path for path, _ in set(found) - set(expected)})
    problems.append(
        Problem(
            log.storage.path(history.SNAPSHOTS_DIR),
            f"the newest checkpoint gives live segments that differ from the commits' "
            f"(missing: {missing[:3]}{'...' if len(missing) > 3 else ''}, extra: "
            f"{extra[:3]}{'...' if len(extra) > 3 else ''}, or different entries); readers "
            f"fail on the gap: restore the snapshot files or delete the damaged ones",
        )
    )


def _segments(
    log: ReplicationLog,
    state: LogState,
    problems: list[Problem],
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Check every live file once (a shared file holds several entries): its checksum,
    that it holds the rows each of its entries names and, for a holed entry, that its
    rows' sequences increase within its range."""
    by_file: dict[str, list[SegmentInfo]] = {}
    for lane in state.segments:
        for segment in lane:
            by_file.setdefault(segment.path, []).append(segment)

    def check(entries: list[SegmentInfo]) -> Problem | None:
        try:
            table = read_file(log.storage, entries[0])
            for entry in entries[1:]:
                if entry.sha256 != entries[0].sha256:
                    raise CorruptionError(
                        log.storage.path(entry.path), "its entries record different checksums"
                    )
                if table.num_rows < entry.offset + entry.events:
                    raise CorruptionError(
                        log.storage.path(entry.path),
                        f"holds {table.num_rows} events, its commit needs "
                        f"{entry.offset + entry.events}",
                    )
            for entry in entries:
                rows = entry_rows(table, entry)  # a sequence column exactly for holed entries
                if entry.holed:  # its rows' sequences: increasing, within its range
                    row_sequences(rows, entry)
        except (ReplogError, OSError) as exc:
            return _problem(exc, log.storage.path(entries[0].path))
        return None

    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        problems.extend(_counted(pool.map(check, by_file.values()), len(by_file), progress))
    return len(by_file)


def _counted(
    found: Iterable[Problem | None], total: int, progress: Callable[[int, int], None] | None
) -> Iterator[Problem]:
    """The problems among ``found``, telling ``progress`` how many files were checked."""
    for done, problem in enumerate(found, 1):
        if problem is not None:
            yield problem
        if progress is not None:
            progress(done, total)


def _manifests(store: ManifestStore, problems: list[Problem]) -> int:
    ids = store.list_ids()
    for checkpoint_id in ids:
        try:
            store.load(checkpoint_id)
        except (ReplogError, OSError) as exc:
            problems.append(_problem(exc, store.storage.path(manifest_name(checkpoint_id))))
    return len(ids)


def _stores(log: ReplicationLog, problems: list[Problem]) -> int:
    """Check every consumer's and sink's manifests (listing each directory once); the
    entries operator commands skip there are reported, so they get removed."""
    checked = 0
    for directory, store_of in ((CONSUMERS_DIR, consumer_store), (SINKS_DIR, sink_store)):
        names, stray = named_stores(log.storage, directory)
        checked += sum(_manifests(store_of(log, name), problems) for name in names)
        problems.extend(
            Problem(log.storage.path(relative), "not a replog name: skipped; remove it")
            for relative in stray
        )
    return checked


def _unreadable_leases(log: ReplicationLog, problems: list[Problem]) -> None:
    for lease in leases.leases(log.storage).unreadable:
        problems.append(
            Problem(
                log.storage.path(lease.relative),
                f"unreadable staging lease ({lease.reason}): recover keeps every staged "
                f"file while it stands; repair or remove it",
            )
        )


def verify(
    log: ReplicationLog, *, progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """Check every checksummed file of ``log``; the report lists every problem found.
    ``progress`` is told the segment files checked so far and in all (most of the work)."""
    problems: list[Problem] = []
    snapshot_problems: list[Problem] = []
    headers = _snapshots(log, snapshot_problems)
    commits, state = _commits(log, problems, headers)
    problems.extend(snapshot_problems)
    problems.extend(_past_the_commits(log, headers, commits))
    snapshots = len(headers) + len(snapshot_problems)
    _checkpointed_segments(log, state, problems)
    segments = _segments(log, state, problems, progress)
    manifests = _stores(log, problems)
    _unreadable_leases(log, problems)
    return VerifyReport(
        url=log.url,
        commits=commits,
        snapshots=snapshots,
        segments=segments,
        manifests=manifests,
        events=retained_events(dict(enumerate(state.heads)), dict(enumerate(state.lows))),
        problems=tuple(problems),
    )
