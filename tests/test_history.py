"""Snapshots and the history behind them (replog.core.history): cheap, and damage-proof."""

import json
import logging
import random
from typing import Any

import pytest
from support.counting import CountingStorage, counting
from support.logcheck import check_log

from replog.core import history
from replog.format.commits import FORMAT_VERSION, commit_path
from replog.format.lanes import Lanes, apply_segments
from replog.format.sealed import seal, unseal
from replog.log import ReplicationLog
from replog.ops.compaction import compact
from replog.ops.retention import truncate
from replog.ops.verify import verify


def counting_log(url: str) -> CountingStorage:
    return counting(ReplicationLog.open(url).storage)


def grow(url: str, commits: int, snapshot_interval: int = 20) -> ReplicationLog:
    """A log of ``commits`` one-event appends (no automatic merges: versions = appends)."""
    log = ReplicationLog.create(url, 2, snapshot_interval=snapshot_interval, auto_compact=False)
    for i in range(commits):
        log.append([{"key": f"k{i % 3}", "data": {"i": i}}])
    return log


@pytest.mark.parametrize("commits", [9, 10, 19, 99, 137])
def test_a_cold_open_reads_a_bounded_number_of_files(memory_url: str, commits: int) -> None:
    grow(memory_url, commits, snapshot_interval=100)
    storage = counting_log(memory_url)
    state = ReplicationLog.from_storage(storage).refresh()
    assert state.version == commits
    requests = sum(n for kind, n in storage.counts.items() if kind != "commit read")
    # descriptor + hint + header + < 10 commits + their probes: never the whole history
    assert requests <= 25, storage.counts
    assert storage.counts.get("list", 0) == 0


@pytest.mark.parametrize("commits", [99, 199])
def test_a_cold_writer_at_a_table_version_reads_no_commits_before_its_header(
    memory_url: str, commits: int
) -> None:
    """The writer of a segment table takes the segments from the table below it plus
    the newest header's changes file, not from the commits in between."""
    grow(memory_url, commits, snapshot_interval=100)
    storage = counting_log(memory_url)
    cold = ReplicationLog.from_storage(storage)
    version = commits + 1
    cold.append([{"key": "last", "data": {"i": version}}])
    assert storage.exists(history.table_path(version))
    # the 9 commits after the newest header, read ahead in parallel (1+2+4+8 reads, the
    # last ones past the head): never the 90 commits before that header
    assert storage.counts["commit read"] <= 15, storage.counts
    # + descriptor, hint (twice: reading, moving it), header, table below, changes file
    assert storage.counts["read"] <= 21, storage.counts
    assert len(check_log(ReplicationLog.open(memory_url))) == version


def _lanes_from_commits(log: ReplicationLog, version: int) -> Lanes:
    lanes: Lanes = [[] for _ in range(log.shards)]
    for record in history.read_commits(log.storage, 1, version):
        apply_segments(lanes, record)
    return lanes


def test_checkpoints_hold_the_segments_the_commits_add_up_to(memory_url: str) -> None:
    """Appends, compactions and truncations, by a warm writer and by cold ones: every
    checkpoint's segments (table, or table plus changes) equal the commits' sum."""
    rng = random.Random(7)
    log = ReplicationLog.create(memory_url, 3, snapshot_interval=20)
    writer = log
    while writer.refresh().version < 95:
        action = rng.random()
        if action < 0.1:
            writer = ReplicationLog.open(memory_url)  # a restarted, cold writer
        elif action < 0.2:
            compact(writer)
        elif action < 0.28:
            heads = writer.refresh().heads
            truncate(writer, {s: max(heads[s] - 3, 1) for s in range(3)}, force=True)
        else:
            writer.append([{"key": f"k{rng.randint(0, 9)}", "data": {"n": n}} for n in range(9)])
    last = writer.refresh().version
    snapshots = history.LogSnapshots(log.storage, log.descriptor)
    for version in range(10, last + 1, 10):
        assert snapshots.segments(version) == _lanes_from_commits(log, version), version
    fresh = ReplicationLog.open(memory_url)
    assert fresh.refresh().segments == _lanes_from_commits(log, last)
    assert verify(fresh).ok


