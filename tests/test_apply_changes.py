"""apply_changes: a replog stream merged into a real Delta table (deltalake), exactly once.

The reference state is computed from the log in plain Python: per key, the event with
the greatest (shard, sequence); absent when it is a delete.
"""

from __future__ import annotations

import itertools
import json
import random
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from support.logcheck import check_log

from replog.errors import InvalidOptionError, SchemaChangeError
from replog.log import ReplicationLog
from replog.spark.functions import apply_changes
from replog.spark.schema import SPARK_SCHEMA_DDL
from replog.tables import changes as rows
from replog.tables.delta import apply_batch, open_table, read_table, tombstones_location

SCHEMA = "id long, name string, n long"
T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


def workload(seed: int, events: int, keys: int) -> list[dict[str, Any]]:
    """Random inserts, updates and deletes; a key's first event (and one after a delete)
    is an insert."""
    rng = random.Random(seed)
    alive: set[int] = set()
    out = []
    for n in range(events):
        k = rng.randrange(keys)
        if k not in alive:
            op = "insert"
            alive.add(k)
        elif rng.random() < 0.2:
            op = "delete"
            alive.discard(k)
        else:
            op = "update"
        out.append(
            {
                "key": json.dumps({"id": k}),
                "operation": op,
                "data": json.dumps({"id": k, "name": f"k{k}-{n}", "n": n}),
                "timestamp": T0 + timedelta(seconds=n),
            }
        )
    return out


