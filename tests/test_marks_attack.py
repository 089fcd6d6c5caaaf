"""Adversarial tests of an event's marks read by apply_changes' task (``event_marks`` in
``_with_metadata_read``) instead of Spark's projection (``from_json(metadata, "unavailable
array<string>, old_key string")``, a NULL ``unavailable`` read as an empty list)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from replog.log import ReplicationLog
from replog.spark.functions import apply_changes
from replog.spark.schema import SPARK_SCHEMA_DDL
from replog.tables import changes as rows
from replog.tables.delta import open_table, read_table

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
SCHEMA = "id long, name string, total long"


def marks_of(texts: list[str | None]) -> tuple[list[Any], list[Any]]:
    from replog.spark import changes

    batch = pa.RecordBatch.from_arrays(
        [pa.array(range(len(texts))), pa.array(texts, pa.string())],
        names=["n", changes._METADATA],
    )
    found = changes._with_metadata_read(batch)
    return found.column(rows.UNSENT).to_pylist(), found.column(rows.OLD_KEY).to_pylist()


def spark_marks(spark: Any, texts: list[str | None]) -> tuple[list[Any], list[Any]]:
    from pyspark.sql import functions as F

    frame = spark.createDataFrame([(t,) for t in texts], "m string")
    parsed = frame.select(
        F.from_json("m", "unavailable array<string>, old_key string").alias("p")
    ).select(
        F.coalesce(F.col("p.unavailable"), F.array().cast("array<string>")).alias("u"),
        F.col("p.old_key").alias("o"),
    )
    found = parsed.collect()
    return [list(r.u) for r in found], [r.o for r in found]


# -- texts the replog log stores (valid JSON objects), read as Spark read them ----------------

PLAUSIBLE = [
    '{"op":"u","unavailable":["caf\\u00e9","\\ud83d\\ude00","a\\\\b","q\\"t"]}',
    '{"op":"u","unavailable":["café","名前"],"source":{"unavailable":["inner"]}}',
    '{"op":"c","old_key":"{\\"id\\":\\"\\u00e9\\\\\\"x\\"}","unavailable":["total"]}',
    '{"source":{"old_key":"{\\"id\\":1}"},"op":"u"}',  # nested: not the event's mark
    '{"transaction":{"id":"7:1"},"unavailable":["total"],"old_key":null}',
    '{"unavailable":null,"old_key":"{\\"id\\":2}"}',
    '{"unavailable" :  [ "total" ] , "old_key" : "{\\"id\\":3}" }',
    "{}",
    None,
]


@pytest.mark.spark
def test_marks_of_texts_capture_and_the_log_can_hold_match_spark(spark: Any) -> None:
    """Unicode (raw and escaped, a surrogate pair), escaped quotes and backslashes,
    members of the same name nested in another object, explicit nulls, spacing: the
    task's marks are Spark's, byte for byte (an old key is compared as text: the fill
    parses it, and a life's rows compare it)."""
    texts = PLAUSIBLE * 3
    assert marks_of(texts) == spark_marks(spark, texts)


# -- texts the log accepts that the task cannot read --------------------------------------


def test_the_log_accepts_a_lone_surrogate_escape_in_metadata(tmp_path: Path) -> None:
    """The premise of the next tests: ``{"unavailable":["\\ud800"]}`` is a JSON object
    of ASCII text, so the log stores it."""
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    log.append(
        [
            {
                "key": '{"id":1}',
                "operation": "update",
                "data": '{"id":1,"name":"a"}',
                "timestamp": T0,
                "metadata": '{"op":"u","unavailable":["\\ud800"]}',
            }
        ]
    )


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('{"op":"u","unavailable":["\\ud800"]}', id="lone-surrogate-in-unavailable"),
        pytest.param('{"op":"c","old_key":"\\udfff"}', id="lone-surrogate-in-old_key"),
        pytest.param(
            '{"unavailable":["x"],"deep":' + "[" * 3000 + "]" * 3000 + "}", id="deep-nesting"
        ),
    ],
)
def test_a_text_the_task_cannot_read_marks_nothing_and_fails_no_task(text: str) -> None:
    """``event_marks`` promises that a text it cannot read marks nothing, as Spark's
    ``from_json`` reads it (Spark: ``?`` for a lone surrogate, NULL for a too deep
    text). A ``UnicodeEncodeError`` (``pa.array`` of a lone surrogate) or a
    ``RecursionError`` (``json.loads``) is no ``ValueError``: it escapes, and fails the
    task and so the whole micro-batch, on every retry (the query cannot pass the
    event). The other events of the batch keep their marks."""
    unsent, old_keys = marks_of([text, '{"unavailable":["total"]}', None])
    assert unsent[1:] == [["total"], []] and old_keys[1:] == [None, None]


