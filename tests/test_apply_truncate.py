"""A truncate event applied to Delta (FORMAT.md, "Segments"; CDC.md, "TRUNCATE"): the
rows of its shard older than it are gone, in the batch's one commit, once; other shards'
rows and the changes after it stay. Core (pyarrow batches into real Delta tables) and the
latest-state reads that must agree with it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from replog.errors import InvalidOptionError
from replog.tables import ahead, delta
from replog.tables import changes as rows
from replog.tables.delta import apply_batch, open_table, read_table

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)

# (table kind, mode): copy-on-write through delta-rs's merge, deletion vectors through
# replog's merge-on-read (scd1) or delta-rs's merge of a table that has them (scd2)
KINDS = [("cow", "scd1"), ("dv", "scd1"), ("cow", "scd2"), ("dv", "scd2")]


def batch(items: list[tuple[int | None, str | None, int, int, str]]) -> pa.Table:
    """A batch of changes: (id, name, shard, sequence, operation); a truncate has no row."""
    return pa.table(
        {
            "id": pa.array([i[0] for i in items], pa.int64()),
            "name": pa.array([i[1] for i in items], pa.string()),
            rows.SHARD: pa.array([i[2] for i in items], pa.int32()),
            rows.SEQUENCE: pa.array([i[3] for i in items], pa.int64()),
            rows.OPERATION: [i[4] for i in items],
            rows.TIMESTAMP: pa.array(
                [T0 + timedelta(seconds=i[3] + 100 * i[2]) for i in items],
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )


def apply(target: str, changes: pa.Table, batch_id: int, kind: str, mode: str, **extra: Any) -> Any:
    return apply_batch(
        target, changes, ["id"], app_id="q", batch_id=batch_id, mode=mode,
        deletion_vectors=kind == "dv", **extra,
    )  # fmt: skip


def current(target: str) -> dict[int, str]:
    """The table's live rows (scd2: its current versions), id -> name."""
    table = open_table(target, None)
    assert table is not None
    found = read_table(table).to_pylist()
    live = [r for r in found if r.get(rows.CURRENT, True)]
    assert len(live) == len({r["id"] for r in live}), "one live row per key"
    return {r["id"]: r["name"] for r in live}


def history(target: str) -> list[tuple[int, str, int, int | None, bool]]:
    """An scd2 table's versions: (id, name, valid from, valid to (seconds), current)."""
    table = open_table(target, None)
    assert table is not None
    return sorted(
        (
            r["id"],
            r["name"],
            int((r[rows.VALID_FROM] - T0).total_seconds()),
            None if r[rows.VALID_TO] is None else int((r[rows.VALID_TO] - T0).total_seconds()),
            r[rows.CURRENT],
        )
        for r in read_table(table).to_pylist()
    )


FIRST = batch([
    (1, "a", 0, 1, "insert"), (2, "b", 0, 2, "insert"), (3, "c", 0, 3, "insert"),
    (4, "d", 1, 1, "insert"), (5, "e", 1, 2, "insert"),
])  # fmt: skip


@pytest.mark.parametrize(("kind", "mode"), KINDS)
def test_a_truncate_removes_its_shards_older_rows_and_keeps_what_follows(
    tmp_path: Path, kind: str, mode: str
) -> None:
    """Shard 0 truncated at 10: its rows of earlier batches and its changes before 10 in
    this batch are gone (scd2: their versions end at the truncate), its changes after 10
    apply (a key truncated and inserted again too); shard 1 is untouched."""
    target = str(tmp_path / "t")
    apply(target, FIRST, 0, kind, mode)
    second = batch([
        (6, "f", 0, 5, "insert"),  # before the truncate, in the same batch: gone
        (1, "a2", 0, 6, "update"),
        (None, None, 0, 10, "truncate"),
        (2, "b-again", 0, 11, "insert"),  # after it: applies
        (7, "g", 0, 12, "insert"),
        (4, "d2", 1, 3, "update"),
    ])  # fmt: skip
    applied = apply(target, second, 1, kind, mode)
    assert not applied.skipped and applied.table_version == 1  # one commit
    assert current(target) == {2: "b-again", 7: "g", 4: "d2", 5: "e"}
    again = apply(target, second, 1, kind, mode)  # the batch replayed: skipped
    assert again.skipped and current(target) == {2: "b-again", 7: "g", 4: "d2", 5: "e"}
    if mode == "scd2":  # every version kept: those alive at the truncate end there
        assert history(target) == [
            (1, "a", 1, 6, False), (1, "a2", 6, 10, False),
            (2, "b", 2, 10, False), (2, "b-again", 11, None, True),
            (3, "c", 3, 10, False), (4, "d", 101, 103, False), (4, "d2", 103, None, True),
            (5, "e", 102, None, True), (6, "f", 5, 10, False), (7, "g", 12, None, True),
        ]  # fmt: skip


