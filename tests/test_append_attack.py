"""Adversarial review of 771609c: a batch of keys no file holds, into a table written
merge-on-read, is appended by replog's own Delta writer (``merge_on_read.append``), and
the table then gets replog's checkpoints and background purges (``_after_own_commit``).
Crashes, replays, purges beside it, scd2, tombstones, truncates and checkpoints."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import deltalake
import polars
import pyarrow as pa
import pytest
from test_deletion_vectors import batch_of, readers

from replog.errors import InjectedFaultError
from replog.tables import delta, merge_on_read
from replog.tables.changes import CURRENT, VALID_FROM, VALID_TO
from replog.tables.delta import apply_batch, open_table, read_table

PURGE_ALL = 1 << 30  # a purge's small_file: every file is small


def changes(items: list[tuple[Any, int, str]], *, text: bool = False) -> pa.Table:
    """(key, sequence, operation) -> a batch; the name carries the sequence."""
    rows = [{"id": 0 if text else k, "name": f"n{s}", "body": f"b{k}", "seq": s, "op": op}
            for k, s, op in items]  # fmt: skip
    built = batch_of(rows)
    if text:
        built = built.set_column(0, "id", pa.array([k for k, _, _ in items], pa.string()))
    return built


def inserts(keys: range | list[int], seq: int) -> pa.Table:
    return changes([(k, seq + n, "insert") for n, k in enumerate(keys)])


def run(target: str, batch: pa.Table, batch_id: int, app_id: str = "a", **kw: Any) -> Any:
    return apply_batch(target, batch, ["id"], app_id=app_id, batch_id=batch_id, **kw)


def names(target: str, version: int | None = None) -> dict[Any, str]:
    """Key -> name by every reader (they must agree, one row per key)."""
    found = {n: {k: v[0] for k, v in rows.items()} for n, rows in readers(target, version).items()}
    first = next(iter(found.values()))
    assert all(f == first for f in found.values()), found
    return first


def root_of(target: str) -> merge_on_read.Table:
    return merge_on_read.table(str(Path(target).resolve()))


@pytest.mark.parametrize("mode", ["scd2", "scd1"])
def test_a_merge_after_appends_survives_the_background_purge_they_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Appends into a deletion-vector table are replog's own commits, after which
    ``purge_later`` starts a background purge once 16 small files gathered. A later batch
    that delta-rs writes (scd2: any update; scd1: a column added with a default, whose
    fill is a merge) reads the table at its start; the purge commits meanwhile (here: let
    run once the batch has read the table) and delta-rs would refuse the commit
    (``CommitFailedError: a concurrent transactions added new data``), failing the
    follower's micro-batch: delta-rs's writes wait for the purge and move the handle past
    it (``delta._after_purge``)."""
    target = str(tmp_path / "t")
    gate, purge = threading.Event(), merge_on_read.purge

    def held_purge(*args: Any, **kwargs: Any) -> Any:
        gate.wait(60)  # until the next batch has read the table
        return purge(*args, **kwargs)

    monkeypatch.setattr(merge_on_read, "purge", held_purge)
    for batch_id in range(merge_on_read.PURGE_FILES):
        run(target, inserts(range(10 * batch_id, 10 * batch_id + 10), 100 * batch_id + 1),
            batch_id, mode=mode)  # fmt: skip
    purging, write = root_of(target).purging, delta._write
    assert purging is not None

    def write_after_purge(*args: Any, **kwargs: Any) -> Any:
        gate.set()
        purging.join(60)  # the purge commits after the batch read the table
        return write(*args, **kwargs)

    monkeypatch.setattr(delta, "_write", write_after_purge)
    update = changes([(5, 10_000, "update")])
    try:
        if mode == "scd2":
            run(target, update, merge_on_read.PURGE_FILES, mode=mode)
        else:
            update = update.append_column("extra", pa.array([1], pa.int64()))
            run(target, update, merge_on_read.PURGE_FILES, defaults={"extra": 7})
    finally:
        gate.set()
    found = read_table(deltalake.DeltaTable(target)).to_pylist()
    if mode == "scd2":
        assert sorted(r[CURRENT] for r in found if r["id"] == 5) == [False, True]
    else:
        assert sorted((r["id"] == 5, r["extra"]) for r in found)[-2:] == [(False, 7), (True, 1)]


