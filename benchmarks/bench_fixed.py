"""Fixed costs of a small query: replog vs the API's floor vs Parquet.

For each source, a fresh Python process with a fresh SparkSession (``local[2]``) times:
the first ``readStream.format(...).load()`` (with ``spark.dataSource.register`` for the
floor: that is where Spark then runs its data source lookup); the first AvailableNow query of 1,000
events into ``noop``; then ``--repeat`` later queries (each a new checkpoint), and the
``triggerExecution`` of their micro-batch. The floor is a Python source that plans 8
tasks of 125 pre-built rows (``ceiling.py``), and the same with 1 task (replog plans a
1,000-event batch over 8 shards as one task).

Then, in one session, later queries of replog and of the 1-task floor alternate (less
noise than separate processes): whole query, start() to the first batch, the batch.

Run: PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/python benchmarks/bench_fixed.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EVENTS = 1_000
SOURCES = ("replog", "python floor, 8 tasks", "python floor, 1 task", "parquet")


def prepare(root: Path) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ceiling import SCHEMA_DDL
    from workload import workload

    from replog.format.events import EVENT_SCHEMA
    from replog.log import ReplicationLog
    from replog.spark.schema import SPARK_SCHEMA_DDL

    if SCHEMA_DDL != SPARK_SCHEMA_DDL:
        raise SystemExit("benchmarks/ceiling.py's SCHEMA_DDL no longer matches replog's schema")

    log = ReplicationLog.create(str(root / "log"), 8)
    log.append(workload(EVENTS))
    table = pa.concat_tables([log.read_table(s) for s in range(8)]).cast(EVENT_SCHEMA)
    (root / "parquet").mkdir()
    pq.write_table(table, root / "parquet" / "part-0.parquet")
    with pa.ipc.new_file(str(root / "template.arrow"), table.schema) as writer:
        writer.write_table(table)
    return {
        "log": str(root / "log"),
        "parquet": str(root / "parquet"),
        "template": str(root / "template.arrow"),
    }


def measure(source: str, paths: dict[str, str], repeat: int) -> dict[str, object]:
    from workload import Run, bench_session, stream_run

    spark = bench_session()
    root = Path(tempfile.mkdtemp(prefix="replog-bench-fixed-"))

    def frame():
        if source == "replog":
            return spark.readStream.format("replog").load(paths["log"])
        if source == "parquet":
            schema = spark.read.parquet(paths["parquet"]).schema
            return spark.readStream.schema(schema).parquet(paths["parquet"])
        tasks = "8" if "8 tasks" in source else "1"
        return (
            spark.readStream.format("ceiling")
            .option("rows", str(EVENTS))
            .option("tasks", tasks)
            .option("template", paths["template"])
            .load()
        )

    start = time.perf_counter()  # a registered source pays Spark's lookup in register()
    if source.startswith("python floor"):
        from ceiling import CeilingSource

        spark.dataSource.register(CeilingSource)

    def query(index: int) -> Run:
        run = stream_run(frame(), root / f"chk{index}")
        assert run.rows == EVENTS, (source, run.rows)
        return run

    frame()
    first_load = time.perf_counter() - start
    first_query = query(0).seconds
    later = [query(i) for i in range(1, repeat + 1)]
    spark.stop()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "first load": first_load,
        "first query": first_query,
        "later query": statistics.median(run.seconds for run in later),
        "micro-batch": statistics.median(run.batch_seconds for run in later),
    }


def interleaved(paths: dict[str, str], rounds: int) -> dict[str, tuple[float, float, float]]:
    """Later queries of replog and of the 1-task floor, alternating in one session:
    medians of (whole query, start() to its first batch, the batch)."""
    from ceiling import CeilingSource
    from workload import Run, bench_session, stream_run

    spark = bench_session()
    spark.dataSource.register(CeilingSource)
    root = Path(tempfile.mkdtemp(prefix="replog-bench-fixed-"))
    frames = {
        "replog": lambda: spark.readStream.format("replog").load(paths["log"]),
        "python floor, 1 task": lambda: (
            spark.readStream.format("ceiling")
            .option("rows", str(EVENTS))
            .option("tasks", "1")
            .option("template", paths["template"])
            .load()
        ),
    }
    runs: dict[str, list[Run]] = {name: [] for name in frames}
    for index in range(rounds + 1):  # round 0 warms up
        for name, frame in frames.items():
            run = stream_run(frame(), root / f"{name}-{index}")
            if index:
                runs[name].append(run)
    spark.stop()
    shutil.rmtree(root, ignore_errors=True)
    return {
        name: (
            statistics.median(run.seconds for run in values),
            statistics.median(run.to_first_batch for run in values),
            statistics.median(run.batch_seconds for run in values),
        )
        for name, values in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, json.loads(args.paths), args.repeat)))
        return
    root = Path(tempfile.mkdtemp(prefix="replog-bench-fixed-data-"))
    try:
        paths = prepare(root)
        results = {}
        for source in SOURCES:
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    source,
                    "--paths",
                    json.dumps(paths),
                    "--repeat",
                    str(args.repeat),
                ],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ},
            )
            [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            results[source] = json.loads(line.removeprefix("RESULT "))
        alternating = interleaved(paths, args.repeat + 3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    columns = ("first load", "first query", "later query", "micro-batch")
    print(f"| {EVENTS:,} events, fresh session per source | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for source, values in results.items():
        print(f"| {source} | " + " | ".join(f"{values[c]:.2f} s" for c in columns) + " |")
    print()
    print(
        f"| later queries, alternating in one session (median of {args.repeat + 3}) "
        "| whole query | start() to first batch | batches |"
    )
    print("|---|---|---|---|")
    for source, (whole, to_first, batch) in alternating.items():
        print(f"| {source} | {whole:.3f} s | {to_first:.3f} s | {batch:.3f} s |")


if __name__ == "__main__":
    main()