def test_a_damaged_or_missing_changes_file_falls_back_to_the_commits(
    memory_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    log = grow(memory_url, 35)
    log.storage.write(history.changes_path(30), b"not arrow")
    expected = _lanes_from_commits(log, 35)
    with caplog.at_level(logging.WARNING):
        fresh = ReplicationLog.open(memory_url)
        assert fresh.refresh().segments == expected
    assert history.changes_path(30) in caplog.text
    assert [p.path for p in verify(fresh).problems] == [log.storage.path(history.changes_path(30))]
    # A writer at a table version falls back the same way and still writes a good table.
    for i in range(5):
        fresh.append([{"key": "more", "data": {"i": i}}])
    assert history.LogSnapshots(log.storage, log.descriptor).segments(40) == _lanes_from_commits(
        log, 40
    )


def test_headers_without_changes_files_are_read_from_the_commits(memory_url: str) -> None:
    """Logs written before changes files existed: their headers name none."""
    log = grow(memory_url, 38)
    for version in (10, 30):
        relative = history.header_path(version)
        body = unseal(log.storage.read(relative), relative, max_version=FORMAT_VERSION)
        del body["changes"]
        log.storage.write(relative, seal(body))
        log.storage.delete(history.changes_path(version))
    fresh = ReplicationLog.open(memory_url)
    assert fresh.refresh().segments == _lanes_from_commits(log, 38)
    assert verify(fresh).ok
    fresh.append([{"key": "more", "data": {"i": 1}}, {"key": "most", "data": {"i": 2}}])
    fresh.append([{"key": "more", "data": {"i": 3}}])  # version 40: a table
    assert len(check_log(ReplicationLog.open(memory_url))) == 41


def test_a_long_running_writer_keeps_a_bounded_history(memory_url: str) -> None:
    """A writer that never reads segments must not keep every commit it applied."""
    log = grow(memory_url, 3, snapshot_interval=20)
    writer = ReplicationLog.open(memory_url)
    for i in range(120):
        writer.append([{"key": "k", "data": {"i": i}}])
    state = writer.state()
    assert len(state._since_base) <= 2 * log.descriptor.snapshot_interval
    assert state.segments == _lanes_from_commits(log, state.version)


def test_a_damaged_segment_table_falls_back_to_an_older_one(memory_url: str) -> None:
    log = grow(memory_url, 45)
    log.storage.write(history.table_path(40), b"not arrow")
    fresh = ReplicationLog.open(memory_url)
    rows = check_log(fresh)  # segments: table 20 + commits 21..45
    assert len(rows) == 45
    problems = verify(fresh).problems
    assert [p.path for p in problems] == [log.storage.path(history.table_path(40))]


def test_missing_tables_and_headers_fall_back_to_the_commits(memory_url: str) -> None:
    log = grow(memory_url, 45)
    for version in (20, 40):
        log.storage.delete(history.table_path(version))
    log.storage.write(history.header_path(40), b"{torn")
    fresh = ReplicationLog.open(memory_url)
    assert fresh.refresh().version == 45
    assert len(check_log(fresh)) == 45
    paths = {p.path for p in verify(fresh).problems}
    assert paths == {
        log.storage.path(history.table_path(20)),
        log.storage.path(history.header_path(40)),
    }


def test_a_lost_hint_is_found_again_by_probing(memory_url: str) -> None:
    log = grow(memory_url, 33)
    log.storage.delete(history.SNAPSHOT_HINT_PATH)
    storage = counting_log(memory_url)
    assert ReplicationLog.from_storage(storage).refresh().version == 33
    # descriptor, hint, header 30 and one window of 10 commits after it: not all 33
    assert storage.counts["read"] <= 13


def test_the_hint_carries_the_header_it_names(memory_url: str) -> None:
    """A cold open takes the newest header from the hint's sealed copy (one request
    fewer); a copy whose seal does not hold is ignored and the header file read."""
    grow(memory_url, 35)
    storage = counting_log(memory_url)
    assert ReplicationLog.from_storage(storage).refresh().version == 35
    assert storage.matching("read", "/snapshots/") == 0
    # descriptor, hint, commits 31..36 (one by one here; a parallel window on S3), and
    # commit 35 again: still the one applied (not expired meanwhile)
    assert storage.counts["read"] == 9, storage.counts
    hint = json.loads(storage.read(history.SNAPSHOT_HINT_PATH))
    assert hint["version"] == 30 and hint["copy"]["version"] == 30
    hint["copy"]["heads"]["0"] += 1  # its seal no longer holds
    storage.write(history.SNAPSHOT_HINT_PATH, json.dumps(hint).encode())
    storage.requests.clear()
    state = ReplicationLog.from_storage(storage).refresh()
    assert dict(enumerate(state.heads)) == ReplicationLog.open(memory_url).head()
    assert storage.matching("read", "/snapshots/") == 1
    # A sound copy of another header (20) under the hint's 30 is not taken for header 30.
    hint["copy"] = json.loads(storage.read(history.header_path(20)))
    storage.write(history.SNAPSHOT_HINT_PATH, json.dumps(hint).encode())
    storage.requests.clear()
    state = ReplicationLog.from_storage(storage).refresh()
    assert state.version == 35 and storage.matching("read", "/snapshots/00000000000000000030")
    # 31..36 and 35 again (the one applied?), not 21..36
    assert storage.counts["commit read"] == 7, storage.counts


def test_a_hint_moved_back_by_a_slow_writer_costs_one_window(memory_url: str) -> None:
    """The hint is not probed past up front; a full window of commits after it reveals
    that it lags, and the newest header is found then, not the commits in between."""
    grow(memory_url, 45)
    ReplicationLog.open(memory_url).storage.write(history.SNAPSHOT_HINT_PATH, b'{"version": 10}')
    storage = counting_log(memory_url)
    state = ReplicationLog.from_storage(storage).refresh()
    assert (
        state.version == 45
        and dict(enumerate(state.heads)) == ReplicationLog.open(memory_url).head()
    )
    # commits 11..20 (a full window reveals the lag), then 41..46 after header 40, and 45
    # again (still the commit applied)
    assert storage.counts["commit read"] == 17, storage.counts


def test_verify_checks_every_checksummed_file(memory_url: str) -> None:
    from replog.checkpoints.consumers import OffsetCommitter, consumer_store
    from replog.checkpoints.store import manifest_name

    log = grow(memory_url, 35)
    OffsetCommitter(log, "reader", "test-run").commit({0: 1, 1: 1}, log_version=35, note="test")
    report = verify(log)
    assert report.ok and report.commits == 35 and report.snapshots == 3
    assert report.manifests == 1 and report.events == 35
    store = consumer_store(log, "reader")
    damaged = [
        (log.storage, commit_path(7)),
        (log.storage, history.header_path(10)),
        (log.storage, history.table_path(20)),
        (log.storage, history.changes_path(30)),
        (store.storage, manifest_name(1)),
    ]
    for storage, relative in damaged:
        data = bytearray(storage.read(relative))
        data[len(data) // 2] ^= 0x01
        storage.write(relative, bytes(data))
    found = {p.path for p in verify(log).problems}
    assert found == {storage.path(relative) for storage, relative in damaged}


def test_a_changes_file_that_lost_a_segment_fails_reads_loudly(memory_url: str) -> None:
    """A changes file that is well-formed and checksummed but misses a segment (a writer
    bug, a bad restore) must not make readers skip its events quietly."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyarrow import ipc

    from replog.errors import CorruptionError
    from replog.format.segments import sha256_hex

    log = grow(memory_url, 35)
    relative = history.changes_path(30)
    table = ipc.open_file(pa.BufferReader(log.storage.read(relative))).read_all()
    assert table.column("change")[0].as_py() == "added"  # rows: added segments first
    table = table.filter(pc.field("path") != table.column("path")[0].as_py())
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = bytes(sink.getvalue())
    log.storage.write(relative, data)
    header = unseal(log.storage.read(history.header_path(30)), "header", max_version=FORMAT_VERSION)
    header["changes"]["sha256"] = sha256_hex(data)
    log.storage.write(history.header_path(30), seal(header))
    log.storage.write(history.SNAPSHOT_HINT_PATH, b'{"version": 30}')  # no stale copy
    with pytest.raises(CorruptionError, match="no live segment holds sequence"):
        check_log(ReplicationLog.open(memory_url))
    problems = verify(ReplicationLog.open(memory_url)).problems
    assert len(problems) == 1 and "differ from the commits" in problems[0].message


def test_a_checkpoint_whose_table_below_was_never_written_still_gets_its_header(
    memory_url: str,
) -> None:
    """The writer of version 20 crashed before its checkpoint: later headers in that
    interval cannot name a table, but must still be written (they make finding the
    head cheap), and readers take the segments from the commits."""
    log = grow(memory_url, 25)
    for relative in (history.table_path(20), history.header_path(20)):
        log.storage.delete(relative)
    log.storage.write(history.SNAPSHOT_HINT_PATH, b'{"version": 10}')  # as the crash left it
    writer = ReplicationLog.open(memory_url)
    for i in range(10):
        writer.append([{"key": "late", "data": {"i": i}}])
    assert log.storage.exists(history.header_path(30))
    assert "changes" not in unseal(
        log.storage.read(history.header_path(30)), "header", max_version=FORMAT_VERSION
    )
    fresh = ReplicationLog.open(memory_url)
    assert fresh.refresh().segments == _lanes_from_commits(log, 35)
    assert len(check_log(fresh)) == 35


def test_a_writer_behind_another_reads_the_others_commit_twice_at_most(s3: Any) -> None:
    """On S3, writer A appends after writer B committed: A's refresh applies B's commit
    and, finding nothing after it, reads it again after the miss (the proof that the next
    slot was never written). Nothing more: no third read after A's put (it was read
    alongside the miss in a second round, which proves no order, and re-read after)."""
    url, options = s3.url("log"), s3.storage_options
    ReplicationLog.create(url, 2, auto_compact=False, storage_options=options)
    a = ReplicationLog.open(url, auto_compact=False, storage_options=options)
    b = ReplicationLog.open(url, auto_compact=False, storage_options=options)
    a.append([{"key": "a", "data": {}}])
    for n in range(3):
        b.append([{"key": f"b{n}", "data": {}}])  # commits 2..4
    a.storage = counting(a.storage)
    record = a.append([{"key": "a", "data": {}}])
    assert record is not None and record.version == 5
    assert isinstance(a.storage, CountingStorage)
    reads = {v: a.storage.matching("read", commit_path(v)) for v in (2, 3, 4)}
    assert reads[4] <= 2, reads
