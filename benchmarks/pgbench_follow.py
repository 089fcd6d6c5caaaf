"""pgbench's database to Delta as a user runs it, then followed while pgbench writes.

    PYSPARK_PYTHON=$PWD/.venv/bin/python nice .venv/bin/python benchmarks/pgbench_follow.py \
        [--scale 100] [--seconds 60] [--max-events 1000000]

The measurement of issue 41: ``pgbench -i -s SCALE`` (SCALE x 100,000 accounts) and a
marker table; ``replog capture postgres`` with the tables only (the snapshot, timed);
one Spark query (``local[2]``, ``foreachBatch(apply_changes("…/{collection}", log=…))``,
``maxEventsPerTrigger``) loading the log into Delta (timed: Spark's start included); then
a following capture and the same query kept running while pgbench runs ``--seconds`` on
two clients and a marker row is inserted every 0.5 s. A marker's latency is from its
``COMMIT`` returning to the first read of its Delta table that holds it (polled every
50 ms with polars). Finally every table is compared with PostgreSQL row by row (the
server's rows through ``COPY``, the table's through polars, joined on the key). Prints
``RESULT {...}``; exits 1 if any row differs.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import polars
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from embedded_pg import running_server
from pgbench_to_delta import pgbench

TABLES = {
    "pgbench_accounts": ("aid",),
    "pgbench_branches": ("bid",),
    "pgbench_tellers": ("tid",),
    "pgbench_history": ("hid",),
    "markers": ("id",),
}


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)


def capture(dsn: str, url: str, *, follow: bool) -> subprocess.Popen[bytes]:
    tables = ",".join(f"public.{t}" for t in TABLES)
    args = ["capture", "postgres", dsn, url, "--slot", "follow", "--tables", tables]
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "replog"), *args, *(["--follow"] if follow else [])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def copy_out(dsn: str, statement: str) -> bytes:
    """What a ``COPY ... TO STDOUT`` statement sends."""
    buffer = io.BytesIO()
    with (
        psycopg.connect(dsn) as connection,
        connection.cursor() as cursor,
        cursor.copy(statement) as copy,
    ):
        for chunk in copy:
            buffer.write(chunk)
    return buffer.getvalue()


def children_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


CHECKPOINT_MANAGER = "spark.sql.streaming.checkpointFileManagerClass"
LOCAL_CHECKPOINTS = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)
"""Spark's checkpoint files through Hadoop's FileSystem API rather than FileContext: on
local disk FileContext forks ``readlink`` and ``chmod`` for each offset and commit log
entry (Hadoop's shell fallback), 90-150 ms of every micro-batch here (OPERATIONS.md)."""


def spark_session() -> Any:
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "6g")
        .config(CHECKPOINT_MANAGER, LOCAL_CHECKPOINTS)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def query(  # noqa: PLR0917 - the benchmark's two queries
    spark: Any, url: str, delta: str, checkpoint: str, max_events: int, once: bool
) -> Any:
    from replog.spark.functions import apply_changes

    writer = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", str(max_events))
        .load(url)
        .writeStream.foreachBatch(apply_changes(delta, app_id="follow", log=url))
        .option("checkpointLocation", checkpoint)
    )
    return writer.trigger(availableNow=True).start() if once else writer.start()


class Markers:
    """A marker row every ``every`` s; its commit time, and when its Delta table first
    held it (seen by :func:`watch_markers` in a process of its own, as a reader of the
    table would be: polling in the Spark driver's process took its GIL from the apply)."""

    def __init__(self, dsn: str, table: str, every: float = 0.5) -> None:
        self.dsn, self.table, self.every = dsn, table, every
        self.committed: dict[int, float] = {}
        self.seen: dict[int, float] = {}
        self.failures: list[BaseException] = []
        spawned = multiprocessing.get_context("spawn")
        self._stop = spawned.Event()
        self._seen, sending = spawned.Pipe(duplex=False)
        self._watcher = spawned.Process(target=watch_markers, args=(table, self._stop, sending))

    def start(self) -> None:
        self._watcher.start()

    def write(self, count: int) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as connection:
                for n in range(count):
                    connection.execute("INSERT INTO markers (id, at) VALUES (%s, now())", (n,))
                    self.committed[n] = time.monotonic()
                    time.sleep(self.every)
        except BaseException as exc:
            self.failures.append(exc)

    def stop(self) -> None:
        """Stop the watcher and take what it saw."""
        self._stop.set()
        seen, failure = self._seen.recv()
        self._watcher.join()
        self.seen.update(seen)
        if failure:
            self.failures.append(RuntimeError(f"the markers' watcher failed: {failure}"))

    def latencies(self) -> list[float]:
        return sorted(self.seen[m] - t for m, t in self.committed.items() if m in self.seen)


