"""Merge-on-read with Delta deletion vectors: what apply_changes writes is read the same
by delta-rs (its scan and its DataFusion SQL), by polars and by delta-rs at every older
version, after every kind of change; a reader without deletion-vector support refuses the
table; and the write path holds through a crash between its files and its commit, a
replayed batch, a lost commit race and a purge running beside it."""

from __future__ import annotations

import json
import random
import shutil
import threading
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import deltalake
import polars
import pyarrow as pa
import pytest
from pyroaring import BitMap64

from replog.errors import CorruptionError
from replog.tables import changes as rows
from replog.tables import deletion_vectors as dvs
from replog.tables import merge_on_read
from replog.tables.delta import apply_batch, open_table, read_table
from replog.tables.delta_log import DeltaLog

TOASTED = rows.UNAVAILABLE
T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


# -- the bytes, against the protocol's own examples ------------------------------------------


def test_a_descriptor_names_its_file_as_the_protocol_example_does() -> None:
    found = dvs.Descriptor("u", "ab^-aqEH.-t@S}K{vb[*k^", 4, 40, 6)
    assert found.relative_file() == "ab/deletion_vector_d2c639aa-8816-431a-aaf6-d3fe2512ff61.bin"
    assert found.unique_id == "uab^-aqEH.-t@S}K{vb[*k^@4"


def test_a_dv_file_round_trips_and_a_damaged_one_is_refused() -> None:
    name = uuid.uuid4()
    bitmaps = [BitMap64([3, 4, 7, 11, 18, 29]), BitMap64([0, 1 << 33])]
    content, descriptors = dvs.pack(bitmaps, name)
    assert content[0] == 1  # the format version
    # magic (4) + buckets (8) + the bucket's key (4) + its 32-bit roaring bitmap (28)
    assert descriptors[0].offset == 1 and descriptors[0].size_in_bytes == 44
    assert [dvs.from_file(d, content) for d in descriptors] == bitmaps
    # the portable format: the magic number, then RoaringFormatSpec's 64-bit serialisation
    start = descriptors[0].offset + 4
    assert content[start : start + 4] == (1681511377).to_bytes(4, "little")
    damaged = bytearray(content)
    damaged[start + 20] ^= 0xFF
    with pytest.raises(CorruptionError, match="CRC-32"):
        dvs.from_file(descriptors[0], bytes(damaged))
    wrong = dvs.Descriptor("u", descriptors[1].path_or_inline_dv, descriptors[1].offset, 1, 2)
    with pytest.raises(CorruptionError):
        dvs.from_file(wrong, content)


# -- a model workload through apply_batch; every reader checked after each batch ------------


def batch_of(items: list[dict[str, Any]]) -> pa.Table:
    """Changes (id, name, body, sequence, operation, old key) as the core takes them."""
    return pa.table(
        {
            "id": pa.array([i["id"] for i in items], pa.int64()),
            "name": pa.array([i.get("name") for i in items], pa.string()),
            "body": pa.array([i.get("body") for i in items], pa.string()),
            rows.SHARD: pa.array([0] * len(items), pa.int32()),
            rows.SEQUENCE: pa.array([i["seq"] for i in items], pa.int64()),
            rows.OPERATION: pa.array([i["op"] for i in items], pa.string()),
            rows.TIMESTAMP: pa.array(
                [T0 + timedelta(seconds=i["seq"]) for i in items], pa.timestamp("us", tz="UTC")
            ),
            rows.OLD_KEY: pa.array([i.get("old") for i in items], pa.string()),
        }
    )


