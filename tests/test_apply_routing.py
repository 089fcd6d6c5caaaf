"""apply_changes in Spark: one query for many tables (keys, types and defaults from the
schema registry), column defaults, and changed keys' unsent values (real Spark, real
Delta tables through deltalake)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from test_apply_changes import TOASTED, micro_batch

from replog.errors import InvalidOptionError
from replog.log import ReplicationLog
from replog.schemas import registry
from replog.spark.apply import _each_table
from replog.spark.changes import Part
from replog.spark.functions import apply_changes
from replog.tables.delta import open_table, read_table

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)

pytestmark = pytest.mark.spark


def envelope(fields: list[dict[str, Any]]) -> dict[str, Any]:
    """A change-event envelope schema as capture registers it (key: non-optional)."""
    row = {"type": "struct", "name": "x.Value", "fields": fields}
    return {
        "type": "struct",
        "name": "x.Envelope",
        "fields": [
            {**row, "field": "before", "optional": True},
            {**row, "field": "after", "optional": True},
            {"field": "op", "type": "string", "optional": False},
        ],
    }


def event(
    collection: str, key: dict[str, Any], op: str, row: dict[str, Any], **meta: Any
) -> dict[str, Any]:
    return {
        "collection": collection,
        "key": json.dumps(key, separators=(",", ":")),
        "operation": op,
        "data": json.dumps(row),
        "timestamp": T0,
        "metadata": json.dumps(meta),
    }


def state(target: str) -> dict[Any, dict[str, Any]]:
    table = open_table(target, None)
    assert table is not None
    found = read_table(table).to_pylist()
    return {
        tuple(r[k] for k in ("id", "sku") if k in r and r[k] is not None): {
            k: v for k, v in r.items() if not k.startswith("__")
        }
        for r in found
    }


def shop_log(tmp_path: Path) -> tuple[ReplicationLog, dict[str, str]]:
    """A log of two captured tables: orders (key id, a decimal total) and stock (key
    sku, a text key), their schemas registered as capture registers them."""
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    orders = registry.register(log.storage, "shop.orders", envelope([
        {"field": "id", "type": "int64", "optional": False},
        {"field": "total", "type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
         "parameters": {"scale": "2", "connect.decimal.precision": "12",
                        "decimal.format": "NUMERIC"}, "optional": True},
    ]))  # fmt: skip
    stock = registry.register(log.storage, "shop.stock", envelope([
        {"field": "sku", "type": "string", "optional": False},
        {"field": "count", "type": "int32", "optional": True},
    ]))  # fmt: skip
    return log, {"shop.orders": orders, "shop.stock": stock}


def routed_batch(spark: Any, events: list[dict[str, Any]], first: int) -> Any:
    """A micro-batch of ``events`` (shard 0, sequences from ``first``) with their
    collections and metadata."""
    numbered = [dict(e, shard=0, sequence=first + n) for n, e in enumerate(events)]
    return (
        micro_batch(spark, numbered)
        .drop("collection", "metadata")
        .join(
            spark.createDataFrame(
                [(e["sequence"], e["collection"], e["metadata"]) for e in numbered],
                "sequence long, collection string, metadata string",
            ),
            "sequence",
        )
    )


def run(spark: Any, log: ReplicationLog, checkpoint: Path, apply: Any) -> Any:
    query = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", "4")
        .load(log.url)
        .writeStream.foreachBatch(apply)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return query


def test_one_query_routes_each_collection_to_its_table(spark: Any, tmp_path: Path) -> None:
    """A path template: each collection's table, keyed and typed by its registered
    schema (a decimal stays exact, a text key works); every table's commits carry the
    query's (app_id, batch_id)."""
    log, digests = shop_log(tmp_path)
    o, s = digests["shop.orders"], digests["shop.stock"]
    log.append([
        event("shop.orders", {"id": 1}, "insert", {"id": 1, "total": 10.25}, schema=o),
        event("shop.stock", {"sku": "a-1"}, "insert", {"sku": "a-1", "count": 3}, schema=s),
        event("shop.orders", {"id": 2}, "insert", {"id": 2, "total": 99999.99}, schema=o),
        event("shop.stock", {"sku": "b-2"}, "insert", {"sku": "b-2", "count": 1}, schema=s),
        event("shop.orders", {"id": 1}, "update", {"id": 1, "total": 11.5}, schema=o),
        event("shop.stock", {"sku": "a-1"}, "delete", {"sku": "a-1"}, schema=s),
        event("shop.orders", {"id": 3}, "insert", {"id": 3, "total": 0.01}, schema=o),
    ])  # fmt: skip
    tables = str(tmp_path / "tables" / "{collection}")
    query = run(spark, log, tmp_path / "chk", apply_changes(tables, app_id="r", log=log.url))
    orders, stock = (str(tmp_path / "tables" / name) for name in ("shop.orders", "shop.stock"))
    assert state(orders) == {
        (1,): {"id": 1, "total": Decimal("11.50")},
        (2,): {"id": 2, "total": Decimal("99999.99")},
        (3,): {"id": 3, "total": Decimal("0.01")},
    }
    assert state(stock) == {("b-2",): {"sku": "b-2", "count": 1}}
    batches = len(query.recentProgress)
    for target in (orders, stock):
        table = open_table(target, None)
        assert table is not None and table.transaction_version("r") is not None
        assert table.transaction_version("r") <= batches - 1