def watch_markers(table: str, stop: Any, sending: Any) -> None:
    """Poll ``table`` every 50 ms until ``stop``; send each marker's first sighting
    (``time.monotonic()``: one clock for every process) and any failure. The table is
    opened once and brought up to date (``update_incremental``), its rows read again only
    when its version moved."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    seen: dict[int, float] = {}
    failure = None
    try:
        opened, version = None, -1
        while not stop.is_set():
            try:
                if opened is None:
                    opened = DeltaTable(table)
                else:
                    opened.update_incremental()
            except TableNotFoundError:  # not created yet
                time.sleep(0.05)
                continue
            if opened.version() != version:
                version = opened.version()
                ids = polars.read_delta(opened, columns=["id"])["id"].to_list()
                now = time.monotonic()
                for marker in ids:
                    seen.setdefault(marker, now)
            time.sleep(0.05)
    except BaseException as exc:
        failure = repr(exc)
    sending.send((seen, failure))


def percentile(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")


COMPARED_KEYS = 5_000_000
"""Keys compared at once: a range of the key at a time, so scale 1000 (100M accounts)
fits in memory."""


def compare(dsn: str, delta: str, table: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The server's rows (``COPY`` as CSV) against the table's (polars), on the key, as
    text, :data:`COMPARED_KEYS` of the (integer) key at a time; timestamps as
    microseconds since the epoch on both sides (the server's text of a ``timestamp`` and
    polars' differ in form, not in value)."""
    with psycopg.connect(dsn) as connection:
        kinds = dict(
            connection.execute(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_schema = 'public' AND table_name = %s",
                (table,),
            ).fetchall()
        )
        span = connection.execute(f"SELECT min({keys[0]}), max({keys[0]}) FROM {table}")
        low, high = span.fetchone() or (None, None)
    scan = polars.scan_delta(delta.format(collection=f"public.{table}"))
    bounds = scan.select(
        polars.col(keys[0]).min().alias("low"), polars.col(keys[0]).max().alias("high")
    ).collect()
    lows = [v for v in (low, bounds["low"][0]) if v is not None]
    highs = [v for v in (high, bounds["high"][0]) if v is not None]
    total = {"rows": 0, "delta_rows": 0, "unequal": 0}
    if not lows:
        return total
    start, end = min(lows), max(highs) + 1
    for first in range(start, end, COMPARED_KEYS):
        last = min(first + COMPARED_KEYS, end)
        part = _compare_range(dsn, scan, table, keys, kinds, (first, last))
        total = {name: total[name] + part[name] for name in total}
    return total