@pytest.mark.parametrize(("kind", "mode"), KINDS)
def test_a_batch_of_truncates_alone_empties_the_table_in_one_commit(
    tmp_path: Path, kind: str, mode: str
) -> None:
    """A batch holding only truncates (every shard's copy) still commits: the table
    emptied (scd2: every current version closed) and the batch recorded."""
    target = str(tmp_path / "t")
    apply(target, FIRST, 0, kind, mode)
    truncates = batch([(None, None, 0, 4, "truncate"), (None, None, 1, 3, "truncate")])
    applied = apply(target, truncates, 1, kind, mode)
    assert applied.table_version == 1
    assert current(target) == {}
    table = open_table(target, None)
    assert table is not None and table.transaction_version("q") == 1
    if mode == "scd2":
        assert [version[3] for version in history(target)] == [4, 4, 4, 103, 103]
    apply(target, batch([(8, "h", 0, 5, "insert")]), 2, kind, mode)
    assert current(target) == {8: "h"}


@pytest.mark.parametrize(("kind", "mode"), KINDS)
def test_two_truncates_of_a_shard_in_one_batch(tmp_path: Path, kind: str, mode: str) -> None:
    """Rows inserted between two truncates of a shard in one batch are gone (scd2: their
    versions end at the second); the table's rows end at the first."""
    target = str(tmp_path / "t")
    apply(target, FIRST, 0, kind, mode)
    second = batch([
        (None, None, 0, 10, "truncate"), (8, "h", 0, 11, "insert"), (1, "a3", 0, 12, "insert"),
        (None, None, 0, 20, "truncate"), (9, "i", 0, 21, "insert"),
    ])  # fmt: skip
    apply(target, second, 1, kind, mode)
    assert current(target) == {9: "i", 4: "d", 5: "e"}
    if mode == "scd2":
        assert history(target) == [
            (1, "a", 1, 10, False), (1, "a3", 12, 20, False), (2, "b", 2, 10, False),
            (3, "c", 3, 10, False), (4, "d", 101, None, True), (5, "e", 102, None, True),
            (8, "h", 11, 20, False), (9, "i", 21, None, True),
        ]  # fmt: skip


def test_a_truncate_into_no_table_yet_creates_it_from_the_rows_after_it(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    first = batch([(1, "a", 0, 1, "insert"), (None, None, 0, 2, "truncate"),
                   (2, "b", 0, 3, "insert")])  # fmt: skip
    apply(target, first, 0, "dv", "scd1")
    assert current(target) == {2: "b"}
    alone = str(tmp_path / "alone")
    only = apply(alone, batch([(None, None, 0, 1, "truncate")]), 0, "dv", "scd1")
    assert only.table_version is None
    assert open_table(alone, None) is None  # nothing to empty, nothing made


def test_latest_events_drop_what_a_truncate_of_their_shard_and_collection_voids() -> None:
    """The latest state the log reads (``view=latest``, capture's live rows) agrees with
    apply_changes: a truncate voids its collection's older events on its shard only."""

    def event(collection: str | None, key: str, op: str, shard: int, seq: int) -> dict[str, Any]:
        return {"collection": collection, "key": key, "operation": op, "shard": shard,
                "sequence": seq}  # fmt: skip

    events = pa.Table.from_pylist([
        event("a", "1", "insert", 0, 1), event("a", "2", "insert", 1, 1),
        event("b", "1", "insert", 0, 2), event(None, "9", "insert", 0, 3),
        event("a", '{"__truncate":0}', "truncate", 0, 4),
        event(None, '{"__truncate":0}', "truncate", 0, 5),
        event("a", "3", "insert", 0, 6), event("a", "1", "insert", 0, 7),
    ])  # fmt: skip
    latest = rows.latest_events([events])
    assert latest is not None
    assert sorted((r["collection"] or "", r["key"]) for r in latest.to_pylist()) == [
        ("a", "1"), ("a", "2"), ("a", "3"), ("b", "1"),
    ]  # fmt: skip


def test_rows_written_ahead_before_a_truncate_are_void(tmp_path: Path) -> None:
    """A task wrote the batch's new keys ahead (``write_ahead``), one before the truncate
    of its shard and one after: the first is gone, the second lands, one commit."""
    target = str(tmp_path / "t")
    apply(target, FIRST, 0, "dv", "scd1")
    plan = delta.ahead_plan(target, open_table(target, None), ["id"], min_rows=1)
    assert plan is not None
    changes = batch([(100, "x", 0, 5, "insert"), (None, None, 0, 10, "truncate"),
                     (101, "y", 0, 11, "insert"), (102, "z", 1, 4, "insert")])  # fmt: skip
    left, written = ahead.write_ahead(changes, plan)
    assert written is not None and written.keys.num_rows == 3  # the task wrote them
    applied = apply(target, left, 1, "dv", "scd1", ahead=[written])
    assert applied.table_version == 1
    assert current(target) == {101: "y", 102: "z", 4: "d", 5: "e"}


def test_a_truncate_of_another_collection_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """A table mirrors one collection: a batch holding another's truncate beside its
    changes is refused, not applied to this table."""
    target = str(tmp_path / "t")
    apply(target, FIRST, 0, "dv", "scd1")
    mixed = batch([(6, "f", 0, 8, "insert"), (None, None, 0, 9, "truncate")])
    mixed = mixed.append_column(rows.COLLECTION, pa.array(["a", "b"]))
    with pytest.raises(InvalidOptionError, match="collections"):
        apply(target, mixed, 1, "dv", "scd1")
    assert current(target) == {1: "a", 2: "b", 3: "c", 4: "d", 5: "e"}
