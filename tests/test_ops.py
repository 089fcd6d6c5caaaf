"""Operator functions (replog.ops): truncate, compact, recover, status."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import pytest
from support.logcheck import check_key_order, check_log, run_concurrently
from support.logs import backdate, commit_offsets, filled_log, log_rows, segment_files
from support.replication import leave_pending
from support.storages import NoTimes

from replog.checkpoints.sinks import Batch, Outcome, SinkCommitter, sink_store
from replog.core import history
from replog.core import leases as lease_store
from replog.core.files import read_segment
from replog.errors import (
    CommitConflictError,
    CorruptionError,
    DataLossError,
    RetentionError,
    StagingCollectedError,
)
from replog.format.commits import COMPACT, CommitRecord, WriterInfo, commit_path
from replog.log import ReplicationLog
from replog.ops import compaction, recovery, retention, status
from replog.ops.verify import verify
from replog.storage import Storage
from replog.storage.backends import temporary_name
from replog.storage.faults import FaultInjector, FaultRates, FaultyStorage
from replog.timeutil import now_ms, use_clock


def sink_batch(log: ReplicationLog, query: str, epoch: int, start: int, count: int) -> Batch:
    since_version, since_ms = log.refresh().version, now_ms()  # as a Spark writer knows them
    staged = tuple(log.stage(log_rows(count, start)))
    return Batch(query, epoch, staged, since_version=since_version, since_ms=since_ms)


# -- truncate ------------------------------------------------------------------------------


def test_truncate_refuses_to_drop_unconsumed_events_and_changes_nothing(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"))
    commit_offsets(log, "etl", {0: 10, 1: 5})
    version = log.refresh().version
    with pytest.raises(RetentionError) as caught:
        retention.truncate(log, {0: 20, 1: 3})
    message = str(caught.value)
    assert "consumer 'etl'" in message and "shard 0" in message and "up to sequence 10" in message
    assert "Nothing was changed" in message
    assert log.refresh().version == version and log.state().lows == [1, 1]
    plan, record = retention.truncate(log, {0: 11, 1: 6})  # up to what it committed
    assert record is not None and record.low_watermarks == {0: 11, 1: 6}
    assert plan.total_dropped == 15
    assert ReplicationLog.open(log.url).state().lows == [11, 6]


def test_truncate_consumed_drops_only_what_every_consumer_committed(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=3)
    heads = log.head()
    commit_offsets(log, "fast", {0: heads[0], 1: heads[1]})
    commit_offsets(log, "slow", {0: 12, 1: heads[1]})
    assert retention.consumed_lows(log) == {0: 13, 1: heads[1] + 1}
    _, record = retention.truncate(log, retention.consumed_lows(log))
    assert record is not None
    assert all(s.last_sequence < 13 for s in record.remove if s.shard == 0)
    rows = check_log(log)
    assert min(r["sequence"] for r in rows if r["shard"] == 0) == 13
    assert not [r for r in rows if r["shard"] == 1]
    with pytest.raises(DataLossError, match="shard 0: events from sequence 1"):
        list(log.read(0, 1))


def test_a_consumer_registered_while_a_truncation_is_planned_blocks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = filled_log(str(tmp_path / "log"), commits=2)
    commit_offsets(log, "fast", {0: log.head()[0], 1: log.head()[1]})
    plan_truncation = retention.plan_truncation

    def plan_then_a_consumer_arrives(
        log: ReplicationLog, requested: dict[int, int]
    ) -> retention.TruncationPlan:
        plan = plan_truncation(log, requested)
        commit_offsets(log, "late", {0: 3})  # after the plan read the consumers
        return plan

    monkeypatch.setattr(retention, "plan_truncation", plan_then_a_consumer_arrives)
    version = log.refresh().version
    with pytest.raises(RetentionError, match="registered or set back while it was planned") as e:
        retention.truncate(log, {0: 8})
    assert "consumer 'late'" in str(e.value) and "up to sequence 3" in str(e.value)
    assert log.refresh().version == version and log.state().lows == [1, 1]
    assert next(log.read(0, 4))["sequence"][0].as_py() == 4  # 'late' still reads on


def test_truncate_with_no_consumers_keeps_everything_and_force_overrides(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=2)
    assert retention.consumed_lows(log) == {0: 1, 1: 1}
    assert retention.truncate(log, retention.consumed_lows(log))[1] is None
    commit_offsets(log, "idle", {})
    _, record = retention.truncate(log, {0: 5}, force=True)
    assert record is not None and log.state().lows[0] == 5


def test_truncate_older_than_uses_event_times(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    log.append([{"key": "a", "data": i, "timestamp": "2020-01-01T00:00:00Z"} for i in range(3)])
    log.append([{"key": "a", "data": i, "timestamp": "2030-01-01T00:00:00Z"} for i in range(2)])
    cutoff = int(time.time() * 1000)
    assert retention.lows_older_than(log.refresh(), cutoff) == {0: 4}


def test_truncate_rejects_a_low_past_the_head(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1)
    with pytest.raises(ValueError, match="shard 1 cannot keep from sequence 999"):
        retention.truncate(log, {1: 999})
    with pytest.raises(ValueError, match="shard 5 does not exist"):
        retention.truncate(log, {5: 1})


# -- compact -------------------------------------------------------------------------------


def test_compaction_keeps_every_event_and_sequence(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=6)
    before = check_log(log)
    assert log.state().segment_count == 12
    result = compaction.compact(log)
    assert result.record is not None and result.record.operation == COMPACT
    reopened = ReplicationLog.open(log.url)
    assert reopened.refresh().segment_count == 2
    assert reopened.head() == log.head()
    after = check_log(reopened)
    assert sorted((r["shard"], r["sequence"], r["event_id"]) for r in after) == sorted(
        (r["shard"], r["sequence"], r["event_id"]) for r in before
    )
    check_key_order(after)
    tail = reopened.read_table(0, 17)  # resuming mid-way through a merged segment
    assert tail.column("sequence").to_pylist() == list(range(17, log.head()[0] + 1))
    assert compaction.compact(reopened).record is None
    assert not lease_store.leases(log.storage).readable  # its lease was released


def test_compaction_respects_target_size(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=6, shards=1)
    sizes = [s.bytes for s in log.refresh().segments[0]]  # alike, not equal (random ids)
    result = compaction.compact(log, target_bytes=sum(sorted(sizes)[-3:]))
    assert [len(m.sources) for m in result.merges] == [3, 3]
    assert log.refresh().segment_count == 2


@pytest.mark.parametrize("fault", ["retried_create", "lost_response"])
def test_a_compaction_whose_commit_landed_unseen_keeps_its_merged_files(
    tmp_path: Path, fault: str
) -> None:
    log = filled_log(str(tmp_path / "log"), commits=4)
    injector = FaultInjector(seed=5, rates=FaultRates.only(**{fault: 1.0}))
    blind = ReplicationLog.from_storage(FaultyStorage.wrap(log.storage, injector))
    result = compaction.compact(blind)
    assert result.record is not None
    fresh = ReplicationLog.open(log.url)
    assert fresh.refresh().version == 5 and fresh.state().segment_count == 2
    assert verify(fresh).ok and len(check_log(fresh)) == 160


def test_compaction_under_concurrent_appends_and_readers(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=10)
    reader = ReplicationLog.open(log.url)
    planned = reader.refresh().covering(0, 1, reader.head()[0])
    appended: list[int] = []

    def append_more() -> None:
        writer = ReplicationLog.open(log.url)
        for c in range(10, 20):
            writer.append([{"key": f"k{i % 7}", "data": {"n": c * 40 + i}} for i in range(40)])
            appended.append(c)

    def compact_twice() -> None:
        for _ in range(2):
            # CommitConflictError: the other compaction removed a source first (no change)
            with contextlib.suppress(CommitConflictError):
                compaction.compact(ReplicationLog.open(log.url))

    run_concurrently(append_more, compact_twice)
    rows = check_log(ReplicationLog.open(log.url))
    assert len(rows) == 20 * 40 and len(appended) == 10
    check_key_order(rows)
    for segment in planned:  # files a reader planned on before the compaction remain
        assert sum(b.num_rows for b in read_segment(reader.storage, segment, 1, 10**9)) > 0


def test_a_compaction_that_does_not_cover_its_sources_is_rejected(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=2, shards=1)
    state = log.refresh()
    first, second = state.segments[0]
    bad = CommitRecord.after(state.version, COMPACT, add=(first,), remove=(first, second))
    log.storage.put_if_absent(commit_path(bad.version), bad.to_bytes())
    with pytest.raises(CorruptionError, match="do not cover exactly"):
        ReplicationLog.open(log.url).refresh()


# -- recover -------------------------------------------------------------------------------


def test_recover_resolves_a_pending_commit_left_by_a_crash(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1)
    committer = SinkCommitter(log, "orders-sink")
    committer.commit(sink_batch(log, "query-1", 0, 0, 10))
    staged = log.stage(log_rows(10, start=10))
    leave_pending(committer, "query-1", 1, staged)

    young = recovery.recover(log)  # default grace: a live driver may be committing
    assert young.pending_too_recent == {"orders-sink": 1} and not young.resolved
    assert all(log.storage.exists(s.path) for s in staged)

    preview = recovery.recover(log, grace_ms=0, dry_run=True)
    assert preview.resolved["orders-sink"].committed is False
    store = sink_store(log, "orders-sink")
    assert store.load_latest().sink_commit_statuses["orders-sink"].is_pending

    time.sleep(0.01)  # the staged files strictly older than the cut-off (ms file times)
    report = recovery.recover(log, grace_ms=0)
    assert report.resolved["orders-sink"].committed is False
    manifest = store.load_latest()
    assert manifest.sink_commit_statuses["orders-sink"].is_failed
    assert manifest.sink_epochs["orders-sink"] == 0
    assert not any(log.storage.exists(s.path) for s in staged)
    committer = SinkCommitter(ReplicationLog.open(log.url), "orders-sink")
    committer.commit(sink_batch(committer.log, "query-1", 1, 10, 10))  # the replay, once
    assert len(check_log(committer.log)) == 40 + 20


def test_recover_marks_committed_when_the_log_holds_the_epoch(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1)
    committer = SinkCommitter(log, "s")
    committer.commit(sink_batch(log, "q", 0, 0, 5))
    staged = log.stage(log_rows(5, start=5))
    leave_pending(committer, "q", 1, staged)
    log.commit_staged(staged, writer=WriterInfo("s", "q", 1))
    report = recovery.recover(log, grace_ms=0)
    assert report.resolved["s"].committed is True
    manifest = committer.store.load_latest()
    assert manifest.sink_commit_statuses["s"].is_committed and manifest.sink_epochs["s"] == 1


def test_garbage_collection_spares_young_and_recently_removed_files(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=3, shards=1)
    orphan = log.stage(log_rows(5))[0].path  # a crashed writer's staged file
    old_live = sorted(segment_files(log) - {orphan})
    for relative in segment_files(log):
        backdate(log, relative, 7200)
    compaction.compact(log)  # removes the three old files just now
    report = recovery.recover(log)  # 1 h grace: only the old orphan goes
    assert report.garbage == [orphan] and not log.storage.exists(orphan)
    assert all(log.storage.exists(relative) for relative in old_live)
    report = recovery.recover(log, grace_ms=0)
    assert sorted(report.garbage) == old_live
    assert len(check_log(log)) == 120 and verify(log).ok


def test_a_compaction_by_a_lagging_clock_gets_its_whole_grace(tmp_path: Path) -> None:
    """A writer whose clock is 6 minutes behind compacts: the files it removed were live
    a moment ago (a reader may have planned a task on them), so a recover with a
    1-minute grace keeps them, whatever that writer's commit stamp says."""
    with use_clock(lambda: time.time() - 7200):  # written two hours ago
        log = filled_log(str(tmp_path / "log"), commits=3, shards=1, auto_compact=False)
    old_files = sorted(segment_files(log))
    for relative in old_files:
        backdate(log, relative, 7200)
    with use_clock(lambda: time.time() - 360):
        compaction.compact(log)
    report = recovery.recover(ReplicationLog.open(log.url), grace_ms=60_000)
    assert report.garbage == [] and report.scan.kept_removed_recently == len(old_files)
    assert all(log.storage.exists(relative) for relative in old_files)


