"""Snapshot chunks of MySQL tables, read between two watermark rows in the binlog.

DESIGN (Netflix's DBLog; Debezium's signalling table): MySQL has no logical messages, so a
watermark is a row: capture's row in ``replog.watermarks`` (one per capture), updated in a
transaction of its own before (``low``) and after (``high``) a chunk is selected. The
binlog orders those updates with every other commit; the stream recognises them (the
table is capture's, never emitted) and, between the two, drops from the chunk each row a
change names (the change is as new as the row, or newer). At the high watermark the rows
left become read events (``op`` r), in that commit of the log.

Each chunk is one autocommitted ``SELECT ... WHERE key > last ORDER BY key LIMIT n``: no
lock, no transaction held open. The table is described before and after it; if its
columns changed in between (or the read met a column or table that went away), the chunk
is read again between new watermarks. A key column retyped starts the table's snapshot
again from its first key.
"""

from __future__ import annotations

import base64
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pymysql

from replog.capture.chunk_sizes import ChunkSizes
from replog.capture.events import ChunkRows
from replog.capture.mysql.columns import BINARIES, identifier, select_expression
from replog.capture.mysql.events import MySqlEvents
from replog.capture.mysql.rows import RowReader
from replog.capture.mysql.server import MySqlServer, TableInfo
from replog.capture.snapshot import PendingChunk, TableSnapshot
from replog.errors import CaptureError

logger = logging.getLogger(__name__)

ATTEMPTS = 5
"""Reads of one chunk before capture gives up on a table whose columns change each time."""
_MOVED = (1054, 1146, 1356)
"""Unknown column, unknown table, a view's table gone: the table changed under the read."""


@dataclass
class MySqlChunk:
    """A chunk in flight: its rows, read between its watermarks, as read events by key."""

    snapshot: TableSnapshot
    table: TableInfo
    mark: str
    """Names this chunk's watermarks (the watermark row carries it)."""
    events: ChunkRows
    after: list[str | None] | None
    finished: bool
    low_seen: bool = False
    metadata: str = ""
    ts_ms: int = 0

    def stood_for(self, key: str) -> None:
        """A change of the window names ``key``: it stands for the row the chunk read."""
        if self.low_seen:
            self.events.pop(key, None)

    def emptied(self) -> None:
        """The table's rows went away inside the window (TRUNCATE, a DROP and CREATE): the
        rows the chunk read were there before it (rows inserted since are changes of the
        window, after it)."""
        if self.low_seen:
            self.events.clear()

    def pending(self, position: int) -> PendingChunk:
        return PendingChunk(
            position, self.table.qualified, self.after, 0, 0, len(self.events), self.finished
        )


def _key_text(value: Any, kind: str) -> str | None:
    """A key value as the plan keeps it: binary keys in base64, a BIT key as its number
    (its bytes are no text), others as their text."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if kind == "bit":
        return str(int.from_bytes(value, "big"))
    if kind in BINARIES:
        return base64.b64encode(value).decode("ascii")
    return str(value.decode("utf-8"))


def _key_columns(table: TableInfo, selected: list[pa.Array]) -> list[pa.Array]:
    """A chunk's key columns, in key order, from its row's columns: their text is the next
    chunk's lower bound (a FLOAT's, the double it widens to: exact, where its own text
    output, cut to six digits, bounded below the stored value and read a row again)."""
    at = {c.name: index for index, c in enumerate(table.columns)}
    return [selected[at[name]] for name in table.key]


def _key_param(text: str | None, kind: str) -> Any:
    """The statement's parameter for a key value the plan keeps (:func:`_key_text`)."""
    if text is None:
        return None
    if kind == "bit":
        return int(text)
    if kind in BINARIES:
        return base64.b64decode(text)
    return text


