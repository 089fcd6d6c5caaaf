"""Small commits are normal: shared files, automatic merges, retention and group commit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from pyarrow import ipc
from support.logcheck import check_key_order, check_log
from support.logs import append_commits, segment_files, short_retention_log

from replog.appender import GroupAppender
from replog.core import history
from replog.errors import InvalidEventError
from replog.format.commits import COMPACT, Transaction, commit_path
from replog.log import ReplicationLog
from replog.merges import FAN_IN, plan_auto
from replog.ops import compaction
from replog.ops.verify import verify


def ten(n: int, prefix: str = "k") -> list[dict[str, object]]:
    return [{"key": f"{prefix}{(n * 10 + j) % 37}", "data": {"n": n * 10 + j}} for j in range(10)]


def live_files(log: ReplicationLog) -> set[str]:
    return {segment.path for lane in log.refresh().segments for segment in lane}


def test_a_small_append_writes_one_file_for_every_shard(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 8)
    record = log.append(ten(0))
    assert record is not None
    paths = {entry.path for entry in record.add}
    assert len(paths) == 1 and next(iter(paths)).startswith("shards/shared/")
    assert len(record.add) == len({entry.shard for entry in record.add}) > 1
    offsets = sorted(entry.offset for entry in record.add)
    assert offsets[0] == 0 and offsets == sorted(set(offsets))
    # the shares of the file's size add up to its size
    assert sum(entry.bytes for entry in record.add) == len(log.storage.read(next(iter(paths))))
    rows = check_log(ReplicationLog.open(log.url))
    assert sorted(r["data"] for r in rows) == sorted(f'{{"n":{n}}}'.encode() for n in range(10))


def test_a_big_append_writes_a_file_per_shard(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 4)
    big = [{"key": f"k{i}", "data": {"n": i, "pad": "x" * 1000}} for i in range(6000)]  # ~6 MB
    record = log.append(big)
    assert record is not None
    assert len({entry.path for entry in record.add}) == len(record.add) == 4
    assert all(entry.offset == 0 and "shared" not in entry.path for entry in record.add)
    assert len(check_log(log)) == 6000


def test_automatic_merges_keep_a_few_files_and_every_event(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 8)
    for n in range(300):
        log.append(ten(n))
    assert append_commits(log) == 300
    files = live_files(log)
    assert len(files) < 3 * FAN_IN, len(files)  # not 300
    reader = ReplicationLog.open(log.url)
    rows = check_log(reader)
    assert len(rows) == 3000
    check_key_order(rows)
    assert verify(reader).ok
    # a merged file is made of large record batches, not the writes' tiny ones
    merged = max(files, key=lambda path: len(log.storage.read(path)))
    with ipc.open_file(pa.BufferReader(log.storage.read(merged))) as opened:
        assert opened.num_record_batches == 1


def test_merges_across_a_big_write_keep_its_place(tmp_path: Path) -> None:
    """Small files on either side of a big write merge into a file with several parts of
    one shard; sequences and order stay exact."""
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    for n in range(4):
        log.append(ten(n))
    log.append([{"key": f"b{i % 37}", "data": {"n": i, "pad": "y" * 1000}} for i in range(5000)])
    for n in range(4, 40):
        log.append(ten(n))
    compacts = [
        history.read_commit(log.storage, v)
        for v in range(1, log.refresh().version + 1)
    ]  # fmt: skip
    assert any(record is not None and record.operation == COMPACT for record in compacts)
    rows = check_log(ReplicationLog.open(log.url))
    assert len(rows) == 400 + 5000
    check_key_order(rows)


def test_a_merge_that_loses_to_another_is_dropped_quietly(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 4, auto_compact=False)
    for n in range(FAN_IN):
        log.append(ten(n))
    first, second = ReplicationLog.open(log.url), ReplicationLog.open(log.url)
    plan = plan_auto(first.refresh())
    assert plan is not None and plan_auto(second.refresh()) is not None
    assert first.merge([plan]) is not None
    before, version = segment_files(log), log.refresh().version
    second.auto_compact = True
    second.maintain()  # plans on its stale state: the merge runs, and finds them gone
    second.flush()
    assert log.refresh().version == version  # nothing committed
    assert segment_files(log) == before  # and it deleted what it had written
    assert len(check_log(ReplicationLog.open(log.url))) == FAN_IN * 10


def test_writers_can_turn_merges_off(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 4)
    quiet = ReplicationLog.open(log.url, auto_compact=False)
    for n in range(3 * FAN_IN):
        quiet.append(ten(n))
    assert quiet.refresh().version == 3 * FAN_IN


def test_full_compaction_gives_every_shard_files_of_its_own(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 4)
    for n in range(50):
        log.append(ten(n))
    before = check_log(log)
    assert compaction.compact(log).record is not None
    state = log.refresh()
    assert state.segment_count == 4
    assert all(len(lane) == 1 and "shared" not in lane[0].path for lane in state.segments)
    assert check_log(ReplicationLog.open(log.url)) == before


# -- retention -------------------------------------------------------------------------------


def aged(url: str, commits: int, retention_ms: int = 1_000) -> ReplicationLog:
    log = short_retention_log(url, 4, retention_ms, snapshot_interval=20)
    for n in range(commits):
        log.append(ten(n))
    return log


def test_retention_removes_old_metadata_and_merged_files(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    log = aged(url, 60)
    time.sleep(1.2)  # everything written so far is past the retention
    for n in range(60, 120):
        log.append(ten(n))
    log.flush()  # retention runs in the writer's background thread
    state = log.refresh()
    retained = state.retained_from
    assert retained >= 40
    # commits up to the oldest retained table are gone; later ones are all there
    assert not log.storage.exists(commit_path(1))
    assert not log.storage.exists(history.header_path(20))
    later = history.read_commits(log.storage, retained + 1, state.version)
    # the files merges replaced before that table were deleted (no listing, no recover):
    # what is on storage is live, or was removed by a commit still retained
    on_storage = segment_files(log)
    removed_later = {segment.path for record in later for segment in record.remove}
    assert live_files(log) <= on_storage <= live_files(log) | removed_later
    assert len(on_storage) < 120
    # readers, cold or warm, and verify see every event
    rows = check_log(ReplicationLog.open(url))
    assert len(rows) == 1200
    check_key_order(rows)
    report = verify(ReplicationLog.open(url))
    assert report.ok, report.problems


def test_an_idle_reader_whose_commits_expired_reloads(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    writer = aged(url, 5)
    reader = ReplicationLog.open(url)
    assert reader.refresh().version >= 5
    for n in range(5, 45):
        writer.append(ten(n))
    time.sleep(1.2)
    for n in range(45, 110):
        writer.append(ten(n))
    writer.flush()
    assert not writer.storage.exists(commit_path(reader.state().version + 1))
    assert reader.refresh().version == writer.refresh().version
    assert sum(reader.read_table(s).num_rows for s in range(4)) == 1100


def test_nothing_expires_within_the_retention(tmp_path: Path) -> None:
    log = aged(str(tmp_path / "log"), 100, retention_ms=3_600_000)
    assert log.refresh().retained_from == 0
    assert log.storage.exists(commit_path(1))


# -- group commit ------------------------------------------------------------------------------


def test_group_commit_batches_threads_into_few_commits(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 8, auto_compact=False)
    outcomes: list[int] = []
    with GroupAppender(ReplicationLog.open(log.url), linger_ms=20) as appender:

        def caller(n: int) -> None:
            for i in range(5):
                record = appender.append(ten(n * 5 + i, prefix=f"t{n}-"))
                assert record is not None
                outcomes.append(record.version)

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        commits = appender.commits
    assert len(outcomes) == 80
    assert commits < 40  # 80 appends, grouped
    rows = check_log(ReplicationLog.open(log.url))
    assert len(rows) == 800
    check_key_order(rows)


def test_group_commit_tells_each_caller_its_own_outcome(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    with GroupAppender(log, linger_ms=50) as appender:
        good = appender.submit(ten(0))
        with pytest.raises(InvalidEventError, match="'data' is required"):
            appender.submit([{"key": "x"}])  # refused before it is queued
        once = appender.submit(ten(1), transaction=Transaction("app", 1))
        again = appender.submit(ten(2), transaction=Transaction("app", 1))
        assert good.result() is not None and once.result() is not None
        assert again.result() is None  # version 1 of "app" was already in
    assert len(check_log(ReplicationLog.open(log.url))) == 20


def test_a_sinks_positions_outlive_its_expired_commit(tmp_path: Path) -> None:
    """A replaced checkpoint resumes after what a linked sink wrote, from the positions in
    the sink's last commit. Retention may delete that commit (the sink idle, other writers
    busy): the positions live on with the sink's mark, or a micro-batch would be doubled."""
    from replog.checkpoints import consumers
    from replog.checkpoints.consumers import SinkLink
    from replog.checkpoints.sinks import Batch, SinkCommitter
    from replog.format.commits import SourcePosition
    from replog.format.events import events_from_records

    source = ReplicationLog.create(str(tmp_path / "a"), 2)
    for n in range(3):
        source.append(ten(n))
    target = short_retention_log(str(tmp_path / "b"), 2, 1000, snapshot_interval=20)
    position = SourcePosition(source.log_id, "mirror", {0: 11, 1: 13})
    consumers.write_link(source.storage, "mirror", SinkLink(target.url, target.log_id, "to-b"))
    staged = target.stage(events_from_records(ten(0)))
    SinkCommitter(target, "to-b").commit(Batch("q", 0, tuple(staged), sources=(position,)))
    sink_version = target.refresh().version
    for n in range(30):
        target.append(ten(n, prefix="other"))
    time.sleep(1.1)
    for n in range(60):
        target.append(ten(n, prefix="more"))
    target.flush()
    assert not target.storage.exists(commit_path(sink_version))  # expired
    resumed = consumers.resume_offsets(source, "mirror", {})
    assert resumed is not None and resumed.offsets == {0: 11, 1: 13}
