"""Capture killed with SIGKILL at random points while a workload runs, restarted each
time: the log ends up with the source's change history exactly (nothing lost, nothing
doubled, every transaction whole and in commit order)."""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest
from support.capture import captured
from support.cli import REPLOG
from support.logcheck import check_log

from replog.capture.options import CaptureOptions
from replog.capture.postgres import capture
from replog.capture.snapshot import SnapshotPlan
from replog.errors import LogNotFoundError
from replog.log import ReplicationLog

pytestmark = pytest.mark.slow

KILLS = 12


class Workload(threading.Thread):
    """Small transactions of inserts, updates and deletes; remembers, in commit order,
    the change events each committed transaction must become."""

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.random = random.Random(seed)
        self.stop = threading.Event()
        self.history: list[tuple[str, str, str]] = []
        self.transactions = 0

    def run(self) -> None:
        live: list[int] = []
        next_id = 1
        with psycopg.connect(self.dsn) as connection:
            while not self.stop.is_set():
                changes = []
                for _ in range(self.random.randint(1, 5)):
                    choice = self.random.random()
                    if choice < 0.5 or not live:
                        row = (next_id, 0, f"{next_id}.{next_id % 100:02d}")
                        connection.execute("INSERT INTO t VALUES (%s, %s, %s::numeric)", row)
                        changes.append(("c", row))
                        live.append(next_id)
                        next_id += 1
                    elif choice < 0.85:
                        key = self.random.choice(live)
                        got = connection.execute(
                            "UPDATE t SET v = v + 1 WHERE id = %s RETURNING id, v, amount::text",
                            (key,),
                        ).fetchone()
                        assert got is not None
                        changes.append(("u", got))
                    else:
                        key = live.pop(self.random.randrange(len(live)))
                        connection.execute("DELETE FROM t WHERE id = %s", (key,))
                        changes.append(("d", (key,)))
                connection.commit()
                self.transactions += 1
                for op, row in changes:
                    key = f'{{"id":{row[0]}}}'
                    data = key if op == "d" else f'{{"id":{row[0]},"v":{row[1]},"amount":{row[2]}}}'
                    self.history.append((op, key, data))
                time.sleep(0.003)


def test_capture_survives_random_sigkills(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        connection.execute("CREATE TABLE t (id int PRIMARY KEY, v int, amount numeric)")
    options = CaptureOptions(pg_dsn, "killed", tables=("t",))
    capture(options, ReplicationLog.create(url, 4))  # the slot, before the workload begins
    seed = random.randrange(1 << 30)
    chooser = random.Random(seed)
    workload = Workload(pg_dsn, seed)
    workload.start()
    command = [
        REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "killed", "--tables", "t",
        "--follow", "--max-changes", "40",
    ]  # fmt: skip
    stderr = tmp_path / "capture.err"
    try:
        for kill in range(KILLS):
            versions = ReplicationLog.open(url).refresh().version
            with stderr.open("a") as errors:
                process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)
            if kill % 2:  # anywhere: starting, connecting, reading the slot, committing
                time.sleep(chooser.uniform(0.0, 2.5))
            else:  # once it commits (however slow the machine), somewhere in what follows
                stuck_after = time.monotonic() + 120  # a hang, not slowness
                while ReplicationLog.open(url).refresh().version == versions:
                    assert process.poll() is None, f"seed {seed}: {stderr.read_text()[-2000:]}"
                    assert time.monotonic() < stuck_after, f"seed {seed}: no commit in 120 s"
                    time.sleep(0.02)
                time.sleep(chooser.uniform(0.0, 0.5))
            process.kill()
            assert process.wait() == -9, f"seed {seed}: {stderr.read_text()[-2000:]}"
    finally:
        workload.stop.set()
        workload.join()
    capture(options, ReplicationLog.open(url))

    events = captured(ReplicationLog.open(url))
    got = [(e["op"], e["key"], e["data"]) for e in events]
    assert len(got) == len(workload.history), f"seed {seed}"
    assert got == workload.history, f"seed {seed}"
    by_txn: dict[int, set[int]] = {}
    for event in events:
        by_txn.setdefault(event["txid"], set()).add(event["version"])
    assert len(by_txn) == workload.transactions
    assert all(len(versions) == 1 for versions in by_txn.values())


def _snapshot_landed(url: str) -> bool:
    try:
        return ReplicationLog.open(url).refresh().version > 0
    except LogNotFoundError:  # not created yet, or half-way
        return False