def expected_state(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The latest row per key from the log's events (deleted keys absent)."""
    last: dict[str, dict[str, Any]] = {}
    for event in events:
        held = last.get(event["key"])
        if held is None or (event["shard"], event["sequence"]) > (held["shard"], held["sequence"]):
            last[event["key"]] = event
    state = {}
    for event in last.values():
        if event["operation"] != "delete":
            row = json.loads(event["data"])
            state[row["id"]] = row
    return state


def table_state(target: str) -> dict[int, dict[str, Any]]:
    table = open_table(target, None)
    assert table is not None
    found = read_table(table).to_pylist()
    assert len(found) == len({r["id"] for r in found}), "one row per key"
    return {r["id"]: {"id": r["id"], "name": r["name"], "n": r.get("n")} for r in found}


def change_table(items: list[tuple[int, str, int, str]], shard: int = 0) -> pa.Table:
    """A batch of changes for the core: (id, name, sequence, operation)."""
    return pa.table(
        {
            "id": pa.array([i[0] for i in items], pa.int64()),
            "name": [i[1] for i in items],
            rows.SHARD: pa.array([shard] * len(items), pa.int32()),
            rows.SEQUENCE: pa.array([i[2] for i in items], pa.int64()),
            rows.OPERATION: [i[3] for i in items],
            rows.TIMESTAMP: pa.array(
                [T0 + timedelta(seconds=i[2]) for i in items], pa.timestamp("us", tz="UTC")
            ),
        }
    )


# -- the core, without Spark ----------------------------------------------------------------


def test_latest_per_key_is_the_last_change_in_log_order() -> None:
    rng = random.Random(7)
    items = [(rng.randrange(20), f"v{s}", s, "update") for s in range(300)]
    rng.shuffle(items)
    latest = rows.latest_per_key(change_table(items), ["id"]).to_pylist()
    want = {i: max(s for k, _, s, _ in items if k == i) for i in {k for k, *_ in items}}
    assert {r["id"]: r[rows.SEQUENCE] for r in latest} == want
    assert [r[rows.SEQUENCE] for r in latest] == sorted(want.values())  # in log order


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    batch = change_table([(1, "a", 1, "insert")])
    with pytest.raises(InvalidOptionError, match="mode 'scd3'"):
        apply_batch(target, batch, ["id"], app_id="a", batch_id=0, mode="scd3")
    with pytest.raises(InvalidOptionError, match=r"keys \['nope'\] are not columns"):
        apply_batch(target, batch, ["nope"], app_id="a", batch_id=0)
    with pytest.raises(InvalidOptionError, match="app_id"):
        apply_batch(target, batch, ["id"], app_id="", batch_id=0)
    with pytest.raises(InvalidOptionError, match="key column 'id' is null"):
        apply_batch(
            target,
            batch.set_column(0, "id", pa.nulls(1, pa.int64())),
            ["id"],
            app_id="a",
            batch_id=0,
        )
    assert open_table(target, None) is None


def test_a_replayed_batch_id_is_skipped(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    apply_batch(target, change_table([(1, "a", 1, "insert")]), ["id"], app_id="q", batch_id=0)
    version = open_table(target, None).version()  # type: ignore[union-attr]
    # the same batch id again, even with other content (a replay after a kill): skipped
    again = apply_batch(
        target, change_table([(1, "b", 2, "update")]), ["id"], app_id="q", batch_id=0
    )
    assert again.skipped
    table = open_table(target, None)
    assert table is not None and table.version() == version
    assert table.transaction_version("q") == 0
    assert table_state(target)[1]["name"] == "a"
    done = apply_batch(
        target, change_table([(1, "b", 2, "update")]), ["id"], app_id="q", batch_id=1
    )
    assert not done.skipped and table_state(target)[1]["name"] == "b"
    # the version the merge's own handle reports is the table's, as a fresh open reads it
    assert done.table_version == open_table(target, None).version() == version + 1  # type: ignore[union-attr]


class Untouchable:
    """A micro-batch that must not be looked at."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a replayed batch was computed (DataFrame.{name})")


def test_a_replayed_micro_batch_is_skipped_before_spark_computes_it(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    first = apply_batch(
        target, change_table([(1, "a", 1, "insert")]), ["id"], app_id="q", batch_id=0
    )
    assert first.table_version == 0
    apply_changes(target, ["id"], app_id="q", schema=SCHEMA)(Untouchable(), 0)  # type: ignore[arg-type]
    assert open_table(target, None).version() == 0  # type: ignore[union-attr]
    with pytest.raises(AssertionError, match="was computed"):  # a new batch id is not skipped
        apply_changes(target, ["id"], app_id="q", schema=SCHEMA)(Untouchable(), 1)  # type: ignore[arg-type]


def test_an_older_change_never_rolls_a_row_back(tmp_path: Path) -> None:
    """An old batch replayed under another app_id (a replaced checkpoint): the txn guard
    does not see it, the position guard does."""
    target = str(tmp_path / "t")
    apply_batch(
        target,
        change_table([(1, "a", 1, "insert"), (2, "b", 2, "insert")]),
        ["id"],
        app_id="q",
        batch_id=0,
    )
    apply_batch(
        target,
        change_table([(1, "a2", 5, "update"), (3, "c", 6, "insert")]),
        ["id"],
        app_id="q",
        batch_id=1,
    )
    apply_batch(
        target,
        change_table([(1, "a", 1, "insert"), (3, "old", 4, "insert"), (2, "b3", 7, "update")]),
        ["id"],
        app_id="new-checkpoint",
        batch_id=0,
    )
    state = table_state(target)
    assert {k: v["name"] for k, v in state.items()} == {1: "a2", 2: "b3", 3: "c"}


def test_durations_and_times_of_day_are_stored_as_counts_of_their_unit(tmp_path: Path) -> None:
    """Delta has no interval or time type: a PostgreSQL ``time`` (Spark's ``interval day to
    second``, Arrow's duration) and an Arrow ``time64`` land as bigint microseconds, in
    the batch that creates the table and in a merge into it, nested ones too."""
    target = str(tmp_path / "t")
    for batch_id, (ids, micros) in enumerate([([1, 2], [1_500_000, 0]), ([2, 3], [7, None])]):
        batch = change_table([(i, f"n{i}", 10 * batch_id + i, "update") for i in ids])
        batch = batch.append_column("took", pa.array(micros, pa.duration("us")))
        batch = batch.append_column("at", pa.array(micros, pa.time64("us")))
        batch = batch.append_column(
            "laps",
            pa.array([[m] if m is not None else [] for m in micros], pa.list_(pa.duration("us"))),
        )
        apply_batch(target, batch, ["id"], app_id="q", batch_id=batch_id)
    table = open_table(target, None)
    assert table is not None
    found = read_table(table)
    assert found.schema.field("took").type == pa.int64()
    assert found.schema.field("laps").type.value_type == pa.int64()
    got = {r["id"]: (r["took"], r["at"], r["laps"]) for r in found.to_pylist()}
    assert got == {1: (1_500_000, 1_500_000, [1_500_000]), 2: (7, 7, [7]), 3: (None, None, [])}


def test_array_and_struct_columns_pass_the_deleted_keys_check(tmp_path: Path) -> None:
    """Once a key was deleted, each batch is checked against the deleted keys' positions
    by a join, which took every column along: Acero joins no list or struct column, so
    a table with a PostgreSQL array failed every batch after its first delete (found on
    a real-shaped table, not by the tests)."""
    target = str(tmp_path / "t")
    for batch_id, items in enumerate(
        [[(1, "a", 1, "insert"), (2, "b", 2, "insert")], [(1, "a", 3, "delete")],
         [(2, "b2", 4, "update"), (1, "old", 0, "update"), (3, "c", 5, "insert")]]
    ):  # fmt: skip
        batch = change_table(items)
        batch = batch.append_column("tags", pa.array([[i[1], "x"] for i in items]))
        batch = batch.append_column("at", pa.array([{"n": i[2]} for i in items]))
        apply_batch(target, batch, ["id"], app_id="q", batch_id=batch_id)
    table = open_table(target, None)
    assert table is not None
    rows = read_table(table).to_pylist()
    got = {r["id"]: (r["name"], r["tags"], r["at"]) for r in rows}
    assert got == {2: ("b2", ["b2", "x"], {"n": 4}), 3: ("c", ["c", "x"], {"n": 5})}


def test_deletes_remove_the_row(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    apply_batch(
        target,
        change_table([(1, "a", 1, "insert"), (2, "b", 2, "insert")]),
        ["id"],
        app_id="q",
        batch_id=0,
    )
    apply_batch(
        target,
        change_table([(1, "a", 3, "delete"), (4, "d", 4, "insert"), (4, "d", 5, "delete")]),
        ["id"],
        app_id="q",
        batch_id=1,
    )
    assert set(table_state(target)) == {2}


def test_scd2_keeps_every_version(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    apply_batch(
        target,
        change_table([(1, "a", 1, "insert"), (2, "b", 2, "insert"), (1, "a2", 3, "update")]),
        ["id"],
        app_id="q",
        batch_id=0,
        mode="scd2",
    )
    apply_batch(
        target,
        change_table([(2, "b", 4, "delete"), (1, "a3", 6, "update")]),
        ["id"],
        app_id="q",
        batch_id=1,
        mode="scd2",
    )
    apply_batch(
        target,
        change_table([(1, "a", 1, "insert")]),
        ["id"],
        app_id="other",
        batch_id=0,
        mode="scd2",
    )  # an old change again: no new version
    table = open_table(target, None)
    assert table is not None
    history = sorted(
        (
            r["id"],
            r["name"],
            r[rows.VALID_FROM].second,
            r[rows.VALID_TO] and r[rows.VALID_TO].second,
            r[rows.CURRENT],
        )
        for r in read_table(table).to_pylist()
    )
    assert history == [
        (1, "a", 1, 3, False),
        (1, "a2", 3, 6, False),
        (1, "a3", 6, None, True),
        (2, "b", 2, 4, False),  # closed by its delete
    ]


def test_a_new_column_is_added_and_a_type_change_names_the_column(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    apply_batch(target, change_table([(1, "a", 1, "insert")]), ["id"], app_id="q", batch_id=0)
    wider = change_table([(2, "b", 2, "insert")]).append_column("price", pa.array([1.5]))
    apply_batch(target, wider, ["id"], app_id="q", batch_id=1)
    found = {r["id"]: r for r in read_table(open_table(target, None)).to_pylist()}  # type: ignore[arg-type]
    assert found[2]["price"] == 1.5 and found[1]["price"] is None
    # text that would cast to double: the type rule refuses it, not a failed cast
    clash = change_table([(3, "c", 3, "insert")]).append_column("price", pa.array(["2.5"]))
    version = open_table(target, None).version()  # type: ignore[union-attr]
    with pytest.raises(SchemaChangeError, match="column 'price'"):
        apply_batch(target, clash, ["id"], app_id="q", batch_id=2)
    assert open_table(target, None).version() == version  # type: ignore[union-attr]


# -- through Spark ---------------------------------------------------------------------------


def micro_batch(spark: Any, events: list[dict[str, Any]]) -> Any:
    """A DataFrame shaped like the replog source's micro-batches."""
    records = [
        (
            e["shard"],
            e["sequence"],
            f"e{e['shard']}-{e['sequence']}",
            e["timestamp"],
            e["operation"],
            None,
            e["key"],
            bytearray(e["data"].encode()),
            None,
            None,
        )
        for e in events
    ]
    return spark.createDataFrame(records, SPARK_SCHEMA_DDL)


@pytest.mark.spark
def test_stream_into_delta_equals_the_latest_state(spark: Any, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 3)
    for start in range(0, 600, 150):
        log.append(workload(1, 600, 40)[start : start + 150])
    target, chk = str(tmp_path / "table"), str(tmp_path / "chk")
    query = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", "100")
        .load(log.url)
        .writeStream.foreachBatch(apply_changes(target, ["id"], app_id="t1", schema=SCHEMA))
        .option("checkpointLocation", chk)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert len(query.recentProgress) >= 6
    assert table_state(target) == expected_state(check_log(log))
    table = open_table(target, None)
    assert table is not None and table.transaction_version("t1") == len(query.recentProgress) - 1


@pytest.mark.spark
def test_replayed_and_older_micro_batches_are_ignored(spark: Any, tmp_path: Path) -> None:
    events = [dict(e, shard=0, sequence=s) for s, e in enumerate(workload(2, 120, 10))]
    first, second = micro_batch(spark, events[:60]), micro_batch(spark, events[60:])
    target = str(tmp_path / "t")
    apply = apply_changes(target, "id", app_id="q", schema=SCHEMA)
    apply(first, 0)
    apply(second, 1)
    state = table_state(target)
    apply(first, 0)  # a replay after a driver kill
    apply(first, 1)
    assert table_state(target) == state
    # a replaced checkpoint: batch ids start again under a new app_id. No live row goes
    # back to an older version, and no deleted key comes back (its tombstone's position)
    replaced = apply_changes(target, "id", app_id="q2", schema=SCHEMA)
    replaced(first, 0)
    midway = table_state(target)
    assert midway == state
    replaced(second, 1)
    assert table_state(target) == state == expected_state(events)


@pytest.mark.spark
def test_spark_scd2_history_is_complete(spark: Any, tmp_path: Path) -> None:
    events = [dict(e, shard=0, sequence=s) for s, e in enumerate(workload(3, 90, 8))]
    target = str(tmp_path / "t")
    apply = apply_changes(target, ["id"], app_id="h", mode="scd2", schema=SCHEMA)
    for number, start in enumerate(range(0, 90, 30)):
        apply(micro_batch(spark, events[start : start + 30]), number)
    table = open_table(target, None)
    assert table is not None
    history = read_table(table).to_pylist()
    versions = sorted((r["id"], r["n"]) for r in history)
    assert versions == sorted(
        (json.loads(e["data"])["id"], json.loads(e["data"])["n"])
        for e in events
        if e["operation"] != "delete"
    )
    current = {r["id"]: r["n"] for r in history if r[rows.CURRENT]}
    assert current == {k: v["n"] for k, v in expected_state(events).items()}
    by_key: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(history, key=lambda r: r["n"]):
        by_key.setdefault(r["id"], []).append(r)
    for chain in by_key.values():  # each version ends where the next begins
        for older, newer in itertools.pairwise(chain):
            assert older[rows.VALID_TO] is not None
            assert older[rows.VALID_TO] <= newer[rows.VALID_FROM]


@pytest.mark.spark
def test_spark_bad_input_is_refused(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="mode 'latest'"):
        apply_changes(str(tmp_path), ["id"], app_id="a", mode="latest")
    events = [dict(e, shard=0, sequence=s) for s, e in enumerate(workload(4, 3, 2))]
    with pytest.raises(InvalidOptionError, match=r"keys \['sku'\]"):
        apply_changes(str(tmp_path / "t"), ["sku"], app_id="a", schema=SCHEMA)(
            micro_batch(spark, events), 0
        )
    with pytest.raises(InvalidOptionError, match="schema="):
        apply_changes(str(tmp_path / "t"), ["id"], app_id="a")(micro_batch(spark, events), 0)
    assert open_table(str(tmp_path / "t"), None) is None


# -- the latest view -------------------------------------------------------------------------


@pytest.mark.spark
def test_latest_view_is_the_newest_event_per_key_without_deletes(
    spark: Any, tmp_path: Path
) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 3)
    events = workload(5, 500, 60)
    for start in range(0, 500, 100):  # several commits: a shard spans several segments
        log.append(events[start : start + 100])
    view = (
        spark.read.format("replog")
        .option("view", "latest")
        .option("maxEventsPerPartition", "40")  # split shards: the view must join them again
        .load(log.url)
    )
    found = view.collect()
    assert len(found) == len({(r["collection"], r["key"]) for r in found})
    assert {json.loads(bytes(r["data"]))["id"]: json.loads(bytes(r["data"])) for r in found} == (
        expected_state(check_log(log))
    )
    assert not [r for r in found if r["operation"] == "delete"]


@pytest.mark.spark
def test_latest_view_options_are_checked(spark: Any, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    with pytest.raises(Exception, match="option 'view': 'newest' is not allowed"):
        spark.read.format("replog").option("view", "newest").load(log.url).collect()
    with pytest.raises(Exception, match="option 'view' is for batch reads"):
        spark.readStream.format("replog").option("view", "latest").load(log.url).writeStream.format(
            "noop"
        ).start().awaitTermination()


def test_a_double_is_not_rounded_into_a_float_column(tmp_path: Path) -> None:
    """A table whose column is float (32 bits) and a change that holds a double the float
    cannot hold exactly: refused, not silently rounded (0.1 became 0.10000000149...)."""
    target = str(tmp_path / "t")
    first = change_table([(1, "a", 1, "insert")]).append_column("x", pa.array([1.0], pa.float32()))
    apply_batch(target, first, ["id"], app_id="q", batch_id=0)
    fits = change_table([(2, "b", 2, "insert")]).append_column(
        "x",
        pa.array(
            [
                0.5,
            ],
            pa.float64(),
        ),
    )
    apply_batch(target, fits, ["id"], app_id="q", batch_id=1)  # exact in 32 bits: cast
    rounded = change_table([(3, "c", 3, "insert")]).append_column(
        "x", pa.array([0.1], pa.float64())
    )
    with pytest.raises(SchemaChangeError, match="column 'x'"):
        apply_batch(target, rounded, ["id"], app_id="q", batch_id=2)
    found = {r["id"]: r["x"] for r in read_table(open_table(target, None)).to_pylist()}  # type: ignore[arg-type]
    assert found == {1: 1.0, 2: 0.5}


TOASTED = "__debezium_unavailable_value"  # Debezium's placeholder for an unchanged TOAST value


def with_body(batch: pa.Table, bodies: list[str | None]) -> pa.Table:
    return batch.append_column("body", pa.array(bodies, pa.string()))


@pytest.mark.parametrize("mode", ["scd1", "scd2"])
def test_an_unavailable_toast_value_keeps_the_stored_value(tmp_path: Path, mode: str) -> None:
    """An update that did not send an unchanged TOASTed column (its value is Debezium's
    placeholder) changes the other columns; the column keeps the value it had, from the
    table or from an earlier change of the batch, never the placeholder."""
    target = str(tmp_path / "t")
    first = with_body(change_table([(1, "a", 1, "insert"), (2, "b", 2, "insert")]), ["long", None])
    apply_batch(target, first, ["id"], app_id="q", batch_id=0, mode=mode)
    second = with_body(
        change_table(
            [
                (1, "a2", 3, "update"),  # the table's value stays
                (2, "b2", 4, "update"),  # a stored NULL stays NULL
                (3, "c", 5, "insert"),
                (3, "c2", 6, "update"),  # the batch's earlier value
                (3, "c3", 7, "update"),  # through two placeholders
            ]
        ),
        [TOASTED, TOASTED, "text", TOASTED, TOASTED],
    )
    apply_batch(target, second, ["id"], app_id="q", batch_id=1, mode=mode)
    table = open_table(target, None)
    assert table is not None
    found = read_table(table).to_pylist()
    current = {r["id"]: (r["name"], r["body"]) for r in found if r.get(rows.CURRENT, True)}
    assert current == {1: ("a2", "long"), 2: ("b2", None), 3: ("c3", "text")}
    assert not [r for r in found if r["body"] == TOASTED]  # no version holds the placeholder


@pytest.mark.spark
def test_spark_reduction_keeps_a_value_an_update_did_not_send(spark: Any, tmp_path: Path) -> None:
    """scd1 reduces a micro-batch to one change per key in Spark: the insert's value of a
    column the later update left out (TOAST placeholder) must survive the reduction."""
    events = [
        {"id": 1, "name": "a", "body": "long"},
        {"id": 1, "name": "a2", "body": TOASTED},
    ]
    batch = [
        {
            "key": '{"id":1}',
            "operation": op,
            "data": json.dumps(row),
            "timestamp": T0,
            "shard": 0,
            "sequence": s,
        }
        for s, (op, row) in enumerate(zip(["insert", "update"], events, strict=True))
    ]
    target = str(tmp_path / "t")
    apply_changes(target, ["id"], app_id="q", schema="id long, name string, body string")(
        micro_batch(spark, batch), 0
    )
    found = read_table(open_table(target, None)).to_pylist()  # type: ignore[arg-type]
    assert [(r["name"], r["body"]) for r in found] == [("a2", "long")]


def test_a_batch_id_of_another_checkpoint_is_not_skipped_silently(tmp_path: Path) -> None:
    """A replaced checkpoint reusing the app_id starts its batch ids at 0 again: its
    batches would be skipped as 'already applied' and their changes lost. The commit
    records the writing query (checkpoint); a skip for another one is an error."""
    target = str(tmp_path / "t")
    apply_batch(
        target, change_table([(1, "a", 1, "insert")]), ["id"], app_id="q", batch_id=0, writer="w1"
    )
    apply_batch(
        target, change_table([(1, "b", 2, "update")]), ["id"], app_id="q", batch_id=1, writer="w1"
    )
    again = apply_batch(
        target, change_table([(1, "b", 2, "update")]), ["id"], app_id="q", batch_id=1, writer="w1"
    )
    assert again.skipped  # a replay by the same checkpoint
    with pytest.raises(InvalidOptionError, match="another checkpoint"):
        apply_batch(
            target,
            change_table([(2, "c", 3, "insert")]),
            ["id"],
            app_id="q",
            batch_id=0,
            writer="w2",
        )
    assert table_state(target) == {1: {"id": 1, "name": "b", "n": None}}


@pytest.mark.spark
def test_a_new_checkpoint_under_the_same_app_id_fails(spark: Any, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    log.append(workload(6, 20, 5))
    target = str(tmp_path / "table")

    def run(checkpoint: str) -> None:
        (
            spark.readStream.format("replog")
            .load(log.url)
            .writeStream.foreachBatch(apply_changes(target, ["id"], app_id="same", schema=SCHEMA))
            .option("checkpointLocation", str(tmp_path / checkpoint))
            .trigger(availableNow=True)
            .start()
            .awaitTermination()
        )

    run("chk1")
    log.append(workload(7, 20, 5))
    with pytest.raises(Exception, match="another checkpoint"):
        run("chk2")  # its batch 0 is not the first checkpoint's batch 0


@pytest.mark.parametrize("mode", ["scd1", "scd2"])
def test_a_key_column_widened_since_the_table_was_made(tmp_path: Path, mode: str) -> None:
    """The table's key is int32 (its first batch's type); later changes carry it as int64
    (a schema version widened it: typed reads the union). The changes apply; an old change
    replayed is still recognised as old."""
    target = str(tmp_path / "t")
    narrow = change_table([(1, "a", 1, "insert")])
    narrow = narrow.set_column(0, "id", narrow.column("id").cast(pa.int32()))
    apply_batch(target, narrow, ["id"], app_id="q", batch_id=0, mode=mode)
    wide = change_table([(1, "a", 1, "insert"), (1, "b", 2, "update"), (2, "c", 3, "insert")])
    apply_batch(target, wide, ["id"], app_id="other", batch_id=0, mode=mode)
    table = open_table(target, None)
    assert table is not None
    found = sorted((r["id"], r["name"]) for r in read_table(table).to_pylist())
    assert found == ([(1, "b"), (2, "c")] if mode == "scd1" else [(1, "a"), (1, "b"), (2, "c")])


@pytest.mark.parametrize("mode", ["scd1", "scd2"])
def test_a_column_listed_as_not_sent_keeps_its_value_whatever_its_type(
    tmp_path: Path, mode: str
) -> None:
    """A captured update lists the TOASTed columns it did not send in
    ``metadata.unavailable``; typed, a bytea there is bytes decoded from the placeholder
    text and a numeric NULL. Neither may replace the stored value."""
    target = str(tmp_path / "t")
    first = change_table([(1, "a", 1, "insert")]).append_column("blob", pa.array([b"\x00big"]))
    apply_batch(target, first, ["id"], app_id="q", batch_id=0, mode=mode)
    garbage = b"u\xe6\xde\xce"  # what unbase64 makes of the placeholder text
    second = (
        change_table([(1, "a2", 2, "update"), (2, "b", 3, "insert"), (2, "b2", 4, "update")])
        .append_column("blob", pa.array([garbage, b"\x01", None]))
        .append_column(rows.UNSENT, pa.array([["blob"], [], ["blob"]], pa.list_(pa.string())))
    )
    apply_batch(target, second, ["id"], app_id="q", batch_id=1, mode=mode)
    found = read_table(open_table(target, None)).to_pylist()  # type: ignore[arg-type]
    current = {r["id"]: (r["name"], r["blob"]) for r in found if r.get(rows.CURRENT, True)}
    assert current == {1: ("a2", b"\x00big"), 2: ("b2", b"\x01")}
    assert rows.UNSENT not in found[0]


@pytest.mark.spark
def test_spark_reads_the_columns_an_event_did_not_send_from_its_metadata(
    spark: Any, tmp_path: Path
) -> None:
    """Typed rows (a struct ``data``) whose ``metadata.unavailable`` names a column: the
    reduction to one change per key and the merge keep the column's value."""
    ddl = (
        "shard int, sequence long, timestamp timestamp, operation string, "
        "data struct<id:long,name:string,total:decimal(12,2)>, metadata string"
    )
    target = str(tmp_path / "t")
    apply = apply_changes(target, ["id"], app_id="q")
    first = [(0, 1, T0, "insert", (1, "a", Decimal("1.50")), '{"op":"c"}')]
    apply(spark.createDataFrame(first, ddl), 0)
    toasted = '{"op":"u","unavailable":["total"]}'
    second = [
        (0, 2, T0, "update", (1, "a2", None), toasted),  # the table's value stays
        (0, 3, T0, "insert", (2, "b", Decimal("2.25")), '{"op":"c"}'),
        (0, 4, T0, "update", (2, "b2", None), toasted),  # the batch's earlier value stays
    ]
    apply(spark.createDataFrame(second, ddl), 1)
    found = read_table(open_table(target, None)).to_pylist()  # type: ignore[arg-type]
    assert sorted((r["id"], r["name"], r["total"]) for r in found) == [
        (1, "a2", Decimal("1.50")),
        (2, "b2", Decimal("2.25")),
    ]


@pytest.mark.parametrize("mode", ["scd1", "scd2"])
def test_random_updates_that_leave_columns_unsent_equal_a_replay_in_python(
    tmp_path: Path, mode: str
) -> None:
    """Random inserts, updates (some not sending ``body``, as text or listed) and deletes,
    in random batches: the current rows equal a fold of the log where a column not sent
    keeps the key's previous value."""
    rng = random.Random(11)
    target = str(tmp_path / "t")
    model: dict[int, tuple[str, str | None]] = {}
    alive: dict[int, str | None] = {}
    sequence = 0
    for batch_id in range(12):
        items, bodies, unsent = [], [], []
        for _ in range(rng.randrange(1, 15)):
            sequence += 1
            k = rng.randrange(6)
            if k not in alive:
                op, body, listed = "insert", rng.choice([f"b{sequence}", None]), []
            elif rng.random() < 0.2:
                op, body, listed = "delete", alive[k], []
            else:
                op, listed = "update", []
                body = rng.choice([f"b{sequence}", None, TOASTED, "listed"])
                if body == "listed":  # typed: the column's value is not the placeholder
                    body, listed = None, ["body"]
            items.append((k, f"n{sequence}", sequence, op))
            bodies.append(body)
            unsent.append(listed)
            if op == "delete":
                del alive[k]
                model.pop(k, None)
            else:
                kept = body == TOASTED or listed
                alive[k] = alive.get(k) if kept else body
                model[k] = (f"n{sequence}", alive[k])
        batch = with_body(change_table(items), bodies).append_column(
            rows.UNSENT, pa.array(unsent, pa.list_(pa.string()))
        )
        apply_batch(target, batch, ["id"], app_id="q", batch_id=batch_id, mode=mode)
        table = open_table(target, None)
        assert table is not None
        found = read_table(table).to_pylist()
        current = {r["id"]: (r["name"], r["body"]) for r in found if r.get(rows.CURRENT, True)}
        assert current == model


def test_changes_of_two_collections_are_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """A table mirrors one collection: equal keys of two collections must not merge."""
    target = str(tmp_path / "t")
    mixed = change_table([(1, "order", 1, "insert"), (1, "customer", 2, "insert")])
    mixed = mixed.append_column(rows.COLLECTION, pa.array(["shop.orders", "shop.customers"]))
    with pytest.raises(InvalidOptionError, match=r"'shop.customers', 'shop.orders'.*collection="):
        apply_batch(target, mixed, ["id"], app_id="q", batch_id=0)
    assert open_table(target, None) is None
    one = mixed.filter(pc.equal(mixed.column(rows.COLLECTION), "shop.orders"))
    apply_batch(target, one, ["id"], app_id="q", batch_id=0)
    assert table_state(target) == {1: {"id": 1, "name": "order", "n": None}}


@pytest.mark.spark
def test_spark_refuses_a_log_of_several_collections_without_collection(
    spark: Any, tmp_path: Path
) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    for name in ("orders", "customers"):
        log.append(
            [
                {"key": json.dumps({"id": k}), "collection": name,
                 "data": json.dumps({"id": k, "name": f"{name}{k}", "n": k})}
                for k in range(3)
            ]
        )  # fmt: skip

    def run(checkpoint: str, **options: Any) -> None:
        (
            spark.readStream.format("replog")
            .load(log.url)
            .writeStream.foreachBatch(
                apply_changes(str(tmp_path / checkpoint), ["id"], app_id=checkpoint,
                              schema=SCHEMA, **options)
            )
            .option("checkpointLocation", str(tmp_path / f"{checkpoint}.chk"))
            .trigger(availableNow=True)
            .start()
            .awaitTermination()
        )  # fmt: skip

    with pytest.raises(Exception, match="collections \\['customers', 'orders'\\]"):
        run("mixed")
    assert open_table(str(tmp_path / "mixed"), None) is None
    run("orders", collection="orders")
    assert table_state(str(tmp_path / "orders")) == {
        k: {"id": k, "name": f"orders{k}", "n": k} for k in range(3)
    }


# -- cost: appends for new keys, merges pruned by the key range ------------------------------


def test_a_snapshot_of_new_keys_is_appended_and_an_overlapping_batch_merged(
    tmp_path: Path,
) -> None:
    """A snapshot loaded in chunks: a chunk whose keys lie outside every file's key range
    is appended (no merge reads the table); one that overlaps is merged, and a key it
    holds again is updated, never doubled."""
    target = str(tmp_path / "t")
    first = apply_batch(
        target, change_table([(k, f"a{k}", k, "insert") for k in range(0, 100)]), ["id"],
        app_id="q", batch_id=0,
    )  # fmt: skip
    assert first.metrics == {"num_target_rows_inserted": 100}
    second = apply_batch(
        target, change_table([(k, f"b{k}", k, "insert") for k in range(100, 200)]), ["id"],
        app_id="q", batch_id=1,
    )  # fmt: skip
    assert second.metrics.get("appended") is True
    third = apply_batch(
        target, change_table([(k, f"c{k}", 1000 + k, "insert") for k in (150, 250, 5)]), ["id"],
        app_id="q", batch_id=2,
    )  # fmt: skip
    assert "appended" not in third.metrics
    state = table_state(target)
    assert len(state) == 201
    assert (state[5]["name"], state[150]["name"], state[250]["name"]) == ("c5", "c150", "c250")
    table = open_table(target, None)
    assert table is not None and table.transaction_version("q") == 2


def keyed_batch(items: list[tuple[str, int, str, int, str]]) -> pa.Table:
    """Changes of a composite (text, int) key: (region, id, name, sequence, operation)."""
    return pa.table(
        {
            "region": pa.array([i[0] for i in items], pa.string()),
            "id": pa.array([i[1] for i in items], pa.int64()),
            "name": [i[2] for i in items],
            rows.SHARD: pa.array([0] * len(items), pa.int32()),
            rows.SEQUENCE: pa.array([i[3] for i in items], pa.int64()),
            rows.OPERATION: [i[4] for i in items],
            rows.TIMESTAMP: pa.array([T0] * len(items), pa.timestamp("us", tz="UTC")),
        }
    )


@pytest.mark.parametrize("file_size", [None, 2048])
def test_pruned_merges_of_text_and_composite_keys_never_miss_a_row(
    tmp_path: Path, file_size: int | None
) -> None:
    """Random inserts, updates and deletes of a (text, int) key whose texts share a prefix
    longer than a statistic keeps (200 characters), in tiny files (many file ranges to
    prune by), some batches new keys only (appended): the table equals a fold of the log,
    one row per key."""
    rng = random.Random(5)
    prefix = "p" * 200
    regions = [f"{prefix}{c}" for c in "abcdé€"] + ["", "z"]
    target = str(tmp_path / "t")
    model: dict[tuple[str, int], str] = {}
    sequence = 0
    fresh = 1000
    for batch_id in range(25):
        items = []
        for _ in range(rng.randrange(1, 30)):
            sequence += 1
            if batch_id % 5 == 4:  # a chunk of new keys only, above every key so far
                fresh += 1
                key = ("zz", fresh)
            else:
                key = (rng.choice(regions), rng.randrange(8))
            op = "delete" if key in model and rng.random() < 0.25 else "update"
            items.append((*key, f"n{sequence}", sequence, op))
            if op == "delete":
                model.pop(key, None)
            else:
                model[key] = f"n{sequence}"
        apply_batch(
            target, keyed_batch(items), ["region", "id"], app_id="q", batch_id=batch_id,
            target_file_size=file_size,
        )  # fmt: skip
        table = open_table(target, None)
        assert table is not None
        found = read_table(table).to_pylist()
        assert len(found) == len({(r["region"], r["id"]) for r in found}), "one row per key"
        assert {(r["region"], r["id"]): r["name"] for r in found} == model
    if file_size is not None:
        assert len(table.file_uris()) > 3  # several files: the merges had ranges to prune by


# -- a key changed by an update: the create takes the old key's unsent values ---------------


def moved(batch: pa.Table, old_keys: list[str | None]) -> pa.Table:
    return batch.append_column(rows.OLD_KEY, pa.array(old_keys, pa.string()))


@pytest.mark.parametrize("mode", ["scd1", "scd2"])
def test_a_changed_key_takes_the_old_keys_unsent_value(tmp_path: Path, mode: str) -> None:
    """An update of a row's primary key is a delete of the old key (its old image holds the
    key only) and a create of the new one that did not send its unchanged TOASTed column
    (``metadata.old_key`` names the old key). The create takes the old key's value: from
    the table's row, or from the old key's changes earlier in the batch; never the
    placeholder."""
    target = str(tmp_path / "t")
    first = with_body(change_table([(1, "a", 1, "insert"), (7, "g", 2, "insert")]), ["long", "g"])
    apply_batch(target, moved(first, [None, None]), ["id"], app_id="q", batch_id=0, mode=mode)
    second = with_body(
        change_table(
            [
                (1, "a", 3, "delete"),  # the old image: the key only
                (2, "a", 4, "insert"),  # id 1 -> 2: body from the table's row of 1
                (7, "g2", 5, "update"),
                (7, "g2", 6, "delete"),
                (8, "g2", 7, "insert"),  # id 7 -> 8: body from 7's update in this batch
                (8, "g3", 8, "update"),  # still not sent: 8's body, taken from 7
            ]
        ),
        [None, TOASTED, "g-body", None, TOASTED, TOASTED],
    )
    second = moved(second, [None, '{"id": 1}', None, None, '{"id":7}', None])
    apply_batch(target, second, ["id"], app_id="q", batch_id=1, mode=mode)
    table = open_table(target, None)
    assert table is not None
    found = read_table(table).to_pylist()
    current = {r["id"]: (r["name"], r["body"]) for r in found if r.get(rows.CURRENT, True)}
    assert current == {2: ("a", "long"), 8: ("g3", "g-body")}
    assert not [r for r in found if r["body"] == TOASTED]
    assert rows.OLD_KEY not in table.schema().to_arrow().names  # type: ignore[attr-defined]


@pytest.mark.parametrize("listed", [False, True])
@pytest.mark.parametrize("mode", ["scd1", "scd2"])
def test_a_key_changed_again_in_the_batch_keeps_the_unsent_value(
    tmp_path: Path, mode: str, listed: bool
) -> None:
    """A key changed three times in one micro-batch (1 -> 2 -> 3 -> 4) with its TOASTed
    column unchanged: each create takes the value of the key before it, the first from
    the table's row, the others from the creates earlier in the batch (issue 39, item
    10: the second create kept the placeholder). ``listed``: capture's form, the column
    named in ``__unavailable`` (a delete's every column), not the placeholder text."""
    target = str(tmp_path / "t")
    first = with_body(change_table([(1, "a", 1, "insert")]), ["long"])
    apply_batch(target, moved(first, [None]), ["id"], app_id="q", batch_id=0, mode=mode)
    body = None if listed else TOASTED
    chain = with_body(
        change_table(
            [
                (1, "a", 2, "delete"),
                (2, "a", 3, "insert"),
                (2, "a", 4, "delete"),
                (3, "a", 5, "insert"),
                (3, "a", 6, "delete"),
                (4, "z", 7, "insert"),
            ]
        ),
        [None, body, None, body, None, body],
    )
    chain = moved(chain, [None, '{"id":1}', None, '{"id":2}', None, '{"id":3}'])
    if listed:
        every, toasted = ["name", "body"], ["body"]
        unsent = [every, toasted, every, toasted, every, toasted]
        chain = chain.append_column(rows.UNSENT, pa.array(unsent, pa.list_(pa.string())))
    apply_batch(target, chain, ["id"], app_id="q", batch_id=1, mode=mode)
    table = open_table(target, None)
    assert table is not None
    found = read_table(table).to_pylist()
    current = {r["id"]: (r["name"], r["body"]) for r in found if r.get(rows.CURRENT, True)}
    assert current == {4: ("z", "long")}
    if mode == "scd2":  # every version of the chain holds the value
        assert {r["id"]: r["body"] for r in found} == {1: "long", 2: "long", 3: "long", 4: "long"}


# -- deleted keys keep their position (tombstones) ------------------------------------------


def test_a_deleted_key_never_comes_back_from_an_older_change(tmp_path: Path) -> None:
    """A checkpoint replaced under a new app_id replays the log from the start: the
    delete's position, kept in the tombstone table beside the target, stops the key's
    older insert and update; a newer insert brings the key back."""
    target = str(tmp_path / "t")
    history = [
        change_table([(1, "a", 1, "insert"), (2, "b", 2, "insert")]),
        change_table([(1, "a2", 3, "update"), (1, "a2", 4, "delete")]),
    ]
    for number, batch in enumerate(history):
        apply_batch(target, batch, ["id"], app_id="q", batch_id=number)
    assert set(table_state(target)) == {2}
    for number, batch in enumerate(history[:1]):  # the new checkpoint, midway
        apply_batch(target, batch, ["id"], app_id="q2", batch_id=number)
        assert set(table_state(target)) == {2}, "the deleted key came back"
    graves = open_table(tombstones_location(target), None)
    assert graves is not None
    assert read_table(graves).select(["id", rows.SEQUENCE]).to_pylist() == [
        {"id": 1, rows.SEQUENCE: 4}
    ]
    apply_batch(target, change_table([(1, "again", 9, "insert")]), ["id"], app_id="q2", batch_id=1)
    assert table_state(target)[1]["name"] == "again"


def test_a_crash_between_the_tombstones_and_the_table_commit_replays_the_delete(
    tmp_path: Path,
) -> None:
    """The tombstones are committed first: a crash before the table's commit leaves a
    tombstone of a delete not yet applied; the replayed batch (same app_id and batch id)
    still deletes the row."""
    target = str(tmp_path / "t")
    apply_batch(target, change_table([(1, "a", 1, "insert")]), ["id"], app_id="q", batch_id=0)
    delete = change_table([(1, "a", 2, "delete")])
    from replog.tables import delta

    real = delta._write

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("killed before the table's commit")

    delta._write = crash  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="killed"):
            apply_batch(target, delete, ["id"], app_id="q", batch_id=1)
    finally:
        delta._write = real  # type: ignore[assignment]
    assert set(table_state(target)) == {1}
    assert open_table(tombstones_location(target), None) is not None
    apply_batch(target, delete, ["id"], app_id="q", batch_id=1)
    assert table_state(target) == {}


# -- column defaults: rows written before a column existed read its default -----------------


@pytest.mark.parametrize("mode", ["scd1", "scd2"])
def test_rows_before_a_column_with_a_default_get_the_default(tmp_path: Path, mode: str) -> None:
    """ADD COLUMN ... DEFAULT: the batch that first carries the column gives the table's
    rows that no change of it touches the default (scd2: the current versions only), of
    each type; a row a change touches takes the change's value."""
    target = str(tmp_path / "t")
    first = change_table([(1, "a", 1, "insert"), (2, "b", 2, "insert"), (3, "c", 3, "insert")])
    apply_batch(target, first, ["id"], app_id="q", batch_id=0, mode=mode)
    apply_batch(
        target, change_table([(3, "c2", 4, "update")]), ["id"], app_id="q", batch_id=1, mode=mode
    )
    defaults = {
        "level": 7,
        "note": "it's new",
        "total": Decimal("1.50"),
        "since": datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=timezone.utc),
        "flag": True,
    }
    # 1: an older change (a replay) matches the row but does not replace it
    wider = change_table([(2, "b2", 5, "update"), (4, "d", 6, "insert"), (1, "old", 0, "update")])
    for name, value in defaults.items():
        kind = pa.decimal128(12, 2) if name == "total" else None
        wider = wider.append_column(name, pa.array([None, value, None], kind))
    wider = wider.set_column(
        wider.schema.get_field_index("since"), "since",
        wider.column("since").cast(pa.timestamp("us", tz="UTC")),
    )  # fmt: skip
    apply_batch(target, wider, ["id"], app_id="q", batch_id=2, mode=mode, defaults=defaults)
    table = open_table(target, None)
    assert table is not None
    found = read_table(table).to_pylist()
    current = {r["id"]: r for r in found if r.get(rows.CURRENT, True)}
    for key in (1, 3, 4):  # untouched rows, and the change that holds the value
        assert {n: current[key][n] for n in defaults} == defaults, key
    assert {n: current[2][n] for n in defaults} == dict.fromkeys(defaults)  # the change's
    if mode == "scd2":  # a version closed before the column existed keeps NULL; one
        closed = {r["name"]: r["level"] for r in found if not r[rows.CURRENT]}
        assert closed == {"c": None, "b": 7}  # current until this batch held the default
    # a later batch leaves the column alone
    apply_batch(
        target, wider.slice(0, 1), ["id"], app_id="q", batch_id=3, mode=mode, defaults=defaults
    )
    after = read_table(open_table(target, None)).to_pylist()  # type: ignore[arg-type]
    assert {r["id"]: r["name"] for r in after if r.get(rows.CURRENT, True)}[1] == "a"
    assert {r["id"]: r["level"] for r in after if r.get(rows.CURRENT, True)}[1] == 7


def test_a_crash_after_a_defaulted_column_was_added_fills_it_on_the_replay(
    tmp_path: Path,
) -> None:
    target = str(tmp_path / "t")
    apply_batch(target, change_table([(1, "a", 1, "insert")]), ["id"], app_id="q", batch_id=0)
    wider = change_table([(2, "b", 2, "insert")]).append_column("level", pa.array([3]))
    from replog.tables import delta

    real = delta._merge

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("killed before the merge's commit")

    delta._merge = crash  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="killed"):
            apply_batch(target, wider, ["id"], app_id="q", batch_id=1, defaults={"level": 9})
    finally:
        delta._merge = real  # type: ignore[assignment]
    table = open_table(target, None)
    assert table is not None and "level" in table.schema().to_arrow().names  # type: ignore[attr-defined]
    apply_batch(target, wider, ["id"], app_id="q", batch_id=1, defaults={"level": 9})
    assert {k: v for k, v in _levels(target).items()} == {1: 9, 2: 3}
    later = change_table([(1, "a", 5, "update")])
    later = later.append_column("level", pa.array([None], pa.int64()))
    # filled once: a later batch's untouched rows keep what they hold
    apply_batch(target, later, ["id"], app_id="q", batch_id=2, defaults={"level": 9})
    assert _levels(target) == {1: None, 2: 3}


def _levels(target: str) -> dict[int, Any]:
    table = open_table(target, None)
    assert table is not None
    return {r["id"]: r["level"] for r in read_table(table).to_pylist()}


def test_a_default_of_a_type_no_literal_holds_leaves_the_rows_null(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A default of a list column: no SQL literal is written for it; the batch applies and
    the earlier rows keep NULL, with a warning naming the column."""
    target = str(tmp_path / "t")
    apply_batch(target, change_table([(1, "a", 1, "insert")]), ["id"], app_id="q", batch_id=0)
    wider = change_table([(2, "b", 2, "insert")]).append_column(
        "tags", pa.array([["x"]], pa.list_(pa.string()))
    )
    apply_batch(target, wider, ["id"], app_id="q", batch_id=1, defaults={"tags": ["new"]})
    found = {r["id"]: r["tags"] for r in read_table(open_table(target, None)).to_pylist()}  # type: ignore[arg-type]
    assert found == {1: None, 2: ["x"]}
    assert "column 'tags'" in caplog.text


METADATA_TEXTS = [
    None,
    "{}",
    '{"source":{"version":"0.5.0","connector":"postgresql","name":"cap","lsn":157114144}}',
    '{"op":"u","source":{"connector":"mysql","name":"srv","pos":4},"transaction":'
    '{"id":"file.000001:1234","total_order":1}}',
    '{"transaction":{"id":"571:28753648","total_order":3},"source":{"lsn":28753000}}',
    '{"source" : { "connector" : "postgresql", "name" : "spaced" }}',
    '{"source":{"connector":"a}b","name":"x"}}',  # a brace inside a value
    '{"source":{"name":"x","connector":"a}b"}}',
    '{"source":{"name":"x","connector":"a{b"}}',
    '{"source":{"connector":"","name":"x"}}',
    '{"source":{"name":"x","connector":"sqlserver"},"lsn":7}',
    '{"source":{"connector":"postgresql"},"name":"outside"}',
    '{"source":{"nested":{"connector":"x"},"connector":"pg","name":"n"}}',
    '{"source":{"connector":"pg","name":"first"},"source":{"connector":"my","name":"2"}}',
    '{"source":{"name":"esc\\"aped","connector":"pg"}}',
    '{"lsn":null,"x":{"lsn":12}}',
    '{"transaction":null,"source":{"lsn":5}}',
    '{"transaction":{"id":"a}b:12"},"lsn":3}',
    '{"transaction":{"x":{"id":"n:1"}},"transaction":{"id":"t:9"}}',
    '{"transaction" : {"total_order":1, "id" : "571:44"}}',
    '{"transaction":{"id":"a:b:77","n":1}}',
]


def test_a_task_reads_each_events_source_and_position_as_the_core_does() -> None:
    """A task reads its events' sources and positions from each distinct metadata text
    once: per event, what the core reads from its own text (nulls, repeats, every form)."""
    from replog.spark import changes
    from replog.tables.coverage import event_positions, event_sources

    texts = pa.array(METADATA_TEXTS * 3, pa.string())
    batch = pa.RecordBatch.from_arrays(
        [pa.array(range(len(texts))), texts], names=["n", changes._METADATA]
    )
    found = changes._with_metadata_read(batch)
    assert found.schema.names == [
        "n", changes._POSITION, changes._SOURCE, rows.UNSENT, rows.OLD_KEY
    ]  # fmt: skip
    assert found.column(changes._POSITION).to_pylist() == event_positions(texts).to_pylist()
    assert found.column(changes._SOURCE).to_pylist() == event_sources(texts).to_pylist()
    assert found.column(changes._POSITION)[3].as_py() == 1234
    assert found.column(changes._SOURCE)[2].as_py() == "postgresql:cap"
    empty = changes._with_metadata_read(batch.slice(0, 0))
    assert empty.num_rows == 0 and empty.schema.names == found.schema.names


MARKED_TEXTS = [
    None,
    "{}",
    '{"unavailable":["big","blob"],"schema":"d1"}',
    '{"op":"c","old_key":"{\\"id\\":7}","schema":"d1"}',
    '{"old_key":"{\\"id\\":8}","unavailable":["big"]}',
    '{"old_key":{"id":9,"k":"x y"}}',  # an object where a text is meant
    '{"unavailable":"big"}',  # not a list
    '{"unavailable":[]}',
    '{"note":"the word unavailable\\" in a value"}',
    'unavailable" not json',
    '{"source":{"connector":"postgresql"},"unavailable":["a\\"b"]}',
]


@pytest.mark.spark
def test_a_task_reads_each_events_marks_as_spark_reads_them(spark: Any) -> None:
    """The columns an event did not send and a changed key's old key, read by a task from
    each distinct metadata text (``event_marks``), are what Spark's ``from_json`` of the
    text gives, per event (nulls, repeats, texts that name a mark but do not parse)."""
    from test_marks_attack import marks_of, spark_marks

    texts = MARKED_TEXTS * 2
    unsent, old_keys = marks_of(texts)
    expected_unsent, expected_old_keys = spark_marks(spark, texts)
    assert unsent == expected_unsent
    assert [None if o is None else json.loads(o) for o in old_keys] == [
        None if o is None else json.loads(o) for o in expected_old_keys
    ]
    assert unsent[2] == ["big", "blob"]
    assert old_keys[3] == '{"id":7}' and unsent[3] == []