def test_scd2_appends_keep_their_history_columns_and_a_later_change_closes_them(
    tmp_path: Path,
) -> None:
    """A new key inserted, updated and another inserted and deleted in one appended
    scd2 batch: two versions (the first closed at the update), the deleted key's version
    closed, not current; a later batch closes the current version; readers agree at
    every version."""
    target = str(tmp_path / "t")
    run(target, inserts(range(10), 1), 0, mode="scd2")
    batch = changes([(20, 50, "insert"), (20, 51, "update"), (21, 52, "insert"),
                     (21, 53, "delete")])  # fmt: skip
    done = run(target, batch, 1, mode="scd2")
    assert done.metrics.get("appended") and done.metrics.get("merge_on_read")
    run(target, changes([(20, 60, "update")]), 2, mode="scd2")
    found = read_table(deltalake.DeltaTable(target)).to_pylist()
    history = sorted((r["name"], r[CURRENT], r[VALID_TO] is None) for r in found if r["id"] >= 20)
    assert history == [("n50", False, False), ("n51", False, False), ("n52", False, False),
                       ("n60", True, True)]  # fmt: skip
    of = {r["name"]: r for r in found}
    assert of["n50"][VALID_TO] == of["n51"][VALID_FROM]
    assert of["n51"][VALID_TO] == of["n60"][VALID_FROM]
    assert polars.read_delta(target, version=1).height == 13
    assert polars.read_delta(target).height == len(found) == 14