def test_recover_spares_the_files_of_a_writer_that_outlives_the_grace(tmp_path: Path) -> None:
    """A batch job or compaction staging for longer than --grace holds a lease: its files
    stay until it commits, however old they are."""
    log = filled_log(str(tmp_path / "log"), commits=1, shards=1)
    lease = lease_store.acquire(log.storage, "a long batch job")
    lease = dataclasses.replace(lease, acquired_ms=lease.acquired_ms - 7_300_000)  # 2 h ago
    log.storage.write(lease.relative, json.dumps(dataclasses.asdict(lease)).encode())
    staged = log.stage(log_rows(5))
    for segment in staged:
        backdate(log, segment.path, 7200)  # staged after the lease, long before now
    report = recovery.recover(log, grace_ms=1000)
    assert report.garbage == [] and report.scan.kept_leased == 1
    assert log.commit_staged(staged) is not None
    lease_store.release(log.storage, lease)
    assert verify(log).ok and len(check_log(log)) == 45


@pytest.mark.parametrize(
    "damage",
    [b"not json", b'{"lease_id": "x", "owner": "o", "acquired_ms": 1, "expires_ms": "soon"}'],
    ids=["not JSON", "expires_ms a string"],
)
def test_an_unreadable_lease_protects_what_it_might_cover(tmp_path: Path, damage: bytes) -> None:
    """A lease damaged while its writer stages: recover cannot tell what it covers, so it
    keeps every staged file (and says which lease), and the writer, finding its lease
    damaged, refuses to commit rather than trust its files."""
    log = filled_log(str(tmp_path / "log"), commits=1, shards=1)
    lease = lease_store.acquire(log.storage, "a long batch job")
    staged = log.stage(log_rows(5))
    for segment in staged:
        backdate(log, segment.path, 7200)
    log.storage.write(lease.relative, damage)
    report = recovery.recover(log, grace_ms=1000)
    assert report.garbage == [] and report.scan.kept_leased == 1
    assert all(log.storage.exists(segment.path) for segment in staged)
    with pytest.raises(StagingCollectedError, match="is damaged"):
        log.commit_staged(staged, since=None, lease=lease)
    problems = verify(log).problems
    assert [p.path for p in problems] == [log.storage.path(lease.relative)]
    assert "unreadable staging lease" in problems[0].message


