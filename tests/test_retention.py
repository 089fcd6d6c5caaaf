"""Retention against slow and failing writers: no commit lands in a range retention
deleted, no process is shown an old view of the log, and retention itself never stops.

Each test forces one interleaving found by review (a writer stalled between two steps
while another writer's expiry runs, an unordered or partial delete, a read outage right
after a commit landed) through a storage subclass on one process's own storage object.
Retention is 1 s (a log as replog 0.5 created them), so the tests sleep past it instead
of replacing clocks: expiry runs in writers' background threads, which do not share a
test's clock. Appends that must not
expire anything before a test is ready are stamped with a stopped clock, and their files
too (expiry judges ages by file times: :class:`~support.storages.ClockTimes`).
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from pathlib import Path

import pytest
from support.logcheck import check_log, read_all
from support.logs import short_retention_log
from support.storages import ClockTimes, as_class

from replog.appender import GroupAppender
from replog.checkpoints.sinks import Batch, Outcome, SinkCommitter
from replog.errors import LogRecreatedError
from replog.format.commits import Transaction, commit_path
from replog.format.events import events_from_records
from replog.log import ReplicationLog
from replog.ops import recovery
from replog.ops.verify import verify
from replog.storage import RetryPolicy, Storage
from replog.timeutil import Clock, now_ms, use_clock

PAST_RETENTION_S = 1.2


def tagged(tag: str, count: int = 3) -> list[dict[str, object]]:
    return [{"key": f"{tag}-{i}", "data": {"tag": tag}} for i in range(count)]


def tags(url: str) -> list[str]:
    """The tag of every event a process opening the log now reads."""
    rows = read_all(ReplicationLog.open(url))
    return [json.loads(data)["tag"] for data in rows.column("data").to_pylist()]


def create(url: str) -> None:
    short_retention_log(url, 2, 1000, snapshot_interval=10, auto_compact=False)


def writer(url: str) -> ReplicationLog:
    return ReplicationLog.open(url, auto_compact=False)


def stopped_clock() -> Clock:
    """A clock stuck at now: commits stamped with it (and so their snapshot headers) stay
    younger than the retention until real time has moved past it, however long the
    commits took to write."""
    stopped = time.time()
    return lambda: stopped


def append_many(log: ReplicationLog, count: int, tag: str) -> None:
    for n in range(count):
        log.append(tagged(f"{tag}{n}"))


class PartialUnorderedDelete(Storage):
    """Multi-object deletes as S3's DeleteObjects may answer them: in no particular order
    (here: newest first) and failing part-way (half the keys deleted, then an error)."""

    def _delete_many_once(self, paths: list[str]) -> None:
        newest_first = sorted(paths, reverse=True)
        for path in newest_first[: len(paths) // 2]:
            self._delete_once(path)
        raise PermissionError("injected: DeleteObjects answered InternalError for some keys")


def expiry_while_reading_commit_2(other: ReplicationLog) -> type[Storage]:
    """Storage on which, right after commit 2 is read, ``other`` makes a table commit and
    its expiry deletes commits 1..20 (before the reader reads on)."""

    class ExpiryWhileReading(Storage):
        fired = False

        def _read_once(self, path: str) -> bytes:
            data = super()._read_once(path)
            if path.endswith(commit_path(2)) and not self.fired:
                type(self).fired = True
                other.append(tagged("table30"))
                other.flush()
            return data

    return ExpiryWhileReading


def test_a_lagging_sink_never_commits_into_an_expired_range(tmp_path: Path) -> None:
    """The sink catches up commit by commit; another writer's expiry deletes the commits
    it has not read yet. The sink must notice it fell behind retention, reload, and commit
    after the real head: an epoch acknowledged COMMITTED is in the log."""
    url = str(tmp_path / "log")
    create(url)
    other, sink_log = writer(url), writer(url)
    other.storage = as_class(other.storage, ClockTimes)  # its files stamped by its clock
    committer = SinkCommitter(sink_log, "sink1")

    def epoch(number: int, tag: str) -> Outcome:
        staged = sink_log.stage(events_from_records(tagged(tag)))
        batch = Batch(
            "q1", number, tuple(staged), since_version=sink_log.state().version, since_ms=now_ms()
        )
        return committer.commit(batch)

    assert epoch(0, "sink-e0") is Outcome.COMMITTED  # version 1
    with use_clock(stopped_clock()):  # however slow: nothing expires before the sleep
        append_many(other, 19, "a")  # tables at 10 and 20
    time.sleep(PAST_RETENTION_S)
    append_many(other, 9, "b")  # version 29

    assert other.storage.exists(commit_path(2))
    expiring = expiry_while_reading_commit_2(other)
    sink_log.storage.__class__ = expiring
    assert epoch(1, "sink-e1") is Outcome.COMMITTED
    assert expiring.fired
    sink_log.storage.__class__ = Storage
    for number in (2, 3):
        assert epoch(number, f"sink-e{number}") is Outcome.COMMITTED

    seen = tags(url)
    assert {"sink-e1", "sink-e2", "sink-e3", "table30"} <= set(seen)
    assert ReplicationLog.open(url).refresh().sinks["sink1"].epoch == 3
    check_log(ReplicationLog.open(url))


def test_a_reader_overtaken_by_expiry_while_catching_up_sees_the_head(tmp_path: Path) -> None:
    """A reader reads commit 2; expiry deletes commits up to 20 before it reads commit 3.
    "Commit 3 missing" is not the head: the reader reloads from the newest table."""
    url = str(tmp_path / "log")
    create(url)
    other = writer(url)
    other.storage = as_class(other.storage, ClockTimes)  # its files stamped by its clock
    other.append(tagged("first"))
    reader = ReplicationLog.open(url)
    reader.refresh()  # at version 1
    with use_clock(stopped_clock()):  # however slow: nothing expires before the sleep
        append_many(other, 19, "a")
    time.sleep(PAST_RETENTION_S)
    append_many(other, 9, "b")  # version 29

    assert other.storage.exists(commit_path(2))
    expiring = expiry_while_reading_commit_2(other)
    reader.storage.__class__ = expiring
    state = reader.refresh()
    assert expiring.fired
    assert state.version == 30
    assert "table30" in {json.loads(d)["tag"] for d in reader.read_all().column("data").to_pylist()}


def test_a_writer_stalled_before_its_put_does_not_fill_an_expired_slot(tmp_path: Path) -> None:
    """A writer checks that its next version is free, then stalls; others commit past it
    and expiry deletes that version's commit. The put then succeeds in the emptied slot:
    the writer must find its commit off the log's history, take it back, and commit after
    the real head."""
    url = str(tmp_path / "log")
    create(url)
    stalled, busy = writer(url), writer(url)
    stalled.append(tagged("first"))  # version 1

    class StallBeforePut(Storage):
        stalled_once = False

        def _create_once(self, path: str, data: bytes, durability: object) -> None:
            if path.endswith(commit_path(2)) and not self.stalled_once:
                type(self).stalled_once = True
                append_many(busy, 19, "b")  # 2..20
                time.sleep(PAST_RETENTION_S)
                append_many(busy, 10, "c")  # table 30: expiry deletes commits 1..20
                busy.flush()
                assert not self._exists_once(path)
            super()._create_once(path, data, durability)  # type: ignore[arg-type]

    stalled.storage.__class__ = StallBeforePut
    record = stalled.append(tagged("stalled"))
    assert StallBeforePut.stalled_once
    assert record is not None and record.version == 31
    assert not stalled.storage.exists(commit_path(2))
    assert tags(url).count("stalled") == 3
    check_log(ReplicationLog.open(url))


def test_an_append_after_a_partial_unordered_expiry_is_kept(tmp_path: Path) -> None:
    """Expiry's delete of old commits fails after deleting the newer half: an idle writer
    finds its next commit gone and its own commit still there. Its append must not take
    the free slot in the expired range (no reader would ever see it)."""
    url = str(tmp_path / "log")
    create(url)
    expiring, idle = writer(url), writer(url)
    expiring.storage.__class__ = PartialUnorderedDelete
    append_many(expiring, 4, "a")
    idle.append(tagged("early"))  # the idle writer is at version 5
    reader = ReplicationLog.open(url)
    reader.refresh()  # an idle reader at version 5 too
    append_many(expiring, 15, "b")
    time.sleep(PAST_RETENTION_S)
    append_many(expiring, 10, "c")  # table 30: expiry runs and fails part-way
    expiring.flush()

    time.sleep(PAST_RETENTION_S)
    record = idle.append(tagged("late", 4))
    assert record is not None and record.version > 30
    assert tags(url).count("late") == 4
    append_many(expiring, 3, "more")
    assert {"late", "more0", "more2"} <= set(
        json.loads(d)["tag"] for d in reader.read_all().column("data").to_pylist()
    )
    assert reader.refresh().version == expiring.refresh().version
    check_log(ReplicationLog.open(url))


def test_leftover_commits_of_a_failed_expiry_are_not_reported(tmp_path: Path) -> None:
    """Expiry deletes old commits oldest first; a delete that fails leaves the commits
    after it. Those are retention's leftovers, not damage: verify says the log is sound,
    and the next expiry removes them."""
    url = str(tmp_path / "log")
    create(url)
    log = writer(url)

    class Commit8Undeletable(Storage):
        def _delete_once(self, path: str) -> None:
            if path.endswith(commit_path(8)):
                raise PermissionError("injected: AccessDenied on one key")
            super()._delete_once(path)

    log.storage.__class__ = Commit8Undeletable
    append_many(log, 20, "a")
    time.sleep(PAST_RETENTION_S)
    append_many(log, 10, "b")
    log.flush()
    assert not log.storage.exists(commit_path(7))
    assert log.storage.exists(commit_path(8))  # and the ones after it
    report = verify(ReplicationLog.open(url))
    assert report.ok, report.problems

    log.storage.__class__ = Storage
    time.sleep(PAST_RETENTION_S)
    append_many(log, 10, "c")
    log.flush()
    assert not log.storage.exists(commit_path(8))
    assert verify(ReplicationLog.open(url)).ok
    # a commit a writer put into the deleted range and could not take back: left over too
    log.storage.put_if_absent(commit_path(3), log.storage.read(commit_path(log.state().version)))
    report = verify(ReplicationLog.open(url))
    assert report.ok, report.problems


def test_a_commit_missing_within_the_retention_is_reported(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    create(url)
    log = writer(url)
    append_many(log, 25, "a")
    log.storage.delete(commit_path(23))
    report = verify(ReplicationLog.open(url))
    assert not report.ok
    assert any(commit_path(23) in problem.path for problem in report.problems)


def test_a_read_outage_after_the_commit_landed_does_not_double_an_append(tmp_path: Path) -> None:
    """Work after the commit (a checkpoint, scheduling expiry) fails on a storage outage
    that begins right after the commit was written: the append reports success, since its
    commit is in, and the caller has no reason to retry."""
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2, snapshot_interval=10, auto_compact=False)
    append_many(writer(url), 19, "a")
    log = writer(url)  # a table commit comes next: checkpoint and expiry follow it

    class OutageAfterCommit(Storage):
        outage = False

        def _create_once(self, path: str, data: bytes, durability: object) -> None:
            super()._create_once(path, data, durability)  # type: ignore[arg-type]
            if "/_replog/commits/" in path:
                type(self).outage = True

        def _read_once(self, path: str) -> bytes:
            if self.outage:
                raise OSError(errno.EIO, "injected: 503 Slow Down")
            return super()._read_once(path)

    log.storage.__class__ = OutageAfterCommit
    log.storage.retry = RetryPolicy(attempts=2, first_delay_s=0.001)
    with GroupAppender(log, linger_ms=0) as appender:
        record = appender.append(tagged("precious", 1))
    assert record is not None and record.version == 20
    assert tags(url).count("precious") == 1


def test_a_stale_hint_copy_past_retention_hides_nothing(tmp_path: Path) -> None:
    """A writer stalls between its table and its hint; meanwhile others go on and expire
    that table. The hint it then writes names a deleted table (with a copy of it): a process
    opening the log must still see the newest version, and its appends must be kept."""
    url = str(tmp_path / "log")
    create(url)
    stalled, busy = writer(url), writer(url)
    append_many(stalled, 19, "a")

    class StallBeforeHint(Storage):
        def _replace_once(self, path: str, data: bytes, durability: object) -> None:
            if path.endswith("_last_snapshot") and json.loads(data)["version"] == 20:
                append_many(busy, 10, "b")
                time.sleep(PAST_RETENTION_S)
                append_many(busy, 10, "c")
                busy.flush()  # expires up to 20
                append_many(busy, 10, "d")
                busy.flush()  # expires up to 30: table 20 is deleted
            super()._replace_once(path, data, durability)  # type: ignore[arg-type]

    stalled.storage.__class__ = StallBeforeHint
    stalled.append(tagged("table20"))
    stalled.storage.__class__ = Storage
    newest = busy.refresh()
    assert not busy.storage.exists(commit_path(20))

    opened = ReplicationLog.open(url).refresh()
    assert (opened.version, opened.heads) == (newest.version, newest.heads)
    record = writer(url).append(tagged("precious"))
    assert record is not None and record.version == newest.version + 1
    append_many(busy, 10, "e")  # the hint moves on
    assert tags(url).count("precious") == 3
    check_log(ReplicationLog.open(url))


def test_group_commit_keeps_the_submission_order_of_a_key(tmp_path: Path) -> None:
    """A transactional update of a key submitted before a plain update of the same key
    reaches the log first: consumers end with the value submitted last."""
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2, auto_compact=False)
    with GroupAppender(writer(url), linger_ms=50) as appender:
        first = appender.submit([{"key": "K", "data": {"v": 1}}], transaction=Transaction("app", 1))
        second = appender.submit([{"key": "K", "data": {"v": 2}}])
        third = appender.submit([{"key": "K", "data": {"v": 3}}], transaction=Transaction("app", 2))
        assert None not in (first.result(), second.result(), third.result())
    rows = sorted(check_log(ReplicationLog.open(url)), key=lambda row: row["sequence"])
    assert [json.loads(row["data"])["v"] for row in rows] == [1, 2, 3]


def test_an_old_writers_checkpoint_cannot_break_a_recreated_log(tmp_path: Path) -> None:
    """The log is deleted and created again between an old writer's commit and its
    checkpoint: the old writer's table and hint land in the new log. The new log opens,
    appends and reaches that version all the same."""
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2, snapshot_interval=10, auto_compact=False)
    old = writer(url)
    append_many(old, 9, "old")

    class RecreatedAfterCommit(Storage):
        def _create_once(self, path: str, data: bytes, durability: object) -> None:
            super()._create_once(path, data, durability)  # type: ignore[arg-type]
            if path.endswith(commit_path(10)):
                shutil.rmtree(url)
                ReplicationLog.create(url, 2, snapshot_interval=10, auto_compact=False)

    old.storage.__class__ = RecreatedAfterCommit
    old.append(tagged("old-table"))  # the old log's commit 10, then its checkpoint
    old.storage.__class__ = Storage
    assert old.storage.exists("_replog/_last_snapshot")

    new = writer(url)
    assert new.refresh().version == 0
    append_many(new, 12, "new")
    assert ReplicationLog.open(url).refresh().version == 12
    assert set(tags(url)) == {f"new{n}" for n in range(12)}
    with pytest.raises(LogRecreatedError):
        old.append(tagged("old-again"))


def test_retention_steps_over_a_table_that_was_never_written(tmp_path: Path) -> None:
    """A writer died between its commit at a table version and writing the table: the
    missing table must not stop retention for good."""
    url = str(tmp_path / "log")
    create(url)
    log = writer(url)

    class NoTable10(Storage):
        def _create_once(self, path: str, data: bytes, durability: object) -> None:
            if path.endswith("00000000000000000010.segments.arrow"):
                raise PermissionError("injected: the writer died before its table")
            super()._create_once(path, data, durability)  # type: ignore[arg-type]

    log.storage.__class__ = NoTable10
    append_many(log, 10, "a")
    log.storage.__class__ = Storage
    for round_ in range(4):
        append_many(log, 10, f"r{round_}-")
        log.flush()
        time.sleep(PAST_RETENTION_S)
    append_many(log, 10, "last")
    log.flush()
    assert not log.storage.exists(commit_path(1))
    assert log.refresh().retained_from >= 30
    assert len(check_log(ReplicationLog.open(url))) == 60 * 3


def test_a_restarted_writer_carries_retention_on(tmp_path: Path) -> None:
    """A process that opens the log takes retained_from from the newest table, which can
    name a table expiry already deleted: its own expiry must go on from there."""
    url = str(tmp_path / "log")
    create(url)
    first = writer(url)
    append_many(first, 20, "a")
    time.sleep(PAST_RETENTION_S)
    append_many(first, 10, "b")
    first.flush()  # expired up to 20
    time.sleep(PAST_RETENTION_S)
    append_many(first, 9, "c")
    first.flush()

    restarted = writer(url)
    restarted.refresh()
    for round_ in range(3):
        time.sleep(PAST_RETENTION_S)
        append_many(restarted, 10, f"d{round_}-")
        restarted.flush()
    oldest = min(int(name[:20]) for name in restarted.storage.listdir("_replog/commits"))
    assert oldest > 40
    assert restarted.refresh().retained_from >= 50


def test_recover_from_a_stale_log_object_deletes_no_live_file(tmp_path: Path) -> None:
    """recover run from a long-lived object whose version's successor expired (a partial,
    unordered delete left its own commit): its mark must not fork the log, and every
    committed event stays readable."""
    url = str(tmp_path / "log")
    create(url)
    expiring = writer(url)
    expiring.storage.__class__ = PartialUnorderedDelete
    append_many(expiring, 5, "a")
    operator = ReplicationLog.open(url)
    operator.refresh()  # at version 5
    append_many(expiring, 15, "b")
    time.sleep(PAST_RETENTION_S)
    append_many(expiring, 10, "c")
    expiring.flush()

    recovery.recover(operator, grace_ms=0)
    assert len(check_log(ReplicationLog.open(url))) == 30 * 3
