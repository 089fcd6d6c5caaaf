"""Key compaction (``replog compact --by-key``): below the cleaner point only the newest
event per key stays, no registered consumer misses a change, sequences keep their values
(holes), and readers, verify, rate limits and the Spark source handle the holes."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support.cli import replog
from support.logs import commit_offsets

from replog.core import files
from replog.core.files import DecodedFiles
from replog.errors import InvalidOptionError
from replog.log import ReplicationLog
from replog.ops import keys
from replog.ops.keys import compact_by_key
from replog.ops.verify import verify
from replog.planning import cap_events
from replog.spark.offsets import SparkOffset
from replog.spark.options import SourceOptions
from replog.spark.source import ReplogStreamReader
from replog.tables.changes import latest_events
from replog.timeutil import now_utc

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


def workload(seed: int, events: int, keys: int, start: int = 0) -> list[dict[str, Any]]:
    """Random inserts, updates and deletes over ``keys`` keys (old event times)."""
    rng = random.Random(seed)
    out = []
    for n in range(start, start + events):
        k = rng.randrange(keys)
        op = "delete" if rng.random() < 0.15 else "update"
        out.append(
            {
                "key": f"k{k}",
                "collection": "orders" if k % 3 else "users",
                "operation": op,
                "data": {"k": k, "n": n},
                "timestamp": T0 + timedelta(seconds=n),
            }
        )
    return out


def filled(url: str, commits: int = 30, per_commit: int = 20, keys: int = 15) -> ReplicationLog:
    log = ReplicationLog.create(url, 2, snapshot_interval=10, auto_compact=False)
    for c in range(commits):
        log.append(workload(c, per_commit, keys, start=c * per_commit))
    return log


def rows(table: pa.Table) -> list[tuple[int, int, str, str]]:
    """(shard, sequence, event id, operation) of every event read."""
    return list(
        zip(
            table.column("shard").to_pylist(),
            table.column("sequence").to_pylist(),
            table.column("event_id").to_pylist(),
            table.column("operation").to_pylist(),
            strict=True,
        )
    )


def final_state(table: pa.Table) -> dict[tuple[str | None, str], str]:
    """(collection, key) -> data of the newest event, deletes applied."""
    latest = latest_events([table])
    if latest is None:
        return {}
    return {
        (row["collection"], row["key"]): row["data"]
        for row in latest.select(["collection", "key", "data"]).to_pylist()
    }


def test_a_lagging_consumer_still_reads_every_change_after_its_offset(tmp_path: Path) -> None:
    log = filled(str(tmp_path / "log"))
    heads = log.refresh().heads
    lag = {shard: head // 2 for shard, head in enumerate(heads)}
    commit_offsets(log, "slow", lag)
    commit_offsets(log, "fast", dict(enumerate(heads)))
    after_lag = rows(log.read_all(start=lag))
    before = log.read_all()

    result = compact_by_key(log)

    assert result.cleaner_points == lag  # the slowest consumer, never past it
    assert result.record is not None and result.events_after < result.events_before
    reopened = ReplicationLog.open(log.url)
    assert rows(reopened.read_all(start=lag)) == after_lag  # every change after N, intact
    assert reopened.read_all().num_rows < before.num_rows
    assert verify(reopened).ok


def test_a_consumer_that_never_committed_holds_everything_back(tmp_path: Path) -> None:
    log = filled(str(tmp_path / "log"), commits=5)
    commit_offsets(log, "new", {})  # registered at the start: offsets 0
    before = rows(log.read_all())
    result = compact_by_key(log)
    assert result.record is None and result.cleaner_points == {0: 0, 1: 0}
    assert rows(ReplicationLog.open(log.url).read_all()) == before


def test_a_compacted_log_read_from_earliest_gives_the_same_final_state(tmp_path: Path) -> None:
    log = filled(str(tmp_path / "log"))
    before = log.read_all()
    heads = list(log.refresh().heads)

    first = compact_by_key(log)
    log.append(workload(99, 40, 15, start=10_000))  # more changes, then compact again
    more = log.read_all()
    second = compact_by_key(log)

    assert first.record is not None and second.record is not None
    reopened = ReplicationLog.open(log.url)
    after = reopened.read_all()
    assert final_state(after) == final_state(more) != final_state(before)
    # one event per key below the cleaner point, in the original order and sequences
    assert after.num_rows <= 15 * 2  # at most one event per (collection, key) per shard
    assert set(rows(after)) <= set(rows(more))
    assert reopened.refresh().heads[0] >= heads[0]
    assert verify(reopened).ok
    assert compact_by_key(reopened).record is None  # nothing superseded any more


def test_a_failure_planning_a_later_shard_leaves_no_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = filled(str(tmp_path / "log"))
    before = sorted((tmp_path / "log").rglob("*.arrow"))
    version = log.refresh().version
    plan_shard = keys._plan_shard

    def failing(*args: Any, **kwargs: Any) -> Any:
        if args[2] == 1:  # shard 0 was planned and written
            raise OSError("storage went away")
        return plan_shard(*args, **kwargs)

    monkeypatch.setattr(keys, "_plan_shard", failing)
    with pytest.raises(OSError, match="storage went away"):
        compact_by_key(log)
    assert sorted((tmp_path / "log").rglob("*.arrow")) == before
    assert log.refresh().version == version


def test_holed_entries_survive_segment_tables_and_later_merges(tmp_path: Path) -> None:
    log = filled(str(tmp_path / "log"))
    compact_by_key(log)
    compacted = rows(log.read_all())
    for c in range(25):  # past two segment tables, auto-merges on
        log.append(workload(200 + c, 5, 15, start=20_000 + 5 * c))
    writer = ReplicationLog.open(log.url)
    writer.append(workload(300, 5, 15, start=30_000))
    writer.flush()
    fresh = ReplicationLog.open(log.url)  # reads the newest table, holed entries included
    assert any(entry.holed for lane in fresh.refresh().segments for entry in lane)
    assert set(compacted) <= set(rows(fresh.read_all()))
    assert verify(fresh).ok


def test_deletes_older_than_keep_deletes_for_vanish_younger_ones_stay(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 1, auto_compact=False)
    now = now_utc()
    log.append(
        [
            {"key": "old", "data": {"v": 1}, "timestamp": now - timedelta(days=3)},
            {"key": "young", "data": {"v": 1}, "timestamp": now - timedelta(days=3)},
            {"key": "kept", "data": {"v": 1}, "timestamp": now - timedelta(days=3)},
        ]
    )
    log.append(
        [
            {"key": "old", "data": {}, "operation": "delete", "timestamp": now - timedelta(days=2)},
            {"key": "young", "data": {}, "operation": "delete", "timestamp": now},
            {"key": "kept", "data": {"v": 2}, "timestamp": now - timedelta(days=2)},
        ]
    )

    kept_all = compact_by_key(ReplicationLog.open(log.url), dry_run=True)
    assert kept_all.shards[0].events_after == 3  # without the option every delete stays
    result = compact_by_key(log, keep_deletes_for_ms=24 * 3600 * 1000)

    assert result.shards[0].deletes_dropped == 1
    after = ReplicationLog.open(log.url).read_all()
    found = zip(after.column("key").to_pylist(), after.column("operation").to_pylist(), strict=True)
    assert sorted(found) == [("kept", "insert"), ("young", "delete")]
    assert after.column("sequence").to_pylist() == [5, 6]  # sequences keep their values
    with pytest.raises(InvalidOptionError, match="--keep-deletes-for"):
        compact_by_key(log, keep_deletes_for_ms=-1)


def test_a_rate_limit_crosses_holes_at_full_rate_and_never_reads_more(tmp_path: Path) -> None:
    log = filled(str(tmp_path / "log"), commits=20, per_commit=30, keys=40)
    commit_offsets(log, "c", {shard: head - 100 for shard, head in enumerate(log.refresh().heads)})
    compact_by_key(log)
    log = ReplicationLog.open(log.url)
    state = log.refresh()
    expected = rows(log.read_all())
    position = {shard: low - 1 for shard, low in enumerate(state.lows)}
    target = dict(enumerate(state.heads))
    seen: list[tuple[int, int, str, str]] = []
    batches = 0
    while position != target:
        end = cap_events(position, target, 25, state, log.row_sequences)
        batch = rows(log.read_all(start=position, end=end))
        assert len(batch) <= 25
        seen.extend(batch)
        position, batches = end, batches + 1
    assert sorted(seen) == sorted(expected)
    assert batches <= len(expected) // 25 + 3  # holes cost nothing: batches are full


def test_a_holed_entrys_row_sequences_are_decoded_once_per_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning asks for them on every trigger that stops inside the entry: its file
    (up to 64 MB, more than DecodedFiles keeps of one file) is not decoded again."""
    log = filled(str(tmp_path / "log"), commits=10)
    compact_by_key(log)
    reader = ReplicationLog.open(log.url)
    reader._files = DecodedFiles(max_bytes=0)  # keeps no file, as for one past its limit
    entry = next(e for lane in reader.refresh().segments for e in lane if e.holed)
    decoded: list[str] = []
    decode = files.decode_file
    monkeypatch.setattr(
        files, "decode_file", lambda s, e, d: decoded.append(e.path) or decode(s, e, d)
    )
    found = reader.row_sequences(entry)
    assert reader.row_sequences(entry) is found and decoded == [entry.path]
    read = reader.read_table(entry.shard, entry.first_sequence, entry.last_sequence)
    assert found.tolist() == read.column("sequence").to_pylist() and len(found) < entry.sequences