def test_an_unreadable_lease_expires_a_day_after_its_last_write(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1, shards=1)
    relative = "_replog/leases/damaged.json"
    log.storage.write(relative, b"{")
    orphan = log.stage(log_rows(3))[0].path
    backdate(log, orphan, 2 * 86_400)
    backdate(log, relative, 86_400 + 60)
    report = recovery.recover(log, grace_ms=1000)
    assert report.garbage == [orphan]
    assert not log.storage.exists(relative)  # removed as an expired lease
    assert verify(log).ok


def test_a_write_that_outlives_its_lease_is_refused_before_it_commits(tmp_path: Path) -> None:
    """A lease that ran out no longer keeps recover away: the write must not commit its
    files on the strength of it (they may be gone, or going)."""
    log = filled_log(str(tmp_path / "log"), commits=1, shards=1)
    lease = lease_store.acquire(log.storage, "a very long batch job")
    staged = log.stage(log_rows(5))
    ran_out = dataclasses.replace(lease, expires_ms=now_ms() - 1)
    log.storage.write(lease.relative, ran_out.to_bytes())
    with pytest.raises(StagingCollectedError, match="ran out"):
        log.commit_staged(staged, lease=lease)
    lease_store.release(log.storage, lease)
    with pytest.raises(StagingCollectedError, match="is gone"):
        log.commit_staged(staged, lease=lease)
    assert log.refresh().version == 1  # nothing committed


