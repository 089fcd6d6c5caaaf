"""A snapshot that holds while the database moves: DDL every 30 s and SIGKILLs, then Delta
compared with PostgreSQL row by row (issue 38).

    PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/python benchmarks/snapshot_soak.py \
        [--scale 10] [--ddl-every 30] [--kills 5]

Not a test (it takes minutes). pgbench's database at ``--scale`` (100,000 accounts each;
``pgbench_accounts`` range-partitioned in 4, with a TOASTed ``doc`` column on some rows)
and an ``items`` table with TOASTed bodies. A following ``replog capture`` (the CLI, a
process of its own, ``--snapshot-chunk-rows 10000``) reads the snapshot while pgbench
runs on two clients and a writer updates, inserts and deletes items (their TOASTed
bodies unchanged). Every ``--ddl-every`` seconds one DDL of the schedule below runs; the
capture is SIGKILLed ``--kills`` times at spread-out moments and started again at once.
Then the writers stop, capture catches up, one Spark query applies the log to a Delta
table per collection (``apply_changes``), and every table is compared with PostgreSQL
row by row on its columns. Prints ``RESULT {...}``; exits 1 if any row differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from embedded_pg import running_server
from pgbench_to_delta import BIG, apply_to_delta, compare_table, pgbench, sql

from replog.log import ReplicationLog

TABLES = {
    "pgbench_accounts": ("aid",),
    "pgbench_branches": ("bid",),
    "pgbench_tellers": ("tid",),
    "pgbench_history": ("aid", "hid"),
    "items": ("id",),
}
ITEMS = 20_000


def schedule(last_partition_bound: str) -> list[tuple[str, list[str]]]:
    """The DDL, one step every ``--ddl-every`` seconds, each named."""
    return [
        ("add column with default, then set",
         ["ALTER TABLE pgbench_accounts ADD COLUMN note text DEFAULT 'n'",
          "UPDATE pgbench_accounts SET note = 'set' WHERE aid % 1000 = 0"]),
        ("retype abalance int -> bigint",
         ["ALTER TABLE pgbench_accounts ALTER COLUMN abalance TYPE bigint"]),
        ("rename column filler -> filler2",
         ["ALTER TABLE pgbench_accounts RENAME COLUMN filler TO filler2"]),
        ("detach the last partition",
         ["ALTER TABLE pgbench_accounts DETACH PARTITION pgbench_accounts_4"]),
        ("rename table items -> items_moved", ["ALTER TABLE items RENAME TO items_moved"]),
        ("attach the partition again",
         [f"ALTER TABLE pgbench_accounts ATTACH PARTITION pgbench_accounts_4 "
          f"{last_partition_bound}"]),
        ("rename table items_moved -> items", ["ALTER TABLE items_moved RENAME TO items"]),
        ("drop column note", ["ALTER TABLE pgbench_accounts DROP COLUMN note"]),
        ("retype items.v int -> bigint USING v * 10 (every value changes)",
         ["ALTER TABLE items ALTER COLUMN v TYPE bigint USING v * 10"]),
        ("rename column filler2 -> filler",
         ["ALTER TABLE pgbench_accounts RENAME COLUMN filler2 TO filler"]),
    ]  # fmt: skip


def prepare(dsn: str, scale: int) -> str:
    """The tables; the last partition's bound (to attach it again after its DETACH)."""
    pgbench(dsn, "-i", "-s", str(scale), "-q", "--partitions", "4", "--partition-method", "range")
    sql(
        dsn,
        "ALTER TABLE pgbench_history ADD COLUMN hid bigint GENERATED ALWAYS AS IDENTITY",
        "ALTER TABLE pgbench_history ADD PRIMARY KEY (aid, hid)",
        "ALTER TABLE pgbench_accounts ADD COLUMN doc text",
        f"UPDATE pgbench_accounts SET doc = {BIG} WHERE aid % 5000 = 0",
        "CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL, body text)",
        f"INSERT INTO items SELECT g, 0, CASE WHEN g % 3 = 0"
        f" THEN (SELECT string_agg(md5(h::text || g::text), '') FROM generate_series(1, 200) h)"
        f" ELSE 'short ' || g END FROM generate_series(1, {ITEMS}) g",
        "ANALYZE",
    )
    with psycopg.connect(dsn) as connection:
        row = connection.execute(
            "SELECT pg_get_expr(relpartbound, oid) FROM pg_class"
            " WHERE relname = 'pgbench_accounts_4'"
        ).fetchone()
    assert row is not None
    return str(row[0])


