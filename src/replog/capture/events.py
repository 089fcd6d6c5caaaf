"""Change events of captured rows, in the shape ``replog append --format debezium``
produces (docs/CDC.md, "What capture writes").

DESIGN: one :class:`EventMaker` turns a row, whichever path read it (a snapshot chunk's
text, or a change the stream decoded), into an event: the row image as exact JSON, the
key, Debezium's ``source`` block and the schema digest. Both paths get each value as its
type's output function wrote it, so a value has one text whichever path carried it.

Speed: a row's JSON is written straight from those texts, column by column
(:class:`Shape` holds, per column, its quoted name and how its text becomes JSON: as it
is for integers and numerics, quoted for text types, through
:mod:`~replog.capture.values` for the rest). Events are kept as columns
(:class:`EventColumns`), never as one dict per event: a snapshot writes tens of thousands
of rows a second this way, on one core.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, NamedTuple

import pyarrow as pa

from replog.capture.jsoncolumns import NUMERIC, event_ids, json_objects, json_values
from replog.capture.pgoutput import Relation, RowChange, SourceTransaction, Unchanged, Value
from replog.capture.schemas import PgType, TypeLookup, table_schema
from replog.capture.source import Columns, Table
from replog.capture.values import ValueReader
from replog.debezium import OPERATIONS, TRUNCATE_OP
from replog.errors import CaptureError
from replog.format import jsontext
from replog.format.events import STORED_SCHEMA
from replog.format.jsontext import RawJSON
from replog.format.routing import shard_of
from replog.schemas import connect as connect_schemas

UNAVAILABLE = "__debezium_unavailable_value"
"""Debezium's placeholder for an unchanged TOASTed value the server did not send."""
EVENT_ID_NAMESPACE = uuid.UUID("0d8b6f3e-3c55-4b8e-9d2b-6a1f5e0c7b21")
_VERSION = importlib.metadata.version("pyspark-replog")
_UNAVAILABLE_JSON = json.dumps(UNAVAILABLE)
_UNAVAILABLE_BYTES = UNAVAILABLE.encode()
_UNAVAILABLE_BASE64 = json.dumps(base64.b64encode(_UNAVAILABLE_BYTES).decode())
_UNAVAILABLE_NUMBERS = json.dumps(list(_UNAVAILABLE_BYTES), separators=(",", ":"))
_UNAVAILABLE_BY_ELEMENT = {
    **dict.fromkeys((25, 1043, 1042, 114, 3802), f"[{_UNAVAILABLE_JSON}]"),  # text-like
    17: f"[{_UNAVAILABLE_BASE64}]",  # bytea[]
    23: _UNAVAILABLE_NUMBERS,  # int4[]: the placeholder's bytes as numbers
    20: _UNAVAILABLE_NUMBERS,  # int8[]
    2950: json.dumps([str(uuid.UUID(bytes=hashlib.md5(_UNAVAILABLE_BYTES).digest(), version=3))]),
}
"""An unchanged TOASTed array's placeholder by its element type, as Debezium writes it
(``UnchangedToastedPlaceholder``): a value of the column's own type, so a reader typing
the column reads it (the string placeholder would fail the whole collection). Debezium's
``date[]`` form (numbers) is left out: capture writes dates as text, not days."""


def unavailable_json(kind: PgType) -> str:
    """The JSON of Debezium's placeholder for an unchanged TOASTed value of type
    ``kind``: ``bytea`` the placeholder's bytes, some arrays an array (above), others the
    placeholder string."""
    if kind.base_oid == 17:
        return _UNAVAILABLE_BASE64
    return _UNAVAILABLE_BY_ELEMENT.get(kind.element_oid, _UNAVAILABLE_JSON)


Fragment = Callable[[str], str]
"""A column's output text -> its JSON text (never called for NULL)."""


_quoted: Callable[[str], str] = json.encoder.encode_basestring
"""A JSON string, as ``json.dumps(text, ensure_ascii=False)`` writes it (its C core)."""


def _numeric(text: str) -> str:
    return text if text[-1].isdigit() else _quoted(text)  # NaN and the infinities: strings


def _same(text: str) -> str:
    return text


