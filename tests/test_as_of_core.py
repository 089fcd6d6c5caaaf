"""The as-of core without Spark: which Delta version and which log events a point needs
(``replog.tables.as_of.plan``), against real Delta commits of ``apply_batch`` that record
their coverage and a real log, also once retention removed the log's first events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from replog.errors import AsOfError
from replog.log import ReplicationLog
from replog.ops.retention import truncate
from replog.tables import as_of
from replog.tables import coverage as covered
from replog.tables.changes import OPERATION, SEQUENCE, SHARD, SOURCE_POSITION, TIMESTAMP
from replog.tables.delta import apply_batch, open_table, read_table

T0 = 1_735_689_600_000


def lsn(txn: int) -> int:
    return 0x500_0000 + txn * 0x100


def append_txn(log: ReplicationLog, txn: int, keys: list[int]) -> None:
    """One source transaction: an upsert of each key, sharing its commit LSN and time."""
    log.append(
        [
            {
                "collection": "t",
                "key": json.dumps({"id": k}),
                "operation": "update",
                "data": json.dumps({"id": k, "txn": txn}),
                "timestamp": T0 + txn * 1000,
                "metadata": json.dumps({"transaction": {"id": f"{txn}:{lsn(txn)}"}}),
            }
            for k in keys
        ]
    )


def apply_since(
    log: ReplicationLog, target: str, after: dict[int, int], batch_id: int, mode: str = "scd1"
) -> None:
    """The log's events after ``after`` applied as one batch whose commit records them."""
    events = log.read_all(after)
    rows = [json.loads(d) for d in events.column("data").to_pylist()]
    changes = pa.table(
        {
            "id": pa.array([r["id"] for r in rows], pa.int64()),
            "txn": pa.array([r["txn"] for r in rows], pa.int64()),
            SHARD: events.column("shard"),
            SEQUENCE: events.column("sequence"),
            OPERATION: events.column("operation"),
            TIMESTAMP: events.column("timestamp"),
            SOURCE_POSITION: covered.event_positions(events.column("metadata")),
        }
    )
    span = covered.Span.of(
        covered.event_positions(events.column("metadata")),
        covered.event_times(events.column("timestamp")),
    )
    batch = covered.BatchCoverage.of_events(
        events.column("shard"), events.column("sequence"), pa.array([]), pa.array([])
    )
    coverage = covered.Coverage(batch.offsets, span, log.log_id, "t", ("id",), mode)
    apply_batch(
        target, changes, ["id"], app_id="core", batch_id=batch_id, mode=mode, coverage=coverage
    )