def test_a_crash_after_the_new_column_before_the_append_commit_then_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch adds a column (its own commit), writes its file and dies at the crash
    point before its commit: the table has the column and the old rows; a new process
    replays the batch once; the dead attempt's file is in no commit; a replay under the
    same app skips, under another app adds nothing."""
    target = str(tmp_path / "t")
    run(target, inserts(range(10), 1), 0)
    wide = inserts(range(100, 105), 100).append_column("extra", pa.array(["x"] * 5))
    monkeypatch.setenv("REPLOG_FAULT", "apply_deletion_vectors@1")
    monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    before = set(os.listdir(target))
    with pytest.raises(InjectedFaultError):
        run(target, wide, 1)
    monkeypatch.delenv("REPLOG_FAULT")
    orphans = set(os.listdir(target)) - before
    assert len(orphans) == 1
    merge_on_read._TABLES.clear()
    assert "extra" in deltalake.DeltaTable(target).schema().to_arrow().names
    assert set(names(target)) == set(range(10))
    done = run(target, wide, 1)
    assert done.metrics.get("appended") and done.table_version == 2  # 1: the column
    assert not orphans & {Path(u).name for u in deltalake.DeltaTable(target).file_uris()}
    assert run(target, wide, 1).skipped
    again = run(target, wide, 0, app_id="b")
    assert again.metrics.get("num_target_rows_inserted") == 0
    assert set(names(target)) == set(range(10)) | set(range(100, 105))
    extra = polars.read_delta(target).sort("id")["extra"].to_list()
    assert extra == [None] * 10 + ["x"] * 5


def test_a_deleted_key_purged_away_comes_back_by_append_and_an_old_change_does_not(
    tmp_path: Path,
) -> None:
    """Key 9 (the table's maximum) deleted; a purge leaves no file whose range holds it,
    so a batch of it is an append. An older change of it replayed under another app id
    (before its delete) must not resurrect it (its tombstone drops it); its re-insert
    (newer) appears; that re-insert replayed under another app is stale."""
    target = str(tmp_path / "t")
    run(target, inserts(range(10), 1), 0)
    run(target, changes([(9, 20, "delete")]), 1)
    merge_on_read.purge(root_of(target), small_file=PURGE_ALL, min_deleted=0.0)
    stats = pa.table(deltalake.DeltaTable(target).get_add_actions(flatten=True))
    assert stats.column("max.id").to_pylist() == [8]
    run(target, changes([(9, 15, "update"), (12, 16, "delete")]), 0, app_id="old")
    assert 9 not in names(target)
    assert run(target, changes([(9, 30, "insert")]), 2).metrics.get("appended")
    assert names(target)[9] == "n30"
    again = run(target, changes([(9, 30, "insert")]), 0, app_id="b")
    assert again.metrics.get("num_stale_changes") == 1
    assert names(target) == {**{k: f"n{k + 1}" for k in range(9)}, 9: "n30"}


@pytest.mark.parametrize("text", [False, True])
def test_appended_keys_of_text_or_negative_ints_are_found_by_the_next_batch(
    tmp_path: Path, text: bool
) -> None:
    """Keys below every file's range (negative ints; text before 'm') are appended; the
    next batch updating them finds them (no second row) and a range spanning both files
    is a merge-on-read batch."""
    target = str(tmp_path / "t")
    keyed = (lambda k: f"m{k:03d}") if text else (lambda k: k)
    lower = (lambda k: f"a{k:03d}") if text else (lambda k: -k - 1)
    run(target, changes([(keyed(k), k + 1, "insert") for k in range(10)], text=text), 0)
    added = changes([(lower(k), 100 + k, "insert") for k in range(5)], text=text)
    assert run(target, added, 1).metrics.get("appended")
    update = changes([(lower(2), 200, "update")], text=text)
    assert run(target, update, 2).metrics.get("num_target_rows_deleted") == 1
    both = changes([(lower(3), 300, "delete"), (keyed(4), 301, "update")], text=text)
    assert not run(target, both, 3).metrics.get("appended")
    found = names(target)
    assert len(found) == 14 and found[lower(2)] == "n200" and lower(3) not in found


def test_tiny_appends_beside_a_purge_loop_lose_and_double_nothing(tmp_path: Path) -> None:
    """Thirty one-row appends while another thread purges in a loop: every row once,
    by every reader, at the end and at every version a batch made."""
    target = str(tmp_path / "t")
    run(target, inserts(range(5), 1), 0)
    stop, failures = threading.Event(), []
    purged: list[merge_on_read.Purged] = []

    def purging() -> None:
        try:
            while not stop.is_set():
                purged.append(merge_on_read.purge(root_of(target), small_file=PURGE_ALL))
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=purging)
    worker.start()
    made = {}
    try:
        for batch_id in range(1, 31):
            done = run(target, inserts([100 + batch_id], 100 + batch_id), batch_id)
            assert done.metrics.get("appended"), done.metrics
            made[done.table_version] = 5 + batch_id
    finally:
        stop.set()
        worker.join(120)
    assert not failures, failures
    assert any(p.version is not None for p in purged)
    assert len(names(target)) == 35
    for version, count in list(made.items())[::7]:
        assert len(names(target, version)) == count, version
    assert run(target, inserts([130], 130), 30).skipped


def test_checkpoints_every_two_versions_of_appends_then_a_fresh_process(tmp_path: Path) -> None:
    """``delta.checkpointInterval`` 2: appends write checkpoints; a new process (log read
    from the newest checkpoint) skips every replay, appends the next batch after it, and
    every reader agrees."""
    target = str(tmp_path / "t")
    run(target, inserts(range(5), 1), 0)
    deltalake.DeltaTable(target).alter.set_table_properties({"delta.checkpointInterval": "2"})
    batches = [inserts(range(10 * b, 10 * b + 3), 10 * b) for b in range(1, 8)]
    for batch_id, batch in enumerate(batches, start=1):
        assert run(target, batch, batch_id).metrics.get("appended")
    logged = {p.name for p in (Path(target) / "_delta_log").iterdir()}
    assert "00000000000000000008.checkpoint.parquet" in logged, sorted(logged)
    merge_on_read._TABLES.clear()
    assert root_of(target).log.state().txns == {"a": 7}
    for batch_id, batch in enumerate(batches, start=1):
        assert run(target, batch, batch_id).skipped
    done = run(target, inserts([500], 500), 8)
    assert done.table_version == 9
    assert len(names(target)) == 5 + 21 + 1
    assert deltalake.DeltaTable(target).transaction_version("a") == 8


def test_a_truncate_with_new_keys_is_not_an_append_and_removes_the_old_rows(
    tmp_path: Path,
) -> None:
    """A batch of new keys after a truncate of their shard: the table's rows before the
    truncate go, the new keys stay (the append path must not take it)."""
    target = str(tmp_path / "t")
    run(target, inserts(range(10), 1), 0)
    cut = {"id": None, "seq": 50, "op": "truncate"}
    batch = batch_of([cut, {"id": 100, "name": "n", "body": "b", "seq": 51, "op": "insert"}])
    done = run(target, batch, 1)
    assert not done.metrics.get("appended")
    assert names(target) == {100: "n"}
    assert open_table(target, None).transaction_version("a") == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["append", "merge"])
def test_a_batch_another_writer_commits_first_is_reported_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The batch's transaction committed by another writer (the same query's retry, say)
    after this one found it absent: replog's writer commits nothing, and the batch says
    it was skipped, not that it was applied at the handle's older version."""
    target = str(tmp_path / "t")
    run(target, inserts(range(5), 0), 0)
    batch = inserts(range(5, 8), 10) if kind == "append" else inserts([1, 6], 10)
    assert not run(target, batch, 1).skipped
    version = deltalake.DeltaTable(target).version()
    monkeypatch.setattr(delta, "replayed", lambda *_args, **_kw: False)  # the race's window
    raced = run(target, batch, 1)
    assert raced.skipped and raced.table_version is None
    assert deltalake.DeltaTable(target).version() == version
