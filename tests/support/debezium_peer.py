"""Debezium's PostgreSQL connector, run as a peer of ``replog capture``: its embedded engine
(jvm/debezium, ``DebeziumRun``) against a DSN, each record it gives written as one JSON line
of what Kafka Connect would put into Kafka (JsonConverter's key and value, with and without
schemas; the value after ExtractNewRecordState; the headers).

    with DebeziumPeer(dsn, directory, tables=("public.orders",)) as peer:
        peer.wait_for(lambda record: ...)   # until a record the caller knows comes last
    peer.records()                         # every record, in the order Debezium gave them

Used by tests/support/debezium_workload.py (the tests' one Debezium run) and
benchmarks/bench_debezium.py (importable from both: it needs only the standard library,
psycopg and the jars of ``make jars``). The engine reaches a server's Unix socket
directly (junixsocket's socket factory in PostgreSQL's JDBC driver), as replog does.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from psycopg.conninfo import conninfo_to_dict

from support.kafka import classpath, java

WAIT_S = 300.0
"""A wait for a hang (nothing in the output for this long), not a limit on speed."""


UNIX_SOCKET_FACTORY = "org.newsclub.net.unix.AFUNIXSocketFactory$FactoryArg"
"""junixsocket's socket factory for PostgreSQL's JDBC driver: ``socketFactoryArg`` names
the server's socket file (jvm/debezium/pom.xml puts junixsocket on the classpath)."""


def _connection(dsn: str) -> dict[str, str]:
    """The connector's ``database.*`` settings for ``dsn``, and ``driver.*`` ones that give
    the JDBC driver the server's Unix socket when the DSN names one (a directory as
    ``host``, or none): the embedded server listens on no TCP address."""
    parts = conninfo_to_dict(dsn)
    host = str(parts.get("host") or "")
    port = str(parts.get("port") or 5432)
    settings = {
        "database.hostname": host or "localhost",
        "database.port": port,
        "database.user": str(parts.get("user") or "postgres"),
        "database.password": str(parts.get("password") or ""),
        "database.dbname": str(parts["dbname"]),
    }
    if not host or host.startswith("/"):
        settings["database.hostname"] = "localhost"  # not used: the factory's socket is
        settings["driver.socketFactory"] = UNIX_SOCKET_FACTORY
        settings["driver.socketFactoryArg"] = f"{host or '/tmp'}/.s.PGSQL.{port}"
    return settings


def connector_properties(
    dsn: str,
    directory: Path,
    *,
    tables: tuple[str, ...],
    slot: str = "debezium",
    topic_prefix: str = "dbserver1",
    snapshot: str = "initial",
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """The connector's configuration, as a user of Debezium's defaults writes it (JSON
    converter, precise decimals, adaptive times, tombstones after deletes), with
    transaction metadata on (each change's ``transaction`` block: id, total_order)."""
    settings = {
        "name": "replog-peer",
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        "offset.storage.file.filename": str(directory / "offsets.dat"),
        "offset.flush.interval.ms": "1000",
        **_connection(dsn),
        "topic.prefix": topic_prefix,
        "plugin.name": "pgoutput",
        "slot.name": slot,
        "publication.name": f"{slot}_publication",
        "publication.autocreate.mode": "filtered",
        "table.include.list": ",".join(tables),
        "snapshot.mode": snapshot,
        "provide.transaction.metadata": "true",
    }
    settings.update(extra or {})
    return settings


class DebeziumPeer:
    """One run of Debezium's embedded engine, in a JVM of its own, until :meth:`stop`."""

    def __init__(
        self,
        dsn: str,
        directory: Path,
        *,
        tables: tuple[str, ...],
        variants: str = "all",
        java_options: tuple[str, ...] = (),
        **settings: Any,
    ) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.output = directory / "records.jsonl"
        properties = directory / "connector.properties"
        config = connector_properties(dsn, directory, tables=tables, **settings)
        properties.write_text("".join(f"{k}={_escaped(v)}\n" for k, v in config.items()))
        self.log = directory / "engine.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    java(),
                    *java_options,
                    "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
                    "-cp",
                    classpath("debezium"),
                    "io.replog.testing.DebeziumRun",
                    str(properties),
                    str(self.output),
                    variants,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != b"READY":
            self.process.kill()
            raise RuntimeError(f"Debezium did not start: {line!r}\n{self.log.read_text()}")
        self._read = 0
        self._records: list[dict[str, Any]] = []

    def __enter__(self) -> DebeziumPeer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def _failed(self) -> None:
        if self.process.poll() is not None and self.process.returncode != 0:
            raise RuntimeError(
                f"Debezium's engine exited ({self.process.returncode}):\n{self.log.read_text()}"
            )

    def new_records(self) -> list[dict[str, Any]]:
        """The records written since the last call (whole lines only)."""
        if not self.output.exists():
            return []
        with self.output.open("rb") as handle:
            handle.seek(self._read)
            chunk = handle.read()
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self._read += len(whole)
        fresh = [json.loads(line) for line in whole.splitlines() if line.strip()]
        self._records.extend(fresh)
        return fresh

    def wait_for_text(self, needle: bytes, count: int = 1) -> None:
        """Until ``needle`` has appeared ``count`` times in the output, read as raw bytes
        (nothing parsed: a benchmark's millions of records)."""
        scanned, seen, tail = 0, 0, b""
        quiet_since = time.monotonic()
        while seen < count:
            chunk = b""
            if self.output.exists():
                with self.output.open("rb") as handle:
                    handle.seek(scanned)
                    chunk = handle.read(1 << 24)
            scanned += len(chunk)
            window = tail + chunk
            seen += window.count(needle) - tail.count(needle)
            tail = window[-len(needle) + 1 :] if len(needle) > 1 else b""
            if chunk:
                quiet_since = time.monotonic()
                continue
            self._failed()
            if self.process.poll() is not None:
                raise RuntimeError(f"Debezium's engine stopped early:\n{self.log.read_text()}")
            if time.monotonic() - quiet_since > WAIT_S:
                raise RuntimeError(f"Debezium gave nothing for {WAIT_S:.0f}s ({seen} of {count})")
            time.sleep(0.05)

    def wait_for(self, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Read records until one for which ``done`` is true; that record."""
        quiet_since = time.monotonic()
        while True:
            fresh = self.new_records()
            for record in fresh:
                if done(record):
                    return record
            self._failed()
            if self.process.poll() is not None:
                raise RuntimeError(f"Debezium's engine stopped early:\n{self.log.read_text()}")
            if fresh:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > WAIT_S:
                raise RuntimeError(
                    f"Debezium gave nothing for {WAIT_S:.0f}s:\n{self.log.read_text()}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Close the engine's input: it stops, committing its offsets."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._failed()

    def records(self) -> list[dict[str, Any]]:
        """Every record read so far (after :meth:`stop`: every record of the run)."""
        self.new_records()
        return list(self._records)


def _escaped(value: str) -> str:
    """A value as a Java properties file reads it back (backslashes, leading blanks)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def change_value(record: dict[str, Any]) -> dict[str, Any] | None:
    """The envelope (``payload``) of a record's value with schemas; None for a tombstone or a
    transaction BEGIN/END record."""
    if record.get("value") is None:
        return None
    payload = json.loads(record["value"]).get("payload")
    if not isinstance(payload, dict) or "op" not in payload:
        return None
    return payload


def changes(records: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(record, envelope) of each change record (no tombstones, no transaction records)."""
    for record in records:
        envelope = change_value(record)
        if envelope is not None:
            yield record, envelope


__all__ = ["DebeziumPeer", "change_value", "changes", "connector_properties"]
