"""The workload of the session's one Debezium run (issue 44): one database, captured at
once by Debezium's PostgreSQL connector (tests/support/debezium_peer.py) and by
``replog capture postgres``, each from a slot of its own made before the changes.

    with peer_run(postgres_server, directory) as run:
        run.records        # Debezium's records, in the order it gave them
        run.log            # replog's log of the same changes

Tables: ``customers`` (default identity, a TOASTed text column), ``orders`` (REPLICA
IDENTITY FULL, a TOASTed text column), ``kinds`` (numeric, temporal, JSON, binary, UUID,
array and enum columns, TOASTed text/jsonb/bytea/array columns), ``pairs`` (a composite
key), ``scratch`` (emptied by TRUNCATE) and ``sentinel`` (its one row ends the workload).
The Kafka tests use ``customers`` and ``orders``; the differential test all of them.

TOASTed values are random hex (about 10 kB, compressing to half) in columns set to
``STORAGE EXTERNAL``: stored out of line, so an UPDATE that leaves them alone does not
send them (compressible text, a repeated md5, stays inline and is always sent).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from replog.capture.options import CaptureOptions
from replog.capture.postgres import capture
from replog.log import ReplicationLog
from support.debezium_peer import DebeziumPeer, change_value

TABLES = (
    "public.customers",
    "public.orders",
    "public.kinds",
    "public.pairs",
    "public.scratch",
    "public.sentinel",
)
KEYS = {
    "public.customers": ("id",),
    "public.orders": ("id",),
    "public.kinds": ("id",),
    "public.pairs": ("region", "id"),
    "public.scratch": ("id",),
    "public.sentinel": ("id",),
}
SHARDS = 4
"""replog's log: a TRUNCATE is one event per shard."""

SCHEMA = [
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
    """CREATE TABLE customers (id int PRIMARY KEY, name text, balance numeric(12,2), born date,
       created timestamp, updated timestamptz, note text, tags text[])""",
    "ALTER TABLE customers ALTER COLUMN note SET STORAGE EXTERNAL",
    """CREATE TABLE orders (id bigint PRIMARY KEY, customer int, total numeric(12,2),
       status text, memo text)""",
    "ALTER TABLE orders ALTER COLUMN memo SET STORAGE EXTERNAL",
    "ALTER TABLE orders REPLICA IDENTITY FULL",
    """CREATE TABLE kinds (id int PRIMARY KEY, small smallint, big bigint, flag boolean,
       r real, d double precision, n numeric, money_ numeric(20,4), t time, tz timetz,
       iv interval, ts timestamp(3), tstz timestamptz, j json, jb jsonb, b bytea, u uuid,
       ch char(4), m mood, ia int[], na numeric(8,2)[], ta text[], doc text, big_jb jsonb,
       big_b bytea, big_ta text[], big_ia int[])""",
    *(
        f"ALTER TABLE kinds ALTER COLUMN {c} SET STORAGE EXTERNAL"
        for c in ("doc", "big_jb", "big_b", "big_ta", "big_ia")
    ),
    "CREATE TABLE pairs (region text, id int, v text, PRIMARY KEY (region, id))",
    "CREATE TABLE scratch (id int PRIMARY KEY, v text)",
    "CREATE TABLE sentinel (id int PRIMARY KEY)",
]

HEX = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 320))"
"""About 10 kB of random hex text: stored out of line in a STORAGE EXTERNAL column."""
KINDS = """INSERT INTO kinds VALUES (%(id)s, %(small)s, %(big)s, %(flag)s, %(r)s, %(d)s,
    %(n)s, %(money)s, %(t)s, %(tz)s, %(iv)s, %(ts)s, %(tstz)s, %(j)s, %(jb)s, %(b)s, %(u)s,
    %(ch)s, %(m)s, %(ia)s, %(na)s, %(ta)s, {doc}, {big_jb}, {big_b}, {big_ta}, {big_ia})"""


