"""Rows written ahead by Spark's tasks (replog.tables.ahead) and committed by the driver
with the rest of their batch: the table equals the same changes applied by the driver,
and a fold of the log in Python, whatever the tasks wrote (a key written twice, a key the
table holds, a key with other changes in the batch, a key deleted before)."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import polars
import pyarrow as pa
import pytest

from replog.tables import ahead as written_ahead
from replog.tables import changes as rows
from replog.tables.delta import ahead_plan, apply_batch, open_table, read_table

UNSENT_BODY = ["body"]


def changes_of(events: list[dict[str, Any]]) -> pa.Table:
    """Changes of ``id long, name string, body string`` in the bookkeeping columns."""
    return pa.table(
        {
            "id": pa.array([e["id"] for e in events], pa.int64()),
            "name": pa.array([e["name"] for e in events], pa.string()),
            "body": pa.array([e["body"] for e in events], pa.string()),
            rows.SHARD: pa.array([e["id"] % 3 for e in events], pa.int32()),
            rows.SEQUENCE: pa.array([e["sequence"] for e in events], pa.int64()),
            rows.OPERATION: pa.array([e["operation"] for e in events], pa.string()),
            rows.TIMESTAMP: pa.nulls(len(events), pa.timestamp("us", tz="UTC")),
            rows.UNSENT: pa.array([e["unsent"] for e in events], pa.list_(pa.string())),
        }
    )


def workload(seed: int, batches: int, keys: int) -> list[list[dict[str, Any]]]:
    """Batches of random inserts, updates (some not sending ``body``) and deletes; a
    key's events in log order (its shard's sequence grows)."""
    rng = random.Random(seed)
    alive: set[int] = set()
    sequence = 0
    out = []
    for _ in range(batches):
        batch = []
        for _ in range(rng.randrange(20, 120)):
            sequence += 1
            k = rng.randrange(keys)
            unsent: list[str] = []
            body: str | None = f"b{sequence}"
            if k not in alive:
                op = "insert"
                alive.add(k)
            elif rng.random() < 0.15:
                op = "delete"
                alive.discard(k)
            else:
                op = "update"
                if rng.random() < 0.3:
                    body, unsent = None, UNSENT_BODY
            batch.append(
                {"id": k, "name": f"n{sequence}", "body": body, "sequence": sequence,
                 "operation": op, "unsent": unsent}
            )  # fmt: skip
        out.append(batch)
    return out


def fold(batches: list[list[dict[str, Any]]]) -> dict[int, tuple[str, str | None]]:
    """The rows the log leaves: per key its last change; a body not sent is kept."""
    state: dict[int, tuple[str, str | None]] = {}
    for batch in batches:
        for event in sorted(batch, key=lambda e: e["sequence"]):
            if event["operation"] == "delete":
                state.pop(event["id"], None)
                continue
            body = event["body"]
            if event["unsent"]:
                body = state.get(event["id"], (None, None))[1]
            state[event["id"]] = (event["name"], body)
    return state


def rows_of(target: str) -> dict[int, tuple[str, str | None]]:
    table = open_table(target, None)
    assert table is not None
    found = read_table(table).to_pylist()
    assert len(found) == len({r["id"] for r in found}), "one row per key"
    via_polars = polars.read_delta(target).sort("id")
    assert via_polars.height == len(found), "polars reads the same rows"
    return {r["id"]: (r["name"], r["body"]) for r in found}


def in_tasks(changes: pa.Table, rng: random.Random, tasks: int) -> list[pa.Table]:
    """The batch's changes cut into ``tasks`` random slices, as Spark's partitions of a
    shard's ranges would be (a key's changes may fall into several)."""
    cuts = sorted(rng.sample(range(1, changes.num_rows), tasks - 1))
    bounds = [0, *cuts, changes.num_rows]
    return [changes.slice(a, b - a) for a, b in itertools.pairwise(bounds)]


def written_in_tasks(
    target: str, changes: pa.Table, rng: random.Random, blind: bool
) -> tuple[pa.Table, list[written_ahead.Prewritten]]:
    """What the tasks of a micro-batch hand the driver: the changes they did not write,
    the files they wrote. ``blind``: a plan that takes no key as held (a stale plan):
    the driver must still be exact."""
    plan = ahead_plan(target, open_table(target, None), ["id"], min_rows=1)
    assert plan is not None
    if blind:
        plan = written_ahead.Plan(plan.root, plan.schema, plan.keys, ([], []), 1)
    left, files = [], []
    for part in in_tasks(changes, rng, 4):
        rest, written = written_ahead.write_ahead(part, plan)
        left.append(rest)
        if written is not None:
            files.append(written)
    return pa.concat_tables(left), files


def test_rows_written_ahead_apply_as_the_drivers_would(tmp_path: Path) -> None:
    rng = random.Random(41)
    batches = workload(41, batches=14, keys=60)
    ahead_target, driver_target = str(tmp_path / "ahead"), str(tmp_path / "driver")
    seen: dict[str, int] = {}
    for batch_id, batch in enumerate(batches):
        changes = changes_of(batch)
        left, files = written_in_tasks(ahead_target, changes, rng, blind=batch_id % 2 == 1)
        done = apply_batch(ahead_target, left, ["id"], app_id="a", batch_id=batch_id, ahead=files)
        apply_batch(driver_target, changes, ["id"], app_id="a", batch_id=batch_id)
        for name, value in done.metrics.items():
            if name.startswith("num_rows_"):
                seen[name] = seen.get(name, 0) + int(value)
        assert rows_of(ahead_target) == rows_of(driver_target) == fold(batches[: batch_id + 1])
    # every way a row written ahead can go was taken
    assert seen["num_rows_written_ahead"] > 0
    assert seen["num_rows_taken_back"] > 0  # a key with other changes in its batch
    assert seen["num_rows_ahead_written_twice"] > 0  # a key in two tasks
    assert seen["num_rows_ahead_stale"] == 0  # no older change written over a newer row


def test_a_row_written_ahead_older_than_the_tables_is_dropped(tmp_path: Path) -> None:
    """A replay under another app id (a replaced checkpoint) writes old rows ahead: the
    table's newer rows stay, and a deleted key stays deleted."""
    target = str(tmp_path / "t")
    first = [
        {"id": k, "name": f"new{k}", "body": "x", "sequence": 100 + k, "operation": "insert",
         "unsent": []}
        for k in range(6)
    ]  # fmt: skip
    apply_batch(target, changes_of(first), ["id"], app_id="a", batch_id=0)
    gone = [{**first[5], "sequence": 200, "operation": "delete"}]
    apply_batch(target, changes_of(gone), ["id"], app_id="a", batch_id=1)
    old = [
        {"id": k, "name": f"old{k}", "body": "y", "sequence": k + 1, "operation": "insert",
         "unsent": []}
        for k in range(8)
    ]  # fmt: skip
    plan = ahead_plan(target, open_table(target, None), ["id"], min_rows=1)
    assert plan is not None
    blind = written_ahead.Plan(plan.root, plan.schema, plan.keys, ([], []), 1)
    left, written = written_ahead.write_ahead(changes_of(old), blind)
    assert written is not None and left.num_rows == 0
    done = apply_batch(target, left, ["id"], app_id="b", batch_id=0, ahead=[written])
    assert done.metrics["num_rows_ahead_stale"] == 5  # keys 0-4: the table's rows are newer
    assert done.metrics["num_rows_taken_back"] == 1  # key 5: its tombstone is checked
    found = rows_of(target)
    assert found == {**{k: (f"new{k}", "x") for k in range(5)}, 6: ("old6", "y"), 7: ("old7", "y")}


