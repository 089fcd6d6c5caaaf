"""Operator commands under ordinary load (issue 32, hole 3): ``replog compact`` and
``replog compact --by-key`` finish while writers append and merge their small files.

Writers merge the small files at the tail of each shard as they commit. A compaction
plans every live entry, rewrites them, and commits only if none left the log meanwhile:
under ~100 appends/s, a writer's merge removed tail files during every attempt, and
all five attempts conflicted. Writers' automatic merges now yield to a running
compaction (its staging lease says it runs). The figures of the same race on a 200,000
event log with two producers are in docs/RELIABILITY.md
(``benchmarks/compact_under_load.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.storages import ClockTimes, as_class

from replog.core import leases
from replog.log import ReplicationLog
from replog.ops import compaction, keys
from replog.ops.verify import verify
from replog.storage import Storage
from replog.timeutil import use_clock


def small(tag: str, count: int = 6) -> list[dict[str, Any]]:
    """A small write with rows in both shards (one shared file)."""
    return [{"key": f"{tag}-{i}", "event_id": f"{tag}-{i}", "data": {"i": i}} for i in range(count)]


def merging_writer(url: str, name: str) -> Callable[[], bool]:
    """A writer that, each time it is called, appends small commits (waiting for its
    automatic merge after each) until one of its merges removed an entry that was live
    when it was called, or 16 commits; returns whether a merge did."""
    log = ReplicationLog.open(url, auto_compact=True)
    count = [0]

    def run() -> bool:
        before = {(s.path, s.offset) for lane in log.refresh().segments for s in lane}
        for _ in range(16):
            count[0] += 1
            log.append(small(f"{name}{count[0]}"))
            log.flush()
            after = {(s.path, s.offset) for lane in log.refresh().segments for s in lane}
            if before - after:
                return True
        return False

    return run


def compacting_log(url: str, writer: Callable[[], bool]) -> tuple[ReplicationLog, list[bool]]:
    """A log object for the compaction whose every attempt, as soon as it writes its first
    merged file, lets ``writer`` run (once per attempt); the list records whether the
    writer merged each time."""
    log = ReplicationLog.open(url, auto_compact=False)
    fired: list[bool] = []
    seen: set[int] = set()
    lock = threading.Lock()

    class WritersMergeMeanwhile(Storage):
        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            if "/shards/" in path:
                with lock:
                    attempt = log.state().version
                    if attempt not in seen:
                        seen.add(attempt)
                        fired.append(writer())
            super()._create_once(path, data, durability)

    log.storage = as_class(log.storage, WritersMergeMeanwhile)
    return log, fired


@pytest.mark.parametrize("kind", ["compact", "compact --by-key"])
def test_a_compaction_finishes_while_writers_merge_their_small_files(
    tmp_path: Path, kind: str
) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    seed = ReplicationLog.open(url, auto_compact=False)
    for n in range(7):  # seven small files: the next write fills the lowest tier
        twice = small(f"s{n}") + small(f"s{n}")  # every key twice: --by-key drops one
        seed.append([dict(e, event_id=f"{e['event_id']}-{j}") for j, e in enumerate(twice)])
    log, fired = compacting_log(url, merging_writer(url, "w"))

    if kind == "compact":
        result = compaction.compact(log)
        assert result.record is not None
    else:
        keyed = keys.compact_by_key(log)
        assert keyed.record is not None
    assert fired and not any(fired), "a writer merged while the compaction ran"
    assert not leases.compaction_running(log.storage)  # released: writers merge again
    assert merging_writer(url, "after")()
    report = verify(ReplicationLog.open(url))
    assert report.ok, report.problems


def test_a_merge_under_way_when_a_compaction_begins_yields_before_its_commit(
    tmp_path: Path,
) -> None:
    """A writer's merge planned before the compaction took its lease, committing after:
    it checks again right before its commit, and commits nothing."""
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    taken: list[leases.Lease] = []

    class CompactionBeginsDuringTheMerge(Storage):
        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            super()._create_once(path, data, durability)
            if "/shards/" in path and threading.current_thread().name.startswith("replog"):
                taken.append(leases.acquire(self, "compaction of the test", compaction=True))

    writer = ReplicationLog.open(url, auto_compact=True)
    writer.storage = as_class(writer.storage, CompactionBeginsDuringTheMerge)
    for n in range(8):  # the 8th commit's writer merges the eight small files
        writer.append(small(f"s{n}"))
    writer.flush()
    assert taken, "the writer never merged"
    state = ReplicationLog.open(url).refresh()
    assert state.version == 8  # no merge commit
    assert len(state.live_paths()) == 8
    on_disk = {p.name for p in (tmp_path / "log" / "shards" / "shared").iterdir()}
    assert on_disk == {path.rsplit("/", 1)[-1] for path in state.live_paths()}  # merged file gone


@pytest.mark.parametrize(
    ("acquired_minutes_ago", "held_back"),
    [(0, True), (-5, True), (59, True), (61, False), (-120, False)],
)
def test_merges_wait_for_a_compaction_lease_for_an_hour_at_most(
    tmp_path: Path, acquired_minutes_ago: int, held_back: bool
) -> None:
    """A compaction that died without releasing its lease holds writers' merges back for
    an hour, not for its lease's 24 hours; a lease stamped two hours in the future (a
    compactor's clock gone wrong) is not waited for at all. (The lease file is stamped
    when it was written, as storage would: a running compaction rewrites it.)"""
    url = str(tmp_path / "log")
    log = ReplicationLog.create(url, 2)
    log.storage = as_class(log.storage, ClockTimes)
    with use_clock(lambda: time.time() - acquired_minutes_ago * 60):
        leases.acquire(log.storage, "compaction of the test", compaction=True)
    leases.acquire(log.storage, "a batch write")  # not a compaction: never waited for
    assert leases.compaction_running(log.storage) is held_back
