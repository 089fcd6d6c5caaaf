"""Helpers for MySQL capture tests: a database on the session's MariaDB server, captures
into a log, and the log's events in source order."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest
from embedded_mariadb import Server

from replog.capture.mysql.capture import capture
from replog.capture.mysql.chunks import MySqlChunks
from replog.capture.mysql.options import MySqlOptions
from replog.capture.progress import CaptureProgress
from replog.log import ReplicationLog
from support.capture import commit_of_events
from support.logcheck import check_log


@dataclass(frozen=True)
class Db:
    """One test's database: its capture DSN and root access to it."""

    server: Server
    dsn: str

    @property
    def name(self) -> str:
        return self.dsn.rsplit("/", 1)[1]

    def sql(self, *statements: str) -> None:
        """Each statement in a transaction of its own (autocommit), as root."""
        self.server.sql(*statements, database=self.name)

    def transaction(self, *statements: str) -> None:
        """The statements in one transaction."""
        self.server.sql("BEGIN", *statements, "COMMIT", database=self.name)

    def query(self, statement: str) -> list[tuple[Any, ...]]:
        return self.server.query(statement, database=self.name)


def run(dsn: str, url: str, **options: Any) -> CaptureProgress:
    """One capture of ``dsn`` into the log at ``url`` (created with 4 shards if absent),
    until caught up."""
    log = ReplicationLog.open_or_create(url, 4)
    return capture(MySqlOptions(dsn=dsn, **options), log)


def events(url: str) -> list[dict[str, Any]]:
    """Every event (checked gapless, ids unique): snapshot reads first (in commit order),
    then changes in source order (commit, then order in the transaction); payloads parsed
    back to text, each with the commit version that added it."""
    log = ReplicationLog.open(url)
    rows = check_log(log)
    commits = commit_of_events(log)
    found = []
    for row in rows:
        metadata = json.loads(row["metadata"])
        source = metadata["source"]
        transaction = metadata.get("transaction") or {}
        found.append(
            {
                "op": metadata["op"],
                "operation": row["operation"],
                "collection": row["collection"],
                "key": row["key"],
                "data": row["data"].decode(),
                "before": row["before"].decode() if row["before"] is not None else None,
                "metadata": metadata,
                "source": source,
                "order": transaction.get("total_order", 0),
                "version": commits[(row["shard"], row["sequence"])],
                "event_id": row["event_id"],
                "shard": row["shard"],
                "sequence": row["sequence"],
            }
        )
    found.sort(
        key=lambda e: (e["version"], e["source"]["file"], e["source"]["pos"], e["order"], e["key"])
    )
    return found


def changes(url: str) -> list[tuple[str, str, str]]:
    """(op, key, data) of every change (reads and one copy of each truncate left out)."""
    return [
        (e["op"], e["key"], e["data"])
        for e in events(url)
        if e["op"] != "r" and (e["op"] != "t" or e["shard"] == 0)
    ]


def rows_of(url: str, collection: str) -> dict[str, str]:
    """The collection's rows as the log leaves them (key -> row JSON): its events applied
    in order (a truncate empties it)."""
    table: dict[str, str] = {}
    for event in events(url):
        if event["collection"] != collection:
            continue
        if event["op"] == "t":
            table.clear()
        elif event["op"] == "d":
            table.pop(event["key"], None)
        else:
            table[event["key"]] = event["data"]
    return table


def columns_of(db: Db, table: str = "t") -> list[str]:
    """The table's columns now, in order."""
    return [
        name
        for (name,) in db.query(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
            f"AND TABLE_NAME = '{table}' ORDER BY ORDINAL_POSITION"
        )
    ]


def assert_equal_to_table(db: Db, url: str, table: str = "t") -> None:
    """The log's rows of ``table``, cut to its columns now, are the server's rows."""
    assert log_rows(url, f"{db.name}.{table}", columns_of(db, table)) == source_rows(db, table)


def racing_chunks(
    monkeypatch: pytest.MonkeyPatch,
    before: dict[int, Callable[[], None]] | None = None,
    after: dict[int, Callable[[], None]] | None = None,
) -> list[int]:
    """Chunk reads that run ``before[n]`` after the n-th chunk's low watermark (before its
    SELECT) and ``after[n]`` after its SELECT (before its high watermark); one item a
    read."""
    select = MySqlChunks._select
    calls: list[int] = []

    def racing(self: MySqlChunks, table: Any, last: Any, limit: int) -> Any:
        calls.append(1)
        if before and len(calls) in before:
            before[len(calls)]()
        rows = select(self, table, last, limit)
        if after and len(calls) in after:
            after[len(calls)]()
        return rows

    monkeypatch.setattr(MySqlChunks, "_select", racing)
    return calls


def source_rows(db: Db, table: str) -> dict[str, dict[str, Any]]:
    """The table's rows as the server writes them itself (``JSON_OBJECT``), by the key
    capture gives them (an ``id`` column): what the log's rows must equal."""
    names = columns_of(db, table)
    pairs = ", ".join(f"'{name}', `{name}`" for name in names)
    found = {}
    for (text,) in db.query(f"SELECT JSON_OBJECT({pairs}) FROM `{table}`"):
        row = json.loads(text, parse_float=Decimal)
        found[f'{{"id":{row["id"]}}}'] = row
    return found


def log_rows(
    url: str, collection: str, columns: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """:func:`rows_of` parsed, each row cut to ``columns`` (the table's columns now: a
    dropped column stays in rows the log wrote before the drop)."""
    found = {}
    for key, text in rows_of(url, collection).items():
        row = json.loads(text, parse_float=Decimal)
        found[key] = row if columns is None else {c: row.get(c) for c in columns}
    return found
