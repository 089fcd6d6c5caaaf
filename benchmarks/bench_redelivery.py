"""Cost of telling Debezium redeliveries from new events (``replog append --format debezium``).

A log of ``--events`` PostgreSQL changes appended in ``--appends`` files; then, each on a
fresh log object: the last 100 changes resent (the lookup reads the last commits), and a
file of another table's 100 changes older than every position (a topic appended late: the
lookup reads the whole history). Prints time, log refreshes and what was appended.

Run: .venv/bin/python benchmarks/bench_redelivery.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from replog import ingest
from replog.log import ReplicationLog


def change(key: int, lsn: int, table: str = "items") -> str:
    source = {
        "connector": "postgresql",
        "name": "pg",
        "ts_ms": 1700000000000 + lsn,
        "snapshot": "false",
        "db": "shop",
        "sequence": json.dumps(["100", str(lsn)]),
        "schema": "public",
        "table": table,
        "txId": 7,
        "lsn": lsn,
    }
    value = {"before": None, "after": {"id": key, "n": lsn}, "source": source, "op": "c"}
    return json.dumps(value, separators=(",", ":"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--appends", type=int, default=100)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()
    url = str(Path(tempfile.mkdtemp(prefix="replog-bench-")) / "log")
    log = ReplicationLog.create(url, shards=args.shards)
    per_append = args.events // args.appends
    base = 1000  # every position of the late table's file is older
    for start in range(0, args.events, per_append):
        lines = [change(key, key + base) for key in range(start, start + per_append)]
        ingest.append_lines(log, lines, format="debezium", key_fields=("id",))
    refreshes = 0
    refresh = ReplicationLog.refresh

    def counted(self: ReplicationLog, **options: Any) -> Any:
        nonlocal refreshes
        refreshes += 1
        return refresh(self, **options)

    ReplicationLog.refresh = counted  # type: ignore[method-assign]
    cases = [
        (
            "last 100 changes resent",
            [change(k, k + base) for k in range(args.events - 100, args.events)],
        ),
        ("another table's 100, older than all", [change(k, k, "orders") for k in range(1, 101)]),
    ]
    print(f"log: {args.events:,} events in {args.appends} appends, {args.shards} shards")
    for label, lines in cases:
        refreshes = 0
        began = time.perf_counter()
        report = ingest.append_lines(
            ReplicationLog.open(url), lines, format="debezium", key_fields=("id",)
        )
        took = time.perf_counter() - began
        print(
            f"{label}: {took:.3f} s, {refreshes} refreshes, "
            f"appended {report.events}, dropped as redelivered {report.behind}"
        )


if __name__ == "__main__":
    main()
