"""An adversarial review of issue 32's fixes (clocks, threads, operators misbehaving).

Each test here failed on the code it attacks; a test of a hole left open is marked
``xfail(strict=True)`` with the reason.

Time passes without sleeping: every clock replog reads (the writers' wall clocks, the
monotonic clock and the storage's file times) is the real one plus
:attr:`Virtual.offset_s`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.logcheck import check_log
from support.storages import as_class
from support.virtual_time import (
    MINUTE_S,
    Aged,
    Virtual,
    append,
    expire_all,
    expiring_log,
    opened,
)

from replog.format.commits import commit_path
from replog.log import ReplicationLog
from replog.timeutil import use_clock

pytestmark = pytest.mark.usefixtures("virtual_time")


def event_ids(url: str, options: Any = None) -> list[str]:
    reader = ReplicationLog.open(url, storage_options=options)
    return [str(i) for i in reader.read_all().column("event_id").to_pylist()]


# -- 1. the writer's after-commit check -------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_commit_that_landed_is_not_taken_back_when_expiry_deletes_its_base_after(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """No clock misbehaves. The log was idle for longer than the retention (commit 10,
    a table, is 25 minutes old; retention 20). W appends: it finds slot 11 free, and
    its put of commit 11 lands. Before W checks its base (commit 10 is old by W's wall
    clock, so it checks), B commits 12..20 on top of W's commit and expires below table
    20: header 10 is 25 minutes old, so commits 1..10 go.

    W then found commit 10 gone and took its commit for one put into a slot retention
    had emptied: it deleted commit 11 (on which B had built) and appended its rows again
    at version 21. Every event of W was then read twice."""
    s3 = request.getfixturevalue("s3") if where == "s3" else None
    url = str(tmp_path / "log") if s3 is None else s3.url("log")
    options = None if s3 is None else s3.storage_options
    expiring_log(url, options)
    a, b = opened(url, options=options), opened(url, options=options)
    for n in range(1, 11):
        append(a, f"a{n}")  # commits 1..10 (table 10)
    Virtual.offset_s += 25 * MINUTE_S  # the log is idle for 25 minutes

    class OthersRaceOn(Aged):
        raced = False

        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            super()._create_once(path, data, durability)
            if path.endswith(commit_path(11)) and not type(self).raced:
                type(self).raced = True  # W's commit 11 landed; B goes on before W checks
                for n in range(12, 21):
                    append(b, f"b{n}")
                b.flush()  # B's expiry (table 20) deletes commits 1..10
                assert not b.storage.exists(commit_path(10))

    w = opened(url, OthersRaceOn, options)
    told = append(w, "w")
    assert OthersRaceOn.raced
    ids = event_ids(url, options)
    assert sorted(i for i in ids if i.startswith("w-")) == ["w-0", "w-1", "w-2"], (
        f"W was told version {told}"
    )
    check_log(ReplicationLog.open(url, storage_options=options))


def test_a_compaction_that_landed_keeps_its_files_when_expiry_deletes_its_base_after(
    tmp_path: Path,
) -> None:
    """The same race with an operator's compaction as W: its commit 11 landed, B built
    on it and expired commits 1..10 before the compaction checked its base. The
    compaction took its commit back, planned again, found its sources gone (its own
    landed commit had removed them) and deleted its merged files: files the log's live
    segments name (every read failed)."""
    from replog.ops.compaction import compact
    from replog.ops.verify import verify

    url = str(tmp_path / "log")
    expiring_log(url)
    a, b = opened(url), opened(url)
    for n in range(1, 11):
        append(a, f"a{n}")
    Virtual.offset_s += 25 * MINUTE_S

    class OthersRaceOn(Aged):
        raced = False

        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            super()._create_once(path, data, durability)
            if path.endswith(commit_path(11)) and not type(self).raced:
                type(self).raced = True
                for n in range(12, 21):
                    append(b, f"b{n}")
                b.flush()
                assert not b.storage.exists(commit_path(10))

    w = opened(url, OthersRaceOn)
    with use_clock(Virtual.clock(), Virtual.monotonic):
        compact(w)
    assert OthersRaceOn.raced
    final = ReplicationLog.open(url)
    report = verify(final)
    assert report.ok, report.problems
    ids = event_ids(url)
    assert len(ids) == len(set(ids)) == 3 * 19


def test_a_writer_paused_after_its_put_for_longer_than_the_retention_is_told_committed(
    tmp_path: Path,
) -> None:
    """W's put of commit 13 lands, then W's machine sleeps for 25 minutes (retention
    20). Meanwhile B commits 14..40 on top of it and expires below table 20: commits
    1..20 go, W's own commit 13 with them. W then found commit 12 gone and took its
    commit for one that filled an emptied slot: it appended its rows again (doubled).
    Its rows are in the log (in table 20): it must say so."""
    url = str(tmp_path / "log")
    expiring_log(url)
    a, b = opened(url), opened(url)
    for n in range(1, 13):
        append(a, f"a{n}")

    class SleepsAfterItsPut(Aged):
        slept = False

        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            super()._create_once(path, data, durability)
            if path.endswith(commit_path(13)) and not type(self).slept:
                type(self).slept = True
                for n in range(14, 31):
                    append(b, f"b{n}")
                Virtual.offset_s += 25 * MINUTE_S  # W's machine sleeps
                for n in range(31, 41):
                    append(b, f"b{n}")
                b.flush()
                assert not b.storage.exists(commit_path(13))

    w = opened(url, SleepsAfterItsPut)
    told = append(w, "w")
    assert SleepsAfterItsPut.slept
    assert told == 13
    ids = event_ids(url)
    assert sorted(i for i in ids if i.startswith("w-")) == ["w-0", "w-1", "w-2"]
    check_log(ReplicationLog.open(url))


def test_a_commit_in_an_emptied_slot_deleted_again_by_a_late_expiry_is_made_again(
    tmp_path: Path,
) -> None:
    """W (a write that staged for minutes, so it checks its staged files before its
    commit) finds slot 10 free and stalls 25 minutes in that check; meanwhile B commits
    10..29 and E expires commits 1..20. W's put fills slot 10, and before W checks its
    base, a writer expiring from an older version (its state came from an old header)
    deletes commits 1..20 again, W's among them. W's commit and its base are both gone:
    it filled an emptied slot (it cannot have expired: far less than the retention passed
    since its put began), so W must commit again, not answer "unknown"."""
    from replog.format.events import events_from_records
    from replog.format.gc import StagingStart

    url = str(tmp_path / "log")
    expiring_log(url)
    a, b, e = opened(url), opened(url), opened(url)
    for n in range(1, 10):
        append(a, f"a{n}")

    class Stalls(Aged):
        armed = stalled = put = False

        def _exists_once(self, path: str) -> bool:
            found = super()._exists_once(path)
            if type(self).armed and "/shards/" in path and not type(self).stalled:
                type(self).stalled = True  # W checks its staged files, and stalls
                for n in range(10, 30):
                    append(b, f"b{n}")
                Virtual.offset_s += 25 * MINUTE_S
                append(e, "e30")
                e.flush()
                assert not e.storage.exists(commit_path(10))
            return found

        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            super()._create_once(path, data, durability)
            if type(self).stalled and path.endswith(commit_path(10)) and not type(self).put:
                type(self).put = True  # a late expiry from version 0 deletes 1..20 again
                expire_all(e)
                assert not e.storage.exists(commit_path(10))

    w = opened(url, Stalls)
    rows = events_from_records(
        [{"key": f"w-{i}", "event_id": f"w-{i}", "data": {}} for i in range(3)]
    )
    with use_clock(Virtual.clock(), Virtual.monotonic):
        began = StagingStart(w.refresh(verify_within=0).version, Virtual.clock(-5)() * 1000)
        staged = w.stage(rows)
        assert w.refresh(verify_within=0).version == 9
        Stalls.armed = True
        record = w.commit_staged(staged, since=began, refreshed=True)
    assert Stalls.put
    assert record is not None and record.version > 30
    ids = event_ids(url)
    assert sorted(i for i in ids if i.startswith("w-")) == ["w-0", "w-1", "w-2"]
    check_log(ReplicationLog.open(url))


def test_a_commit_left_in_an_emptied_slot_by_a_dead_writer_misleads_no_other(
    tmp_path: Path,
) -> None:
    """X reads the log at version 9 and goes idle. W, also at 9, stalls 25 minutes before
    its put of commit 10 (retention 20); meanwhile B commits 10..29 and E expires commits
    1..20. W's put fills slot 10 and W dies before its check. X then appends: it read
    commit 10 (W's), found no commit 11 and commit 10 still there, and put commit 11:
    acknowledged, but every reader starts from header 30. An old commit followed by
    nothing while the hint names a header above it is such a leftover: X now reads the
    log from that header."""
    from replog.storage.faults import SimulatedCrash

    url = str(tmp_path / "log")
    expiring_log(url)
    a, b, e, x, reader = (opened(url) for _ in range(5))
    for n in range(1, 10):
        append(a, f"a{n}")
    with use_clock(Virtual.clock(), Virtual.monotonic):
        assert x.refresh(verify_within=0).version == 9
        assert reader.refresh(verify_within=0).version == 9

    class StallsAndDies(Aged):
        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            if not path.endswith(commit_path(10)):
                super()._create_once(path, data, durability)
                return
            for n in range(10, 30):
                append(b, f"b{n}")
            Virtual.offset_s += 25 * MINUTE_S
            append(e, "e30")
            e.flush()
            super()._create_once(path, data, durability)
            raise SimulatedCrash("W dies right after its put")

    w = opened(url, StallsAndDies)
    with pytest.raises(SimulatedCrash):
        append(w, "w")
    with use_clock(Virtual.clock(), Virtual.monotonic):  # a reader idle at 9 is not stuck
        assert reader.refresh(verify_within=0).version >= 30  # at 10, where nothing follows
    told = append(x, "x")
    ids = event_ids(url)
    assert {"x-0", "x-1", "x-2"} <= set(ids), f"X was told version {told}"


def test_a_storage_clock_that_steps_forward_does_not_empty_a_slot_a_writer_is_about_to_fill(
    tmp_path: Path,
) -> None:
    """Every writer's clock is right; the storage's clock (an S3-compatible server, an
    NFS server) steps 30 minutes forward, as NTP does to a clock that fell behind. W
    reads the log at version 9 and pauses a moment before its put of version 10;
    meanwhile B commits 10..19, the storage's clock steps, and E commits 20: by file
    times header 10 is 30 minutes old (retention 20), so E expired commits 1..10. W,
    rightly finding that no time passed, skipped its check and filled slot 10: its
    append, acknowledged at version 10, was never read. Expiry judged by one clock that
    no other clock checks: by the writers' clocks header 10 was seconds old."""
    url = str(tmp_path / "log")
    expiring_log(url)
    a, b, e = opened(url), opened(url), opened(url)
    for n in range(1, 10):
        append(a, f"a{n}")

    class Pauses(Aged):
        paused = False

        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            if path.endswith(commit_path(10)) and not type(self).paused:
                type(self).paused = True
                for n in range(10, 20):
                    append(b, f"b{n}")
                Virtual.storage_step_s += 30 * MINUTE_S  # the storage's clock steps
                append(e, "e20")
                e.flush()
            super()._create_once(path, data, durability)

    w = opened(url, Pauses)
    told = append(w, "w")
    assert Pauses.paused
    ids = event_ids(url)
    assert {"w-0", "w-1", "w-2"} <= set(ids), f"W was told version {told}"
    check_log(ReplicationLog.open(url))


# -- 2. threads -----------------------------------------------------------------------------


def test_a_cancelled_future_in_a_group_leaves_no_caller_of_that_group_waiting(
    tmp_path: Path,
) -> None:
    """A caller gives up on its append and cancels its future (``asyncio.wrap_future``
    under a timeout does that) while it waits in the queue. The sender committed the
    group, then ``set_result`` on the cancelled future raised ``InvalidStateError``: the
    sender died, and every later caller of that group, whose events were committed,
    waited forever."""
    from replog.appender import GroupAppender

    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    appender = GroupAppender(ReplicationLog.open(url), linger_ms=3_600_000)
    gives_up = appender.submit([{"key": "a", "event_id": "a", "data": {}}])
    waits = appender.submit([{"key": "b", "event_id": "b", "data": {}}])
    assert gives_up.cancel()
    appender.close()  # the group is sent now
    assert waits.done(), "the caller would wait forever"
    record = waits.result()
    assert record is not None
    ids = event_ids(url)
    assert ids.count("b") == 1 and "a" not in ids  # cancelled before it was sent


# -- 3. operators' compactions against writers' merges ---------------------------------------


@pytest.mark.parametrize("kind", ["compact", "compact --by-key"])
def test_a_compaction_that_runs_longer_than_an_hour_under_load_finishes(
    tmp_path: Path, kind: str
) -> None:
    """An operator's compaction of a big log takes over two hours (15 minutes per source
    file read); meanwhile a writer appends and merges its small files, the compaction's
    sources among them. Merges yielded to a compaction's lease for an hour after it was
    taken (so that a dead one holds them back no longer): after that they merged its
    sources away, and it failed 5 of 5 attempts. A running compaction now shows it is
    alive (it rewrites its lease as it makes progress)."""
    from replog.ops.compaction import compact
    from replog.ops.keys import compact_by_key

    url = str(tmp_path / "log")
    ReplicationLog.create(url, 1)
    producer = ReplicationLog.open(url)  # merges its small files after its commits
    producer.storage = as_class(producer.storage, Aged)
    written = [0]

    def produce(rows: int = 3) -> None:
        """One commit, each a little larger than the one before (merges take the smallest
        files first: the oldest, here)."""
        written[0] += 1
        n = written[0]
        with use_clock(Virtual.clock(), Virtual.monotonic):
            rows_of = [{"key": f"k{i % 50}", "data": {"n": n, "pad": "x" * (10 * n)}}
                       for i in range(rows)]  # fmt: skip
            producer.append(rows_of)
        producer.flush()

    for _ in range(3):
        produce(rows=400)  # files no writer merges (a tier of 3)
    for _ in range(6):
        produce()
    attempts: list[int] = []

    class LongCompaction(Aged):
        def _read_once(self, path: str) -> bytes:
            if "/shards/" in path:
                Virtual.offset_s += 15 * MINUTE_S  # a big file
            return super()._read_once(path)

        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            super()._create_once(path, data, durability)
            if "/shards/" in path:  # one merged file per shard and attempt
                attempts.append(1)
                for _ in range(8):
                    produce()

    operator = opened(url, LongCompaction)
    with use_clock(Virtual.clock(), Virtual.monotonic):
        if kind == "compact":
            assert compact(operator).record is not None, attempts
        else:
            assert compact_by_key(operator).record is not None, attempts
    assert Virtual.offset_s > 2 * 3600
    assert len(attempts) == 1  # no conflict
    ids = event_ids(url)
    assert len(ids) == len(set(ids))


# -- 4. capture's staged transactions against recover ---------------------------------------


def test_a_new_capture_run_cannot_hand_a_live_runs_staged_files_to_recover(
    tmp_path: Path,
) -> None:
    """Run 1 of slot s1 stages a large transaction under a staging lease, 30 minutes
    long, and begins its commit (recover's mark is in, its lease checks out, its files
    exist). Then it freezes, long enough for PostgreSQL to drop its connection; run 2
    starts and releases run 1's lease as a dead run's, and a `recover --grace 10m` scans.
    Run 1's put then lands, and recover deletes its files: the commit names deleted
    files (every read fails). A dead run's lease must wind down, not vanish."""
    import threading
    from types import SimpleNamespace

    from replog.capture.events import Event
    from replog.capture.options import capture_app_id
    from replog.capture.postgres import Batch, PostgresCapture
    from replog.format.commits import Transaction
    from replog.ops.recovery import recover
    from replog.ops.verify import verify

    url = str(tmp_path / "log")
    ReplicationLog.create(url, 1)
    owner = "replog capture of slot s1"
    at_put, go = threading.Event(), threading.Event()

    class Run1(Aged):
        armed = False

        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            if type(self).armed and "/commits/" in path:
                type(self).armed = False
                at_put.set()
                go.wait()
            super()._create_once(path, data, durability)

    run1 = opened(url, Run1)
    batch = Batch(run1, owner, stage_events=2)
    with use_clock(Virtual.clock(), Virtual.monotonic):
        batch.add([Event(f"e{i}", 1_764_000_000_000, "insert", "public.t", f"k{i}", "{}",
                         None, "{}") for i in range(4)])  # fmt: skip
    assert batch.lease is not None and batch.staged
    Virtual.offset_s += 30 * MINUTE_S
    run1_done: list[Any] = []

    def commit_run1() -> None:
        with use_clock(Virtual.clock(), Virtual.monotonic):
            run1_done.append(batch.commit(Transaction(capture_app_id("s1"), 100, follows=0)))

    committing = threading.Thread(target=commit_run1)

    class Collector(Aged):
        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            super()._create_once(path, data, durability)
            if "/commits/" in path and not committing.is_alive() and not run1_done:
                Run1.armed = True  # recover's mark is in: run 1 commits, and freezes
                committing.start()
                assert at_put.wait(30)
                run2 = opened(url)
                PostgresCapture._release_dead_leases(  # run 2 starts
                    SimpleNamespace(log=run2, _lease_owner=owner)  # type: ignore[arg-type]
                )

        def _delete_once(self, path: str) -> None:
            if "/shards/" in path and committing.is_alive():
                go.set()  # run 1 wakes and puts its commit
                committing.join()
            super()._delete_once(path)

    collector = opened(url, Collector)
    with use_clock(Virtual.clock(), Virtual.monotonic):
        recover(collector, grace_ms=10 * 60_000)
    go.set()
    if committing.is_alive():
        committing.join()
    assert run1_done and run1_done[0] is not None  # run 1's commit landed
    report = verify(ReplicationLog.open(url))
    assert report.ok, f"a live commit's files were collected: {report.problems}"
    assert sorted(event_ids(url)) == [f"e{i}" for i in range(4)]