def test_sigterm_finishes_the_commit_and_exits_cleanly(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        connection.execute("CREATE TABLE t (id int PRIMARY KEY, v int, amount numeric)")
        connection.execute("INSERT INTO t VALUES (1, 1, 1.5)")
    command = [REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "term", "--tables", "t"]
    process = subprocess.Popen(
        [*command, "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    while not _snapshot_landed(url):
        assert process.poll() is None, process.communicate()[1]
        time.sleep(0.05)
    process.terminate()
    stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr
    assert "captured 0 rows (1 in the snapshot)" in stdout
    assert [e["op"] for e in captured(ReplicationLog.open(url))] == ["r"]


SNAPSHOT_ROWS = 6_000
FIRST_ROW = 1_000_000


class RowUpdates(threading.Thread):
    """Updates random rows of those the snapshot reads, in small transactions."""

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.random, self.stop = dsn, random.Random(seed + 1), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as connection:
                while not self.stop.is_set():
                    key = FIRST_ROW + self.random.randrange(SNAPSHOT_ROWS)
                    connection.execute("UPDATE t SET v = v + 1 WHERE id = %s", (key,))
                    time.sleep(0.002)
        except BaseException as exc:  # the test reports it
            self.error = exc


def test_a_snapshot_killed_at_random_points_holds_every_row_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    """SIGKILL at random points of a chunked snapshot while the table is written to: each
    restart goes on from the last committed chunk (the plan), no row is read twice by the
    snapshot, and the log applied key by key equals the table."""
    url = str(tmp_path / "log")
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        connection.execute("CREATE TABLE t (id int PRIMARY KEY, v int, amount numeric)")
        connection.execute(  # above the ids the workload inserts
            f"INSERT INTO t SELECT g, 0, g / 100.0 FROM generate_series({FIRST_ROW},"
            f" {FIRST_ROW + SNAPSHOT_ROWS - 1}) g"
        )
    seed = random.randrange(1 << 30)
    chooser = random.Random(seed)
    workload = Workload(pg_dsn, seed)
    workload.start()
    updates = RowUpdates(pg_dsn, seed)
    updates.start()
    command = [
        REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "snap", "--tables", "t",
        "--snapshot-chunk-rows", "250",
    ]  # fmt: skip
    stderr = tmp_path / "capture.err"
    committed = []
    try:
        for kill in range(6):
            versions = ReplicationLog.open(url).refresh().version if _snapshot_landed(url) else 0
            with stderr.open("a") as errors:
                process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)
            if kill % 2:  # anywhere
                time.sleep(chooser.uniform(0.0, 2.0))
            else:  # once it commits a chunk (however slow the machine), somewhere after
                stuck_after = time.monotonic() + 120  # a hang, not slowness
                while not _snapshot_landed(url) or (
                    ReplicationLog.open(url).refresh().version == versions
                ):
                    if process.poll() is not None:
                        break  # it finished the snapshot
                    assert time.monotonic() < stuck_after, f"seed {seed}: no commit in 120 s"
                    time.sleep(0.02)
                time.sleep(chooser.uniform(0.0, 0.3))
            process.kill()
            assert process.wait() in (-9, 0), f"seed {seed}: {stderr.read_text()[-2000:]}"
            if _snapshot_landed(url):
                log = ReplicationLog.open(url)
                plan = SnapshotPlan.load(log.storage, "snap", log.log_id)
                committed.append(plan.queue[0].rows if plan and plan.queue else SNAPSHOT_ROWS)
    finally:
        for writer in (workload, updates):
            writer.stop.set()
            writer.join()
    assert updates.error is None, updates.error
    assert committed == sorted(committed), f"seed {seed}: {committed}"
    capture(CaptureOptions(pg_dsn, "snap", tables=("t",)), ReplicationLog.open_or_create(url, 8))
    read_twice, built = _applied_key_by_key(url)
    assert read_twice == [], f"seed {seed}"
    with psycopg.connect(pg_dsn) as connection:
        source = {
            f'{{"id":{i}}}': f'{{"id":{i},"v":{v},"amount":{a}}}'
            for i, v, a in connection.execute("SELECT id, v, amount::text FROM t").fetchall()
        }
    assert built == source, f"seed {seed}"


def _applied_key_by_key(url: str) -> tuple[list[str], dict[str, str]]:
    """(keys the snapshot read more than once, the table the log builds applied key by
    key in each shard's order)."""
    per_key: dict[str, list[tuple[str, str]]] = {}
    rows = sorted(check_log(ReplicationLog.open(url)), key=lambda r: (r["shard"], r["sequence"]))
    for row in rows:
        metadata = json.loads(row["metadata"])
        per_key.setdefault(row["key"], []).append((metadata["op"], row["data"].decode()))
    read_twice = [k for k, events in per_key.items() if sum(e[0] == "r" for e in events) > 1]
    built = {k: events[-1][1] for k, events in per_key.items() if events[-1][0] != "d"}
    return read_twice, built
