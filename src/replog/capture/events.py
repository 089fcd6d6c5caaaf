"""Change events of captured rows, in the shape ``replog append --format debezium``
produces (docs/CDC.md, "What capture writes").

DESIGN: one :class:`EventMaker` turns a row, whichever path read it (a snapshot chunk's
text, or a change the stream decoded), into an event: the row image as exact JSON, the
key, Debezium's ``source`` block and the schema digest. Both paths get each value as its
type's output function wrote it, so a value has one text whichever path carried it.
"""

from __future__ import annotations

import importlib.metadata
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from replog.capture.pgoutput import Relation, RowChange, SourceTransaction, Unchanged, Value
from replog.capture.schemas import TypeLookup, table_schema
from replog.capture.source import Columns, Table
from replog.capture.values import ValueReader
from replog.debezium import OPERATIONS
from replog.errors import CaptureError
from replog.format import jsontext
from replog.format.jsontext import RawJSON
from replog.schemas import connect as connect_schemas

UNAVAILABLE = "__debezium_unavailable_value"
"""Debezium's placeholder for an unchanged TOASTed value the server did not send."""
EVENT_ID_NAMESPACE = uuid.UUID("0d8b6f3e-3c55-4b8e-9d2b-6a1f5e0c7b21")
_VERSION = importlib.metadata.version("pyspark-replog")


@dataclass(frozen=True)
class Shape:
    """What the events of a table need of its columns, worked out once per description
    (the catalog's, or each Relation message): not per row."""

    reads: tuple[tuple[str, int], ...]
    """Each column's name and the base type id its values are read by."""
    identity: frozenset[str]
    """The replica identity columns (what an old row sent as key only holds)."""
    digest: str


def key_value(value: Any) -> Any:
    """A key column's value as the key writes it: a number in its shortest exact form,
    so ``1``, ``1.0`` and ``1.00`` (a ``numeric`` key retyped to ``numeric(10, 2)``) are
    one key, routed to one shard; every other value as the row image has it."""
    if isinstance(value, RawJSON):
        try:
            number = Decimal(value)
        except InvalidOperation:
            return value
        if number == number.to_integral_value():
            return RawJSON(str(int(number)))
        return RawJSON(format(number.normalize(), "f"))
    return value


def schema_value(value: Any) -> Any:
    """A stored value as a schema (plain JSON, no exact decimals) holds it: a number with
    a fraction as a string of its exact digits, an integral one as an integer."""
    if isinstance(value, RawJSON):
        number = Decimal(value)
        return int(number) if number == number.to_integral_value() else str(value)
    if isinstance(value, list):
        return [schema_value(item) for item in value]
    return value