_FAST: dict[int, Fragment] = {
    16: lambda text: "true" if text == "t" else "false",  # boolean
    20: _same,  # int8
    21: _same,  # int2
    23: _same,  # int4
    26: _same,  # oid
    1700: _numeric,
    18: _quoted,  # "char"
    19: _quoted,  # name
    25: _quoted,  # text
    114: _quoted,  # json (its exact text, as a string: Debezium's Json)
    1042: _quoted,  # character(n), its blanks kept
    1043: _quoted,  # character varying
    2950: _quoted,  # uuid (the server writes its canonical form)
    3802: _quoted,  # jsonb
}
"""Types whose output text becomes JSON without being parsed (the same JSON
:mod:`~replog.capture.values` gives them, a test compares the two)."""


def event_id(identity: str) -> str:
    """A UUID (version 5) named by ``identity``: the same change always gets the same id."""
    digest = hashlib.sha1(EVENT_ID_NAMESPACE.bytes + identity.encode(), usedforsecurity=False)
    raw = bytearray(digest.digest()[:16])
    raw[6] = (raw[6] & 0x0F) | 0x50
    raw[8] = (raw[8] & 0x3F) | 0x80
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


TRUNCATE_OPERATION = "truncate"
"""The operation of a truncate event (FORMAT.md, "Truncate events")."""


def truncate_key(shard: int, shards: int) -> str:
    """The key of a truncate event meant for ``shard`` of a log of ``shards``:
    ``{"__truncate":n}`` with the smallest ``n`` that routes there."""
    n = 0
    while shard_of(key := f'{{"__truncate":{n}}}', shards) != shard:
        n += 1
    return key


def key_value(value: Any) -> Any:
    """A key column's value as the key writes it: a number in its shortest exact form,
    so ``1``, ``1.0`` and ``1.00`` (a ``numeric`` key retyped to ``numeric(10, 2)``) are
    one key, routed to one shard; every other value as the row image has it."""
    if isinstance(value, RawJSON):
        return RawJSON(_shortest(value))
    return value


def _shortest(text: str) -> str:
    try:
        number = Decimal(text)
    except InvalidOperation:
        return text
    if number == number.to_integral_value():
        return str(int(number))
    return format(number.normalize(), "f")


def schema_value(value: Any) -> Any:
    """A stored value as a schema (plain JSON, no exact decimals) holds it: a number with
    a fraction as a string of its exact digits, an integral one as an integer."""
    if isinstance(value, RawJSON):
        number = Decimal(value)
        return int(number) if number == number.to_integral_value() else str(value)
    if isinstance(value, list):
        return [schema_value(item) for item in value]
    return value


Fetch = Callable[[Table, Sequence[str | None], Sequence[str]], "dict[str, str | None] | None"]
Unsent = Callable[[str, list[str]], "dict[str, str]"]
"""(event key, columns the server did not send) -> the JSON text of those of them an
earlier image of the row holds."""
"""(table, its key columns' text, columns) -> the text of those columns the table still has,
in the row with that key now, or None if there is none."""


class Event(NamedTuple):
    """One change event, its payloads and metadata as JSON text."""

    event_id: str
    timestamp_ms: int
    operation: str
    collection: str
    key: str
    data: str
    before: str | None
    metadata: str


