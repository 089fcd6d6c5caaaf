"""Capture killed with SIGKILL at random points while a workload runs, restarted each
time: the log ends up with the source's change history exactly (nothing lost, nothing
doubled, every transaction whole and in commit order)."""

from __future__ import annotations

import random
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest
from support.capture import captured
from support.cli import REPLOG

from replog.capture.options import CaptureOptions
from replog.capture.postgres import capture
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