class ItemWriter(threading.Thread):
    """Updates (TOASTed bodies unchanged), inserts and deletes of items until stopped,
    under whichever name the table has (it is renamed back and forth)."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.stop = dsn, threading.Event()
        self.error: BaseException | None = None
        self.transactions = 0

    def run(self) -> None:
        picks = random.Random(38)
        names = ["items", "items_moved"]
        next_id = ITEMS + 1
        try:
            with psycopg.connect(self.dsn, autocommit=True) as connection:
                while not self.stop.is_set():
                    choice, key = picks.random(), picks.randint(1, next_id)
                    try:
                        if choice < 0.8:
                            connection.execute(
                                f"UPDATE {names[0]} SET v = v + 1 WHERE id = %s", (key,)
                            )
                        elif choice < 0.9:
                            connection.execute(f"DELETE FROM {names[0]} WHERE id = %s", (key,))
                        else:
                            connection.execute(
                                f"INSERT INTO {names[0]} VALUES (%s, 0, 'new')", (next_id,)
                            )
                            next_id += 1
                    except psycopg.errors.UndefinedTable:  # renamed meanwhile
                        names.reverse()
                        continue
                    self.transactions += 1
                    time.sleep(0.01)
        except BaseException as exc:  # reported by main, never swallowed
            self.error = exc


class Pgbench(threading.Thread):
    """pgbench on two clients for ``seconds``, started again when DDL aborted it (a
    client that meets a lock timeout or a retyped column gives up, as pgbench does)."""

    def __init__(self, dsn: str, seconds: float) -> None:
        super().__init__(daemon=True)
        self.dsn, self.until = dsn, time.monotonic() + seconds
        self.restarts = 0

    def run(self) -> None:
        while (left := self.until - time.monotonic()) > 1:
            try:
                pgbench(self.dsn, "-n", "-c", "2", "-T", str(int(left)))
            except subprocess.CalledProcessError:
                self.restarts += 1


def capture(dsn: str, url: str, *, follow: bool) -> subprocess.Popen[bytes]:
    tables = ",".join(f"public.{t}" for t in TABLES)
    args = ["capture", "postgres", dsn, url, "--slot", "soak", "--tables", tables,
            "--shards", "8", "--snapshot-chunk-rows", "10000"]  # fmt: skip
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "replog"), *args, *(["--follow"] if follow else [])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--ddl-every", type=float, default=30)
    parser.add_argument("--kills", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="replog-soak-"))
    url, delta = str(root / "log"), str(root / "delta" / "{collection}")
    with running_server() as server, server.database() as dsn:
        bound = prepare(dsn, args.scale)
        steps = schedule(bound)
        seconds = args.ddl_every * (len(steps) + 1)
        kill_at = [seconds * (i + 0.5) / args.kills for i in range(args.kills)]
        started = time.monotonic()
        follower = capture(dsn, url, follow=True)
        load = Pgbench(dsn, seconds)
        load.start()
        writer = ItemWriter(dsn)
        writer.start()
        done: list[dict[str, Any]] = []
        kills = 0
        next_ddl = args.ddl_every
        while time.monotonic() - started < seconds:
            now = time.monotonic() - started
            if kill_at and now >= kill_at[0]:
                kill_at.pop(0)
                follower.send_signal(signal.SIGKILL)  # the capture alone, mid-whatever
                follower.wait()
                kills += 1
                follower = capture(dsn, url, follow=True)
                print(f"{now:6.1f}s  SIGKILL {kills} of capture, started again", flush=True)
            if steps and now >= next_ddl:
                name, statements = steps.pop(0)
                sql(dsn, *statements)
                done.append({"at_s": round(now, 1), "ddl": name})
                print(f"{now:6.1f}s  {name}", flush=True)
                next_ddl += args.ddl_every
            if follower.poll() is not None:
                _, errors = follower.communicate()
                raise SystemExit(f"capture failed:\n{errors.decode()[-3000:]}")
            time.sleep(0.2)
        load.join()
        writer.stop.set()
        writer.join()
        if writer.error is not None:
            raise writer.error
        follower.send_signal(signal.SIGTERM)
        _, errors = follower.communicate(timeout=900)
        assert follower.returncode == 0, errors.decode()[-3000:]
        last = capture(dsn, url, follow=False)  # what the follower had not read
        _, errors = last.communicate(timeout=1800)
        assert last.returncode == 0, errors.decode()[-3000:]
        capture_s = time.monotonic() - started
        events = ReplicationLog.open(url).read_all().num_rows
        apply_s = apply_to_delta(url, delta, str(root / "checkpoint"))
        tables = {name: compare_table(dsn, delta, name, keys) for name, keys in TABLES.items()}
    result = {
        "scale": args.scale,
        "ddl": done,
        "kills": kills,
        "item_transactions": writer.transactions,
        "pgbench_restarts": load.restarts,
        "events": events,
        "capture_s": round(capture_s, 1),
        "apply_s": round(apply_s, 1),
        "tables": tables,
    }
    print("RESULT", json.dumps(result))
    bad = any(t["missing"] or t["extra"] or t["differ"] for t in tables.values())
    print("UNEQUAL" if bad else "EQUAL")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    main()
