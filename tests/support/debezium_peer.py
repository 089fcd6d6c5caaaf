"""Debezium's PostgreSQL connector, run as a peer of ``replog capture``: its embedded engine
(jvm/debezium, ``DebeziumRun``) against a DSN, each record it gives written as one JSON line
of what Kafka Connect would put into Kafka (JsonConverter's key and value, with and without
schemas; the value after ExtractNewRecordState; the headers).

    with DebeziumPeer(dsn, directory, tables=("public.orders",)) as peer:
        peer.wait_for(lambda record: ...)   # until a record the caller knows comes last
    peer.records()                         # every record, in the order Debezium gave them

Used by tests/test_debezium_peer.py and benchmarks/bench_debezium.py (importable from
both: it needs only the standard library, psycopg and the jars of ``make jars``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from support.kafka import classpath, java

WAIT_S = 300.0
"""A wait for a hang (nothing in the output for this long), not a limit on speed."""


class LoopbackForwarder:
    """A TCP port on loopback (the kernel picks it: no race) forwarding each connection to
    the server's Unix socket: the embedded server listens on no TCP address, and Debezium's
    JDBC driver reaches a server over TCP only. Two threads per connection, 1 MiB reads."""

    def __init__(self, unix_path: str) -> None:
        self.unix_path = unix_path
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.connect(self.unix_path)
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(source, target), daemon=True).start()

    def close(self) -> None:
        self._listener.close()


def _pump(source: socket.socket, target: socket.socket) -> None:
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    try:
        while True:
            count = source.recv_into(buffer)
            if count == 0:
                break
            target.sendall(view[:count])
    except OSError:
        pass  # the other side closed: the connection is over
    finally:
        for end in (source, target):
            with contextlib.suppress(OSError):  # already shut
                end.shutdown(socket.SHUT_RDWR)


def tcp_dsn(dsn: str) -> tuple[str, LoopbackForwarder | None]:
    """``dsn`` reachable over TCP: itself when it names a TCP host, else a forwarder to its
    Unix socket and the DSN of that."""
    parts = conninfo_to_dict(dsn)
    host = str(parts.get("host") or "")
    if host and not host.startswith("/"):
        return dsn, None
    port = int(parts.get("port") or 5432)
    forwarder = LoopbackForwarder(f"{host or '/tmp'}/.s.PGSQL.{port}")
    return make_conninfo(dsn, host="127.0.0.1", port=forwarder.port), forwarder


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
    parts = conninfo_to_dict(dsn)
    settings = {
        "name": "replog-peer",
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        "offset.storage.file.filename": str(directory / "offsets.dat"),
        "offset.flush.interval.ms": "1000",
        "database.hostname": str(parts.get("host") or "localhost"),
        "database.port": str(parts.get("port") or 5432),
        "database.user": str(parts.get("user") or "postgres"),
        "database.password": str(parts.get("password") or ""),
        "database.dbname": str(parts["dbname"]),
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
        dsn, self._forwarder = tcp_dsn(dsn)
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
        (nothing parsed: a benchmark's millions of records, with no work for the GIL that
        the forwarder's threads need)."""
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
        if self._forwarder is not None:
            self._forwarder.close()
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
