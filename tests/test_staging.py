"""Staging as the Spark sink does it: rows routed batch by batch, files written in turn,
and what replog does for the Python processes Spark starts for it."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyarrow import ipc
from support.logcheck import check_key_order, check_log

from replog.core import files
from replog.format.arrays import strings
from replog.format.events import events_from_records
from replog.log import ReplicationLog
from replog.spark import workers
from replog.storage import Storage
from replog.storage.faults import FaultInjector, FaultRates, FaultyStorage


def events(count: int, keys: int = 97, pad: int = 200) -> pa.Table:
    return events_from_records(
        {"key": f"k{n % keys}", "data": {"n": n, "pad": "x" * pad}} for n in range(count)
    )


def fed_in_batches(log: ReplicationLog, table: pa.Table, rows: int, **limits: Any) -> list[Any]:
    routed = files.RoutedRows(log.shards)
    for batch in table.to_batches(max_chunksize=rows):
        routed.add(batch)
    return files.stage_routed(log.storage, routed, **limits)


def file_rows(log: ReplicationLog, path: str) -> tuple[pa.Table, int]:
    reader = ipc.open_file(pa.BufferReader(log.storage.read(path)))
    return reader.read_all(), reader.num_record_batches


def test_rows_fed_batch_by_batch_are_staged_as_one_table_would_be(tmp_path: Path) -> None:
    table = events(20_000)  # ~5 MB: a file per shard
    one = ReplicationLog.create(str(tmp_path / "one"), 4)
    fed = ReplicationLog.create(str(tmp_path / "fed"), 4)
    whole = one.stage(table)
    pieces = fed_in_batches(fed, table, 1_000)
    assert [(s.shard, s.events, s.offset) for s in pieces] == [
        (s.shard, s.events, s.offset) for s in whole
    ]
    for mine, theirs in zip(pieces, whole, strict=True):
        rows, batches = file_rows(fed, mine.path)
        assert batches == 1  # the 20 pieces of a shard were joined: readers get full batches
        assert rows.equals(file_rows(one, theirs.path)[0])
        assert "shared" not in mine.path and mine.path.startswith(f"shards/{mine.shard:05d}/")
    fed.commit_staged(pieces)
    rows = check_log(ReplicationLog.open(fed.url))
    assert len(rows) == 20_000
    check_key_order(rows)


def test_a_small_write_fed_in_batches_is_one_shared_file(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 8)
    staged = fed_in_batches(log, events(300, pad=10), 7)
    assert len({s.path for s in staged}) == 1 and staged[0].path.startswith("shards/shared/")
    assert [s.offset for s in staged] == sorted(s.offset for s in staged)
    assert sum(s.bytes for s in staged) == len(log.storage.read(staged[0].path))
    log.commit_staged(staged)
    rows = check_log(ReplicationLog.open(log.url))
    assert len(rows) == 300
    check_key_order(rows)


def test_a_shard_bigger_than_a_file_is_cut_in_order(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    staged = fed_in_batches(log, events(6_000, keys=5), 500, max_bytes=300_000, shared_bytes=0)
    per_shard: dict[int, int] = {}
    for segment in staged:
        per_shard[segment.shard] = per_shard.get(segment.shard, 0) + 1
    assert all(count >= 3 for count in per_shard.values()), per_shard
    for segment in staged:
        rows, _ = file_rows(log, segment.path)
        assert rows.nbytes < 2 * 300_000
    log.commit_staged(staged)
    rows = check_log(ReplicationLog.open(log.url))
    assert len(rows) == 6_000
    check_key_order(rows)


def test_a_failed_write_leaves_none_of_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 8)
    real = Storage.put_if_absent
    calls: list[str] = []

    def failing(self: Storage, relative: str, data: Any, **kwargs: Any) -> None:
        calls.append(relative)
        if len(calls) == 5:
            raise OSError("disk full")
        real(self, relative, data, **kwargs)

    monkeypatch.setattr(Storage, "put_if_absent", failing)
    with pytest.raises(OSError, match="disk full"):
        fed_in_batches(log, events(20_000), 2_000)
    assert len(calls) >= 5
    left = [p for p in (tmp_path / "log" / "shards").rglob("*") if p.is_file()]
    assert left == []


def test_strings_are_what_pyarrow_builds() -> None:
    for values in (["insert", "update"], [], ["", "é", "日本", "x" * 1000]):
        assert strings(values).equals(pa.array(values, pa.string()))


def test_replog_planning_does_not_import_pandas(tmp_path: Path) -> None:
    """Spark starts a Python process per streaming query to plan it: pandas (which
    pyarrow imports on its first ``pa.array``) would cost it ~130 ms and a larger heap."""
    log = ReplicationLog.create(str(tmp_path / "log"), 4)
    log.append(events(100, pad=10))
    script = textwrap.dedent(
        f"""
        import json, sys
        from pyspark.sql.streaming.datasource import ReadAllAvailable
        from replog.spark.options import SourceOptions
        from replog.spark.source import ReplogStreamReader
        from replog.spark.sink import ReplogSinkDataSource
        options = {{"path": {log.url!r}, "startingOffsets": "earliest"}}
        reader = ReplogStreamReader(SourceOptions.parse(options, streaming=True))
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        reader.partitions(start, end)
        reader.commit(end)
        print(json.dumps("pandas" in sys.modules))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) is False


def test_settle_freezes_a_spark_workers_objects_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "_settled", False)
    monkeypatch.setattr(workers, "in_spark_worker", lambda: True)
    assert gc.get_freeze_count() == 0
    try:
        workers.settle()
        frozen = gc.get_freeze_count()
        assert frozen > 1000
        kept = [[] for _ in range(100)]  # tracked objects alive at the second call
        workers.settle()
        # Not frozen again (frozen objects freed meanwhile may lower the count).
        assert gc.get_freeze_count() <= frozen
        del kept
    finally:
        gc.unfreeze()


def test_settle_leaves_other_processes_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "_settled", False)
    assert not workers.in_spark_worker()  # pytest's __main__
    workers.settle()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("fault", ["retried_create", "lost_response"])
def test_files_whose_writes_landed_unseen_are_staged_once(tmp_path: Path, fault: str) -> None:
    """Every create answers as if it failed after landing: each file is read back and
    found to hold exactly what was written (the bytes compared, high bits included)."""
    log = ReplicationLog.create(str(tmp_path / "log"), 4)
    injector = FaultInjector(seed=3, rates=FaultRates.only(**{fault: 1.0}))
    blind = ReplicationLog.from_storage(FaultyStorage.wrap(log.storage, injector))
    staged = fed_in_batches(blind, events(20_000), 2_000)
    assert injector.faults and len({s.path for s in staged}) == 4
    log.commit_staged(staged)
    assert len(check_log(ReplicationLog.open(log.url))) == 20_000