def test_min_events_per_trigger_counts_events_not_sequences_across_holes(tmp_path: Path) -> None:
    """40 sequences compacted to 2 events are not 20 events waiting: the source holds the
    batch back until 20 events are there (the decision alone: no Spark session)."""
    log = ReplicationLog.create(str(tmp_path / "log"), 1, auto_compact=False)
    log.append([{"key": f"k{n % 2}", "data": {"n": n}} for n in range(40)])
    compact_by_key(log)  # no consumer: the whole range, two events kept
    assert log.refresh().events_between(0, 1, 40) == 2
    reader = ReplogStreamReader(
        SourceOptions.parse({"path": log.url, "minEventsPerTrigger": "20"}, streaming=True)
    )
    start = reader.initialOffset()
    limit = reader.getDefaultReadLimit()
    assert SparkOffset.from_json(reader.latestOffset(start, limit)).offsets == {0: 0}  # waits
    log.append([{"key": f"new{n}", "data": {"n": n}} for n in range(17)])
    assert SparkOffset.from_json(reader.latestOffset(start, limit)).offsets == {0: 0}  # 20 - 1
    log.append([{"key": "last", "data": {}}])
    assert SparkOffset.from_json(reader.latestOffset(start, limit)).offsets == {0: 58}


def test_bad_cli_options_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    log = filled(str(tmp_path / "log"), commits=3)
    version = log.refresh().version
    result = replog("compact", log.url, "--keep-deletes-for", "1d")
    assert result.returncode != 0 and "--keep-deletes-for needs --by-key" in result.stderr
    result = replog("compact", log.url, "--by-key", "--keep-deletes-for", "soon")
    assert result.returncode != 0 and "--keep-deletes-for" in result.stderr
    assert ReplicationLog.open(log.url).refresh().version == version
    result = replog("compact", log.url, "--by-key", "--json")
    document = json.loads(result.stdout)
    assert document["by_key"] and document["version"] == version + 1