def _compare_range(  # noqa: PLR0917 - one range's parts
    dsn: str,
    scan: Any,
    table: str,
    keys: tuple[str, ...],
    kinds: dict[str, str],
    span: tuple[int, int],
) -> dict[str, int]:
    stamps = {c for c, kind in kinds.items() if kind.startswith("timestamp")}
    chosen = ", ".join(
        f"(extract(epoch FROM {c}) * 1000000)::bigint AS {c}" if c in stamps else c for c in kinds
    )
    where = f"{keys[0]} >= {span[0]} AND {keys[0]} < {span[1]}"
    statement = (
        f"COPY (SELECT {chosen} FROM {table} WHERE {where}) TO STDOUT WITH (FORMAT csv, HEADER)"
    )
    source = polars.read_csv(copy_out(dsn, statement), infer_schema=False)
    found = scan.filter(
        (polars.col(keys[0]) >= span[0]) & (polars.col(keys[0]) < span[1])
    ).collect()
    columns = source.columns

    def text(column: str) -> polars.Expr:
        value = polars.col(column)
        if column in stamps:
            value = value.dt.epoch("us")
        return value.cast(polars.String).str.strip_chars_end(" ")

    source = source.select([polars.col(c).str.strip_chars_end(" ") for c in columns])
    found = found.select([text(c) for c in columns if c in found.columns])
    joined = source.join(found, on=list(keys), how="full", suffix="_delta", coalesce=True)
    values = [c for c in columns if c not in keys]
    unequal = joined.filter(
        polars.any_horizontal([polars.col(c).ne_missing(polars.col(f"{c}_delta")) for c in values])
    ).height
    return {"rows": source.height, "delta_rows": found.height, "unequal": unequal}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=int, default=100)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--max-events", type=int, default=1_000_000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="replog-follow-", dir=os.environ.get("BENCH_DIR")))
    url, delta, checkpoint = (
        str(root / "log"),
        str(root / "delta" / "{collection}"),
        str(root / "chk"),
    )
    result: dict[str, Any] = {"scale": args.scale, "max_events": args.max_events}
    with running_server() as server, server.database() as dsn:
        started = time.perf_counter()
        pgbench(dsn, "-i", "-s", str(args.scale), "-q")
        sql(dsn, "CREATE TABLE markers (id bigint PRIMARY KEY, at timestamptz)",
            "ALTER TABLE pgbench_history ADD COLUMN hid bigint GENERATED ALWAYS AS IDENTITY",
            "ALTER TABLE pgbench_history ADD PRIMARY KEY (hid)")  # fmt: skip
        result["pgbench_init_s"] = round(time.perf_counter() - started, 1)
        rows = args.scale * 100_000 + args.scale * 11
        # 1. the snapshot
        started = time.perf_counter()
        snapshot = capture(dsn, url, follow=False)
        _, errors = snapshot.communicate(timeout=7200)
        assert snapshot.returncode == 0, errors.decode()[-2000:]
        seconds = time.perf_counter() - started
        result["capture"] = {"s": round(seconds, 1), "rows_per_s": round(rows / seconds),
                             "peak_rss_mb": round(children_peak_rss_mb())}  # fmt: skip
        # 2. the load through Spark
        started = time.perf_counter()
        spark = spark_session()
        load = query(spark, url, delta, checkpoint, args.max_events, once=True)
        load.awaitTermination()
        seconds = time.perf_counter() - started
        for progress in load.recentProgress:
            print("BATCH", progress["batchId"], progress["numInputRows"],
                  json.dumps(progress["durationMs"]), flush=True)  # fmt: skip
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result["load"] = {"s": round(seconds, 1), "rows_per_s": round(rows / seconds),
                          "driver_python_peak_rss_mb": round(rss)}  # fmt: skip
        print("LOADED", json.dumps(result), flush=True)
        # 3. following while pgbench runs
        follower = capture(dsn, url, follow=True)
        running = query(spark, url, delta, checkpoint, args.max_events, once=False)
        markers = Markers(dsn, delta.format(collection="public.markers"))
        writer = threading.Thread(target=markers.write, args=(args.seconds * 2,))
        markers.start()
        time.sleep(5)  # the follower and the query running
        bench = threading.Thread(
            target=pgbench, args=(dsn, "-n", "-c", "2", "-T", str(args.seconds))
        )
        bench.start()
        writer.start()
        writer.join()
        bench.join()
        time.sleep(10)  # pgbench's last transactions through
        follower.send_signal(signal.SIGTERM)
        follower.communicate(timeout=600)
        last = capture(dsn, url, follow=False)
        last.communicate(timeout=600)
        time.sleep(5)
        running.processAllAvailable()
        running.stop()
        time.sleep(1)  # the watcher's last poll
        markers.stop()
        assert not markers.failures, markers.failures
        spark.stop()
        found = markers.latencies()
        with psycopg.connect(dsn) as connection:
            tps = connection.execute("SELECT count(*) FROM pgbench_history").fetchone()
        result["follow"] = {
            "markers": len(markers.committed), "seen": len(found),
            "p50_s": round(percentile(found, 0.5), 3), "p95_s": round(percentile(found, 0.95), 3),
            "max_s": round(max(found), 3) if found else None,
            "pgbench_transactions": tps[0] if tps else None,
        }  # fmt: skip
        result["tables"] = {t: compare(dsn, delta, t, k) for t, k in TABLES.items()}
    print("RESULT", json.dumps(result))
    bad = any(t["unequal"] or t["rows"] != t["delta_rows"] for t in result["tables"].values())
    print("UNEQUAL" if bad else "EQUAL")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    main()