class Model:
    """The rows a table must hold, and the changes that make them: updates (some with
    their body unsent, as PostgreSQL's unchanged TOASTed values), deletes, inserts, key
    changes (a delete and a create naming the old key, its body unsent)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.rows: dict[int, tuple[str, str]] = {}
        self.seq = 0
        self.next_id = 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def batch(self, size: int, *, inserts: float = 0.25) -> pa.Table:
        items: list[dict[str, Any]] = []
        moved: set[int] = set()  # moved in this batch: not moved again (left for later)
        for _ in range(size):
            roll = self.rng.random()
            alive = sorted(self.rows)
            if not alive or roll < inserts:
                key = self.next_id
                self.next_id += 1
                seq = self._next()
                self.rows[key] = (f"n{seq}", f"b{seq}")
                items.append({"id": key, "name": f"n{seq}", "body": f"b{seq}", "seq": seq,
                              "op": "insert"})  # fmt: skip
            elif roll < inserts + 0.4:
                key = self.rng.choice(alive)
                unsent = self.rng.random() < 0.4
                seq = self._next()
                body = self.rows[key][1] if unsent else f"ub{seq}"
                self.rows[key] = (f"u{seq}", body)
                items.append({"id": key, "name": f"u{seq}", "body": TOASTED if unsent else body,
                              "seq": seq, "op": "update"})  # fmt: skip
            elif roll < inserts + 0.6:
                key = self.rng.choice(alive)
                del self.rows[key]
                items.append({"id": key, "seq": self._next(), "op": "delete"})
            else:  # the key changes: the body goes along unsent
                old = self.rng.choice([k for k in alive if k not in moved] or alive)
                if old in moved:
                    continue
                new = self.next_id
                self.next_id += 1
                _, body = self.rows.pop(old)
                items.append({"id": old, "seq": self._next(), "op": "delete"})
                seq = self._next()
                moved.add(new)
                self.rows[new] = (f"m{seq}", body)
                items.append({"id": new, "name": f"m{seq}", "body": TOASTED, "seq": seq,
                              "op": "insert", "old": json.dumps({"id": old})})  # fmt: skip
        return batch_of(items)


def readers(target: str, version: int | None = None) -> dict[str, dict[int, tuple[str, str]]]:
    """What each reader finds in the table (at ``version``: delta-rs's time travel)."""
    table = deltalake.DeltaTable(target, version=version)
    scanned = read_table(table).to_pylist()
    sql = pa.table(
        deltalake.QueryBuilder()
        .register("t", table)
        .execute("SELECT id, name, body FROM t")
        .read_all()
    ).to_pylist()
    found = {"delta-rs scan": scanned, "delta-rs SQL": sql}
    if version is None:
        found["polars"] = polars.read_delta(target).to_dicts()
    else:
        found["polars"] = polars.read_delta(target, version=version).to_dicts()
    out = {}
    for name, listed in found.items():
        keyed = {r["id"]: (r["name"], r["body"]) for r in listed}
        assert len(keyed) == len(listed), f"{name}: one row per key"
        out[name] = keyed
    return out


def apply(target: str, batch: pa.Table, batch_id: int, app_id: str = "a") -> Any:
    return apply_batch(target, batch, ["id"], app_id=app_id, batch_id=batch_id)


def test_every_reader_reads_every_kind_of_change_and_every_older_version(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    model = Model(seed=41)
    expected: dict[int, dict[int, tuple[str, str]]] = {}
    used = []
    for batch_id in range(12):
        done = apply(
            target, model.batch(60, inserts=1) if batch_id == 0 else model.batch(25), batch_id
        )
        used.append(bool(done.metrics.get("merge_on_read")))
        expected[done.table_version] = dict(model.rows)
        for name, found in readers(target).items():
            assert found == model.rows, (batch_id, name)
    assert used[0] is False and all(used[1:]), "batch 0 created the table, the rest merged on read"
    table = open_table(target, None)
    assert table is not None
    assert table.protocol().reader_features == ["deletionVectors"]
    assert pa.RecordBatchReader.from_stream(table.deletion_vectors()).read_all().num_rows
    for version, state in expected.items():  # a reader at an older version
        for name, found in readers(target, version).items():
            assert found == state, (version, name)


def test_a_handle_kept_between_batches_and_checkpoints_of_replogs_own_commits(
    tmp_path: Path,
) -> None:
    """apply_changes keeps one handle of a table and refreshes it once per batch, before
    the batch (never after replog's own commit): every batch's version is the one its
    commit made, a batch on a handle never refreshed still lands exactly, and a Delta
    checkpoint is written every ``delta.checkpointInterval`` versions of replog's own."""
    target = str(tmp_path / "t")
    model = Model(seed=7)
    apply(target, model.batch(40, inserts=1), 0)
    deltalake.DeltaTable(target).alter.set_table_properties({"delta.checkpointInterval": "3"})
    kept = open_table(target, None)
    assert kept is not None
    versions = []
    for batch_id in range(1, 9):
        if batch_id % 2:  # as apply_changes' lookup; the even batches on a stale handle
            kept.update_incremental()
        done = apply_batch(target, model.batch(20), ["id"], app_id="a", batch_id=batch_id,
                           table=kept)  # fmt: skip
        assert done.metrics.get("merge_on_read"), batch_id
        versions.append(done.table_version)
        for name, found in readers(target).items():
            assert found == model.rows, (batch_id, name)
    fresh = deltalake.DeltaTable(target)
    assert versions == list(range(versions[0], versions[0] + 8)) and versions[-1] == fresh.version()
    logged = {p.name for p in (Path(target) / "_delta_log").iterdir()}
    due = [v for v in versions if v % 3 == 0]
    assert due and all(f"{v:020d}.checkpoint.parquet" in logged for v in due), sorted(logged)
    assert fresh.transaction_version("a") == 8


def test_new_keys_are_appended_by_replogs_writer_in_one_commit_a_replay_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of keys no file holds (a follower's inserts, pgbench_history's rows) is one
    ``WRITE`` commit of replog's own (no read of the log through delta-rs), with the batch's
    transaction and file statistics: every reader reads it, a replay adds nothing, a crash
    before its commit leaves the table as it was, and a column it adds is added first."""
    target = str(tmp_path / "t")
    model = Model(seed=43)
    apply(target, model.batch(30, inserts=1), 0)
    batches = [model.batch(20, inserts=1), model.batch(20, inserts=1)]
    for batch_id, batch in enumerate(batches, start=1):
        done = apply(target, batch, batch_id)
        assert done.metrics.get("appended") and done.metrics.get("merge_on_read"), done.metrics
        assert done.metrics["num_target_rows_inserted"] == 20
    for name, found in readers(target).items():
        assert found == model.rows, name
    table = open_table(target, None)
    assert table is not None
    newest = table.history(limit=1)[0]
    assert (newest["operation"], newest["engineInfo"]) == ("WRITE", "replog")
    assert table.transaction_version("a") == 2
    stats = pa.table(table.get_add_actions(flatten=True))
    assert stats.column("min.id").null_count == 0  # the next batch's pruning needs them
    version = table.version()
    assert apply(target, batches[1], 2).skipped
    assert open_table(target, None).version() == version  # type: ignore[union-attr]

    batch = model.batch(10, inserts=1)

    def crash(self: DeltaLog, version: int, actions: Any) -> None:
        raise KeyboardInterrupt("killed before the commit")

    monkeypatch.setattr(DeltaLog, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        apply(target, batch, 3)
    monkeypatch.undo()
    merge_on_read._TABLES.clear()
    assert open_table(target, None).version() == version  # type: ignore[union-attr]
    assert apply(target, batch, 3).metrics["appended"]
    files = len(deltalake.DeltaTable(target).file_uris())
    gone = apply(target, batch_of([{"id": 9_999, "seq": 9_999, "op": "delete"}]), 4)
    assert gone.metrics["num_target_rows_inserted"] == 0  # a key never held: no empty file
    assert len(deltalake.DeltaTable(target).file_uris()) == files
    wider = batch_of([{"id": 10_000, "name": "w", "body": "b", "seq": 10_000, "op": "insert"}])
    wider = wider.append_column("extra", pa.array(["x"]))
    assert apply(target, wider, 5).metrics["appended"]
    found = polars.read_delta(target).to_dicts()
    assert {r["id"]: (r["name"], r["body"]) for r in found} == {**model.rows, 10_000: ("w", "b")}
    assert [r["extra"] for r in found if r["id"] == 10_000] == ["x"]
    assert sum(r["extra"] is None for r in found) == len(model.rows)


def test_a_reader_without_deletion_vector_support_refuses_the_table(tmp_path: Path) -> None:
    target = str(tmp_path / "t")
    model = Model(seed=3)
    apply(target, model.batch(30, inserts=1), 0)
    apply(target, model.batch(30), 1)
    table = open_table(target, None)
    assert table is not None
    protocol = table.protocol()
    assert (protocol.min_reader_version, protocol.min_writer_version) == (3, 7)
    # delta-rs's pyarrow path does not apply deletion vectors: it refuses, it never misreads
    with pytest.raises(deltalake.exceptions.DeltaProtocolError, match="deletionVectors"):
        table.to_pyarrow_dataset()
    with pytest.raises(deltalake.exceptions.DeltaProtocolError, match="deletionVectors"):
        table.to_pyarrow_table()


def test_a_replayed_batch_changes_nothing_and_an_old_one_rolls_nothing_back(
    tmp_path: Path,
) -> None:
    target = str(tmp_path / "t")
    model = Model(seed=5)
    batches = [model.batch(80, inserts=1), *(model.batch(40) for _ in range(3))]
    for batch_id, batch in enumerate(batches):
        apply(target, batch, batch_id)
    version = open_table(target, None).version()  # type: ignore[union-attr]
    assert apply(target, batches[2], 2).skipped  # the same app, a batch it committed
    # the same changes under another app id (a replaced checkpoint): each is at or before
    # its row's position, so none is applied
    again = apply(target, batches[1], 0, app_id="other")
    assert again.metrics["num_stale_changes"] > 0
    assert again.metrics["num_target_rows_inserted"] == 0
    assert open_table(target, None).version() == version + 1  # type: ignore[union-attr]
    for name, found in readers(target).items():
        assert found == model.rows, name


def test_a_crash_between_the_files_and_the_commit_leaves_the_table_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's row file and DV file are written, its commit is not: the table reads as
    before; the replayed batch commits once, and no commit names the dead attempt's files
    (they are garbage for a VACUUM that lists the folder: delta-rs's lite VACUUM, run here,
    leaves the table whole)."""
    target = str(tmp_path / "t")
    model = Model(seed=9)
    apply(target, model.batch(50, inserts=1), 0)
    before = dict(model.rows)
    batch = model.batch(30)

    def crash(self: DeltaLog, version: int, actions: Any) -> None:
        raise KeyboardInterrupt("killed before the commit")

    monkeypatch.setattr(DeltaLog, "commit", crash)
    existing = {p.name for p in Path(target).iterdir()}
    with pytest.raises(KeyboardInterrupt):
        apply(target, batch, 1)
    monkeypatch.undo()
    orphans = {p.name for p in Path(target).iterdir()} - existing
    assert any(name.startswith("deletion_vector_") for name in orphans)
    merge_on_read._TABLES.clear()  # a new process: nothing of the dead one's state
    for name, found in readers(target).items():
        assert found == before, name
    done = apply(target, batch, 1)
    assert done.table_version == 1 and not done.skipped
    state = merge_on_read.table(str(Path(target).resolve())).log.state()
    named = set(state.files)
    for add in state.files.values():
        if add.get("deletionVector"):
            named.add(dvs.Descriptor.from_json(add["deletionVector"]).relative_file())
    assert not orphans & named, "a file of the dead attempt is in a commit"
    table = open_table(target, None)
    assert table is not None
    table.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    for name, found in readers(target).items():
        assert found == model.rows, name


def test_a_batch_that_loses_the_commit_race_starts_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer (delta-rs's own compaction, which rewrites the files the batch found
    its rows in) commits the version the batch was about to: the batch's commit fails, it
    reads the new version, finds its rows in the new files and commits after it."""
    target = str(tmp_path / "t")
    model = Model(seed=11)
    for batch_id in range(3):
        apply(target, model.batch(50, inserts=1 if batch_id == 0 else 0.25), batch_id)
    batch = model.batch(20)
    real = DeltaLog.commit
    attempts: list[int] = []

    def race(self: DeltaLog, version: int, actions: Any) -> None:
        attempts.append(version)
        if len(attempts) == 1:
            compacted = deltalake.DeltaTable(target).optimize.compact()
            assert compacted["numFilesRemoved"] > 1
        real(self, version, actions)

    monkeypatch.setattr(DeltaLog, "commit", race)
    done = apply(target, batch, 3)
    assert attempts == [3, 4] and done.table_version == 4
    for name, found in readers(target).items():
        assert found == model.rows, name


def test_a_purge_beside_a_running_apply_loses_nothing(tmp_path: Path) -> None:
    """Purges run in a loop in another thread while batches apply; each purge folds the
    deletion vectors and small files into new files, carrying the rows deleted since it
    read them; at the end (and after every batch) every reader sees the model's rows."""
    target = str(tmp_path / "t")
    model = Model(seed=13)
    apply(target, model.batch(200, inserts=1), 0)
    root = str(Path(target).resolve())
    stop = threading.Event()
    purged: list[merge_on_read.Purged] = []
    failures: list[BaseException] = []

    def purging() -> None:
        try:
            while not stop.is_set():
                purged.append(merge_on_read.purge(merge_on_read.table(root), small_file=1 << 30))
        except BaseException as exc:  # handed to the test's thread below
            failures.append(exc)

    worker = threading.Thread(target=purging)
    worker.start()
    try:
        for batch_id in range(1, 25):
            apply(target, model.batch(30), batch_id)
            for name, found in readers(target).items():
                assert found == model.rows, (batch_id, name)
    finally:
        stop.set()
        worker.join(300)
    assert not failures, failures
    committed = [p for p in purged if p.version is not None]
    assert committed, "some purge committed while the batches applied"
    table = open_table(target, None)
    assert table is not None
    assert table.transaction_version("a") == 24
    for name, found in readers(target).items():
        assert found == model.rows, name


def test_rows_deleted_while_a_purge_rewrites_are_deleted_in_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch commits between the purge's read of a file and the purge's commit (it
    deletes rows of that file): the purge's new file carries those rows in its deletion
    vector, so they stay deleted."""
    target = str(tmp_path / "t")
    model = Model(seed=17)
    apply(target, model.batch(100, inserts=1), 0)
    apply(target, model.batch(30), 1)
    real = merge_on_read.read_all
    meanwhile = model.batch(30, inserts=0)

    def read_then_apply(*args: Any) -> pa.Table:
        found = real(*args)
        if meanwhile.num_rows:
            apply(target, meanwhile, 2)  # once: the batch ids make the rest skips
        return found

    monkeypatch.setattr(merge_on_read, "read_all", read_then_apply)
    done = merge_on_read.purge(merge_on_read.table(str(Path(target).resolve())), small_file=1 << 30)
    assert done.version == 3  # after the batch's commit (2)
    state = merge_on_read.table(str(Path(target).resolve())).log.state()
    assert any(add.get("deletionVector") for add in state.files.values())
    for name, found in readers(target).items():
        assert found == model.rows, name


def test_a_timestamp_without_time_zone_gets_its_table_feature(tmp_path: Path) -> None:
    """PROTOCOL.md: a table with a timestamp without time zone lists ``timestampNtz``
    (PostgreSQL's ``timestamp``, as pgbench_history's ``mtime``); readers refuse it
    otherwise."""
    target = str(tmp_path / "t")
    model = Model(seed=19)
    first = model.batch(20, inserts=1)
    stamps = pa.array([datetime(2024, 1, 1, 0, 0, i) for i in range(20)], pa.timestamp("us"))
    apply(target, first.append_column("at", stamps), 0)
    second = model.batch(10)
    apply(target, second.append_column("at", stamps.slice(0, second.num_rows)), 1)
    table = open_table(target, None)
    assert table is not None
    assert sorted(table.protocol().reader_features or []) == ["deletionVectors", "timestampNtz"]
    for name, found in readers(target).items():
        assert found == model.rows, name


# -- found by the adversarial review (issue 41) ----------------------------------------------


def test_a_toast_fill_and_a_key_change_read_rows_of_files_delta_rs_merged(tmp_path: Path) -> None:
    """A column added with a default is filled by a delta-rs merge, which writes the
    table's strings as Arrow ``string_view``; a later unchanged TOASTed value (and a key
    change) of a row in such a file is filled from it, and must not fail on the view type
    (pyarrow has no ``take`` for views)."""
    target = str(tmp_path / "t")
    first = [{"id": i, "name": f"n{i}", "body": f"b{i}", "seq": i, "op": "insert"}
             for i in range(1, 4)]  # fmt: skip
    apply(target, batch_of(first), 0)
    added = batch_of([{"id": 1, "name": "a", "body": "b", "seq": 4, "op": "update"}])
    added = added.append_column("extra", pa.array([7], pa.int64()))
    apply_batch(target, added, ["id"], app_id="a", batch_id=1, defaults={"extra": 5})
    assert deltalake.DeltaTable(target).history(1)[0]["operation"] == "MERGE"
    done = apply(target, batch_of([
        {"id": 2, "name": "c2", "body": TOASTED, "seq": 5, "op": "update"},
        {"id": 3, "seq": 6, "op": "delete"},
        {"id": 4, "name": "m", "body": TOASTED, "seq": 7, "op": "insert",
         "old": json.dumps({"id": 3})},
    ]), 2)  # fmt: skip
    assert done.metrics.get("merge_on_read")
    expected = {1: ("a", "b"), 2: ("c2", "b2"), 4: ("m", "b3")}
    for name, found in readers(target).items():
        assert found == expected, name


def test_a_table_dropped_and_created_again_in_the_same_process_is_read_anew(
    tmp_path: Path,
) -> None:
    """A process keeps each table's log state between batches; a table deleted and
    created again at the same path (a notebook's rerun) must be read anew, not written
    from the dropped table's files and versions (a commit after the old version would
    leave a gap in the new table's log)."""
    target = str(tmp_path / "t")
    old = Model(seed=23)
    for batch_id in range(4):
        apply(target, old.batch(30, inserts=1 if batch_id == 0 else 0.25), batch_id)
    shutil.rmtree(target)
    model = Model(seed=29)
    for batch_id in range(3):
        done = apply(target, model.batch(30, inserts=1 if batch_id == 0 else 0.25), batch_id)
        assert done.table_version == batch_id
    for name, found in readers(target).items():
        assert found == model.rows, name


def test_a_purge_killed_before_its_commit_leaves_every_reader_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A purge dies between its files and its commit, while a reader holds the table at an
    older version: no reader (that one included) sees a change, the next batch applies,
    and the next purge folds the files the dead one meant to."""
    target = str(tmp_path / "t")
    root = str(Path(target).resolve())
    model = Model(seed=37)
    apply(target, model.batch(60, inserts=1), 0)
    apply(target, model.batch(30), 1)
    before = dict(model.rows)
    older = deltalake.DeltaTable(target)  # a reader's handle, at version 1

    def killed(self: DeltaLog, version: int, actions: Any) -> None:
        raise KeyboardInterrupt("killed before the purge's commit")

    monkeypatch.setattr(DeltaLog, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        merge_on_read.purge(merge_on_read.table(root), small_file=1 << 30)
    monkeypatch.undo()
    for name, found in readers(target).items():
        assert found == before, name
    apply(target, model.batch(30), 2)
    done = merge_on_read.purge(merge_on_read.table(root), small_file=1 << 30)
    assert done.version == 3 == deltalake.DeltaTable(target).version()
    assert done.files_removed >= 3
    assert {r["id"]: (r["name"], r["body"]) for r in read_table(older).to_pylist()} == before
    for name, found in readers(target).items():
        assert found == model.rows, name


def test_a_purge_writes_each_output_file_before_reading_the_files_of_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background purge folds a table's every file with deletion vectors (random
    updates reach all of them): it holds one output file's rows at a time, not the whole
    table's, and what it folds reads the same."""
    target = str(tmp_path / "t")
    model = Model(seed=41)
    apply(target, model.batch(60, inserts=1), 0)
    for batch_id in range(1, 5):
        apply(target, model.batch(20), batch_id)
    events: list[str] = []
    read, write = merge_on_read.read_all, merge_on_read.write_file

    def reading(*args: Any) -> pa.Table:
        events.append("read")
        return read(*args)

    def writing(*args: Any, **kwargs: Any) -> dict[str, Any]:
        events.append("write")
        return write(*args, **kwargs)

    monkeypatch.setattr(merge_on_read, "read_all", reading)
    monkeypatch.setattr(merge_on_read, "write_file", writing)
    root = str(Path(target).resolve())
    done = merge_on_read.purge(merge_on_read.table(root), small_file=1 << 30, target_size=1)
    assert done.files_removed == events.count("read") >= 4
    assert done.files_added == events.count("write") == done.files_removed
    assert events[:3] == ["read", "read", "write"], events  # the first file out, then on
    for name, found in readers(target).items():
        assert found == model.rows, name


def test_a_purge_that_loses_its_commit_race_leaves_no_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A purge in another process (its own log) carries rows deleted since its read in a
    new DV file, then loses the version to a batch: it tries again, and the DV file of the
    lost attempt is deleted (no commit names it; only a full VACUUM, which deltalake 1.6
    must not run on these tables, would find it)."""
    target = str(tmp_path / "t")
    model = Model(seed=43)
    apply(target, model.batch(60, inserts=1), 0)
    apply(target, model.batch(20), 1)
    purging = merge_on_read.Table(str(Path(target).resolve()))  # another process's
    pending = [model.batch(20, inserts=0), model.batch(20, inserts=0)]
    read, commit = merge_on_read.read_all, DeltaLog.commit

    def read_then_apply(*args: Any) -> pa.Table:
        if len(pending) == 2:
            apply(target, pending.pop(0), 2)  # rows deleted after the purge read them
        return read(*args)

    def race(self: DeltaLog, version: int, actions: Any) -> None:
        if self is purging.log and pending:
            apply(target, pending.pop(0), 3)  # takes the version the purge wanted
        commit(self, version, actions)

    monkeypatch.setattr(merge_on_read, "read_all", read_then_apply)
    monkeypatch.setattr(DeltaLog, "commit", race)
    done = merge_on_read.purge(purging, small_file=1 << 30)
    assert done.version == 4 and not pending
    named = "".join(p.read_text() for p in (tmp_path / "t" / "_delta_log").glob("*.json"))
    for found in (tmp_path / "t").glob("deletion_vector_*.bin"):
        encoded = dvs.z85encode(uuid.UUID(found.stem.split("_")[-1]).bytes)
        assert encoded in named, f"{found.name}: in no commit"
    for name, rows_found in readers(target).items():
        assert rows_found == model.rows, name