def kinds_row(n: int, *, nulls: bool = False) -> dict[str, Any]:
    """Values of one ``kinds`` row (all NULL but the key with ``nulls``)."""
    values: dict[str, Any] = {
        "id": n,
        "small": -n,
        "big": 9_000_000_000_000 + n,
        "flag": n % 2 == 0,
        "r": 1.5 + n,
        "d": 0.1 * n,
        "n": [
            "1.50",
            "-0.000000000000000000000000001",
            "123456789012345678901234567890.123",
            "NaN",
            "0",
        ][n % 5],
        "money": f"{n}1234.5678",
        "t": f"10:{n % 60:02d}:30.123456",
        "tz": f"11:{n % 60:02d}:00+02",
        "iv": ["1 year 2 mons 3 days 04:05:06.5", "-3 days", "01:00:00", "2 mons"][n % 4],
        "ts": f"2024-02-29 23:59:{n % 60:02d}.125",
        "tstz": f"2024-03-01 00:00:{n % 60:02d}.5-05",
        "j": '{"b": 1,  "a": [1, 2.50]}',
        "jb": f'{{"n": {n}, "nested": {{"x": null}}}}',
        "b": bytes([0, 1, 2, 255, n % 256]),
        "u": f"a0eebc99-9c0b-4ef8-bb6d-6bb9bd38{n:04d}",
        "ch": "ab",
        "m": ["sad", "ok", "happy"][n % 3],
        "ia": [1, None, n],
        "na": ["1.50", "-2.25", None],
        "ta": ["x", 'with "quote"', None, "a,b"],
    }
    if nulls:
        values = {name: (value if name == "id" else None) for name, value in values.items()}
    return values


def _insert_kinds(connection: psycopg.Connection[Any], n: int, *, big: bool) -> None:
    """A ``kinds`` row; with ``big``, TOASTed text, jsonb and bytea values, and on every
    other such row TOASTed arrays too (rows with the scalar ones alone)."""
    toasted = {
        "doc": HEX,
        "big_jb": f"jsonb_build_object('hex', {HEX})",
        "big_b": f"decode({HEX}, 'hex')",
        "big_ta": f"ARRAY[{HEX}, 'short']" if n % 4 < 2 else "ARRAY['short']",
        "big_ia": "ARRAY(SELECT generate_series(1, 3000))" if n % 4 < 2 else "NULL",
    }
    fills = toasted if big else dict.fromkeys(toasted, "NULL")
    connection.execute(KINDS.format(**fills).encode(), kinds_row(n, nulls=n % 7 == 0))


def snapshot_rows(connection: psycopg.Connection[Any]) -> None:
    """The rows both snapshots read."""
    for n in range(1, 21):
        connection.execute(
            f"INSERT INTO customers VALUES (%s, %s, %s, '1980-01-02', '2024-03-01 10:00:00.5',"
            f" '2024-03-01 10:00:00+02', {HEX if n % 4 == 0 else 'NULL'}, ARRAY['a', 'b'])",
            (n, f"customer {n}", f"{n}.{n % 100:02d}"),
        )
        connection.execute(
            f"INSERT INTO orders VALUES (%s, %s, %s, 'new', {HEX if n % 5 == 0 else 'NULL'})",
            (n, n, f"{n * 3}.50"),
        )
    for n in range(1, 8):
        _insert_kinds(connection, n, big=n % 2 == 1)
    for n in range(1, 4):
        connection.execute("INSERT INTO pairs VALUES ('eu', %s, 'x'), ('us', %s, 'y')", (n, n))
    for n in range(1, 6):
        connection.execute("INSERT INTO scratch VALUES (%s, 'before the truncate')", (n,))