class EventMaker:
    """Change events of captured tables, with the schemas they name."""

    def __init__(self, database: str, slot: str, types: TypeLookup) -> None:
        self.reader = ValueReader()
        self.database = database
        self.slot = slot
        self.types = types
        self._digests: dict[tuple[str, Columns, tuple[str, ...], tuple[Any, ...]], str] = {}
        self._shapes: dict[tuple[str, bool], tuple[Table | Relation, Table, Shape]] = {}
        """(table, from a Relation) -> the descriptions last seen, and their shape."""
        self.schemas: dict[str, tuple[str, dict[str, Any]]] = {}
        """digest -> (collection, Kafka Connect schema) of every schema an event named."""

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
        found = Shape(reads, identity, self._digest(table, columns, dict(reads)))
        self._shapes[cache_key] = (described, table, found)
        return found

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

    def _row(
        self, shape: Shape, values: Sequence[Value], fallback: Sequence[Value] = ()
    ) -> tuple[dict[str, Any], list[str]]:
        """A row image; unchanged TOASTed values come from ``fallback`` (an old image under
        REPLICA IDENTITY FULL) or become :data:`UNAVAILABLE` (listed)."""
        image: dict[str, Any] = {}
        unavailable: list[str] = []
        read = self.reader.read
        for index, (name, base_oid) in enumerate(shape.reads):
            value = values[index] if index < len(values) else None
            if isinstance(value, Unchanged) and index < len(fallback):
                value = fallback[index]
            if isinstance(value, Unchanged):
                image[name] = UNAVAILABLE
                unavailable.append(name)
            else:
                image[name] = read(base_oid, value)
        return image, unavailable

    @staticmethod
    def key(table: Table, image: Mapping[str, Any]) -> str:
        """The event key of a row image: its key columns, in key order."""
        return jsontext.encode({name: key_value(image.get(name)) for name in table.key})

    def event(
        self,
        table: Table,
        *,
        op: str,
        key: str,
        after: dict[str, Any] | None,
        before: dict[str, Any] | None,
        source: dict[str, Any],
        identity: str,
        schema: str,
        ts_ms: int,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One event; ``ts_ms`` is when capture processed it (one time per batch)."""
        image = after if after is not None else before
        assert image is not None
        return {
            "event_id": str(uuid.uuid5(EVENT_ID_NAMESPACE, identity)),
            "timestamp": source["ts_ms"],
            "operation": OPERATIONS[op],
            "collection": table.qualified,
            "key": key,
            "data": RawJSON(jsontext.encode(image)),
            "before": RawJSON(jsontext.encode(before)) if before is not None else None,
            "metadata": RawJSON(
                self.metadata_text(op=op, ts_ms=ts_ms, source=source, schema=schema, extra=extra)
            ),
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

    def snapshot_row(
        self,
        table: Table,
        values: Sequence[str | None],
        *,
        ts_ms: int,
        position: int,
        kind: str = "true",
    ) -> dict[str, Any]:
        """The read event (``op`` r) of a row a snapshot chunk read (each value its type's
        output text), placed at ``position``; ``kind`` is ``source.snapshot`` (``true``
        for the initial snapshot, ``incremental`` for one taken while streaming)."""
        shape = self.shape(table)
        after, _ = self._row(shape, values)
        key = self.key(table, after)
        return self.event(
            table,
            op="r",
            key=key,
            after=after,
            before=None,
            source=self.source_block(table, ts_ms, kind, None, position),
            identity=f"{self.slot}:snapshot:{position}:{table.qualified}:{key}",
            schema=shape.digest,
            ts_ms=ts_ms,
        )

    def images(
        self, table: Table, change: RowChange
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[str], Shape]:
        """(after, before, unavailable columns, shape) of one row change."""
        shape = self.shape(table, change.relation)
        before: dict[str, Any] | None = None
        if change.old is not None:
            before, _ = self._row(shape, change.old)
            if change.old_is_key_only:  # only the identity columns were sent
                missing = [k for k in table.key if k not in shape.identity]
                if missing:
                    raise CaptureError(
                        f"a change of {table.qualified} at LSN {change.lsn} carries its replica "
                        f"identity ({', '.join(sorted(shape.identity))}), not its key "
                        f"({', '.join(table.key)}): the identity was changed while changes "
                        f"were unread. Capture cannot key it; restart capture with "
                        f"--keys {table.qualified}={','.join(sorted(shape.identity))} into a "
                        f"new slot and log, or give the table its identity back"
                    )
                before = {k: v for k, v in before.items() if k in shape.identity}
        after = None
        unavailable: list[str] = []
        if change.new is not None:
            full_old = change.old if change.old is not None and not change.old_is_key_only else ()
            after, unavailable = self._row(shape, change.new, full_old)
        return after, before, unavailable, shape

    def changes(
        self,
        table: Table,
        change: RowChange,
        txn: SourceTransaction,
        order: int,
        ts_ms: int,
        *,
        images: tuple[dict[str, Any] | None, dict[str, Any] | None, list[str], Shape] | None = None,
    ) -> list[dict[str, Any]]:
        """The events of one row change, numbered from ``order`` in the transaction; ``ts_ms``:
        when its batch was processed. An update that changes the row's key is, as Debezium
        emits it, a delete of the old key then a create of the new one (as one update of
        the new key, the old key would live on in every table built from the log); the
        create names the old key (``old_key``) and the delete the new one (``new_key``),
        as Debezium's ``__debezium.oldkey``/``newkey`` headers do, so a consumer can take
        the values the server did not send again from the old key's row."""
        after, before, unavailable, shape = images or self.images(table, change)
        image = after if after is not None else before
        assert image is not None
        key = self.key(table, image)
        parts: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None, str, dict[str, Any]]]
        parts = [(change.op, after, before, key, {})]
        if change.op == "u" and before is not None and all(k in before for k in table.key):
            old_key = self.key(table, before)  # the server sends the old key when it changed
            if old_key != key:
                parts = [
                    ("d", None, before, old_key, {"new_key": key}),
                    ("c", after, None, key, {"old_key": old_key}),
                ]
        events = []
        for index, (op, new_image, old_image, event_key, marks) in enumerate(parts):
            number = order + index
            events.append(
                self.event(
                    table,
                    op=op,
                    key=event_key,
                    after=new_image,
                    before=old_image,
                    source=self.source_block(table, txn.commit_ms, "false", txn.xid, change.lsn),
                    identity=f"{self.slot}:{txn.commit_lsn}:{number}",
                    schema=shape.digest,
                    ts_ms=ts_ms,
                    extra={
                        "transaction": {
                            "id": f"{txn.xid}:{txn.commit_lsn}",
                            "total_order": number,
                            "data_collection_order": number,
                        },
                        **({"unavailable": unavailable} if unavailable and new_image else {}),
                        **marks,
                    },
                )
            )
        return events
