"""status, truncate, recover and compact: the core functions and the CLI commands."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from clirun import replog
from logcheck import check_key_order, check_log, run_concurrently
from test_sink_protocol import leave_pending

from replog import compaction, consumers, recovery, retention, status
from replog.errors import CorruptionError, DataLossError, RetentionError
from replog.events import events_from_records
from replog.log import ReplicationLog, read_segment
from replog.records import COMPACT, CommitRecord, WriterInfo, commit_path
from replog.sink_protocol import SinkCommitter


def filled_log(
    url: str,
    commits: int = 4,
    per_commit: int = 40,
    shards: int = 2,
    storage_options: dict | None = None,
) -> ReplicationLog:
    log = ReplicationLog.create(url, shards, storage_options=storage_options)
    for c in range(commits):
        log.append(
            [{"key": f"k{i % 7}", "data": {"n": c * per_commit + i}} for i in range(per_commit)]
        )
    return log


def segment_files(log: ReplicationLog) -> set[str]:
    return {
        f"shards/{lane}/{name}"
        for lane in log.storage.list("shards")
        for name in log.storage.list(f"shards/{lane}")
    }


def backdate(log: ReplicationLog, relative: str, seconds: float) -> None:
    """Age a local file (only garbage collection looks at file times)."""
    path = log.storage.path(relative)
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


# -- truncate ------------------------------------------------------------------------------


def test_truncate_refuses_to_drop_unconsumed_events_and_changes_nothing(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"))
    consumers.commit_offsets(log, "etl", {0: 10, 1: 5}, epoch=1)
    version = log.refresh().version
    with pytest.raises(RetentionError) as caught:
        retention.truncate(log, {0: 20, 1: 3})
    message = str(caught.value)
    assert "consumer 'etl'" in message and "shard 0" in message and "up to sequence 10" in message
    assert "Nothing was changed" in message
    assert log.refresh().version == version and log.state().lows == [1, 1]
    # Up to what the consumer committed is allowed.
    plan, record = retention.truncate(log, {0: 11, 1: 6})
    assert record is not None and record.low_watermarks == {0: 11, 1: 6}
    assert plan.total_dropped == 15
    assert ReplicationLog.open(log.url).state().lows == [11, 6]


def test_truncate_consumed_drops_only_what_every_consumer_committed(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=3)
    heads = log.head()
    consumers.commit_offsets(log, "fast", {0: heads[0], 1: heads[1]}, epoch=1)
    consumers.commit_offsets(log, "slow", {0: 12, 1: heads[1]}, epoch=1)
    assert retention.consumed_lows(log) == {0: 13, 1: heads[1] + 1}
    _, record = retention.truncate(log, retention.consumed_lows(log))
    assert record is not None
    # Whole segments below the low leave the log; the straddling one stays, read from 13.
    assert all(s.last_sequence < 13 for s in record.remove if s.shard == 0)
    rows = check_log(log)
    assert min(r["sequence"] for r in rows if r["shard"] == 0) == 13
    assert not [r for r in rows if r["shard"] == 1]
    with pytest.raises(DataLossError, match="shard 0: events from sequence 1"):
        list(log.read(0, 1))


def test_truncate_with_no_consumers_keeps_everything_and_force_overrides(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=2)
    assert retention.consumed_lows(log) == {0: 1, 1: 1}
    assert retention.truncate(log, retention.consumed_lows(log))[1] is None
    consumers.commit_offsets(log, "idle", {}, epoch=0)
    _, record = retention.truncate(log, {0: 5}, force=True)
    assert record is not None and log.state().lows[0] == 5


def test_truncate_older_than_uses_event_times(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    log.append([{"key": "a", "data": 1, "timestamp": "2020-01-01T00:00:00Z"}] * 3)
    log.append([{"key": "a", "data": 2, "timestamp": "2030-01-01T00:00:00Z"}] * 2)
    cutoff = int(time.time() * 1000)
    assert retention.lows_older_than(log.refresh(), cutoff) == {0: 4}


def test_truncate_rejects_a_low_past_the_head(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1)
    with pytest.raises(ValueError, match="shard 1 cannot keep from sequence 999"):
        retention.truncate(log, {1: 999})
    with pytest.raises(ValueError, match="shard 5 does not exist"):
        retention.truncate(log, {5: 1})


# -- compact ---------------------------------------------------------------------------------


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
    # A reader that resumes mid-way through a merged segment gets exactly the rest.
    tail = reopened.read_table(0, 17)
    assert tail.column("sequence").to_pylist() == list(range(17, log.head()[0] + 1))
    assert compaction.compact(reopened).record is None  # nothing left to merge


def test_compaction_respects_target_size(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=6, shards=1)
    sizes = [s.bytes for s in log.refresh().segments[0]]
    result = compaction.compact(log, target_bytes=sum(sizes[:3]))
    assert [len(m.sources) for m in result.merges] == [3, 3]
    assert log.refresh().segment_count == 2


def test_compaction_under_concurrent_appends_and_readers(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=10)
    reader = ReplicationLog.open(log.url)
    planned = reader.refresh().covering(0, 1, reader.head()[0])  # a plan made before
    appended: list[int] = []

    def append_more() -> None:
        writer = ReplicationLog.open(log.url)
        for c in range(10, 20):
            writer.append([{"key": f"k{i % 7}", "data": {"n": c * 40 + i}} for i in range(40)])
            appended.append(c)

    def compact_twice() -> None:
        for _ in range(2):
            compaction.compact(ReplicationLog.open(log.url))

    run_concurrently(append_more, compact_twice)
    rows = check_log(ReplicationLog.open(log.url))
    assert len(rows) == 20 * 40 and len(appended) == 10
    check_key_order(rows)
    # Files a reader planned on before the compaction are still there to read.
    for segment in planned:
        assert sum(b.num_rows for b in read_segment(reader.storage, segment, 1, 10**9)) > 0


def test_a_compaction_that_does_not_cover_its_sources_is_rejected(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=2, shards=1)
    state = log.refresh()
    first, second = state.segments[0]
    bad = CommitRecord(
        version=state.version + 1,
        timestamp_ms=1,
        operation=COMPACT,
        add=(first,),
        remove=(first, second),
    )
    log.storage.put_if_absent(commit_path(bad.version), bad.to_bytes())
    with pytest.raises(CorruptionError, match="do not cover exactly"):
        ReplicationLog.open(log.url).refresh()


# -- recover ---------------------------------------------------------------------------------


def test_recover_resolves_a_pending_commit_left_by_a_crash(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1)
    committer = SinkCommitter(log, "orders-sink")
    committer.commit("query-1", 0, log.stage(log_rows(10)))
    # A crash after Pending: the manifest says Pending, the log never got the commit.
    staged = log.stage(log_rows(10, start=10))
    leave_pending(committer, "query-1", 1, staged)

    young = recovery.recover(log)  # default grace: a live driver may be committing
    assert young.pending_too_recent == {"orders-sink": 1} and not young.resolved
    assert all(log.storage.exists(s.path) for s in staged)

    preview = recovery.recover(log, grace_ms=0, dry_run=True)
    assert preview.resolved["orders-sink"].committed is False
    assert (
        consumers.sink_store(log, "orders-sink")
        .load_latest()
        .sink_commit_statuses["orders-sink"]
        .is_pending
    )

    report = recovery.recover(log, grace_ms=0)
    assert report.resolved["orders-sink"].committed is False
    manifest = consumers.sink_store(log, "orders-sink").load_latest()
    assert manifest.sink_commit_statuses["orders-sink"].is_failed
    assert manifest.sink_epochs["orders-sink"] == 0
    assert not any(log.storage.exists(s.path) for s in staged)
    # The replayed epoch then commits normally, once.
    committer = SinkCommitter(ReplicationLog.open(log.url), "orders-sink")
    committer.commit("query-1", 1, committer.log.stage(log_rows(10, start=10)))
    assert len(check_log(committer.log)) == 40 + 20


def test_recover_marks_committed_when_the_log_holds_the_epoch(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1)
    committer = SinkCommitter(log, "s")
    committer.commit("q", 0, log.stage(log_rows(5)))
    staged = log.stage(log_rows(5, start=5))
    leave_pending(committer, "q", 1, staged)
    log.commit_staged(staged, writer=WriterInfo("s", "q", 1))  # the log commit made it
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
    assert len(check_log(log)) == 120
    assert not log.verify()


# -- status ----------------------------------------------------------------------------------


def test_status_reports_lag_age_and_sinks(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    log.append(
        [{"key": f"k{i}", "data": i, "timestamp": "2026-01-01T00:00:00Z"} for i in range(20)]
    )
    log.append([{"key": f"k{i}", "data": i} for i in range(20)])
    SinkCommitter(log, "mirror").commit("q-7", 3, log.stage(log_rows(4)))
    heads = log.head()
    consumers.commit_offsets(log, "caught-up", {0: heads[0], 1: heads[1]}, epoch=2)
    consumers.commit_offsets(log, "behind", {0: 1, 1: 0}, epoch=1)
    report = status.log_status(log)
    by_name = {c["name"]: c for c in report["consumers"]}
    assert by_name["caught-up"]["total_lag"] == 0
    assert by_name["caught-up"]["oldest_unconsumed_ms"] is None
    assert by_name["behind"]["total_lag"] == sum(log.head().values()) - 1
    # The next unconsumed events are from the first append: 2026-01-01.
    assert by_name["behind"]["oldest_unconsumed_ms"] == 1767225600000
    [sink] = report["sinks"]
    assert sink["sink_id"] == "mirror" and sink["epoch"] == 3 and sink["status"] == "Committed"
    assert sink["query_id"] == "q-7" and sink["log_epoch"] == 3


# -- the commands --------------------------------------------------------------------------


def run_operator_commands(
    url: str, storage_options: dict | None = None, fs_args: tuple[str, ...] = ()
) -> None:
    """Every operator command against one log, through the installed ``replog`` script."""
    log = filled_log(url, commits=4, storage_options=storage_options)
    consumers.commit_offsets(log, "etl", {0: 8, 1: 8}, epoch=1)
    shown = replog("status", url, *fs_args)
    assert shown.returncode == 0 and "etl" in shown.stdout and "lag" in shown.stdout
    report = json.loads(replog("status", url, "--json", *fs_args).stdout)
    assert report["consumers"][0]["name"] == "etl"

    refused = replog("truncate", url, "--keep-from", '{"0": 30}', *fs_args)
    assert refused.returncode == 2 and "consumer 'etl'" in refused.stderr
    assert log.refresh().lows == [1, 1]
    dry = replog("truncate", url, "--keep-from", '{"0": 30}', "--dry-run", *fs_args)
    assert dry.returncode == 1 and "BLOCKED" in dry.stdout and "--force" in dry.stdout
    done = replog("truncate", url, *fs_args)  # what every consumer committed
    assert done.returncode == 0, done.stderr
    assert log.refresh().lows == [9, 9]
    forced = replog("truncate", url, "--keep-from", '{"0": 30}', "--force", *fs_args)
    assert forced.returncode == 0 and log.refresh().lows[0] == 30
    bad = replog("truncate", url, "--older-than", "soon", *fs_args)
    assert bad.returncode == 2 and "--older-than: 'soon' is not a duration" in bad.stderr

    compacted = replog("compact", url, *fs_args)
    assert compacted.returncode == 0 and "merged" in compacted.stdout, compacted.stderr
    assert log.refresh().segment_count == 2
    kept = replog("recover", url, *fs_args)
    assert kept.returncode == 0 and "deleted 0 garbage" in kept.stdout
    collected = replog("recover", url, "--grace", "0", *fs_args)
    assert collected.returncode == 0 and "deleted 8 garbage" in collected.stdout
    assert replog("verify", url, *fs_args).returncode == 0
    assert len(check_log(log)) == 160 - 29 - 8  # shard 0 keeps from 30, shard 1 from 9


def test_operator_commands(tmp_path: Path) -> None:
    run_operator_commands(str(tmp_path / "log"))


def log_rows(count: int, start: int = 0):
    return events_from_records(
        [{"key": f"s{i}", "data": {"n": i}} for i in range(start, start + count)]
    )