def changes(connection: psycopg.Connection[Any]) -> None:
    """Inserts, updates (TOASTed columns unchanged), deletes, key changes, NULLs,
    transactions of several tables, one large transaction, a TRUNCATE inside a transaction."""
    for n in range(21, 41):
        with connection.transaction():
            connection.execute(
                f"INSERT INTO customers VALUES (%s, %s, 9999999.99, '2000-02-29', now(), now(),"
                f" {HEX}, ARRAY['x'])",
                (n, f"new {n}"),
            )
            connection.execute("INSERT INTO orders VALUES (%s, %s, 1.00, 'new', NULL)", (n, n))
    for n in range(1, 41, 3):
        connection.execute("UPDATE customers SET balance = balance + 1 WHERE id = %s", (n,))
        connection.execute("UPDATE orders SET status = 'paid' WHERE id = %s", (n,))
    connection.execute("UPDATE customers SET id = 1000 WHERE id = 4")  # key change, TOASTed
    connection.execute("UPDATE orders SET id = 1005 WHERE id = 5")  # key change, FULL, TOASTed
    with connection.transaction():  # several tables, NULLs set and unset
        for n in range(8, 12):
            _insert_kinds(connection, n, big=n % 2 == 0)
        connection.execute("UPDATE customers SET name = NULL, tags = NULL WHERE id = 2")
        connection.execute("UPDATE pairs SET v = NULL WHERE region = 'eu'")
    for n in range(1, 12):  # TOASTed text, jsonb, bytea and array columns left alone
        connection.execute("UPDATE kinds SET small = small + 100 WHERE id = %s", (n,))
    connection.execute("UPDATE kinds SET id = 100 WHERE id = 1")  # key change, TOASTed
    connection.execute("UPDATE kinds SET doc = 'short now', n = 2.5 WHERE id = 3")
    connection.execute("UPDATE pairs SET region = 'ap' WHERE region = 'us' AND id = 1")
    connection.execute("UPDATE pairs SET id = 10 WHERE region = 'eu' AND id = 2")
    for n in range(2, 41, 5):
        with connection.transaction():
            connection.execute("DELETE FROM orders WHERE id = %s", (n,))
            connection.execute("DELETE FROM customers WHERE id = %s", (n,))
    connection.execute("DELETE FROM kinds WHERE id IN (5, 9)")
    connection.execute("DELETE FROM pairs WHERE region = 'us' AND id = 3")
    with connection.transaction():  # a TRUNCATE between changes of one transaction
        connection.execute("INSERT INTO scratch VALUES (6, 'gone with the rest')")
        connection.execute("UPDATE customers SET balance = 0 WHERE id = 1")
        connection.execute("TRUNCATE scratch")
        connection.execute("INSERT INTO scratch VALUES (1, 'after the truncate')")
    with connection.transaction():  # one large transaction
        connection.execute("UPDATE orders SET total = total * 2 WHERE status = 'new'")
    connection.execute("INSERT INTO sentinel VALUES (1)")


@dataclass
class PeerRun:
    """The workload's database, Debezium's records of it and replog's log of it."""

    dsn: str
    records: list[dict[str, Any]]
    log: ReplicationLog


def _is_sentinel(record: dict[str, Any]) -> bool:
    return bool(record["topic"].endswith(".sentinel") and change_value(record) is not None)


def _snapshot_done(record: dict[str, Any]) -> bool:
    return (change_value(record) or {}).get("source", {}).get("snapshot") == "last"


@contextmanager
def peer_run(postgres_server: Any, directory: Path) -> Iterator[PeerRun]:
    """Schema and rows, both snapshots, the changes; each tool caught up to the sentinel."""
    with postgres_server.database() as dsn:
        with psycopg.connect(dsn, autocommit=True) as connection:
            for statement in SCHEMA:
                connection.execute(statement)
            snapshot_rows(connection)
        log = ReplicationLog.create(str(directory / "replog"), SHARDS)
        options = CaptureOptions(dsn, "replog", tables=TABLES)
        with DebeziumPeer(
            dsn,
            directory / "debezium",
            tables=TABLES,
            extra={"skipped.operations": "none"},  # TRUNCATE records too (default: "t")
        ) as peer:
            peer.wait_for(_snapshot_done)
            capture(options, log)  # replog's slot and snapshot, before the changes
            with psycopg.connect(dsn, autocommit=True) as connection:
                changes(connection)
            peer.wait_for(_is_sentinel)
        capture(options, log)
        yield PeerRun(dsn, peer.records(), log)


__all__ = ["KEYS", "TABLES", "PeerRun", "changes", "peer_run", "snapshot_rows"]