# -- the Spark source on a holed log ------------------------------------------------------------


@pytest.mark.spark
def test_spark_reads_a_holed_log_with_offsets_and_max_events(spark: Any, tmp_path: Path) -> None:
    log = filled(str(tmp_path / "log"), commits=20, per_commit=30, keys=40)
    commit_offsets(log, "c", {shard: head - 60 for shard, head in enumerate(log.refresh().heads)})
    assert compact_by_key(log).record is not None
    expected = sorted((s, q) for s, q, _, _ in rows(log.read_all()))

    query = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", "30")
        .load(log.url)
        .writeStream.format("parquet")
        .option("path", str(tmp_path / "out"))
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    sizes = [p["numInputRows"] for p in query.recentProgress]
    streamed = sorted(
        (r["shard"], r["sequence"]) for r in spark.read.parquet(str(tmp_path / "out")).collect()
    )
    assert streamed == expected
    assert max(sizes) <= 30 and len(sizes) <= len(expected) // 30 + 3

    frame = (
        spark.read.format("replog")
        .option("startingOffsets", '{"0": 3, "1": 0}')
        .option("maxEventsPerPartition", "7")
        .load(log.url)
    )
    batch = sorted((r["shard"], r["sequence"]) for r in frame.collect())
    assert batch == [(s, q) for s, q in expected if s == 1 or q > 3]


def test_a_consumer_registered_while_compacting_misses_no_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer registered (``consumer set --create --to-earliest``) or reset back
    while a key compaction rewrites its ranges, which can take minutes, must find every
    event when it starts: the compaction must not commit cleaner points it read before."""
    log = filled(str(tmp_path / "log"))
    commit_offsets(log, "fast", dict(enumerate(log.refresh().heads)))
    before = rows(log.read_all())
    write_shard = keys._write_shard
    registered = []

    def write_and_register(*args: Any) -> Any:
        if not registered:
            commit_offsets(log, "new-replica", {})  # registered at the start: offsets 0
            registered.append(True)
        return write_shard(*args)

    monkeypatch.setattr(keys, "_write_shard", write_and_register)
    compact_by_key(log)
    assert registered
    assert rows(ReplicationLog.open(log.url).read_all()) == before
