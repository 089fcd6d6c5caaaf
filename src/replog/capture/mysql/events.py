"""Change events of captured MySQL rows, in the shape Debezium's MySQL connector gives
them (``source`` with ``connector`` ``mysql``, ``server_id``, ``gtid``, ``file``, ``pos``,
``row``, ``db``, ``table``), with the schemas they name (docs/CDC.md, "Capturing MySQL and
MariaDB").

DESIGN: as :mod:`replog.capture.events` for PostgreSQL, one maker writes events whichever
path read the row (a snapshot chunk's text, a binlog row image): a row image is the JSON
fragments of its values (:mod:`~replog.capture.mysql.columns`), joined. The events, their
columns, ids and keys are the shared ones (:class:`~replog.capture.events.Event`,
:func:`~replog.capture.events.event_id`, :func:`~replog.capture.events.key_value`).
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from replog.capture.events import (
    EVENT_ID_NAMESPACE,
    ChunkRows,
    Event,
    TransactionOrder,
    event_id,
    key_value,
    truncate_key,
)
from replog.capture.jsoncolumns import event_ids, json_objects, json_strings
from replog.capture.mysql.binlog import PartialJson, Rows
from replog.capture.mysql.columns import (
    INTEGERS,
    TEXTS,
    ZERO,
    MySqlColumn,
    quoted,
    table_schema,
    text_fragment,
)
from replog.capture.mysql.jsontext import apply_diffs
from replog.capture.mysql.server import TableInfo
from replog.debezium import OPERATIONS, TRUNCATE_OP
from replog.errors import CaptureError
from replog.format import jsontext
from replog.format.jsontext import RawJSON
from replog.schemas import connect as connect_schemas

_VERSION = importlib.metadata.version("pyspark-replog")
_NUMERIC_KEYS = frozenset((*INTEGERS, "decimal"))
"""Kinds whose values are numbers: a key of them is written in its shortest form."""
_AS_TEXT = _NUMERIC_KEYS
"""Kinds whose text output (as the snapshot selects it) is their JSON: the same kinds,
for another reason."""
_AS_STRING = frozenset((*TEXTS, "enum", "set", "json"))
"""Kinds whose text output is their JSON string (escaped as ``quoted`` escapes it)."""
_SHORTEST_INTEGER = "^(-?[1-9][0-9]*|0)$"
"""A number key_value leaves as it is (no fraction, no leading zero)."""


@dataclass
class Transaction:
    """The source transaction being read: what its events' ``source`` and
    ``transaction`` blocks say."""

    gtid: str | None
    ts_ms: int
    server_id: int
    file: str = ""
    start: int = 0
    """Where it starts in the binlog (``file``, offset)."""

    @property
    def id(self) -> str:
        return self.gtid or f"{self.file}:{self.start}"


@dataclass(frozen=True)
class Shape:
    """What events of a table need of its columns, worked out once per description."""

    collection: str
    columns: tuple[MySqlColumn, ...]
    key: tuple[str, ...]
    names: tuple[str, ...]
    """Each column's ``"name":``."""
    key_positions: tuple[int, ...]
    numeric_keys: tuple[bool, ...]
    digest: str
    json_positions: tuple[int, ...]