@pytest.fixture(params=["scd1"])
def replica(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Transactions 1-6 in the log; version 0 holds 1-2, version 1 holds 3-4."""
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    target = str(tmp_path / "table")
    append_txn(log, 1, [1, 2, 3])
    append_txn(log, 2, [2])
    apply_since(log, target, {}, 0, request.param)
    first = log.head()
    append_txn(log, 3, [1, 4])
    append_txn(log, 4, [3])
    apply_since(log, target, first, 1, request.param)
    second = log.head()
    append_txn(log, 5, [2, 5])
    append_txn(log, 6, [1])
    return {"log": log, "target": target, "offsets": (first, second)}


def planned(replica: dict[str, Any], txn_lsn: int) -> as_of.Plan:
    table = open_table(replica["target"], None)
    assert table is not None
    versions = covered.table_history(table.history())
    return as_of.plan(versions, replica["log"], as_of.Point(position=txn_lsn))


def txns(plan: as_of.Plan) -> list[int]:
    return sorted({json.loads(d)["txn"] for d in plan.events.column("data").to_pylist()})


def test_the_newest_version_at_or_below_the_point_and_the_events_after_it(
    replica: dict[str, Any],
) -> None:
    cases = {
        lsn(1): (None, [1]),  # before version 0 ends: from the empty table
        lsn(2) - 1: (None, [1]),
        lsn(2): (0, []),  # version 0 ends exactly there
        lsn(3): (0, [3]),  # inside version 1's batch
        lsn(4): (1, []),
        lsn(5): (1, [5]),  # past the last version: the log alone
        lsn(6): (1, [5, 6]),
    }
    for point, (version, events) in cases.items():
        plan = planned(replica, point)
        assert (plan.version, txns(plan)) == (version, events), hex(point)


def test_the_commits_record_cumulative_offsets_and_spans(replica: dict[str, Any]) -> None:
    table = open_table(replica["target"], None)
    assert table is not None
    versions = covered.table_history(table.history())
    first, second = replica["offsets"]
    assert [dict(v.coverage.offsets) for v in versions] == [
        {s: q for s, q in first.items() if q},
        {s: q for s, q in second.items() if q},
    ]
    assert [(v.coverage.batch.first_position, v.reached.last_position) for v in versions] == [
        (lsn(1), lsn(2)),
        (lsn(3), lsn(4)),
    ]
    assert versions[1].coverage.batch.last_ms == T0 + 4000
    log = replica["log"]
    apply_since(log, replica["target"], second, 2)  # transactions 5-6
    before = log.head()
    append_txn(log, 7, [1])  # one key: one shard
    apply_since(log, replica["target"], before, 3)
    table.update_incremental()
    last = covered.table_history(table.history())[-1]
    assert len([s for s, q in log.head().items() if q > before[s]]) == 1
    assert dict(last.coverage.offsets) == {s: q for s, q in log.head().items() if q}


def test_past_retention_a_version_ending_at_the_point_is_read_alone_else_the_range_is_named(
    replica: dict[str, Any],
) -> None:
    log = replica["log"]
    _, second = replica["offsets"]
    truncate(log, {s: q + 1 for s, q in second.items()}, force=True)  # txns 1-4 gone
    assert planned(replica, lsn(4)).version == 1  # the log still holds what follows
    assert txns(planned(replica, lsn(5))) == [5]
    plan = planned(replica, lsn(2))  # version 0 ends there: nothing at or before it later
    assert (plan.version, plan.events.num_rows) == (0, 0)
    with pytest.raises(AsOfError, match=r"not reachable.*Reachable: from 0/5000400 to 0/5000600"):
        planned(replica, lsn(3))  # inside version 1's batch: its events are gone
    with pytest.raises(AsOfError, match=r"not reachable"):
        planned(replica, lsn(1))


@pytest.mark.parametrize("replica", ["scd2"], indirect=True)
def test_past_retention_an_scd2_table_is_read_from_a_later_versions_history(
    replica: dict[str, Any],
) -> None:
    """The events between version 0 and version 1 gone, a point inside version 1's batch
    is read from version 1's history, cut at the point by its rows' validity positions:
    the versions opened after it are left out, those closed after it are current."""
    log = replica["log"]
    _, second = replica["offsets"]
    truncate(log, {s: q + 1 for s, q in second.items()}, force=True)  # txns 1-4 gone
    table = open_table(replica["target"], None)
    assert table is not None
    versions = covered.table_history(table.history())
    at = as_of.Point(position=lsn(4) - 1)  # after txn 3, before txn 4
    with pytest.raises(AsOfError, match="not reachable"):
        as_of.plan(versions, log, at, cut=False)
    plan = as_of.plan(versions, log, at)
    assert (plan.cut, plan.version) == (True, 1)
    table.load_as_version(1)
    found = as_of.history_at(read_table(table), at)
    assert found is not None
    rows = sorted((r["id"], r["txn"], r["__current"]) for r in found.to_pylist())
    assert rows == [(1, 1, False), (1, 3, True), (2, 1, False), (2, 2, True), (3, 1, True),
                    (4, 3, True)]  # fmt: skip
    assert {r["__valid_to_position"] for r in found.to_pylist() if r["__current"]} == {None}


def test_a_point_newer_than_the_log_is_refused(replica: dict[str, Any]) -> None:
    with pytest.raises(AsOfError, match=r"newer than the log's newest event \(0/5000600\)"):
        planned(replica, lsn(6) + 1)


def test_rows_as_of_reduce_as_a_batch_does() -> None:
    """Base rows plus later changes: a delete removes its key, an update replaces it, a
    change at or before its key's row position is not applied again, and a truncate of a
    shard ends the rows of its keys and the changes before it."""
    base = pa.table(
        {
            "id": pa.array([1, 2, 3], pa.int64()),
            "v": ["a", "b", "c"],
            SHARD: pa.array([0, 0, 1], pa.int32()),
            SEQUENCE: pa.array([1, 2, 1], pa.int64()),
        }
    )
    changes = pa.table(
        {
            "id": pa.array([1, 2, 2, 4], pa.int64()),
            "v": ["a1", "stale", None, "d"],
            SHARD: pa.array([0, 0, 0, 1], pa.int32()),
            SEQUENCE: pa.array([3, 2, 4, 3], pa.int64()),
            OPERATION: ["update", "update", "delete", "insert"],
            TIMESTAMP: pa.array([0, 0, 0, 0], pa.timestamp("us", tz="UTC")),
        }
    )
    found = as_of.rows_as_of(base, changes, ["id"]).to_pylist()
    assert sorted((r["id"], r["v"]) for r in found) == [(1, "a1"), (3, "c"), (4, "d")]
    truncates = pa.table(
        {
            "shard": pa.array([1], pa.int32()),
            "sequence": pa.array([2], pa.int64()),  # after the row at 1, before the insert
            "timestamp": pa.array([0], pa.timestamp("us", tz="UTC")),
        }
    )
    found = as_of.rows_as_of(base, changes, ["id"], truncates=truncates).to_pylist()
    assert sorted((r["id"], r["v"]) for r in found) == [(1, "a1"), (4, "d")]


def test_points_are_parsed_strictly() -> None:
    assert as_of.point(lsn="16/B374D848") == as_of.Point(position=0x16B374D848)
    assert as_of.point(at="2025-01-01T00:00:00") == as_of.Point(ms=T0)
    with pytest.raises(Exception, match="not a PostgreSQL LSN"):
        as_of.point(lsn="16/")
    with pytest.raises(Exception, match="exactly one"):
        as_of.point()


def history_changes(events: list[tuple[int, int, str, int | None, int]]) -> pa.Table:
    """Changes (key, sequence, operation, value, source position) on shard 0; a key of
    None for a truncate; the position's number is the change's time in ms too."""
    return pa.table(
        {
            "id": pa.array([e[0] for e in events], pa.int64()),
            "v": pa.array([e[3] for e in events], pa.int64()),
            SHARD: pa.array([0] * len(events), pa.int32()),
            SEQUENCE: pa.array([e[1] for e in events], pa.int64()),
            OPERATION: [e[2] for e in events],
            TIMESTAMP: pa.array([e[4] * 1000 for e in events], pa.timestamp("us", tz="UTC")),
            SOURCE_POSITION: pa.array([e[4] for e in events], pa.int64()),
        }
    )


@pytest.mark.parametrize("mode", ["scd1", "scd2"])
def test_truncates_after_a_version_reduce_as_the_batch_that_applies_them(
    tmp_path: Path, mode: str
) -> None:
    """A version, then changes with two truncates between them: the rows as of their
    end (the version's rows and the changes, truncates apart) are the rows of the table
    that applies the changes as one micro-batch, row by row (scd2: every version, its
    validity times and positions: the table's versions end at the first truncate; a key
    changed before it ends at its change; the changes before a truncate end at it)."""
    target = str(tmp_path / "t")
    first = history_changes([(1, 1, "insert", 10, 100), (2, 2, "insert", 20, 101),
                             (3, 3, "insert", 30, 102)])  # fmt: skip
    apply_batch(target, first, ["id"], app_id="a", batch_id=0, mode=mode)
    table = open_table(target, None)
    assert table is not None
    base = read_table(table)
    tail = [
        (2, 4, "update", 21, 110),  # a key of the version, changed before the truncate
        (4, 5, "insert", 40, 111),  # a key born and ended between the version and it
        (None, 6, "truncate", None, 112),
        (5, 7, "insert", 50, 113),
        (None, 8, "truncate", None, 114),
        (1, 9, "insert", 11, 115),  # a key of the version, back after the truncates
        (6, 10, "insert", 60, 116),
    ]
    changes = history_changes(tail)
    apply_batch(target, changes, ["id"], app_id="a", batch_id=1, mode=mode)
    applied = read_table(open_table(target, None))  # type: ignore[arg-type]
    is_truncate = pa.array([e[2] == "truncate" for e in tail])
    marks = changes.filter(is_truncate)
    truncates = pa.table(
        {
            "shard": marks.column(SHARD),
            "sequence": marks.column(SEQUENCE),
            "timestamp": marks.column(TIMESTAMP),
            "position": marks.column(SOURCE_POSITION),
        }
    )
    rest = changes.filter(pc.invert(is_truncate))
    found = as_of.rows_as_of(base, rest, ["id"], mode=mode, truncates=truncates)

    def ordered(table: pa.Table) -> list[dict[str, Any]]:
        return sorted(table.to_pylist(), key=lambda r: (r["id"], r[SEQUENCE]))

    assert ordered(found.select(applied.column_names)) == ordered(applied)
    if mode == "scd2":
        ends = {(r["id"], r["v"]): r["__valid_to_position"] for r in applied.to_pylist()}
        assert ends == {(1, 10): 112, (2, 20): 110, (2, 21): 112, (3, 30): 112, (4, 40): 112,
                        (5, 50): 114, (1, 11): None, (6, 60): None}  # fmt: skip