def test_a_replay_after_some_tables_committed_applies_the_rest_once(
    spark: Any, tmp_path: Path
) -> None:
    """A crash after one table's commit and before the other's: the replayed batch skips
    the table that has it and applies the one that does not; nothing doubles."""
    log, digests = shop_log(tmp_path)
    o, s = digests["shop.orders"], digests["shop.stock"]

    def frame_of(events: list[dict[str, Any]], first: int) -> Any:
        return routed_batch(spark, events, first)

    frame = frame_of([
        event("shop.orders", {"id": 1}, "insert", {"id": 1, "total": 1}, schema=o),
        event("shop.stock", {"sku": "a"}, "insert", {"sku": "a", "count": 1}, schema=s),
    ], first=10)  # fmt: skip
    tables = {name: str(tmp_path / name) for name in ("shop.orders", "shop.stock")}
    apply = apply_changes(tables, app_id="r", log=log.url)
    # the orders table committed batch 0 before a crash, with an older change for id 1:
    # a replay that were not skipped would replace it (its change is newer)
    earlier = event("shop.orders", {"id": 1}, "insert", {"id": 1, "total": 5}, schema=o)
    older = frame_of([earlier], first=0)
    apply_changes({"shop.orders": tables["shop.orders"]}, app_id="r", log=log.url)(older, 0)
    version = open_table(tables["shop.orders"], None).version()  # type: ignore[union-attr]
    apply(frame, 0)  # the replay
    assert open_table(tables["shop.orders"], None).version() == version  # type: ignore[union-attr]
    assert state(tables["shop.orders"]) == {(1,): {"id": 1, "total": Decimal(5)}}
    assert state(tables["shop.stock"]) == {("a",): {"sku": "a", "count": 1}}
    apply(frame, 0)  # and again: every table has it
    assert open_table(tables["shop.stock"], None).transaction_version("r") == 0  # type: ignore[union-attr]
    assert state(tables["shop.orders"]) == {(1,): {"id": 1, "total": Decimal(5)}}


def test_keys_that_are_not_the_events_keys_are_refused(spark: Any, tmp_path: Path) -> None:
    log, digests = shop_log(tmp_path)
    log.append([event("shop.orders", {"id": 1, "x": 2}, "insert", {"id": 1, "total": 1},
                      schema=digests["shop.orders"])])  # fmt: skip
    apply = apply_changes(str(tmp_path / "{collection}"), app_id="r", log=log.url)
    with pytest.raises(Exception, match=r"keyed by \['id'\] but its events' keys name"):
        run(spark, log, tmp_path / "chk", apply)
    unrouted = micro_batch(spark, [event("shop.orders", {"id": 1}, "insert", {"id": 1}) | {
        "shard": 0, "sequence": 0}])  # fmt: skip
    with pytest.raises(InvalidOptionError, match="events without a collection"):
        apply_changes(str(tmp_path / "{collection}"), ["id"], app_id="r")(unrouted, 0)
    with pytest.raises(InvalidOptionError, match="collection= is for one table"):
        apply_changes(str(tmp_path / "{collection}"), app_id="r", collection="a")
    one = apply_changes(str(tmp_path / "t"), app_id="r", log=log.url, collection="orders")
    with pytest.raises(InvalidOptionError, match=r"'orders'.*did you mean 'shop.orders'.*keys="):
        one(unrouted, 0)