@dataclass
class EventColumns:
    """Events held as columns, made into one Arrow table in the log's stored schema (no
    dict per event, no validation: capture writes them, and they are well-formed). Events
    added one by one gather in lists; a table added whole (a snapshot chunk's) is kept
    as it is, in its place."""

    event_id: list[str] = field(default_factory=list)
    timestamp_ms: list[int] = field(default_factory=list)
    operation: list[str] = field(default_factory=list)
    collection: list[str] = field(default_factory=list)
    key: list[str] = field(default_factory=list)
    data: list[str] = field(default_factory=list)
    before: list[str | None] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)
    tables: list[pa.Table] = field(default_factory=list)
    """Whole tables added, and the lists' events before each, in order."""

    def __len__(self) -> int:
        return len(self.event_id) + sum(int(table.num_rows) for table in self.tables)

    def add(self, events: Sequence[Event]) -> None:
        for event in events:
            self.event_id.append(event.event_id)
            self.timestamp_ms.append(event.timestamp_ms)
            self.operation.append(event.operation)
            self.collection.append(event.collection)
            self.key.append(event.key)
            self.data.append(event.data)
            self.before.append(event.before)
            self.metadata.append(event.metadata)

    def add_table(self, table: pa.Table) -> None:
        """Events already made into a table of the stored schema (a chunk's reads)."""
        if len(self.event_id):
            self.tables.append(self._listed())
            self._clear_lists()
        self.tables.append(table)

    def table(self) -> pa.Table:
        if not self.tables:
            return self._listed()
        return pa.concat_tables([*self.tables, self._listed()])

    def _listed(self) -> pa.Table:
        stamps = pa.array(self.timestamp_ms, pa.int64())
        columns = {
            "event_id": pa.array(self.event_id, pa.string()),
            "timestamp": pa.compute.multiply(stamps, 1000).cast(pa.timestamp("us", tz="UTC")),
            "operation": pa.array(self.operation, pa.string()),
            "collection": pa.array(self.collection, pa.string()),
            "key": pa.array(self.key, pa.string()),
            "data": pa.array(self.data, pa.string()).cast(pa.binary()),
            "before": pa.array(self.before, pa.string()).cast(pa.binary()),
            "metadata": pa.array(self.metadata, pa.string()),
        }
        return pa.table(columns, schema=STORED_SCHEMA)

    def _clear_lists(self) -> None:
        for name in self.__dataclass_fields__:
            if name != "tables":
                getattr(self, name).clear()

    def clear(self) -> None:
        self._clear_lists()
        self.tables.clear()


class Read(NamedTuple):
    """A row a snapshot chunk read: its event id, key and row JSON."""

    event_id: str
    key: str
    data: str


class ChunkRows:
    """A snapshot chunk's read events, held as columns (event ids, keys, row JSON), found
    by key as a dict would find them: a change of the chunk's window takes a row out
    (:meth:`pop`), and the rows left become the chunk's events in one Arrow table
    (:meth:`table`). A key read twice (a table read in physical order, keyed by columns
    that are not unique) is its last row."""

    def __init__(self, event_ids: pa.Array, keys: pa.Array, data: pa.Array) -> None:
        self._ids, self._keys, self._data = event_ids, keys, data
        self._index: dict[str, int] = dict(zip(keys.to_pylist(), range(len(keys)), strict=True))

    @classmethod
    def empty(cls) -> ChunkRows:
        nothing = pa.array([], pa.string())
        return cls(nothing, nothing, nothing)

    @classmethod
    def joined(cls, parts: Sequence[ChunkRows]) -> ChunkRows:
        """The rows of ``parts`` (each one's rows left), in order."""
        kept = [part._kept() for part in parts]
        return cls(
            *(
                pa.concat_arrays([part[column] for part in kept])
                if kept
                else pa.array([], pa.string())
                for column in range(3)
            )
        )

    def _kept(self) -> tuple[pa.Array, pa.Array, pa.Array]:
        if len(self._index) == len(self._keys):
            return self._ids, self._keys, self._data
        rows = pa.array(sorted(self._index.values()), pa.int64())
        return self._ids.take(rows), self._keys.take(rows), self._data.take(rows)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """The bytes of its keys and row JSON (about twice the rows' text)."""
        return int(self._keys.nbytes + self._data.nbytes)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def get(self, key: str) -> Read | None:
        row = self._index.get(key)
        return None if row is None else self._read(row)

    def pop(self, key: str, default: Read | None = None) -> Read | None:
        row = self._index.pop(key, None)
        return default if row is None else self._read(row)

    def clear(self) -> None:
        self._index.clear()

    def values(self) -> list[Read]:
        return [self._read(row) for row in sorted(self._index.values())]

    def _read(self, row: int) -> Read:
        return Read(self._ids[row].as_py(), self._keys[row].as_py(), self._data[row].as_py())

    def table(self, collection: str, ts_ms: int, metadata: str) -> pa.Table:
        """The rows left as insert events of ``collection`` (the log's stored schema), all
        with ``ts_ms`` and ``metadata``."""
        ids, keys, data = self._kept()
        count = len(keys)
        return pa.table(
            {
                "event_id": ids,
                "timestamp": pa.repeat(pa.scalar(ts_ms * 1000, pa.timestamp("us", "UTC")), count),
                "operation": pa.repeat(pa.scalar("insert", pa.string()), count),
                "collection": pa.repeat(pa.scalar(collection, pa.string()), count),
                "key": keys,
                "data": data.cast(pa.binary()),
                "before": pa.nulls(count, pa.binary()),
                "metadata": pa.repeat(pa.scalar(metadata, pa.string()), count),
            },
            schema=STORED_SCHEMA,
        )