def test_a_compaction_whose_lease_is_lost_commits_nothing(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=6, shards=1, auto_compact=False)
    version = log.refresh().version

    class LeaseLostBeforeCommit(type(log.storage)):  # type: ignore[misc]
        def _create_once(self, path: str, data: bytes, durability: object) -> None:
            super()._create_once(path, data, durability)  # type: ignore[arg-type]
            if "/shards/" in path:  # the lease is lost while the merged files are written
                for name in self.listdir("_replog/leases"):
                    self.delete(f"_replog/leases/{name}")

    log.storage.__class__ = LeaseLostBeforeCommit
    with pytest.raises(StagingCollectedError, match="is gone"):
        compaction.compact(log)
    assert log.refresh().version == version
    log.storage.__class__ = Storage
    assert len(check_log(log)) == 240 and verify(log).ok


def test_a_lease_still_being_written_is_not_an_unreadable_lease(tmp_path: Path) -> None:
    """On local disk a lease is written to a temporary file beside its name first; a
    listing in between finds that file, possibly half-written. It is no lease: verify
    reports nothing and recover still collects what no lease guards."""
    log = filled_log(str(tmp_path / "log"), commits=1, shards=1)
    lease = lease_store.acquire(log.storage, "a writer")
    half = f"_replog/leases/{temporary_name(lease.relative.rsplit('/', 1)[1])}"
    log.storage.write(half, lease.to_bytes()[:20])
    lease_store.release(log.storage, lease)
    orphan = log.stage(log_rows(3))[0].path
    backdate(log, orphan, 2 * 86_400)
    assert verify(log).ok
    assert recovery.recover(log, grace_ms=1000).garbage == [orphan]