@pytest.mark.spark
def test_a_lone_surrogate_in_a_logged_events_metadata_does_not_stop_the_stream(
    spark: Any, tmp_path: Path
) -> None:
    """End to end: an event the log accepted (its metadata names a column as
    ``"\\ud800"``) went through Spark's projection (the name read as ``?``, no column);
    read by the task, the query fails and cannot get past it."""
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    log.append(
        [
            {"key": '{"id":1}', "operation": "insert", "timestamp": T0,
             "data": '{"id":1,"name":"a","total":5}', "metadata": '{"op":"c"}'},
            {"key": '{"id":1}', "operation": "update", "timestamp": T0,
             "data": '{"id":1,"name":"a2","total":6}',
             "metadata": '{"op":"u","unavailable":["\\ud800"]}'},
        ]
    )  # fmt: skip
    target = str(tmp_path / "t")
    query = (
        spark.readStream.format("replog")
        .load(log.url)
        .writeStream.foreachBatch(apply_changes(target, ["id"], app_id="q", schema=SCHEMA))
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    found = read_table(open_table(target, None)).to_pylist()  # type: ignore[arg-type]
    assert [(r["id"], r["name"], r["total"]) for r in found] == [(1, "a2", 6)]


# -- texts of other writers (apply_changes takes any frame shaped like the source's) --------


@pytest.mark.spark
def test_texts_spark_reads_marks_from_are_read_by_the_task_too(spark: Any) -> None:
    """Shapes Python's ``json.loads`` refuses or reads otherwise than Spark's parser:
    content after the object (a NUL a C writer left, a second object), a null item
    (Spark: null), items that are not text (Spark: their compact JSON, characters as they
    are), an old key that is an object. Where Spark read a column as not sent and the
    task does not, the update's NULL would overwrite the stored value. (Single quotes and
    a member repeated with another type are read otherwise still: ``event_marks`` says
    so; no replog writer makes them.)"""
    texts = [
        '{"op":"u","unavailable":["total"]}\x00',
        '{"op":"u","unavailable":["total"]}{"op":"u"}',
        '  {"op":"u","unavailable":["total"]}',
        '{"unavailable":["total",null]}',
        '{"unavailable":[["a", "b"],{"k": 1, "é": "ü"}, 1.5, true]}',
        '{"old_key":{"id":"é", "n": [1, 2]}}',
    ]
    assert marks_of(texts) == spark_marks(spark, texts)


# -- end to end, both ways a batch is split -------------------------------------------------


def _frame(
    spark: Any, events: list[tuple[int, str, dict[str, Any], str | None]], first: int
) -> Any:
    """A micro-batch of (id, operation, data, metadata), numbered from ``first``."""
    records = [
        (0, first + n, f"e{first + n}", T0, op, None, json.dumps({"id": data["id"]}),
         bytearray(json.dumps(data).encode()), None, meta)
        for n, (_, op, data, meta) in enumerate(events)
    ]  # fmt: skip
    return spark.createDataFrame(records, SPARK_SCHEMA_DDL)


def _big_frame(spark: Any, count: int, first: int, base: int) -> Any:
    """``count`` inserts of new keys ``base``.. (ids), numbered from ``first``."""
    return spark.range(count).selectExpr(
        "cast(0 as int) as shard",
        f"id + {first} as sequence",
        "concat('b', id) as event_id",
        "timestamp'2024-01-01 00:00:00' as timestamp",
        "'insert' as operation",
        "cast(null as string) as collection",
        f"to_json(named_struct('id', id + {base})) as key",
        f"cast(to_json(named_struct('id', id + {base}, 'name', 'big', 'total', id)) as binary)"
        " as data",
        "cast(null as binary) as before",
        'if(id % 2 = 0, cast(null as string), \'{"op":"c","snapshot":"true"}\') as metadata',
    )


def _unsent(old_key: int | None = None, extra: str = "") -> str:
    marks = {"op": "c" if old_key is not None else "u", "unavailable": ["total"]}
    if old_key is not None:
        marks["old_key"] = json.dumps({"id": old_key}, separators=(",", ":"))
    return json.dumps(marks)[:-1] + extra + "}"


def _key_change(old: int, new: int, name: str, *, sent: int | None = None) -> list[Any]:
    """Capture's delete of ``old`` and create of ``new`` (``total`` not sent unless
    ``sent``)."""
    create = {"id": new, "name": name, **({"total": sent} if sent is not None else {})}
    meta = json.dumps({"old_key": json.dumps({"id": old})}) if sent is not None else _unsent(old)
    return [
        (old, "delete", {"id": old}, json.dumps({"new_key": json.dumps({"id": new})})),
        (new, "insert", create, meta),
    ]


@pytest.mark.spark
def test_unsent_columns_and_changed_keys_end_to_end_through_tasks_and_the_driver(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TOASTed updates (``total`` not sent, listed in ``unavailable``) and changed keys
    (``old_key``), mixed with events without marks and without metadata, in a query's
    first batch (tasks), a small batch after it (split on the driver), and a batch after
    one of more than LOCAL_EVENTS events (tasks again, over several partitions): every
    unsent ``total`` keeps the key's (or the old key's) value, none becomes NULL."""
    from replog.spark import apply as applying
    from replog.spark.changes import LOCAL_EVENTS

    ways: list[bool] = []
    gather = applying.gather

    def recorded(*args: Any, local: bool = False) -> Any:
        ways.append(local)
        return gather(*args, local=local)

    monkeypatch.setattr(applying, "gather", recorded)
    target = str(tmp_path / "t")
    apply = apply_changes(target, ["id"], app_id="q", schema=SCHEMA)
    model: dict[int, tuple[str, int | None]] = {}

    first = [
        (1, "insert", {"id": 1, "name": "a", "total": 10}, None),
        (2, "insert", {"id": 2, "name": "b", "total": 20}, '{"op":"c"}'),
        (3, "insert", {"id": 3, "name": "c", "total": 30}, "{}"),
        (4, "insert", {"id": 4, "name": "d", "total": 40}, '{"op":"c"}'),
        (3, "update", {"id": 3, "name": "c2"}, _unsent(extra=',"é":"\\"unavailable\\""')),
        *_key_change(4, 41, "d2"),  # from the batch's delete of 4
        (6, "insert", {"id": 6, "name": "f", "total": 60}, '{"unavailable":[]}'),
    ]
    apply(_frame(spark, first, 0), 0)  # a query's first batch: tasks
    model.update({1: ("a", 10), 2: ("b", 20), 3: ("c2", 30), 41: ("d2", 40), 6: ("f", 60)})

    second = [
        (1, "update", {"id": 1, "name": "a2"}, _unsent()),  # from the table
        *_key_change(2, 21, "b2"),  # from the table's row of 2
        (41, "update", {"id": 41, "name": "d3"}, _unsent()),
        (6, "update", {"id": 6, "name": "f2", "total": None}, '{"op":"u"}'),  # sent: NULL
        (7, "insert", {"id": 7, "name": "g", "total": 70}, None),
        (7, "update", {"id": 7, "name": "g2"}, _unsent()),
    ]
    apply(_frame(spark, second, 100), 1)  # small: on the driver
    del model[2]
    model.update({1: ("a2", 10), 21: ("b2", 20), 41: ("d3", 40), 6: ("f2", None), 7: ("g2", 70)})

    big = LOCAL_EVENTS + 1
    apply(_big_frame(spark, big, 1000, 100_000), 2)  # after a small one: on the driver
    model.update({100_000 + i: ("big", i) for i in range(big)})

    third = [
        (1, "update", {"id": 1, "name": "a3"}, _unsent()),
        *_key_change(21, 22, "b3"),
        *_key_change(3, 31, "c3", sent=33),  # a changed key that sent its value
        (100_005, "update", {"id": 100_005, "name": "big2"}, _unsent()),
        *_key_change(100_007, 7_000, "big3"),
        (7, "update", {"id": 7, "name": "g3"}, _unsent(extra=',"old_key":null')),
        *_key_change(41, 42, "d4"),
        *_key_change(42, 43, "d5"),  # changed twice in the batch
    ]
    frame = _frame(spark, third, 100_000_000).repartition(3)
    apply(frame, 3)  # after a big one: tasks
    for gone in (21, 3, 100_007, 41):
        del model[gone]
    model.update(
        {1: ("a3", 10), 22: ("b3", 20), 31: ("c3", 33), 100_005: ("big2", 5),
         7_000: ("big3", 7), 7: ("g3", 70), 43: ("d5", 40)}
    )  # fmt: skip

    found = read_table(open_table(target, None)).to_pylist()  # type: ignore[arg-type]
    state = {r["id"]: (r["name"], r["total"]) for r in found}
    assert ways == [False, True, True, False]  # tasks, driver, driver, tasks
    assert len(found) == len(state)
    assert state == model
