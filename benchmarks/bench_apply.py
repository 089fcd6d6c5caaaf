"""apply_changes throughput: changes applied per second to a Delta table of 1M rows.

The core path that every micro-batch's driver runs after Spark's reduction
(:func:`replog.tables.delta.apply_batch`): a 1M-row table is created, then batches of
changes (80% updates of random existing keys, 10% inserts of new keys, 10% deletes) are
merged, each as one Delta commit with its app transaction. Reported: changes per second
per batch size (median of the runs), and the table's row count at the end.

Run: .venv/bin/python benchmarks/bench_apply.py [--rows 1000000] [--batches 10000,100000]
[--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa

from replog.tables import changes as rows
from replog.tables.delta import apply_batch, open_table, read_table

NOW = datetime(2024, 1, 1, tzinfo=timezone.utc)


def batch(ids: np.ndarray, ops: list[str], first_sequence: int) -> pa.Table:
    count = len(ids)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"name-{i}" for i in ids]),
            "price": pa.array(np.random.default_rng(first_sequence).random(count)),
            rows.SHARD: pa.array(np.zeros(count, np.int32)),
            rows.SEQUENCE: pa.array(np.arange(first_sequence, first_sequence + count)),
            rows.OPERATION: pa.array(ops),
            rows.TIMESTAMP: pa.array([NOW] * count, pa.timestamp("us", tz="UTC")),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batches", default="10000,100000")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as where:
        target = f"{where}/table"
        start = time.perf_counter()
        apply_batch(
            target,
            batch(np.arange(args.rows), ["insert"] * args.rows, 0),
            ["id"],
            app_id="bench",
            batch_id=0,
        )
        print(f"created {args.rows:,} rows in {time.perf_counter() - start:.1f} s")
        sequence, batch_id, next_id = args.rows, 1, args.rows
        print("| changes per batch | median s per batch | changes applied/s |\n|---|---|---|")
        for size in (int(s) for s in args.batches.split(",")):
            times = []
            for _ in range(args.runs):
                updates = int(size * 0.8)
                inserts = int(size * 0.1)
                deletes = size - updates - inserts
                ids = np.concatenate(
                    [
                        rng.choice(next_id, updates + deletes, replace=False),
                        np.arange(next_id, next_id + inserts),
                    ]
                )
                ops = ["update"] * updates + ["delete"] * deletes + ["insert"] * inserts
                changes = batch(ids, ops, sequence)
                sequence += size
                next_id += inserts
                start = time.perf_counter()
                apply_batch(target, changes, ["id"], app_id="bench", batch_id=batch_id)
                times.append(time.perf_counter() - start)
                batch_id += 1
            median = statistics.median(times)
            print(f"| {size:,} | {median:.2f} | {size / median:,.0f} |")
        table = open_table(target, None)
        assert table is not None
        print(f"final table: {read_table(table, []).num_rows:,} rows, version {table.version()}")


if __name__ == "__main__":
    main()