class MySqlEvents:
    """Change events of captured tables, with the schemas they name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.schemas: dict[str, tuple[str, dict[str, Any]]] = {}
        """digest -> (collection, Connect schema) of every schema an event named."""
        self.zero_dates: dict[str, int] = {}
        """``collection.column`` -> zero dates written as null."""
        self._shapes: dict[tuple[str, tuple[MySqlColumn, ...], tuple[str, ...]], Shape] = {}
        self.order = TransactionOrder()

    def shape(
        self, collection: str, columns: tuple[MySqlColumn, ...], key: tuple[str, ...]
    ) -> Shape:
        cache_key = (collection, columns, key)
        found = self._shapes.get(cache_key)
        if found is not None:
            return found
        names = tuple(quoted(c.name) + ":" for c in columns)
        by_name = [c.name for c in columns]
        missing = [k for k in key if k not in by_name]
        if missing:
            raise CaptureError(
                f"{collection} has no column {', '.join(missing)} of its key "
                f"({', '.join(key)}) at this point of the binlog: its key was changed; capture "
                f"it into a new log, keyed as it is now"
            )
        positions = tuple(by_name.index(k) for k in key)
        schema = table_schema(f"{self.name}.{collection}", columns, key)
        digest = connect_schemas.digest(schema)
        self.schemas[digest] = (collection, schema)
        found = Shape(
            collection,
            columns,
            key,
            names,
            positions,
            tuple(columns[i].kind in _NUMERIC_KEYS for i in positions),
            digest,
            tuple(i for i, c in enumerate(columns) if c.kind == "json"),
        )
        if len(self._shapes) > 1000:
            self._shapes.clear()
        self._shapes[cache_key] = found
        return found

    # -- row images and keys -------------------------------------------------------------------

    def _row(self, shape: Shape, values: Sequence[Any]) -> str:
        parts = []
        for name, value, column in zip(shape.names, values, shape.columns, strict=True):
            if value is None:
                parts.append(name + "null")
            else:
                if value is ZERO:
                    counted = f"{shape.collection}.{column.name}"
                    self.zero_dates[counted] = self.zero_dates.get(counted, 0) + 1
                parts.append(name + value)
        return "{" + ",".join(parts) + "}"

    @staticmethod
    def _key(shape: Shape, values: Sequence[Any]) -> str:
        parts = []
        for name_index, numeric in zip(shape.key_positions, shape.numeric_keys, strict=True):
            value = values[name_index]
            text = "null" if value is None else value
            if numeric and value is not None:
                text = str(key_value(RawJSON(text)))
            parts.append(shape.names[name_index] + text)
        return "{" + ",".join(parts) + "}"

    # -- the snapshot --------------------------------------------------------------------------

    def snapshot_shape(self, table: TableInfo) -> Shape:
        return self.shape(table.qualified, table.columns, table.key)

    def reads(self, table: TableInfo, columns: Sequence[pa.Array], chunk: str) -> ChunkRows:
        """The read events of a chunk's rows (the server's text output of each column, as
        binary arrays), by key, in the order read: made column by column in Arrow as the
        PostgreSQL snapshot's are (:mod:`~replog.capture.jsoncolumns`), each value
        through the same fragment writer as before where its type has no vector form."""
        if not columns or not len(columns[0]):
            return ChunkRows.empty()
        shape = self.snapshot_shape(table)
        values = [self._column(shape, index, columns[index]) for index in range(len(shape.columns))]
        data = json_objects(list(zip(shape.names, values, strict=True)))
        keys = json_objects(
            [
                (shape.names[index], self._key_column(shape, index, values[index]))
                for index in shape.key_positions
            ]
        )
        prefix = f"{self.name}:snapshot:{chunk}:{table.qualified}:"
        return ChunkRows(event_ids(EVENT_ID_NAMESPACE.bytes, prefix, keys), keys, data)

    def _column(self, shape: Shape, index: int, raw: pa.Array) -> pa.Array:
        """One column of a chunk's rows as JSON values (null for NULL)."""
        column = shape.columns[index]
        if column.kind in _AS_TEXT:  # the server's text is the JSON number
            return raw.cast(pa.string())
        if column.kind in _AS_STRING:
            return json_strings(raw.cast(pa.string()))
        write = text_fragment(column)
        values = [None if value is None else write(value) for value in raw.to_pylist()]
        zeros = sum(1 for value in values if value is ZERO)
        if zeros:
            counted = f"{shape.collection}.{column.name}"
            self.zero_dates[counted] = self.zero_dates.get(counted, 0) + zeros
        return pa.array(values, pa.string())

    @staticmethod
    def _key_column(shape: Shape, index: int, values: pa.Array) -> pa.Array:
        """A key column's values as the key writes them (a number in its shortest form:
        :func:`~replog.capture.events.key_value`)."""
        if shape.columns[index].kind not in _NUMERIC_KEYS:
            return values
        if pc.all(pc.match_substring_regex(values, _SHORTEST_INTEGER)).as_py() is not False:
            return values
        return pa.array(
            [
                None if text is None else str(key_value(RawJSON(text)))
                for text in values.to_pylist()
            ],
            pa.string(),
        )

    def source_block(
        self,
        database: str,
        table: str,
        *,
        ts_ms: int,
        snapshot: str,
        server_id: int,
        gtid: str | None,
        file: str,
        pos: int,
        row: int,
    ) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "connector": "mysql",
            "name": self.name,
            "ts_ms": ts_ms,
            "snapshot": snapshot,
            "db": database,
            "table": table,
            "server_id": server_id,
            "gtid": gtid,
            "file": file,
            "pos": pos,
            "row": row,
        }

    def snapshot_metadata(
        self, table: TableInfo, *, ts_ms: int, kind: str, server_id: int, file: str, pos: int
    ) -> str:
        """The ``metadata`` of every read event of one chunk (``op`` r), placed at the
        high watermark's binlog position."""
        source = self.source_block(
            table.database, table.name, ts_ms=ts_ms, snapshot=kind, server_id=server_id,
            gtid=None, file=file, pos=pos, row=0,
        )  # fmt: skip
        return jsontext.encode(
            {
                "op": "r",
                "ts_ms": ts_ms,
                "source": source,
                "schema": self.snapshot_shape(table).digest,
            }
        )

    # -- the binlog ----------------------------------------------------------------------------

    def changes(  # noqa: PLR0917 - a row event's place in its transaction
        self,
        rows: Rows,
        collection: str,
        columns: tuple[MySqlColumn, ...],
        key: tuple[str, ...],
        txn: Transaction,
        order: int,
        ts_ms: int,
    ) -> list[Event]:
        """The events of one row event of a captured table (``collection``: the table it
        is captured as; ``columns``: as the table map describes them; ``key``: its key),
        numbered from ``order`` in the transaction. An update of the key is a delete of
        the old key, then a create of the new one (``old_key``/``new_key`` name each
        other), as Debezium emits it."""
        shape = self.shape(collection, columns, key)
        event = rows.event
        pos = rows.position[1] - event.packet.event_size
        events: list[Event] = []
        for index, (before, image) in enumerate(rows.rows):
            after = image
            if image is not None and before is not None and shape.json_positions:
                after = _partial_applied(shape, before, image)
            source = self.source_block(
                rows.schema, rows.table, ts_ms=event.timestamp * 1000, snapshot="false",
                server_id=txn.server_id, gtid=txn.gtid, file=rows.position[0], pos=pos,
                row=index,
            )  # fmt: skip
            made = self._events(shape, rows.op, before, after, source, txn, order, ts_ms)
            events.extend(made)
            order += len(made)
        return events

    def _events(  # noqa: PLR0917 - a row event's place in its transaction
        self,
        shape: Shape,
        op: str,
        before: list[Any] | None,
        after: list[Any] | None,
        source: dict[str, Any],
        txn: Transaction,
        order: int,
        ts_ms: int,
    ) -> list[Event]:
        old_image = self._row(shape, before) if before is not None else None
        new_image = self._row(shape, after) if after is not None else None
        old_key = self._key(shape, before) if before is not None else None
        new_key = self._key(shape, after) if after is not None else None
        key = new_key or old_key
        assert key is not None
        parts: list[tuple[str, str | None, str | None, str, dict[str, Any]]]
        if op == "u" and old_key != new_key:
            assert old_key is not None and new_key is not None
            parts = [
                ("d", None, old_image, old_key, {"new_key": new_key}),
                ("c", new_image, None, new_key, {"old_key": old_key}),
            ]
        else:
            parts = [(op, new_image, old_image, key, {})]
        made = []
        for offset, (kind, data, old, event_key, marks) in enumerate(parts):
            number = order + offset
            metadata = {
                "op": kind,
                "ts_ms": ts_ms,
                "source": source,
                "transaction": self.order.block(txn.id, number, shape.collection),
                **marks,
                "schema": shape.digest,
            }
            made.append(
                Event(
                    event_id(f"{self.name}:{txn.id}:{number}"),
                    txn.ts_ms,
                    OPERATIONS[kind],
                    shape.collection,
                    event_key,
                    data if data is not None else old or "{}",
                    old,
                    jsontext.encode(metadata),
                )
            )
        return made

    def truncates(
        self,
        table: TableInfo | None,
        collection: str,
        txn: Transaction,
        *,
        order: int,
        ts_ms: int,
        shards: int,
        position: tuple[str, int],
        why: dict[str, Any] | None = None,
    ) -> list[Event]:
        """A ``TRUNCATE`` of ``collection`` (or its rows gone otherwise: ``why``): one
        ``truncate`` event on each of the log's shards, as for PostgreSQL."""
        database, _, name = collection.partition(".")
        source = self.source_block(
            database, name, ts_ms=txn.ts_ms, snapshot="false", server_id=txn.server_id,
            gtid=txn.gtid, file=position[0], pos=position[1], row=0,
        )  # fmt: skip
        if why:
            source.update(why)
        metadata: dict[str, Any] = {
            "op": TRUNCATE_OP,
            "ts_ms": ts_ms,
            "source": source,
            "transaction": self.order.block(txn.id, order, collection),
            "truncate": {"shards": shards},
        }
        if table is not None:
            metadata["schema"] = self.snapshot_shape(table).digest
        text = jsontext.encode(metadata)
        return [
            Event(
                event_id(f"{self.name}:{txn.id}:{order}:truncate:{shard}"),
                txn.ts_ms,
                "truncate",
                collection,
                truncate_key(shard, shards),
                "{}",
                None,
                text,
            )
            for shard in range(shards)
        ]


def _partial_applied(shape: Shape, before: list[Any], after: list[Any]) -> list[Any]:
    """An after image whose JSON columns hold partial updates (MySQL's
    ``binlog_row_value_options=PARTIAL_JSON``), with the changes applied to the before
    image's values."""
    if not any(isinstance(after[i], PartialJson) for i in shape.json_positions):
        return after
    applied = list(after)
    for i in shape.json_positions:
        value = after[i]
        if isinstance(value, PartialJson):
            if before[i] is None:
                raise CaptureError(
                    f"a partial JSON update of {shape.collection}.{shape.columns[i].name} has "
                    f"no before image to apply it to (binlog_row_image must be FULL)"
                )
            applied[i] = quoted(apply_diffs(json.loads(before[i]), value.diffs))
    return applied