@dataclass(frozen=True)
class Shape:
    """What the events of a table need of its columns, worked out once per description
    (the catalog's, or each Relation message): not per row."""

    names: tuple[str, ...]
    reads: tuple[tuple[str, int], ...]
    """Each column's name and the base type id its values are read by."""
    identity: frozenset[str]
    """The replica identity columns (what an old row sent as key only holds)."""
    digest: str
    fragments: tuple[tuple[str, Fragment], ...]
    """Each column's ``"name":`` and how its text becomes JSON."""
    key_positions: tuple[int, ...] | None
    """Where the key columns are, in key order (None: a key column is missing)."""
    key_fragments: tuple[tuple[str, Fragment], ...]
    unavailable: tuple[str, ...]
    """Each column's JSON for an unchanged TOASTed value (:func:`unavailable_json`)."""


class TransactionOrder:
    """An event's ``transaction`` block as Debezium writes it: ``total_order`` numbers the
    transaction's events (1, 2, ...), ``data_collection_order`` each table's apart. The
    events are numbered in stream order; a transaction read again (a restart, a
    reconnect) starts again at ``total_order`` 1, and so do the tables' counts."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def block(self, transaction: str, total_order: int, collection: str) -> dict[str, Any]:
        if total_order == 1:
            self._counts.clear()
        self._counts[collection] = in_collection = self._counts.get(collection, 0) + 1
        return {
            "id": transaction,
            "total_order": total_order,
            "data_collection_order": in_collection,
        }


class EventMaker:
    """Change events of captured tables, with the schemas they name."""

    def __init__(
        self, database: str, slot: str, types: TypeLookup, fetch: Fetch | None = None
    ) -> None:
        self.fetch = fetch
        """Reads columns of a row as the table holds it now (see :meth:`changes`)."""
        self.reader = ValueReader()
        self.database = database
        self.slot = slot
        self.types = types
        self._digests: dict[tuple[str, Columns, tuple[str, ...], tuple[Any, ...]], str] = {}
        self._shapes: dict[tuple[str, bool], tuple[Table | Relation, Table, Shape]] = {}
        """(table, from a Relation) -> the descriptions last seen, and their shape."""
        self._fragments: dict[int, Fragment] = {}
        self.schemas: dict[str, tuple[str, dict[str, Any]]] = {}
        """digest -> (collection, Kafka Connect schema) of every schema an event named."""
        self.order = TransactionOrder()

    def shape(self, table: Table, relation: Relation | None = None) -> Shape:
        """The shape of ``table`` as ``relation`` (else the catalog) describes it. The
        decoder makes a Relation per decoding session, so this is worked out once per table
        per batch; the schema (and its digest) once per distinct set of columns."""
        described: Table | Relation = table if relation is None else relation
        cache_key = (table.qualified, relation is not None)
        cached = self._shapes.get(cache_key)
        if cached is not None and cached[0] is described and cached[1] is table:
            return cached[2]
        if relation is None:
            columns, identity = table.columns, frozenset(table.key)
        else:
            columns = tuple((c.name, c.type_oid, c.type_modifier) for c in relation.columns)
            identity = frozenset(c.name for c in relation.columns if c.in_identity)
        reads = tuple((name, self.types(type_oid).base_oid) for name, type_oid, _ in columns)
        names = tuple(name for name, _ in reads)
        fragments = tuple((_quoted(name) + ":", self._fragment(oid)) for name, oid in reads)
        positions = (
            tuple(names.index(k) for k in table.key) if all(k in names for k in table.key) else None
        )
        key_fragments = tuple(
            (fragments[i][0], self._key_fragment(reads[i][1])) for i in positions or ()
        )
        found = Shape(
            names,
            reads,
            identity,
            self._digest(table, columns, dict(reads)),
            fragments,
            positions,
            key_fragments,
            tuple(unavailable_json(self.types(type_oid)) for _, type_oid, _ in columns),
        )
        self._shapes[cache_key] = (described, table, found)
        return found

    def _fragment(self, type_oid: int) -> Fragment:
        found = _FAST.get(type_oid) or self._fragments.get(type_oid)
        if found is None:
            read = self.reader.read

            def found(text: str) -> str:
                return jsontext.encode(read(type_oid, text))

            self._fragments[type_oid] = found
        return found

    def _key_fragment(self, type_oid: int) -> Fragment:
        fragment = self._fragment(type_oid)
        if type_oid != 1700:
            return fragment
        return lambda text: _shortest(text) if text[-1].isdigit() else fragment(text)

    def _digest(self, table: Table, columns: Columns, reads: Mapping[str, int]) -> str:
        """The digest of the table's schema with ``columns``; the schema is kept in
        :attr:`schemas` for registering before the commit."""
        defaults = tuple(
            (name, schema_value(self.reader.read(reads[name], text)))
            for name, text in table.defaults
            if name in reads
        )
        cache_key = (table.qualified, columns, table.key, defaults)
        digest = self._digests.get(cache_key)
        if digest is None:
            prefix = f"{self.slot}.{table.qualified}"
            schema = table_schema(prefix, columns, table.key, self.types, dict(defaults))
            digest = connect_schemas.digest(schema)
            self._digests[cache_key] = digest
            self.schemas[digest] = (table.qualified, schema)
        return digest

    # -- row images and keys, as JSON text ----------------------------------------------------

    @staticmethod
    def _row(
        shape: Shape,
        values: Sequence[Value],
        fallback: Sequence[Value] = (),
        only: frozenset[str] | None = None,
        filled: Mapping[str, str] | None = None,
    ) -> tuple[str, list[str]]:
        """A row image's JSON; unchanged TOASTed values come from ``fallback`` (an old
        image under REPLICA IDENTITY FULL), from ``filled`` (column -> its JSON text, known
        from an earlier image of the row) or become :data:`UNAVAILABLE` (listed).
        ``only``: just these columns (an old row sent as its identity)."""
        parts: list[str] = []
        unavailable: list[str] = []
        count = len(values)
        for index, (name, fragment) in enumerate(shape.fragments):
            column = shape.names[index]
            if only is not None and column not in only:
                continue
            value = values[index] if index < count else None
            if isinstance(value, Unchanged) and index < len(fallback):
                value = fallback[index]
            if value is None:
                parts.append(name + "null")
            elif not isinstance(value, Unchanged):
                parts.append(name + fragment(value))
            elif filled and column in filled:
                parts.append(name + filled[column])
            else:
                parts.append(name + shape.unavailable[index])
                unavailable.append(column)
        return "{" + ",".join(parts) + "}", unavailable

    @staticmethod
    def _key(shape: Shape, values: Sequence[Value], present: frozenset[str] | None) -> str | None:
        """The event key of a row (its key columns in key order, numbers in shortest form),
        or None if a key column is not in it."""
        if shape.key_positions is None:
            return None
        parts = []
        for (name, fragment), index in zip(shape.key_fragments, shape.key_positions, strict=True):
            if present is not None and shape.names[index] not in present:
                return None
            value = values[index] if index < len(values) else None
            if isinstance(value, Unchanged):
                return None
            parts.append(name + ("null" if value is None else fragment(value)))
        return "{" + ",".join(parts) + "}"

    @staticmethod
    def key(table: Table, image: Mapping[str, Any]) -> str:
        """The event key of a row image given as values (the key columns, in key order)."""
        return jsontext.encode({name: key_value(image.get(name)) for name in table.key})

    # -- events -----------------------------------------------------------------------------

    def source_block(
        self, table: Table, ts_ms: int, snapshot: str, xid: int | None, lsn: int
    ) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "connector": "postgresql",
            "name": self.slot,
            "ts_ms": ts_ms,
            "snapshot": snapshot,
            "db": self.database,
            "schema": table.schema,
            "table": table.name,
            "txId": xid,
            "lsn": lsn,
        }

    @staticmethod
    def metadata_text(
        *,
        op: str,
        ts_ms: int,
        source: dict[str, Any],
        schema: str,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """An event's ``metadata``: Debezium's envelope without the row images."""
        metadata = {"op": op, "ts_ms": ts_ms, "source": source, **(extra or {}), "schema": schema}
        return jsontext.encode(metadata)

    def snapshot_metadata(self, table: Table, *, ts_ms: int, position: int, kind: str) -> str:
        """The ``metadata`` of every read event of one chunk (``op`` r), placed at
        ``position``; ``kind`` is ``source.snapshot`` (``true`` for the initial snapshot,
        ``incremental`` for one taken while streaming)."""
        return self.metadata_text(
            op="r",
            ts_ms=ts_ms,
            source=self.source_block(table, ts_ms, kind, None, position),
            schema=self.shape(table).digest,
        )

    def reads(self, table: Table, rows: pa.Table, position: int) -> ChunkRows:
        """The read events of the rows a chunk read (``rows``: a column of each value's
        output text per column of ``table``, in order), made column-wise
        (:mod:`~replog.capture.jsoncolumns`); their ids name the slot, ``position``, the
        table and the key."""
        if rows.num_rows == 0:
            return ChunkRows.empty()
        shape = self.shape(table)
        assert shape.key_positions is not None  # the snapshot reads every column, the key's
        values = [
            json_values(rows.column(index).combine_chunks(), type_oid, self._fragment(type_oid))
            for index, (_, type_oid) in enumerate(shape.reads)
        ]
        data = json_objects([(name, values[i]) for i, (name, _) in enumerate(shape.fragments)])
        keys = json_objects(
            [
                (name, self._key_values(rows.column(index).combine_chunks(), shape, index))
                for (name, _), index in zip(shape.key_fragments, shape.key_positions, strict=True)
            ]
        )
        prefix = f"{self.slot}:snapshot:{position}:{table.qualified}:"
        return ChunkRows(event_ids(EVENT_ID_NAMESPACE.bytes, prefix, keys), keys, data)

    def _key_values(self, texts: pa.Array, shape: Shape, index: int) -> pa.Array:
        """A key column's values as the key writes them (a numeric in its shortest form)."""
        type_oid = shape.reads[index][1]
        if type_oid != NUMERIC:
            return json_values(texts, type_oid, self._fragment(type_oid))
        key_fragment = self._key_fragment(type_oid)
        return pa.array(
            [None if text is None else key_fragment(text) for text in texts.to_pylist()],
            pa.string(),
        )

    def _fetched(
        self, table: Table, shape: Shape, change: RowChange, unavailable: list[str]
    ) -> tuple[str, list[str], list[str]]:
        """The create of a changed key with values the server did not send (unchanged
        TOASTed columns: the old row, under the default identity, is its key only): those
        values read from the row as the table holds it now, the one place they still are.
        A later change of the row comes after this event anyway, so the row's last state
        is the source's. (row JSON, columns still unsent, columns read)."""
        assert self.fetch is not None and change.new is not None
        assert shape.key_positions is not None  # the key changed: each key column was sent
        key = [v for i in shape.key_positions if not isinstance(v := change.new[i], Unchanged)]
        assert len(key) == len(shape.key_positions)
        found = self.fetch(table, key, unavailable)
        if found is None:  # deleted since: a later event of the stream deletes it too
            return self._row(shape, change.new)[0], unavailable, []
        values = [
            found[name] if isinstance(value, Unchanged) and name in found else value
            for name, value in zip(shape.names, change.new, strict=False)
        ]
        after, still = self._row(shape, values)
        return after, still, [name for name in unavailable if name not in still]

    def _old(self, table: Table, shape: Shape, change: RowChange) -> tuple[str | None, str | None]:
        """The old row image of ``change`` and its key (None, None: none was sent)."""
        if change.old is None:
            return None, None
        only = shape.identity if change.old_is_key_only else None
        if only is not None and not set(table.key) <= only:
            raise CaptureError(
                f"a change of {table.qualified} at LSN {change.lsn} carries its replica "
                f"identity ({', '.join(sorted(only))}), not its key "
                f"({', '.join(table.key)}): the identity was changed while changes "
                f"were unread. Capture cannot key it; restart capture with "
                f"--keys {table.qualified}={','.join(sorted(only))} into a new slot "
                f"and log, or give the table its identity back"
            )
        return self._row(shape, change.old, only=only)[0], self._key(shape, change.old, only)

    def truncates(
        self, table: Table, txn: SourceTransaction, *, lsn: int, order: int, ts_ms: int, shards: int
    ) -> list[Event]:
        """A ``TRUNCATE`` of ``table`` at ``lsn``: one ``truncate`` event on each of the
        log's ``shards`` (keyed :func:`truncate_key`), so each shard orders it with the
        events of its own keys, however a reader cuts its batches across shards. Numbered
        ``order`` in the transaction (each copy names the one truncate: ``truncate``)."""
        source = self.source_block(table, txn.commit_ms, "false", txn.xid, lsn)
        metadata = self.metadata_text(
            op=TRUNCATE_OP,
            ts_ms=ts_ms,
            source=source,
            schema=self.shape(table).digest,
            extra={
                "transaction": self.order.block(
                    f"{txn.xid}:{txn.commit_lsn}", order, table.qualified
                ),
                "truncate": {"shards": shards},
            },
        )
        return [
            Event(
                event_id(f"{self.slot}:{txn.commit_lsn}:{order}:truncate:{shard}"),
                txn.commit_ms,
                TRUNCATE_OPERATION,
                table.qualified,
                truncate_key(shard, shards),
                "{}",
                None,
                metadata,
            )
            for shard in range(shards)
        ]

    def changes(
        self,
        table: Table,
        change: RowChange,
        txn: SourceTransaction,
        order: int,
        ts_ms: int,
        *,
        unsent: Unsent | None = None,
    ) -> list[Event]:
        """The events of one row change, numbered from ``order`` in the transaction; ``ts_ms``:
        when its batch was processed. An update that changes the row's key is, as Debezium
        emits it, a delete of the old key then a create of the new one (as one update of
        the new key, the old key would live on in every table built from the log); the
        create names the old key (``old_key``) and the delete the new one (``new_key``),
        as Debezium's ``__debezium.oldkey``/``newkey`` headers do, so a consumer can take
        the values the server did not send again from the old key's row. ``unsent`` gives
        the values the server did not send where an earlier image of the row is known
        (a snapshot chunk's, inside its window: ``metadata.filled`` names them)."""
        shape = self.shape(table, change.relation)
        before, old_key = self._old(table, shape, change)
        after = key = None
        unavailable: list[str] = []
        if change.new is not None:
            full_old = change.old if change.old is not None and not change.old_is_key_only else ()
            after, unavailable = self._row(shape, change.new, full_old)
            key = self._key(shape, change.new, None)  # None: a TOASTed key column unchanged
        key = key or old_key
        if key is None:
            raise CaptureError(f"a change of {table.qualified} at LSN {change.lsn} has no key")
        marks: dict[str, Any] = {}
        if unavailable and unsent is not None and (old_key is None or old_key == key):
            known = unsent(key, unavailable)
            if known:
                assert change.new is not None
                after, unavailable = self._row(shape, change.new, full_old, filled=known)
                marks["filled"] = sorted(known)
        parts: list[tuple[str, str | None, str | None, str, dict[str, Any]]]
        parts = [(change.op, after, before, key, marks)]
        if change.op == "u" and old_key is not None and old_key != key:
            marks = {"old_key": old_key}
            if unavailable and self.fetch is not None:
                after, unavailable, fetched = self._fetched(table, shape, change, unavailable)
                if fetched:
                    marks["fetched"] = fetched
            parts = [
                ("d", None, before, old_key, {"new_key": key}),
                ("c", after, None, key, marks),
            ]
        events = []
        source = self.source_block(table, txn.commit_ms, "false", txn.xid, change.lsn)
        for index, (op, new_image, old_image, event_key, marks) in enumerate(parts):
            number = order + index
            extra = {
                "transaction": self.order.block(
                    f"{txn.xid}:{txn.commit_lsn}", number, table.qualified
                ),
                **({"unavailable": unavailable} if unavailable and new_image else {}),
                **marks,
            }
            events.append(
                Event(
                    event_id(f"{self.slot}:{txn.commit_lsn}:{number}"),
                    txn.commit_ms,
                    OPERATIONS[op],
                    table.qualified,
                    event_key,
                    new_image if new_image is not None else old_image or "{}",
                    old_image,
                    self.metadata_text(
                        op=op, ts_ms=ts_ms, source=source, schema=shape.digest, extra=extra
                    ),
                )
            )
        return events
