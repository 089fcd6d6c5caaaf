"""As-of reads (issue 42): ``table_as_of`` on a 1M-row table at points 1k, 100k and 1M
changes after the nearest Delta version, beside a plain read of that version.

The table is built by ``apply_batch`` (the core of ``apply_changes``) from a log of 1M
inserts (one Delta version, its commit recording what it covers); then 1M updates of
random keys are appended to the log in transactions of 1,000 events, each with its commit
LSN, so that the version lies 1k, 100k or 1M changes before the points read. Printed per
point: the events after the version, the time of ``table_as_of`` (to a counted
DataFrame) and of its core (``read_rows``: the version read, the events typed in one
Spark job, the reduction), beside the plain Delta read (delta-rs scan, and Spark's
DataFrame of it) and Spark's own Parquet source over the version's files (one version
written at once: no deletion vectors, its files are the table).

Run: PYSPARK_PYTHON=.venv/bin/python nice .venv/bin/python benchmarks/bench_as_of.py
[--rows 1000000] [--points 1000,100000,1000000] [--no-scd2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
from pyspark.sql import SparkSession

from replog.log import ReplicationLog
from replog.spark.as_of import frame_of, read_rows, table_as_of
from replog.tables import as_of
from replog.tables import coverage as covered
from replog.tables.changes import OPERATION, SEQUENCE, SHARD, SOURCE_POSITION, TIMESTAMP
from replog.tables.delta import apply_batch, open_table, read_table

COLLECTION = "bench.items"
SCHEMA = "id long, name string, price double"
TXN = 1_000
T0 = 1_735_689_600_000
LSN0 = 0x1000_0000


def events(ids: np.ndarray, first_txn: int, operation: str) -> list[dict[str, Any]]:
    """Events of ``ids`` in transactions of :data:`TXN`, numbered from ``first_txn``."""
    found = []
    for index, key in enumerate(ids.tolist()):
        txn = first_txn + index // TXN
        lsn = LSN0 + txn * 4096
        found.append(
            {
                "collection": COLLECTION,
                "key": f'{{"id":{key}}}',
                "operation": operation,
                "data": f'{{"id":{key},"name":"n-{key}-{txn}","price":{txn}.5}}',
                "timestamp": T0 + txn,
                "metadata": (
                    f'{{"op":"u","source":{{"lsn":{lsn}}},"transaction":{{"id":"{txn}:{lsn}"}}}}'
                ),
            }
        )
    return found


def append(log: ReplicationLog, found: list[dict[str, Any]]) -> None:
    for start in range(0, len(found), 200_000):
        log.append(found[start : start + 200_000])


def changes_of(log: ReplicationLog, read: pa.Table | None = None) -> pa.Table:
    """The log's events (or ``read``, some of them) as ``apply_batch`` takes them (rows
    parsed from ``data``; each event's source position)."""
    read = log.read_all() if read is None else read
    rows = pj.read_json(pa.BufferReader(b"\n".join(read.column("data").to_pylist())))
    return (
        rows.select(["id", "name", "price"])
        .cast(pa.schema([("id", pa.int64()), ("name", pa.string()), ("price", pa.float64())]))
        .append_column(SHARD, read.column("shard"))
        .append_column(SEQUENCE, read.column("sequence"))
        .append_column(OPERATION, read.column("operation"))
        .append_column(TIMESTAMP, read.column("timestamp"))
        .append_column(SOURCE_POSITION, covered.event_positions(read.column("metadata")))
    )


def coverage_of(
    log: ReplicationLog, read: pa.Table, offsets: dict[int, int], mode: str
) -> covered.Coverage:
    """What a batch of the events ``read`` covers, the log applied up to ``offsets``."""
    span = covered.Span.of(
        covered.event_positions(read.column("metadata")),
        covered.event_times(read.column("timestamp")),
    )
    return covered.Coverage(offsets, span, log.log_id, COLLECTION, ("id",), mode, SCHEMA)


