"""``replog capture mysql --follow`` killed with SIGKILL ten times under a workload of
inserts, updates, deletes, key changes, a large transaction and DDL (columns added with
and without a value for every row, one renamed, one retyped, TRUNCATE, a table dropped and
created again): at each step of its commit protocol (its position record written, the
commit not made; the commit made; a piece of the large transaction staged) and at random
moments, its snapshot among them. The log holds every change exactly once, counted against
the binlog as mysql-replication itself reads it, each source transaction in one commit,
and the Delta tables that ``apply_changes`` builds from the log equal the server's tables
row by row."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from support.cli import REPLOG
from support.mariadb import PASSWORD, USER
from support.mysql import Db, events, run
from test_capture_to_delta import delta_rows

from replog.log import ReplicationLog
from replog.spark.functions import apply_changes

pytestmark = [pytest.mark.slow, pytest.mark.spark]

INITIAL = 300
BIG = 1_500
"""Rows the large transaction updates (staged in pieces of ``--stage-events`` 200; the
1M-row one is benchmarks/bench_capture_mysql.py's)."""
KILLS = ("committed", "random", "noted", "random", "staged", "random", "committed", "noted",
         "random", "random")  # fmt: skip
"""Each run of capture ends in SIGKILL: at a step of its commit protocol (``noted``: its
position record written, the commit not made; ``committed``: the commit made, nothing after
it; ``staged``: a piece of the large transaction staged) where it kills itself
(crashpoints), or at a random moment (in the snapshot, reading the binlog, committing)."""
COUNTER = Path(__file__).resolve().parents[1] / "tests" / "procs" / "binlog_count.py"
HANG_S = 300.0
"""A wait for a hang, not a limit on speed."""


class Workload(threading.Thread):
    """Small transactions on ``t`` and ``u``, DDL at fixed steps, and the large transaction
    when asked (:attr:`big`); an error is kept for the test to raise."""

    DDL = {
        40: ("ALTER TABLE t ADD COLUMN note varchar(20) NULL",),
        80: ("TRUNCATE TABLE w",),
        120: ("ALTER TABLE t ADD COLUMN lvl int NOT NULL DEFAULT 5",),
        160: ("DROP TABLE w", "CREATE TABLE w (id int PRIMARY KEY, w int)"),
        200: ("ALTER TABLE t RENAME COLUMN note TO remark",),
        240: ("ALTER TABLE t MODIFY v bigint",),
    }
    STEPS = 300
    """Steps by which every DDL happened."""

    def __init__(self, db: Db, seed: int) -> None:
        super().__init__(daemon=True)
        self.db, self.random = db, random.Random(seed)
        self.stop = threading.Event()
        self.big = threading.Event()
        self.big_done = 0
        self.error: BaseException | None = None
        self.steps = 0

    def run(self) -> None:
        try:
            with self.db.server.admin(self.db.name) as connection:
                connection.autocommit(False)
                with connection.cursor() as cursor:
                    self._work(connection, cursor)
        except BaseException as exc:  # raised by the test
            self.error = exc

    def _work(self, connection: Any, cursor: Any) -> None:
        live = set(range(1, BIG + 1))
        next_id = 100_000
        while not self.stop.is_set():
            self.steps += 1
            if self.big.is_set():
                cursor.execute("UPDATE t SET v = v + 1 WHERE id <= %s", (BIG,))
                self.big.clear()
                self.big_done += 1
            for statement in self.DDL.get(self.steps, ()):
                cursor.execute(statement)
            for _ in range(self.random.randint(1, 4)):
                next_id = self._change(cursor, live, next_id)
            connection.commit()
            time.sleep(0.02)

    def _change(self, cursor: Any, live: set[int], next_id: int) -> int:
        choice = self.random.random()
        if choice < 0.4 or len(live) < 10:
            cursor.execute("INSERT INTO t (id, v, amount) VALUES (%s, 0, %s)",
                           (next_id, Decimal(next_id % 1000) / 100))  # fmt: skip
            live.add(next_id)
            return next_id + 1
        key = self.random.choice(sorted(live))
        if choice < 0.65:
            cursor.execute("UPDATE t SET v = v + 1 WHERE id = %s", (key,))
        elif choice < 0.75:
            cursor.execute("UPDATE t SET id = %s WHERE id = %s", (next_id, key))
            live.discard(key)
            live.add(next_id)
            return next_id + 1
        elif choice < 0.85:
            cursor.execute("DELETE FROM t WHERE id = %s", (key,))
            live.discard(key)
        else:
            table = self.random.choice(("u", "w"))
            cursor.execute(f"INSERT INTO {table} VALUES (%s, 1) ON DUPLICATE KEY UPDATE w = w + 1",
                           (self.random.randrange(50),))  # fmt: skip
        return next_id

    def finish(self) -> None:
        self.stop.set()
        self.join()
        if self.error is not None:
            raise self.error


def _binlog_counts(db: Db, file: str, pos: int) -> dict[str, dict[str, int]]:
    """The binlog's row changes from ``file``:``pos`` on, as stock mysql-replication reads
    them (a process of its own: replog replaces its row decoding where it is imported)."""
    done = subprocess.run(
        [
            sys.executable,
            str(COUNTER),
            db.server.host,
            str(db.server.port),
            USER,
            PASSWORD,
            file,
            str(pos),
            db.name,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    counts: dict[str, dict[str, int]] = json.loads(done.stdout)
    return counts


def _log_counts(url: str) -> dict[str, Counter[str]]:
    counts: dict[str, Counter[str]] = {}
    for event in events(url):
        table = event["collection"].split(".", 1)[1]
        found = counts.setdefault(table, Counter())
        metadata, op = event["metadata"], event["op"]
        if op == "c":
            found["key_change" if "old_key" in metadata else "insert"] += 1
        elif op == "u":
            found["update"] += 1
        elif op == "d" and "new_key" not in metadata:
            found["delete"] += 1
        elif op == "t" and event["shard"] == 0 and not event["source"].get("table_recreated"):
            found["truncate"] += 1
    return counts


def _source(db: Db, table: str) -> dict[int, dict[str, Any]]:
    with db.server.admin(db.name) as connection, connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {table}")
        names = [d[0] for d in cursor.description]
        return {row[0]: dict(zip(names, row, strict=True)) for row in cursor.fetchall()}


def _kill(
    command: list[str], kind: str, workload: Workload, chooser: random.Random, errors: Path
) -> None:
    """One run of capture, ended by SIGKILL as ``kind`` says."""
    env = {**os.environ}
    if kind != "random":
        env["REPLOG_FAULT"] = f"capture_{kind}"
    with errors.open("a") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                                   start_new_session=True)  # fmt: skip
    try:
        if kind == "random":
            time.sleep(chooser.uniform(0.5, 4.0))
            process.kill()
        elif kind == "staged":
            workload.big.set()  # staged in pieces: it kills itself at the first
        process.wait(timeout=HANG_S)  # it kills itself at its step
    finally:
        process.kill()
    assert process.returncode == -9, errors.read_text()[-3000:]


def _check_counts(db: Db, url: str, file: str, pos: int) -> None:
    """Every change of the binlog once in the log, each source transaction in one commit."""
    found = events(url)  # gapless, ids unique
    by_transaction: dict[str, set[int]] = {}
    for event in found:
        if event["op"] != "r":
            txn = event["metadata"]["transaction"]["id"]
            by_transaction.setdefault(txn, set()).add(event["version"])
    assert all(len(v) == 1 for v in by_transaction.values()), "a transaction split"
    binlog = _binlog_counts(db, file, pos)
    logged = _log_counts(url)
    for table in ("t", "u", "w"):
        expected = {k: v for k, v in binlog[table].items() if v}
        assert dict(logged[table]) == expected, table
    assert binlog["t"]["key_change"] > 0 and binlog["w"]["truncate"] == 1
    assert binlog["t"]["update"] >= BIG  # the large transaction


def _check_delta(spark: Any, db: Db, url: str, tmp_path: Path) -> None:
    """``apply_changes`` from the log: each Delta table equal to its source row by row
    (``w``, truncated and re-created, is counted only: apply_changes of truncate events is
    issue 39's)."""
    targets = {f"{db.name}.{table}": str(tmp_path / "delta" / table) for table in ("t", "u")}
    query = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", "5000")
        .load(url)
        .writeStream.foreachBatch(apply_changes(targets, app_id="kill", log=url))
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    for table in ("t", "u"):
        delta = delta_rows(str(tmp_path / "delta" / table))
        source = _source(db, table)
        assert sorted(delta) == sorted(source), f"{table} keys"
        for key, row in source.items():
            assert {c: delta[key].get(c) for c in row} == row, f"{table} {key}"


def test_capture_killed_again_and_again_holds_every_change_once(
    spark: Any, mysql_db: Db, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int, amount decimal(8,2))",
        f"INSERT INTO t SELECT seq, 0, seq / 100 FROM seq_1_to_{INITIAL}",
        f"INSERT INTO t SELECT seq, 0, 1 FROM seq_{INITIAL + 1}_to_{BIG}",
        "CREATE TABLE u (id int PRIMARY KEY, w int)",
        "CREATE TABLE w (id int PRIMARY KEY, w int)",
    )
    ReplicationLog.create(url, 4)
    [(file, pos, *_)] = mysql_db.query("SHOW MASTER STATUS")  # capture starts here
    seed = random.randrange(1 << 30)
    chooser = random.Random(seed)
    workload = Workload(mysql_db, seed)
    command = [REPLOG, "capture", "mysql", mysql_db.dsn, url, "--tables", "t,u,w", "--follow",
               "--max-changes", "40", "--stage-events", "200", "--snapshot-chunk-rows", "150"]
    errors = tmp_path / "capture.err"
    try:
        for number, kind in enumerate(KILLS):
            _kill(command, kind, workload, chooser, errors)
            if number == 0:  # the capture's position is in the log: writes may start
                assert ReplicationLog.open(url).transaction_version("mysql-capture.mysql")
                workload.start()
        while workload.steps < Workload.STEPS or not workload.big_done:
            assert workload.is_alive(), "the workload stopped"
            time.sleep(0.1)
    except BaseException as exc:
        exc.add_note(f"seed {seed}")
        raise
    finally:
        if workload.is_alive():
            workload.finish()
    if workload.error is not None:
        raise workload.error
    run(mysql_db.dsn, url, tables=("t", "u", "w"))
    try:
        _check_counts(mysql_db, url, file, pos)
        _check_delta(spark, mysql_db, url, tmp_path)
    except AssertionError as exc:
        exc.add_note(f"seed {seed}")
        raise
