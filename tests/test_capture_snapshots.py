"""Snapshots read in chunks between watermarks while the stream runs (a real PostgreSQL):
on demand, racing changes, resumed after a failure, never held whole in memory."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from support.capture import captured, query, run, sql
from support.cli import replog
from support.logcheck import check_log

from replog.capture import chunk_sizes
from replog.capture.options import CaptureOptions
from replog.capture.postgres import PostgresCapture
from replog.capture.snapshot import SnapshotPlan, request_snapshot
from replog.capture.workers import RangeReaders
from replog.errors import InjectedFaultError, InvalidOptionError, SourceConfigError
from replog.log import ReplicationLog

ROWS = 300


def _table(dsn: str) -> None:
    sql(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL, note text)",
        f"INSERT INTO t SELECT g, 0, 'n' || g FROM generate_series(1, {ROWS}) g",
    )


class Writes(threading.Thread):
    """Small transactions of updates, deletes and inserts on ``t`` until stopped."""

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.random, self.stop = dsn, random.Random(seed), threading.Event()
        self.error: BaseException | None = None
        self.transactions = 0

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn) as connection:
                next_id = ROWS + 1
                while not self.stop.is_set():
                    for _ in range(self.random.randint(1, 4)):
                        key = self.random.randint(1, next_id)
                        choice = self.random.random()
                        if choice < 0.6:
                            connection.execute("UPDATE t SET v = v + 1 WHERE id = %s", (key,))
                        elif choice < 0.8:
                            connection.execute("DELETE FROM t WHERE id = %s", (key,))
                        else:
                            connection.execute(
                                "INSERT INTO t VALUES (%s, 0, 'new') ON CONFLICT DO NOTHING",
                                (next_id,),
                            )
                            next_id += 1
                    connection.commit()
                    self.transactions += 1
                    time.sleep(0.002)
        except BaseException as exc:  # reported by the test, never swallowed
            self.error = exc


def _events_in_log_order(url: str) -> dict[str, list[dict[str, Any]]]:
    """Per key, its events in the order the log holds them (one shard per key)."""
    per_key: dict[str, list[dict[str, Any]]] = {}
    rows = sorted(check_log(ReplicationLog.open(url)), key=lambda r: (r["shard"], r["sequence"]))
    for row in rows:
        metadata = json.loads(row["metadata"])
        per_key.setdefault(row["key"], []).append(
            {
                "op": metadata["op"],
                "snapshot": metadata["source"]["snapshot"],
                "data": row["data"].decode(),
            }
        )
    return per_key


def _check_equal_and_in_order(url: str, dsn: str, kind: str) -> int:
    """The log, applied event by event per key, ends equal to the source; every read event
    holds the row as the events before it left it (no read is older than a change it
    follows); no key is read twice by the snapshot of ``kind``. The number of such reads."""
    source = {
        f'{{"id":{i}}}': json.dumps({"id": i, "v": v, "note": n}, separators=(",", ":"))
        for i, v, n in query(dsn, "SELECT id, v, note FROM t")
    }
    built: dict[str, str] = {}
    reads = 0
    for key, events in _events_in_log_order(url).items():
        state: str | None = None
        seen_read = False
        for event in events:
            if event["op"] == "r" and event["snapshot"] == kind:
                assert not seen_read, f"{key} was read twice by the snapshot"
                seen_read = True
                reads += 1
                if state is not None:
                    assert event["data"] == state, (key, events)
            state = None if event["op"] == "d" else event["data"]
        if state is not None:
            built[key] = state
    assert built == source
    return reads


def _follow(
    url: str, dsn: str, **options: Any
) -> tuple[threading.Thread, threading.Event, dict[str, Any]]:
    """A following capture in a thread; what it found (``capture``, ``error``)."""
    stop = threading.Event()
    found: dict[str, Any] = {}
    opts = CaptureOptions(dsn=dsn, slot="cap", tables=("t",), follow=True, poll_s=0.01, **options)
    ready = threading.Event()

    def body() -> None:
        try:
            with PostgresCapture(opts, ReplicationLog.open(url), stop=stop) as running:
                found["capture"] = running
                ready.set()
                running.run()
        except BaseException as exc:
            found["error"] = exc
            ready.set()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    ready.wait(60)
    return thread, stop, found


def _wait_for(condition: Any, found: dict[str, Any], what: str) -> None:
    deadline = time.monotonic() + 300  # a hang, not a speed: the machines are shared
    while not condition():
        assert "error" not in found, found.get("error")
        assert time.monotonic() < deadline, f"waited 300 s for {what}"
        time.sleep(0.02)


def test_a_snapshot_asked_for_while_changes_race_it_is_exact(pg_dsn: str, tmp_path: Path) -> None:
    """``replog snapshot`` while a capture follows a busy table: every row is read once
    (or stood for by a change in its chunk's window), no read undoes a newer change, and
    the log builds the source's table exactly."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))  # the initial snapshot
    writes = Writes(pg_dsn, seed=7)
    writes.start()
    thread, stop, found = _follow(url, pg_dsn, snapshot_chunk_rows=16)
    try:
        before = writes.transactions
        result = replog("snapshot", "postgres", pg_dsn, "--slot", "cap", "--tables", "t")
        assert result.returncode == 0, result.stderr
        capture: PostgresCapture = found["capture"]
        _wait_for(
            lambda: (
                capture.plan is not None
                and any(f["reason"] == "requested" for f in capture.plan.finished)
            ),
            found,
            "the requested snapshot",
        )
        raced = writes.transactions - before
        # Go on writing until 50 transactions followed the request, however fast the
        # snapshot was: the follower must also order the changes after its last chunk.
        _wait_for(
            lambda: writes.error is not None or writes.transactions - before >= 50,
            found,
            "50 transactions",
        )
    finally:
        writes.stop.set()
        writes.join()
        stop.set()
        thread.join()
    assert writes.error is None and "error" not in found, (writes.error, found.get("error"))
    run(pg_dsn, url, tables=("t",))  # what the follower had not read yet
    assert raced > 0, "no transaction committed while the snapshot was asked for and read"
    reads = _check_equal_and_in_order(url, pg_dsn, "incremental")
    assert reads > ROWS // 2
    plan = SnapshotPlan.load(
        ReplicationLog.open(url).storage, "cap", ReplicationLog.open(url).log_id
    )
    assert plan is not None and plan.queue == [] and plan.pending is None


def test_a_signal_for_another_slot_or_an_unknown_table_changes_nothing(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    with pytest.raises(SourceConfigError, match="no publication 'other'"):
        request_snapshot(pg_dsn, ["t"], slot="other")
    with pytest.raises(InvalidOptionError, match=r"does not capture public\.nope: it captures"):
        request_snapshot(pg_dsn, ["public.nope"], slot="cap")
    emit = "SELECT pg_logical_emit_message(true, 'replog.signal', '{}')"  # checks nothing
    sql(
        pg_dsn,
        emit.format('{"snapshot": ["public.t"], "slot": "other"}'),
        emit.format('{"snapshot": ["public.nope"], "slot": "cap"}'),
        emit.format("not json"),
    )
    with caplog.at_level("WARNING", logger="replog.capture"):
        run(pg_dsn, url, tables=("t",))
    reads = [e for e in check_log(ReplicationLog.open(url)) if '"incremental"' in e["metadata"]]
    assert reads == []
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "public.nope, which this capture does not capture" in messages
    assert "cannot be read" in messages


def test_a_snapshot_killed_between_chunks_goes_on_from_the_last_committed_one(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after a chunk's commit, before the slot advance: the restart reads no
    committed chunk again and every row exactly once."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    monkeypatch.setenv("REPLOG_FAULT", "capture_committed")
    monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    chunks = []
    for _ in range(5):
        with pytest.raises(InjectedFaultError):
            run(pg_dsn, url, tables=("t",), snapshot_chunk_rows=50)
        log = ReplicationLog.open(url)
        plan = SnapshotPlan.load(log.storage, "cap", log.log_id)
        assert plan is not None and plan.pending is not None
        chunks.append(plan.pending.after)
        sql(pg_dsn, f"UPDATE t SET v = v + 1 WHERE id = {len(chunks) * 50 - 10}")
    monkeypatch.delenv("REPLOG_FAULT")
    assert chunks == [[str(n * 50)] for n in range(1, 6)]  # one new chunk per run
    run(pg_dsn, url, tables=("t",), snapshot_chunk_rows=50)
    assert _check_equal_and_in_order(url, pg_dsn, "true") == ROWS


def test_wide_rows_are_read_in_short_chunks_narrow_rows_in_long_ones(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk holds about CHUNK_BYTES of row text (memory flat in the width of the rows):
    each snapshot commit of a table of 20 KB rows holds about that many bytes of them,
    while a table of narrow rows is read in chunks of --snapshot-chunk-rows; every row
    once."""
    monkeypatch.setattr(chunk_sizes, "CHUNK_BYTES", 256 << 10)
    monkeypatch.setattr(chunk_sizes, "FIRST_CHUNK_ROWS", 20)
    sql(
        pg_dsn,
        "CREATE TABLE wide (id int PRIMARY KEY, body text)",
        "ALTER TABLE wide ALTER COLUMN body SET STORAGE EXTERNAL",  # not compressed
        "INSERT INTO wide SELECT g, repeat(md5(g::text), 640) FROM generate_series(1, 200) g",
        "CREATE TABLE narrow (id int PRIMARY KEY, v int)",
        "INSERT INTO narrow SELECT g, g FROM generate_series(1, 1000) g",
    )
    url = str(tmp_path / "log")
    run(pg_dsn, url, tables=("wide", "narrow"), snapshot_chunk_rows=300)
    events = captured(ReplicationLog.open(url))
    per_commit: dict[tuple[str, int], int] = {}
    for event in events:
        assert event["op"] == "r"
        name = event["collection"].split(".")[-1]
        per_commit[(name, event["version"])] = per_commit.get((name, event["version"]), 0) + 1
    wide = [n for (name, _), n in sorted(per_commit.items()) if name == "wide"]
    narrow = [n for (name, _), n in sorted(per_commit.items()) if name == "narrow"]
    assert sum(wide) == 200 and sum(narrow) == 1000
    assert len({(e["collection"], e["key"]) for e in events}) == 1200  # every row once
    # 20,480-byte rows, 256 KiB a chunk: 12 rows (13 at most with the key's bytes)
    assert wide[0] == 20 and all(n <= 13 for n in wide[1:-1]) and len(wide) > 10, wide
    assert narrow[0] == 20 and narrow[1:4] == [300, 300, 300], narrow


def test_a_snapshot_read_by_several_workers_while_changes_race_it_is_exact(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--snapshot-workers: each chunk is key ranges read by processes of their own, inside
    one pair of watermarks; the log is as exact as with one reader."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    ranges_per_chunk: list[int] = []
    read = RangeReaders.read

    def counted(self: RangeReaders, table: Any, relation: int, ranges: Any, low: int) -> Any:
        ranges_per_chunk.append(len(ranges))
        return read(self, table, relation, ranges, low)

    monkeypatch.setattr(RangeReaders, "read", counted)
    writes = Writes(pg_dsn, seed=11)
    writes.start()
    try:
        run(pg_dsn, url, tables=("t",), snapshot_chunk_rows=16, snapshot_workers=3)
    finally:
        writes.stop.set()
        writes.join()
    assert writes.error is None
    run(pg_dsn, url, tables=("t",))
    assert _check_equal_and_in_order(url, pg_dsn, "true") > ROWS // 2
    assert 3 in ranges_per_chunk, ranges_per_chunk  # the chunks were read by three workers
