"""TRUNCATE end to end (a real PostgreSQL, Spark, Delta): capture -> log -> apply_changes
-> Delta equals PostgreSQL row by row, for a table's TRUNCATE (truncate events, one per
shard) and a partition's (deletes), in a transaction with inserts after it, refilled
across micro-batch boundaries; scd1 and scd2, copy-on-write and deletion-vector tables,
the per-collection router. The latest view of the log agrees."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.capture import query, run, sql
from test_capture_to_delta import delta_rows, source_rows

from replog import debezium
from replog.spark.functions import apply_changes, to_debezium, typed
from replog.tables import changes as rows
from replog.tables.delta import open_table, read_table

pytestmark = pytest.mark.spark

TABLES = ("t", "p")


def _tables(dsn: str) -> None:
    sql(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t SELECT g, 'a' || g FROM generate_series(1, 40) g",
        "CREATE TABLE p (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)",
        "CREATE TABLE p_1 PARTITION OF p FOR VALUES FROM (1) TO (101)",
        "CREATE TABLE p_2 PARTITION OF p FOR VALUES FROM (101) TO (201)",
        "CREATE TABLE p_3 PARTITION OF p FOR VALUES FROM (201) TO (301)",
        "INSERT INTO p SELECT g, 'p' || g FROM generate_series(1, 300, 3) g",
    )


def _stream(spark: Any, url: str, checkpoint: Path, apply: Any, per_trigger: int) -> int:
    """One AvailableNow run of ``apply`` over the log; its micro-batches with events."""
    started = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", str(per_trigger))
        .load(url)
        .writeStream.foreachBatch(apply)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    started.awaitTermination()
    return sum(1 for p in started.recentProgress if p["numInputRows"])


def _current(target: str) -> dict[Any, dict[str, Any]]:
    """An scd2 table's current versions as :func:`delta_rows` gives an scd1 table's."""
    table = open_table(target, None)
    assert table is not None
    found = [r for r in read_table(table).to_pylist() if r[rows.CURRENT]]
    assert len(found) == len({r["id"] for r in found}), "one current version per key"
    return {r["id"]: {k: v for k, v in r.items() if not k.startswith("__")} for r in found}


@pytest.mark.parametrize(
    "applied",
    [("scd1", True, 1), ("scd1", False, None), ("scd2", True, None)],
    ids=["scd1-deletion-vectors-written-ahead", "scd1-copy-on-write", "scd2"],
)
def test_truncate_of_a_table_and_of_a_partition_equal_in_delta(
    spark: Any, pg_dsn: str, tmp_path: Path, applied: tuple[str, bool, int | None]
) -> None:
    """The snapshot applied first (rows in earlier micro-batches), then: a table's
    TRUNCATE in a transaction with inserts before and after it, a partition's TRUNCATE
    and refill, the table truncated again and refilled by a transaction of its own; read
    6 events per micro-batch, so truncate copies and refills fall in different batches."""
    mode, deletion_vectors, write_ahead = applied
    url, checkpoint = str(tmp_path / "log"), tmp_path / "chk"
    target = str(tmp_path / "delta" / "{collection}")
    _tables(pg_dsn)
    run(pg_dsn, url, tables=TABLES)
    apply = apply_changes(
        target, app_id="tr", log=url, mode=mode, deletion_vectors=deletion_vectors,
        write_ahead_rows=write_ahead,
    )  # fmt: skip
    _stream(spark, url, checkpoint, apply, 1000)
    sql(
        pg_dsn,
        "DO $$ BEGIN INSERT INTO t VALUES (500, 'before'); UPDATE t SET v = 'u' WHERE id = 3;"
        " TRUNCATE t; INSERT INTO t VALUES (7, 'after'), (501, 'after'); END $$",
        "DO $$ BEGIN TRUNCATE p_2; INSERT INTO p SELECT g, 'again' || g"
        " FROM generate_series(101, 131, 5) g; END $$",
        "UPDATE p SET v = 'kept' WHERE id = 4",
        "TRUNCATE t",
        "INSERT INTO t SELECT g, 'refill' || g FROM generate_series(10, 21) g",
    )
    progress = run(pg_dsn, url, tables=TABLES)
    assert progress.truncations == 3  # two of t, one of a partition of p
    batches = _stream(spark, url, checkpoint, apply, 6)
    assert batches > 5, "the truncates' copies and the refill span micro-batches"
    found = _current if mode == "scd2" else delta_rows
    for name in TABLES:
        assert found(str(tmp_path / "delta" / f"public.{name}")) == source_rows(pg_dsn, name)
    assert len(source_rows(pg_dsn, "t")) == 12 and len(source_rows(pg_dsn, "p")) == 74
    latest = spark.read.format("replog").option("view", "latest").load(url)
    for name in TABLES:  # the log's latest state agrees with the tables
        keys = latest.where(f"collection = 'public.{name}'").select("key").collect()
        assert sorted(int(r["key"].split(":")[1].rstrip("}")) for r in keys) == sorted(
            source_rows(pg_dsn, name)
        )
    if mode == "scd2":  # t's first rows closed at the first TRUNCATE's commit time
        versions = read_table(open_table(str(tmp_path / "delta" / "public.t"), None))
        first = [r for r in versions.to_pylist() if r["v"] == "a1"]
        (committed,) = query(pg_dsn, "SELECT now()")[0]  # later than every commit above
        assert len(first) == 1 and not first[0][rows.CURRENT]
        assert first[0][rows.VALID_TO] is not None and first[0][rows.VALID_TO] <= committed
        (after,) = [r for r in versions.to_pylist() if r["v"] == "after" and r["id"] == 7]
        assert first[0][rows.VALID_TO] == after[rows.VALID_FROM]  # one transaction
        (before,) = [r for r in versions.to_pylist() if r["v"] == "before"]
        assert before[rows.VALID_TO] == first[0][rows.VALID_TO]  # ended by that TRUNCATE


def test_to_debezium_writes_one_truncate_record_as_debezium_does(
    spark: Any, pg_dsn: str, tmp_path: Path
) -> None:
    """A captured TRUNCATE (one event on each of the log's 4 shards) goes out as one
    Debezium truncate record, as Debezium's PostgreSQL connector writes it
    (``Envelope.truncate``: key null; ``before``, ``after`` null; ``source``,
    ``transaction``, ``op`` t, ``ts_ms``), among the rows' records; no tombstone after it.
    ``typed`` gives each copy no row (``data``, ``after``, ``before`` null)."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t VALUES (1, 'a'), (2, 'b')")  # fmt: skip
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "DO $$ BEGIN TRUNCATE t; INSERT INTO t VALUES (3, 'c'); END $$")
    run(pg_dsn, url, tables=("t",))
    records = to_debezium(spark.read.format("replog").load(url)).collect()
    values = [json.loads(r["value"]) for r in records]
    truncates = [(r, v) for r, v in zip(records, values, strict=True) if v["op"] == "t"]
    assert len(truncates) == 1 and len(records) == 4  # 2 reads, the truncate, 1 create
    record, value = truncates[0]
    assert record["key"] is None
    assert list(value) == ["before", "after", "source", "transaction", "op", "ts_ms"]
    assert value["before"] is None and value["after"] is None
    assert value["source"]["connector"] == "postgresql" and value["source"]["table"] == "t"
    (create,) = [v for v in values if v["op"] == "c"]
    assert value["transaction"]["id"] == create["transaction"]["id"]  # one transaction
    assert value["transaction"]["total_order"] < create["transaction"]["total_order"]
    assert value["source"]["txId"] == create["source"]["txId"]
    shown = typed(spark.read.format("replog").load(url), url, "public.t")
    truncated = shown.where("operation = 'truncate'").select("data", "after", "before").collect()
    assert len(truncated) == 4 and all(r == (None, None, None) for r in truncated)  # no row


def test_a_replog_made_truncate_record_has_no_row() -> None:
    made = json.loads(debezium.envelope(
        operation="truncate", data="{}", before=None, ts_ms=5, source={"connector": "replog"}
    ))  # fmt: skip
    assert made == {"before": None, "after": None, "source": {"connector": "replog"},
                    "transaction": None, "op": "t", "ts_ms": 5}  # fmt: skip