def test_a_replayed_batch_deletes_the_files_its_tasks_wrote(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    events = [
        {"id": k, "name": f"n{k}", "body": "b", "sequence": k + 1, "operation": "insert",
         "unsent": []}
        for k in range(30)
    ]  # fmt: skip
    changes = changes_of(events)
    rng = random.Random(3)
    left, files = written_in_tasks(target, changes, rng, blind=False)
    apply_batch(target, left, ["id"], app_id="a", batch_id=0, ahead=files)
    version = open_table(target, None).version()  # type: ignore[union-attr]
    left, again = written_in_tasks(target, changes, rng, blind=True)
    assert again, "the replay's tasks wrote files"
    done = apply_batch(target, left, ["id"], app_id="a", batch_id=0, ahead=again)
    assert done.skipped
    assert open_table(target, None).version() == version  # type: ignore[union-attr]
    for one in again:
        assert not (Path(target) / one.add["path"]).exists(), "a replay's file is deleted"
    assert len(rows_of(target)) == 30


@pytest.mark.parametrize("how", ["copy-on-write", "scd2"])
def test_files_written_ahead_a_table_cannot_take_are_applied_as_changes(
    tmp_path: Path, how: str
) -> None:
    """A table written copy-on-write (no deletion vectors) or kept as scd2 history takes
    no file as it is: the rows are read back, applied by the driver, the files deleted."""
    target = str(tmp_path / "t")
    mode = "scd2" if how == "scd2" else "scd1"
    vectors = how != "copy-on-write"
    events = [
        {"id": k, "name": f"n{k}", "body": "b", "sequence": k + 1, "operation": "insert",
         "unsent": []}
        for k in range(20)
    ]  # fmt: skip
    plan = written_ahead.Plan(str(tmp_path / "t"), None, ("id",), ([], []), 1)
    (tmp_path / "t").mkdir()
    left, written = written_ahead.write_ahead(changes_of(events), plan)
    assert written is not None
    apply_batch(
        target, left, ["id"], app_id="a", batch_id=0, mode=mode, deletion_vectors=vectors,
        ahead=[written],
    )  # fmt: skip
    assert not (Path(target) / written.add["path"]).exists()
    table = open_table(target, None)
    assert table is not None
    assert sorted(r["id"] for r in read_table(table).to_pylist()) == list(range(20))


def test_only_whole_row_images_of_keys_not_held_are_written_ahead(tmp_path: Path) -> None:
    events = [
        {"id": 1, "name": "a", "body": "x", "sequence": 1, "operation": "insert", "unsent": []},
        {"id": 2, "name": "b", "body": None, "sequence": 2, "operation": "update",
         "unsent": UNSENT_BODY},
        {"id": 3, "name": "c", "body": rows.UNAVAILABLE, "sequence": 3, "operation": "update",
         "unsent": []},
        {"id": 4, "name": "d", "body": "x", "sequence": 4, "operation": "delete", "unsent": []},
        {"id": 50, "name": "e", "body": "x", "sequence": 5, "operation": "update", "unsent": []},
        {"id": 7, "name": "f", "body": "x", "sequence": 6, "operation": "update", "unsent": []},
    ]  # fmt: skip
    changes = changes_of(events)
    assert written_ahead.plain(changes, ["id"]).tolist() == [True, False, False, False, True, True]
    held = written_ahead.merged_ranges([40, 5, 45], [60, 8, 50])
    assert held == ([5, 40], [8, 60])
    assert written_ahead.outside(changes.column("id"), held).tolist() == [
        True, True, True, True, False, False,
    ]  # fmt: skip
    plan = written_ahead.Plan(str(tmp_path), None, ("id",), held, 1)
    left, written = written_ahead.write_ahead(changes, plan)
    assert written is not None
    assert written.keys.column("id").to_pylist() == [1]
    assert left.column("id").to_pylist() == [2, 3, 4, 50, 7]
    assert written_ahead.write_ahead(changes, written_ahead.Plan(str(tmp_path), None, ("id",),
                                                                 held, 2))[1] is None  # fmt: skip
    restored = written_ahead.Prewritten.from_bytes(written.to_bytes())
    assert restored.add == written.add and restored.keys.equals(written.keys)
    assert np.array_equal(
        written_ahead.outside(pa.chunked_array([pa.array([None, 3], pa.int64())]), ([], [])),
        [False, True],
    )


def test_the_tables_key_ranges_steer_the_tasks(tmp_path: Path) -> None:
    """The plan's ranges are the table's files' and its tombstones'; a table whose keys
    are dates takes no row ahead (only integers and texts are compared)."""
    target = str(tmp_path / "t")
    first = [
        {"id": k, "name": "a", "body": "x", "sequence": k, "operation": "insert", "unsent": []}
        for k in (10, 20)
    ]  # fmt: skip
    apply_batch(target, changes_of(first), ["id"], app_id="a", batch_id=0)
    gone = [{**first[0], "id": 90, "sequence": 3, "operation": "delete"}]
    apply_batch(target, changes_of(gone), ["id"], app_id="a", batch_id=1)
    plan = ahead_plan(target, open_table(target, None), ["id"])
    assert plan is not None and plan.held == ([10, 90], [20, 90])
    assert json.loads(json.dumps(plan.schema.names)) == ["id", "name", "body", *rows.POSITION]