def test_rows_before_an_added_column_read_its_default(spark: Any, tmp_path: Path) -> None:
    """ADD COLUMN level int DEFAULT 5: the registered schema's new field carries
    ``default``. Rows already in the table, and events of the version before the column,
    read 5; events of the new version read their own value (NULL included)."""
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    key = {"field": "id", "type": "int64", "optional": False}
    v1 = registry.register(
        log.storage, "t", envelope([key, {"field": "name", "type": "string", "optional": True}])
    )
    log.append([
        event("t", {"id": 1}, "insert", {"id": 1, "name": "a"}, schema=v1),
        event("t", {"id": 2}, "insert", {"id": 2, "name": "b"}, schema=v1),
    ])  # fmt: skip
    target = str(tmp_path / "t")
    run(
        spark, log, tmp_path / "chk", apply_changes(target, app_id="r", log=log.url, collection="t")
    )
    v2 = registry.register(log.storage, "t", envelope([
        key,
        {"field": "name", "type": "string", "optional": True},
        {"field": "level", "type": "int32", "optional": True, "default": 5},
        {"field": "since", "type": "string", "name": "io.debezium.time.IsoDate",
         "optional": True, "default": "2024-02-03"},
    ]))  # fmt: skip
    log.append([
        event("t", {"id": 3}, "update", {"id": 3, "name": "c"}, schema=v1),  # written before
        event("t", {"id": 4}, "insert", {"id": 4, "name": "d", "level": 9, "since": None},
              schema=v2),
        event("t", {"id": 1}, "update", {"id": 1, "name": "a2", "level": None}, schema=v2),
    ])  # fmt: skip
    run(
        spark,
        log,
        tmp_path / "chk2",
        apply_changes(target, app_id="r2", log=log.url, collection="t"),
    )
    found = {
        k[0]: (v["name"], v["level"], v["since"] and v["since"].isoformat())
        for k, v in state(target).items()
    }
    assert found == {
        1: ("a2", None, None),  # its own values (NULL: the update said so)
        2: ("b", 5, "2024-02-03"),  # in the table before the column: the default
        3: ("c", 5, "2024-02-03"),  # an event of the version without the column
        4: ("d", 9, None),
    }


def test_a_changed_key_keeps_its_unchanged_toasted_value_through_spark(
    spark: Any, tmp_path: Path
) -> None:
    """An update of the primary key: capture's delete of the old key (its old image, the
    key only) and create of the new one (``metadata.old_key``; the unchanged TOASTed body
    not sent) in one micro-batch: the new row holds the old body."""
    ddl = "id long, name string, body string"
    target = str(tmp_path / "t")
    apply = apply_changes(target, ["id"], app_id="q", schema=ddl)

    def batch(items: list[tuple[int, str, dict[str, Any], dict[str, Any]]], first: int) -> Any:
        return micro_batch(spark, [
            {"key": json.dumps({"id": row["id"]}), "operation": op, "data": json.dumps(row),
             "timestamp": T0, "shard": 0, "sequence": first + n}
            for n, (_, op, row, _) in enumerate(items)
        ]).drop("metadata").join(
            spark.createDataFrame(
                [(first + n, json.dumps(meta)) for n, (*_, meta) in enumerate(items)],
                "sequence long, metadata string",
            ),
            "sequence",
        )  # fmt: skip

    apply(batch([(0, "insert", {"id": 1, "name": "a", "body": "long"}, {}),
                 (0, "insert", {"id": 5, "name": "e", "body": "five"}, {})], 0), 0)  # fmt: skip
    apply(batch([
        (0, "update", {"id": 5, "name": "e2", "body": "five-2"}, {}),
        (0, "delete", {"id": 1}, {"new_key": '{"id":2}'}),
        (0, "insert", {"id": 2, "name": "a", "body": TOASTED},
         {"old_key": '{"id":1}', "unavailable": ["body"]}),
        (0, "delete", {"id": 5}, {"new_key": '{"id":6}'}),
        (0, "insert", {"id": 6, "name": "e2", "body": TOASTED},
         {"old_key": '{"id":5}', "unavailable": ["body"]}),
    ], 10), 1)  # fmt: skip
    assert {k[0]: (v["name"], v["body"]) for k, v in state(target).items()} == {
        2: ("a", "long"),  # the table's row of the old key
        6: ("e2", "five-2"),  # the old key's value sent earlier in the batch
    }


def test_every_table_of_a_batch_is_tried_and_the_first_failure_raised() -> None:
    """A micro-batch's tables are committed at once: one table's failure neither stops
    another's commit half-way nor hides a second failure."""
    parts = [Part(i, f"shop.t{i}", ("id",), None) for i in range(6)]
    tried: list[int] = []

    def apply(part: Part) -> None:
        tried.append(part.index)
        if part.index in (1, 4):
            raise OSError(f"disk full under table {part.index}")

    with pytest.raises(OSError, match="table 1") as raised:
        _each_table(apply, parts)
    assert sorted(tried) == list(range(6))
    assert any("shop.t4" in note and "table 4" in note for note in raised.value.__notes__)
    tried.clear()
    _each_table(lambda part: tried.append(part.index), parts[:1])  # one table: inline
    assert tried == [0]
