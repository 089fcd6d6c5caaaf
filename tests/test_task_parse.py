"""Payloads a task parses with Arrow (replog.tables.payloads) give the Delta table
Spark's own typing gives, through real Spark: inserts, updates, an unchanged TOASTed
value, a changed key, deletes and a truncate, in the tasks (mapInArrow) and on the driver
(a small batch), and an event of a schema version registered after the plan fails the
batch, naming it, as Spark's typing does."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from test_apply_routing import T0, envelope
from test_payloads import SIMPLE

from replog.log import ReplicationLog
from replog.processlocal import ProcessDict
from replog.schemas import registry
from replog.spark import apply as apply_module
from replog.spark import changes as changes_module
from replog.spark.changes import Part, changes_frame
from replog.spark.functions import apply_changes
from replog.tables import payloads
from replog.tables.delta import open_table, read_table

pytestmark = pytest.mark.spark


def _event(key: int, op: str, row: dict[str, Any] | None, **meta: Any) -> dict[str, Any]:
    return {
        "collection": "s.t",
        "key": json.dumps({"id": key}),
        "operation": op,
        "data": None if row is None else json.dumps(row),
        "timestamp": T0,
        "metadata": json.dumps(meta, separators=(",", ":")),
    }


def _row(n: int) -> dict[str, Any]:
    return {"id": n, "small": n % 300 - 150, "tiny": n % 100, "n": n * 7, "ok": n % 2 == 0,
            "name": f"name {n} \u00e9\"", "born": n - 1000, "seen": n * 1_000_003,
            "at": n * 86_400_001, "when": -n * 1000, "clock": n * 1_000_001,
            "ms_clock": n * 1001, "spent": -n, "tag": f"tag-{n}"}  # fmt: skip


def _log(tmp_path: Path) -> tuple[ReplicationLog, str]:
    log = ReplicationLog.create(str(tmp_path / "log"), 1)  # the truncate: every row
    fields = [{"optional": True, **f} for f in SIMPLE["fields"]]  # keyed by id alone
    digest = registry.register(log.storage, "s.t", envelope(fields))
    log.append([_event(n, "insert", _row(n), schema=digest) for n in range(40)])
    log.append([{"collection": "s.t", "key": None, "operation": "truncate", "data": "{}",
                 "timestamp": T0, "metadata": json.dumps({"schema": digest})}])  # fmt: skip
    log.append([_event(n, "insert", _row(n), schema=digest) for n in range(40, 60)])
    log.append([
        _event(43, "update", {**_row(43), "name": "__debezium_unavailable_value", "n": 1},
               schema=digest, unavailable=["name"]),
        _event(44, "delete", {"id": 44}, schema=digest),
        _event(45, "delete", {"id": 45}, schema=digest, new_key='{"id":500}'),
        _event(500, "insert", {**_row(45), "id": 500, "name": "__debezium_unavailable_value"},
               schema=digest, old_key='{"id":45}', unavailable=["name"]),
        _event(46, "update", {"id": 46, "small": None, "name": None}, schema=digest),
        _event(47, "update", {**_row(47), "tiny": None}, schema=digest),
    ])  # fmt: skip
    log.append([_event(n, "insert", _row(n), schema=digest) for n in range(70, 90)])
    return log, digest


def run(spark: Any, log: ReplicationLog, checkpoint: Path, apply: Any) -> None:
    """Batches of 7 events: the key change (events 63 and 64) in one."""
    query = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", "7")
        .load(log.url)
        .writeStream.foreachBatch(apply)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def _applied(spark: Any, log: ReplicationLog, tmp_path: Path, name: str) -> pa.Table:
    target = str(tmp_path / name)
    apply = apply_changes(target, app_id=name, log=log.url, collection="s.t")
    run(spark, log, tmp_path / f"chk-{name}", apply)
    table = open_table(target, None)
    assert table is not None
    found = read_table(table)
    return found.sort_by("id")


@pytest.mark.parametrize("tasks", [True, False], ids=["tasks", "driver"])
def test_a_task_parsed_table_equals_sparks_typing(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tasks: bool
) -> None:
    log, _ = _log(tmp_path)
    if tasks:  # every batch through mapInArrow's tasks, none split on the driver
        monkeypatch.setattr(apply_module, "LOCAL_EVENTS", -1)
    batch = spark.read.format("replog").load(log.url)
    part = Part(0, "s.t", ("id",), None, registry.versions(log.storage, "s.t"))
    assert changes_frame(batch, [part])[1][0].parse is not None  # the task parses it
    parsed = _applied(spark, log, tmp_path, "parsed")
    monkeypatch.setattr(payloads, "plan", lambda *_: None)
    monkeypatch.setattr(changes_module, "_BUILT", ProcessDict())  # built again, by Spark
    assert changes_frame(batch, [part])[1][0].parse is None
    typed = _applied(spark, log, tmp_path, "typed")
    assert parsed.schema == typed.schema
    assert parsed.to_pylist() == typed.to_pylist()
    rows = {r["id"]: r for r in parsed.to_pylist()}
    kept = sorted({*range(40, 60), *range(70, 90), 500} - {44, 45})  # truncated before 40
    assert sorted(rows) == kept
    assert rows[71]["name"] == _row(71)["name"] and rows[71]["tiny"] == 71
    assert (rows[43]["name"], rows[43]["n"]) == (_row(43)["name"], 1)  # the TOASTed text kept
    assert rows[500]["name"] == _row(45)["name"]  # the changed key's, from the old key
    assert (rows[46]["small"], rows[46]["name"], rows[46]["tiny"]) == (None, None, None)
    assert rows[47]["tiny"] is None and rows[47]["born"] == date(1967, 5, 24)


def test_an_event_of_a_version_the_plan_lacks_fails_its_batch(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan is made from the versions registered when the batch is planned; an event
    naming another (a writer that registers after appending, or another log's digest)
    must not be read with a union that lacks its columns."""
    monkeypatch.setattr(apply_module, "LOCAL_EVENTS", -1)
    log, _ = _log(tmp_path)
    log.append([_event(1, "update", _row(1), schema="f" * 64)])
    apply = apply_changes(str(tmp_path / "t"), app_id="a", log=log.url, collection="s.t")
    with pytest.raises(Exception, match=r"names schema version f{64}, not known to typed"):
        run(spark, log, tmp_path / "chk", apply)