@pytest.mark.parametrize(
    "stray",
    [
        "_replog/sinks/.DS_Store",
        "_replog/consumers/my consumer (copy)/0000000001.json",
        "_replog/consumers/README",
        "_replog/sinks/notes.txt",
        "_replog/leases/x.json",
    ],
)
def test_one_stray_file_stops_no_operator_command(tmp_path: Path, stray: str) -> None:
    """recover, truncate, status and verify warn about a file that is not replog's (or a
    lease they cannot read), name it, and go on; verify reports it."""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=2, shards=2)
    commit_offsets(log, "reader", {0: 10, 1: 10})
    content = b'{"lease_id": "x", "owner": "o", "acquired_ms": 1, "expires_ms": "soon"}'
    log.storage.write(stray, content)
    recovery.recover(ReplicationLog.open(url), grace_ms=0)
    lows = retention.consumed_lows(ReplicationLog.open(url))
    retention.truncate(ReplicationLog.open(url), lows)
    assert ReplicationLog.open(url).refresh().lows == [11, 11]
    report = status.log_status(ReplicationLog.open(url))
    assert [c.name for c in report.consumers] == ["reader"]
    assert report.sinks == ()
    problems = verify(ReplicationLog.open(url)).problems
    assert len(problems) == 1 and stray.split("/")[2] in problems[0].path
    assert len(check_log(ReplicationLog.open(url))) == 60  # 20 truncated


@pytest.mark.parametrize("cold", [False, True], ids=["warm committer", "cold committer"])
def test_a_recover_during_a_sink_commit_never_leaves_a_commit_naming_deleted_files(
    tmp_path: Path, cold: bool
) -> None:
    """recover (grace 0) deletes the staged files of an epoch that began before its gc
    mark: the sink must refuse to commit, also when it loads the log afresh from a
    checkpoint header written after the mark. Files staged after the mark are kept."""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    doomed = sink_batch(log, "q", 0, 0, 10)  # began before the recover below
    time.sleep(0.01)  # stamped strictly before the cut-off (file times are in ms)
    recovery.recover(ReplicationLog.open(url), grace_ms=0)
    assert not any(log.storage.exists(path) for path in doomed.paths)
    safe = sink_batch(log, "q", 0, 100, 10)  # began after it
    if cold:  # the mark lies below the newest header: it must carry gc_version
        for n in range(10):
            log.append(log_rows(1, 1000 + n))
        assert history.read_commit(log.storage, 2).gc is not None  # type: ignore[union-attr]
        assert log.refresh().version >= 10 and log.storage.exists(history.header_path(10))
    committer = SinkCommitter(ReplicationLog.open(url) if cold else log, "s")
    with pytest.raises(StagingCollectedError, match="began while this write was staging"):
        committer.commit(doomed)
    committer.abort(doomed, "its files were collected")
    assert committer.commit(safe) is Outcome.COMMITTED
    final = ReplicationLog.open(url)
    assert verify(final).ok
    assert len(check_log(final)) == 40 + 10 + (10 if cold else 0)


def test_recover_on_a_backend_without_file_times_waits_a_grace_from_first_sight(
    tmp_path: Path,
) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1, shards=1)
    storage = log.storage.child("")
    storage.__class__ = NoTimes
    blind = ReplicationLog.from_storage(storage)
    staged = log.stage(log_rows(5))  # a live writer's file, not yet committed
    assert recovery.recover(blind, grace_ms=60_000).garbage == []
    assert log.commit_staged(staged) is not None
    assert verify(log).ok and len(check_log(log)) == 45
    orphan = log.stage(log_rows(3))[0].path
    assert recovery.recover(blind, grace_ms=60_000).garbage == []  # first seen now
    time.sleep(0.01)
    assert recovery.recover(blind, grace_ms=5).garbage == [orphan]


# -- status ----------------------------------------------------------------------------------


def test_status_reports_lag_age_and_sinks(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    log.append(
        [{"key": f"k{i}", "data": i, "timestamp": "2026-01-01T00:00:00Z"} for i in range(20)]
    )
    log.append([{"key": f"k{i}", "data": i} for i in range(20)])
    SinkCommitter(log, "mirror").commit(sink_batch(log, "q-7", 3, 0, 4))
    heads = log.head()
    commit_offsets(log, "caught-up", {0: heads[0], 1: heads[1]})
    commit_offsets(log, "behind", {0: 1, 1: 0})
    report = status.log_status(log)
    by_name = {c.name: c for c in report.consumers}
    assert by_name["caught-up"].total_lag == 0
    assert by_name["caught-up"].oldest_unconsumed_ms is None
    assert by_name["behind"].total_lag == sum(log.head().values()) - 1
    assert by_name["behind"].oldest_unconsumed_ms == 1767225600000  # 2026-01-01
    [sink] = report.sinks
    assert sink.sink_id == "mirror" and sink.epoch == 3 and sink.status == "Committed"
    assert sink.query_id == "q-7" and sink.log_epoch == 3
    assert report.to_json()["consumers"][0]["name"] == "behind"