class MySqlChunks:
    """Reads chunks of captured tables on a session of its own (values as the server's
    text), each between the two watermarks it writes."""

    def __init__(self, server: MySqlServer, maker: MySqlEvents, name: str, chunk_rows: int) -> None:
        self.server = server
        self.maker = maker
        self.name = name
        self.sizes = ChunkSizes(chunk_rows)
        self._reader = RowReader(server.dsn)

    def close(self) -> None:
        self._reader.close()

    def read(self, snapshot: TableSnapshot, table: TableInfo) -> MySqlChunk | None:
        """The next chunk of ``snapshot`` (of ``table``, described anew), read between its
        watermarks; None if the table was dropped meanwhile."""
        for _ in range(ATTEMPTS):
            described = self._describe(table)
            if described is None:
                return None
            if not described.key:
                raise CaptureError(f"{table.qualified} lost its primary key while captured")
            if self._key_shape(described) != self._key_shape(table) and snapshot.after is not None:
                logger.warning(
                    "the key of %s changed while its snapshot ran: the snapshot starts again "
                    "from its first key", table.qualified,
                )  # fmt: skip
                snapshot.after = None
            table = described
            mark = uuid.uuid4().hex
            self.server.watermark(self.name, mark, "low")
            limit = self.sizes.rows(table.qualified)
            try:
                columns = self._select(table, snapshot.after, limit)
            except pymysql.err.MySQLError as exc:
                if exc.args and exc.args[0] in _MOVED:
                    logger.info("%s changed while a chunk was read (%s): read again",
                                table.qualified, exc.args[1])  # fmt: skip
                    continue
                raise
            again = self._describe(table)
            if again is None or again.columns != table.columns or again.key != table.key:
                logger.info("the columns of %s changed while a chunk was read: read again",
                            table.qualified)  # fmt: skip
                continue
            self.server.watermark(self.name, mark, "high")
            keys = _key_columns(table, columns)
            read = len(columns[0])
            self.sizes.learn(table.qualified, read, sum(column.nbytes for column in columns))
            after = snapshot.after
            if read:
                kinds = [self._kind(table, k) for k in table.key]
                last = [column[read - 1].as_py() for column in keys]
                after = [_key_text(v, kind) for v, kind in zip(last, kinds, strict=True)]
            events = self.maker.reads(table, columns, mark)
            return MySqlChunk(snapshot, table, mark, events, after, read < limit)
        raise CaptureError(
            f"the columns of {table.qualified} changed during each of {ATTEMPTS} reads of a "
            f"snapshot chunk: capture stops rather than read rows of a shape it cannot name "
            f"(start it again once the DDL on the table is done)"
        )

    def _describe(self, table: TableInfo) -> TableInfo | None:
        return self.server.describe(
            table.qualified, self.server.options.keys.get(table.qualified, ())
        )

    @staticmethod
    def _kind(table: TableInfo, name: str) -> str:
        return next(c.kind for c in table.columns if c.name == name)

    @staticmethod
    def _key_shape(table: TableInfo) -> tuple[tuple[str, str], ...]:
        kinds = {c.name: c.kind for c in table.columns}
        return tuple((k, kinds.get(k, "")) for k in table.key)

    def _select(
        self, table: TableInfo, after: list[str | None] | None, limit: int
    ) -> list[pa.Array]:
        """The next ``limit`` rows of ``table`` in key order (each column's text), column
        by column: one statement, no lock."""
        keys = ", ".join(identifier(k) for k in table.key)
        columns = ", ".join(select_expression(c) for c in table.columns)
        where, args = "", []
        if after is not None:
            marks = ", ".join(["%s"] * len(table.key))
            where = f" WHERE ({keys}) > ({marks})"
            args = [
                _key_param(v, self._kind(table, k)) for k, v in zip(table.key, after, strict=True)
            ]
        statement = (
            f"SELECT {columns} FROM {table.sql_name}{where} ORDER BY {keys} "
            f"LIMIT {int(limit)}"
        )
        return self._reader.columns(statement, args or None)