def scd2_reads(spark: SparkSession, log: ReplicationLog, root: str, inserted: dict[int, int],
               loaded: int) -> None:  # fmt: skip
    """An scd2 table of the 1M inserts (version 0) and the first 2,000 updates (version
    1), read as of the end of the first 1,000: from version 1's history cut at the point
    (its rows' validity positions), and from version 0 with the 1,000 events after it."""
    target = str(Path(root) / "items_scd2")
    first = log.read_all(None, inserted)
    apply_batch(target, changes_of(log, first), ["id"], app_id="bench", batch_id=0,
                mode="scd2", coverage=coverage_of(log, first, inserted, "scd2"))  # fmt: skip
    del first
    lsn = LSN0 + loaded * 4096  # the first update transaction's commit LSN
    updates = log.read_all(inserted)
    positions = covered.event_positions(updates.column("metadata"))
    second = updates.filter(pc.less_equal(positions, lsn + 4096))  # two transactions
    del updates
    offsets = dict(inserted)
    for shard, sequence in zip(*(second.column(c).to_pylist() for c in ("shard", "sequence")),
                               strict=True):  # fmt: skip
        offsets[shard] = max(offsets[shard], sequence)
    apply_batch(target, changes_of(log, second), ["id"], app_id="bench", batch_id=1,
                mode="scd2", coverage=coverage_of(log, second, offsets, "scd2"))  # fmt: skip
    table = open_table(target, None)
    assert table is not None
    plain, _ = timed(lambda: frame_of(spark, read_table(table)).count())
    text = covered.lsn_to_text(lsn)
    point = as_of.point(lsn=text)
    tail, by_tail = timed(lambda: read_rows(spark, target, log, point, cut=False))
    cut, by_cut = timed(lambda: read_rows(spark, target, log, point))
    counted, frame = timed(lambda: table_as_of(spark, target, log=log, lsn=text).count())
    assert by_cut.num_rows == by_tail.num_rows == frame, (by_cut.num_rows, by_tail.num_rows)
    print(f"scd2 ({table.version() + 1} versions, {by_cut.num_rows:,} rows as of the point "
          f"1,000 changes after version 0): read_rows from version 0 + 1,000 events "
          f"{tail:.2f} s; from version 1's history cut at the point {cut:.2f} s; "
          f"table_as_of counted {counted:.2f} s; version 1 as a counted DataFrame "
          f"{plain:.2f} s")  # fmt: skip
    print(json.dumps({"scd2_tail_s": tail, "scd2_cut_s": cut, "scd2_table_as_of_s": counted,
                      "scd2_plain_frame_s": plain}))  # fmt: skip


def timed(run: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--points", default="1000,100000,1000000")
    parser.add_argument("--no-scd2", dest="scd2", action="store_false",
                        help="skip the scd2 table's reads")  # fmt: skip
    args = parser.parse_args()
    points = [int(p) for p in args.points.split(",")]
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.memory", "4g")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    with tempfile.TemporaryDirectory(prefix="bench-as-of-") as root:
        log = ReplicationLog.create(str(Path(root) / "log"), shards=4)
        loaded = args.rows // TXN
        append(log, events(np.arange(args.rows), 0, "insert"))
        inserted = log.head()
        target = str(Path(root) / "items")
        first = log.read_all()
        batch = changes_of(log, first)
        coverage = coverage_of(log, first, dict(inserted), "scd1")
        apply_batch(target, batch, ["id"], app_id="bench", batch_id=0, coverage=coverage)
        del batch, first
        rng = np.random.default_rng(42)
        updates = rng.integers(0, args.rows, max(points))
        append(log, events(updates, loaded, "update"))
        table = open_table(target, None)
        assert table is not None
        plain, base = timed(lambda: read_table(table))
        spark.read.parquet(target).count()  # the JVM's classes loaded once
        parquet, _ = timed(lambda: spark.read.parquet(target).count())
        arrow, _ = timed(lambda: spark.createDataFrame(read_table(table)).count())
        plain_frame, _ = timed(lambda: frame_of(spark, read_table(table)).count())
        print(f"table: {args.rows:,} rows, version {table.version()}; log: {log.head()}")
        print(f"plain Delta read (delta-rs scan): {plain:.2f} s; as a counted DataFrame: "
              f"{plain_frame:.2f} s (frame_of), {arrow:.2f} s (createDataFrame's own "
              f"batches); Spark's Parquet source on its files: {parquet:.2f} s")  # fmt: skip
        print(f"{'changes after':>14} {'events read':>12} {'read_rows s':>12} "
              f"{'table_as_of s':>14} {'x plain':>8}")  # fmt: skip
        for count in points:
            last_txn = loaded + count // TXN - 1
            lsn = covered.lsn_to_text(LSN0 + last_txn * 4096)
            point = as_of.point(lsn=lsn)
            core, found = timed(lambda p=point: read_rows(spark, target, log, p))
            frame, counted = timed(lambda v=lsn: table_as_of(spark, target, log=log, lsn=v).count())
            assert found.num_rows == counted == args.rows, (found.num_rows, counted)
            print(f"{count:>14,} {count:>12,} {core:>12.2f} {frame:>14.2f} "
                  f"{frame / plain_frame:>8.1f}")  # fmt: skip
        print(json.dumps({"rows": args.rows, "plain_s": plain, "plain_frame_s": plain_frame,
                          "create_data_frame_s": arrow, "parquet_s": parquet}))  # fmt: skip
        del base
        if args.scd2:
            scd2_reads(spark, log, root, inserted, loaded)
    spark.stop()


if __name__ == "__main__":
    main()
