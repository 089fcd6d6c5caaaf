"""``replog verify``: every checksummed file of a log, checked.

That is the commit records (and that they apply, in order, to a consistent state), every
snapshot header and segment table, every live segment file, and every checkpoint manifest
of the log's consumers and sinks. Verification lists directories (snapshots, manifest
stores); it is a repair tool, not a reader.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from replog.checkpoints.consumers import consumer_store, list_consumers
from replog.checkpoints.sinks import list_sinks, sink_store
from replog.checkpoints.store import ManifestStore, manifest_name
from replog.errors import CorruptionError, ReplogError
from replog.format import history
from replog.format.commits import COMMITS_DIR, commit_path
from replog.format.segments import SegmentInfo, read_stored
from replog.format.state import LogState, retained_events
from replog.log import ReplicationLog

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


def _commits(log: ReplicationLog, problems: list[Problem]) -> tuple[int, LogState]:
    """Check every commit record (listed: a missing one in the middle is found too).
    Returns how many there are and the state they build up to the first broken one."""
    versions = [
        int(name.removesuffix(".json"))
        for name in log.storage.listdir(COMMITS_DIR)
        if name.endswith(".json") and name.removesuffix(".json").isdigit()
    ]
    last = max(versions, default=0)
    state = LogState(shards=log.shards)
    broken = False
    for version in range(1, last + 1):
        path = log.storage.path(commit_path(version))
        try:
            record = history.read_commit(log.storage, version)
            if record is None:
                raise CorruptionError(path, "commit is missing (later commits exist)")
            if not broken:
                state.apply(record)
        except (ReplogError, OSError) as exc:
            problems.append(_problem(exc, path))
            broken = True  # later commits are still checked for their checksums
    return last, state


def _snapshots(log: ReplicationLog, problems: list[Problem]) -> int:
    checked = 0
    for name in log.storage.listdir(history.SNAPSHOTS_DIR):
        stem = name.removesuffix(".json")
        if not (name.endswith(".json") and stem.isdigit()):
            continue
        checked += 1
        try:
            history.check_snapshot(log.storage, log.descriptor, int(stem))
        except (ReplogError, OSError) as exc:
            problems.append(_problem(exc, log.storage.path(history.header_path(int(stem)))))
    return checked


def _checkpointed_segments(log: ReplicationLog, state: LogState, problems: list[Problem]) -> None:
    """Compare the live segments a reader gets (newest checkpoint plus the commits after
    it) with those the commits add up to: well-formed, checksummed snapshot files can
    still be wrong."""
    try:
        reader = history.load_state(log.storage, log.descriptor)
        if reader.version != state.version:
            return  # a broken commit stopped the replay: reported already
        found = {s.path: s for lane in reader.segments for s in lane}
    except (ReplogError, OSError):
        return  # unreadable snapshot files: reported by _snapshots
    expected = {s.path: s for lane in state.segments for s in lane}
    if found == expected:
        return
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    problems.append(
        Problem(
            log.storage.path(history.SNAPSHOTS_DIR),
            f"the newest checkpoint gives live segments that differ from the commits' "
            f"(missing: {missing[:3]}{'...' if len(missing) > 3 else ''}, extra: "
            f"{extra[:3]}{'...' if len(extra) > 3 else ''}, or different entries); readers "
            f"fail on the gap: restore the snapshot files or delete the damaged ones",
        )
    )


def _segments(log: ReplicationLog, state: LogState, problems: list[Problem]) -> int:
    live: list[SegmentInfo] = [segment for lane in state.segments for segment in lane]

    def check(segment: SegmentInfo) -> Problem | None:
        try:
            read_stored(log.storage, segment)
        except (ReplogError, OSError) as exc:
            return _problem(exc, log.storage.path(segment.path))
        return None

    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        problems.extend(p for p in pool.map(check, live) if p is not None)
    return len(live)


def _manifests(store: ManifestStore, problems: list[Problem]) -> int:
    ids = store.list_ids()
    for checkpoint_id in ids:
        try:
            store.load(checkpoint_id)
        except (ReplogError, OSError) as exc:
            problems.append(_problem(exc, store.storage.path(manifest_name(checkpoint_id))))
    return len(ids)


def verify(log: ReplicationLog) -> VerifyReport:
    """Check every checksummed file of ``log``; the report lists every problem found."""
    problems: list[Problem] = []
    commits, state = _commits(log, problems)
    snapshots = _snapshots(log, problems)
    _checkpointed_segments(log, state, problems)
    segments = _segments(log, state, problems)
    manifests = sum(
        _manifests(consumer_store(log, name), problems) for name in list_consumers(log)
    ) + sum(_manifests(sink_store(log, name), problems) for name in list_sinks(log))
    return VerifyReport(
        url=log.url,
        commits=commits,
        snapshots=snapshots,
        segments=segments,
        manifests=manifests,
        events=retained_events(dict(enumerate(state.heads)), dict(enumerate(state.lows))),
        problems=tuple(problems),
    )
