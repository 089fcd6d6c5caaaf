"""PostgreSQL changes into a log, each source transaction exactly once (``replog capture
postgres``; docs/CDC.md, "Capturing PostgreSQL").

How it stays exactly once:

* The slot is read with ``pg_logical_slot_peek_binary_changes`` (``pgoutput``, protocol 1):
  a peek consumes nothing, and the server returns whole transactions only. pgoutput
  names each column's type, so every value is decoded by its type (test_decoding's text
  would have to be parsed back, and wal2json is not shipped with the server).
* Each commit to the log holds whole source transactions (one or many) and is an
  idempotent append (:class:`~replog.format.commits.Transaction`): app id
  ``pg-capture.<slot>``, version = the end LSN of its last transaction. The position
  is thus recorded in the same atomic commit as the events, and a version the log
  already holds is never appended again.
* The slot is advanced (``pg_replication_slot_advance``) only after the commit landed.
  A capture killed in between finds the log ahead of the slot on restart: it advances
  the slot to the log's position and skips every transaction at or below it.
* The initial snapshot is read under the snapshot the slot exported when it was created
  (``CREATE_REPLICATION_SLOT ... EXPORT_SNAPSHOT`` on a replication connection), so it
  holds exactly the transactions before the slot's first change. It is one commit at the
  slot's consistent point; a capture killed before it landed drops the slot (nothing was
  read from it) and starts over.

This module never imports pyspark.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from replog.capture.options import CaptureOptions, capture_app_id
from replog.capture.pgoutput import (
    Decoder,
    Relation,
    RowChange,
    SourceTransaction,
    Unchanged,
    Value,
    lsn_to_int,
    lsn_to_text,
)
from replog.capture.progress import CaptureProgress
from replog.capture.schemas import PgType, table_schema
from replog.capture.values import SESSION_SETTINGS, ValueReader
from replog.crashpoints import crash_point
from replog.debezium import OPERATIONS
from replog.errors import (
    CaptureError,
    InvalidOptionError,
    SourceConfigError,
    SourceConnectionError,
    SourcePositionError,
    TransactionOrderError,
)
from replog.format import jsontext
from replog.format.commits import Transaction
from replog.format.jsontext import RawJSON
from replog.log import ReplicationLog
from replog.schemas import connect as connect_schemas
from replog.schemas import registry
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

UNAVAILABLE = "__debezium_unavailable_value"
"""Debezium's placeholder for an unchanged TOASTed value the server did not send."""
EVENT_ID_NAMESPACE = uuid.UUID("0d8b6f3e-3c55-4b8e-9d2b-6a1f5e0c7b21")
_VERSION = importlib.metadata.version("pyspark-replog")


Columns = tuple[tuple[str, int, int], ...]
"""A table's columns: name, type id and type modifier (``atttypmod``: a numeric's
precision and scale; -1: none), as the catalog and pgoutput's Relation message give them."""


@dataclass(frozen=True)
class Table:
    """A captured table as the catalog describes it: its columns and its key columns."""

    schema: str
    name: str
    columns: Columns
    key: tuple[str, ...]
    oid: int
    """The table's id: pgoutput names a table by it, and it survives a rename."""

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


def _safe_dsn(dsn: str) -> str:
    """The DSN without its password, for messages."""
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "the given DSN"
    shown = {k: v for k, v in parts.items() if k in ("host", "port", "dbname", "user")}
    return " ".join(f"{k}={v}" for k, v in shown.items()) or "the default server"


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """An autocommit session that writes values as :mod:`~replog.capture.values` reads them."""
    try:
        connection = psycopg.connect(dsn, autocommit=True, **kwargs)
    except psycopg.Error as exc:
        raise SourceConnectionError(
            f"cannot connect to PostgreSQL ({_safe_dsn(dsn)}): {str(exc).strip()}"
        ) from exc
    if not kwargs.get("replication"):
        for name, value in SESSION_SETTINGS.items():
            connection.execute("SELECT set_config(%s, %s, false)", (name, value))
    return connection


class PostgresSource:
    """The source database: checks, tables, the slot and the publication."""

    def __init__(self, options: CaptureOptions) -> None:
        self.options = options
        self.connection = connect(options.dsn)
        row = self.connection.execute("SELECT current_database()").fetchone()
        assert row is not None
        self.database: str = row[0]
        self.tables: dict[str, Table] = {}
        self._by_oid: dict[int, Table] = {}
        self._types: dict[int, PgType] = {}

    def close(self) -> None:
        self.connection.close()

    def _one(self, query: str | sql.Composed, params: Sequence[Any] = ()) -> Any:
        row = self.connection.execute(query, params).fetchone()
        return None if row is None else row[0]

    # -- checks, before anything is written ------------------------------------------

    def check(self) -> None:
        """Every reason capture cannot run, as an error naming the value at fault."""
        wal_level = self._one("SHOW wal_level")
        if wal_level != "logical":
            raise SourceConfigError(
                f"wal_level is {wal_level!r} on {_safe_dsn(self.options.dsn)}; capture needs "
                f"'logical' (ALTER SYSTEM SET wal_level = logical, then restart the server)"
            )
        publication = self.options.publication
        if publication is not None and not self._one(
            "SELECT count(*) FROM pg_publication WHERE pubname = %s", (publication,)
        ):
            raise SourceConfigError(
                f"publication {publication!r} does not exist in database {self.database!r}"
            )
        names = self.options.tables or self._publication_tables(publication or "")
        if not names:
            raise SourceConfigError(f"publication {publication!r} publishes no tables")
        for name in names:
            self.add_table(name)
        unknown = set(self.options.keys) - set(self.tables)
        if unknown:
            raise InvalidOptionError(f"keys given for tables not captured: {sorted(unknown)}")
        if publication is not None and self.options.tables:
            published = set(self._publication_tables(publication))
            for name in self.tables:
                if name not in published:
                    raise SourceConfigError(f"table {name!r} is not in publication {publication!r}")
        self._check_slot()

    def _publication_tables(self, publication: str) -> list[str]:
        rows = self.connection.execute(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s"
            " ORDER BY 1",
            (publication,),
        ).fetchall()
        return [row[0] for row in rows]

    def add_table(self, name: str) -> Table:
        """Describe table ``name`` from the catalog and capture it from now on; raises
        :class:`SourceConfigError` for one that is missing or has no usable key."""
        table = self._table(name)
        self.tables[table.qualified] = table
        self._by_oid[table.oid] = table
        return table

    def rekey(self, table: Table, key: tuple[str, ...]) -> Table:
        """Capture ``table`` keyed by ``key`` from now on."""
        rekeyed = replace(table, key=key)
        self.tables[table.qualified] = rekeyed
        self._by_oid[table.oid] = rekeyed
        return rekeyed

    def primary_key(self, oid: int) -> tuple[str, ...]:
        """The table's primary key columns as the catalog has them now, in key order."""
        return tuple(
            row[0]
            for row in self.connection.execute(
                "SELECT a.attname FROM pg_index i JOIN pg_attribute a"
                " ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
                " WHERE i.indrelid = %s AND i.indisprimary"
                " ORDER BY array_position(i.indkey::int2[], a.attnum)",
                (oid,),
            ).fetchall()
        )

    def table_with_oid(self, oid: int) -> Table | None:
        """The captured table whose id is ``oid`` (whatever it is called now)."""
        return self._by_oid.get(oid)

    def _table(self, name: str) -> Table:
        qualified = name if "." in name else f"public.{name}"
        schema, _, table = qualified.partition(".")
        oid = self._one(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
            (schema, table),
        )
        if oid is None:
            raise SourceConfigError(
                f"table {qualified!r} does not exist in database {self.database!r}"
            )
        columns = self.connection.execute(
            "SELECT attname, atttypid, atttypmod FROM pg_attribute"
            " WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (oid,),
        ).fetchall()
        primary = self.primary_key(oid)
        key = tuple(self.options.keys.get(qualified, ())) or tuple(primary)
        names = {column for column, _, _ in columns}
        if not key:
            raise SourceConfigError(
                f"table {qualified!r} has no primary key: give its key columns "
                f"(--keys {qualified}=col[,col...]) and set REPLICA IDENTITY FULL on it"
            )
        missing = [column for column in key if column not in names]
        if missing:
            raise SourceConfigError(f"table {qualified!r} has no column(s) {missing}")
        identity = self._one("SELECT relreplident FROM pg_class WHERE oid = %s", (oid,))
        if not primary and identity != "f":
            raise SourceConfigError(
                f"table {qualified!r} has no primary key, so its deletes would carry no key: "
                f"ALTER TABLE {qualified} REPLICA IDENTITY FULL"
            )
        return Table(schema, table, tuple((c, t, m) for c, t, m in columns), key, int(oid))

    def pg_type(self, type_oid: int) -> PgType:
        """A type id's base type (domains resolved), the domain's modifier and an array's
        element type, from the catalog (once per id: type ids never change meaning)."""
        found = self._types.get(type_oid)
        if found is not None:
            return found
        row = self.connection.execute(
            "SELECT typtype, typbasetype, typtypmod, typelem, typcategory FROM pg_type"
            " WHERE oid = %s",
            (type_oid,),
        ).fetchone()
        if row is None:  # dropped meanwhile: its values are text
            found = PgType(type_oid)
        elif row[0] == "d":  # a domain: its base type, and its modifier if it sets one
            base = self.pg_type(row[1])
            found = PgType(
                base.base_oid, row[2] if row[2] >= 0 else base.modifier, base.element_oid
            )
        elif row[4] == "A" and row[3]:
            found = PgType(type_oid, -1, row[3])
        else:
            found = PgType(type_oid)
        self._types[type_oid] = found
        return found

    def _check_slot(self) -> None:
        slot = self.slot()
        if slot is None:
            return
        plugin, database, _, active_pid = slot
        if plugin != "pgoutput":
            raise SourceConfigError(
                f"replication slot {self.options.slot!r} uses plug-in {plugin!r}, not pgoutput"
            )
        if database != self.database:
            raise SourceConfigError(
                f"replication slot {self.options.slot!r} belongs to database {database!r}, "
                f"not {self.database!r}"
            )
        if active_pid is not None:
            raise CaptureError(
                f"replication slot {self.options.slot!r} is in use by server process "
                f"{active_pid} (another capture?)"
            )

    # -- the slot and the publication --------------------------------------------------

    def slot(self) -> tuple[str, str, int, int | None] | None:
        """(plug-in, database, confirmed position, active pid) of the slot, if it exists."""
        row = self.connection.execute(
            "SELECT plugin, database, confirmed_flush_lsn::text, active_pid"
            " FROM pg_replication_slots WHERE slot_name = %s",
            (self.options.slot,),
        ).fetchone()
        if row is None:
            return None
        return row[0], row[1], lsn_to_int(row[2]) if row[2] else 0, row[3]

    @property
    def publication(self) -> str:
        return self.options.publication or self.options.slot

    def ensure_publication(self) -> None:
        """Create the slot's own publication for the tables, or add tables missing from it."""
        if self.options.publication is not None:
            return
        name = sql.Identifier(self.publication)
        tables = [sql.Identifier(t.schema, t.name) for t in self.tables.values()]
        exists = self._one(
            "SELECT count(*) FROM pg_publication WHERE pubname = %s", (self.publication,)
        )
        if not exists:
            self.connection.execute(
                sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                    name, sql.SQL(", ").join(tables)
                )
            )
            logger.info("created publication %s", self.publication)
            return
        published = set(self._publication_tables(self.publication))
        for table in self.tables.values():
            if table.qualified not in published:
                self.connection.execute(
                    sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                        name, sql.Identifier(table.schema, table.name)
                    )
                )

    def create_slot(self) -> int:
        """Create the slot (no snapshot); its consistent point."""
        row = self.connection.execute(
            "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
            (self.options.slot,),
        ).fetchone()
        assert row is not None
        return lsn_to_int(row[0])

    def drop_slot(self) -> None:
        self.connection.execute("SELECT pg_drop_replication_slot(%s)", (self.options.slot,))
        logger.info("dropped replication slot %s", self.options.slot)

    def advance(self, position: int) -> None:
        self.connection.execute(
            "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
            (self.options.slot, lsn_to_text(position)),
        )

    def current_position(self) -> int:
        return lsn_to_int(self._one("SELECT pg_current_wal_lsn()::text"))

    def peek(self, max_changes: int) -> list[tuple[int, bytes]]:
        """The slot's next messages (whole transactions), consuming nothing."""
        rows = self.connection.execute(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes("
            "%s, NULL, %s, 'proto_version', '1', 'publication_names', %s)",
            (self.options.slot, max_changes, _quoted_list(self.publication)),
        ).fetchall()
        return [(lsn_to_int(lsn), bytes(data)) for lsn, data in rows]

    @contextmanager
    def slot_with_snapshot(self) -> Iterator[tuple[int, psycopg.Connection[Any]]]:
        """Create the slot and yield its consistent point with a session reading the
        database as it was at that point (the snapshot the slot exported)."""
        replication = connect(self.options.dsn, replication="database")
        try:
            row = replication.execute(
                f"CREATE_REPLICATION_SLOT {self.options.slot} LOGICAL pgoutput EXPORT_SNAPSHOT"
            ).fetchone()
            assert row is not None
            consistent_point, snapshot_name = lsn_to_int(row[1]), row[2]
            reader = connect(self.options.dsn)
            try:
                reader.autocommit = False
                reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                reader.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(snapshot_name))
                yield consistent_point, reader
                reader.rollback()
            finally:
                reader.close()
        finally:
            replication.close()


def _quoted_list(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class _Shape:
    """What the events of a table need of its columns, worked out once per description
    (the catalog's, or each Relation message): not per row."""

    reads: tuple[tuple[str, int], ...]
    """Each column's name and the base type id its values are read by."""
    identity: frozenset[str]
    """The replica identity columns (what an old row sent as key only holds)."""
    digest: str


class _Events:
    """Change events in the shape ``replog append --format debezium`` produces."""

    def __init__(self, source: PostgresSource, slot: str) -> None:
        self.reader = ValueReader()
        self.source = source
        self.slot = slot
        self._digests: dict[tuple[str, Columns, tuple[str, ...]], str] = {}
        self._shapes: dict[tuple[str, bool], tuple[Table | Relation, _Shape]] = {}
        """(table, from a Relation) -> the description last seen, and its shape."""
        self.schemas: dict[str, tuple[str, dict[str, Any]]] = {}
        """digest -> (collection, Kafka Connect schema) of every schema an event named."""

    def shape(self, table: Table, relation: Relation | None = None) -> _Shape:
        """The shape of ``table`` as ``relation`` (else the catalog) describes it. The
        decoder makes a Relation per decoding session, so this is worked out once per table
        per batch; the schema (and its digest) once per distinct set of columns."""
        described: Table | Relation = table if relation is None else relation
        cache_key = (table.qualified, relation is not None)
        cached = self._shapes.get(cache_key)
        if cached is not None and cached[0] is described:
            return cached[1]
        if relation is None:
            columns, identity = table.columns, frozenset(table.key)
        else:
            columns = tuple((c.name, c.type_oid, c.type_modifier) for c in relation.columns)
            identity = frozenset(c.name for c in relation.columns if c.in_identity)
        reads = tuple(
            (name, self.source.pg_type(type_oid).base_oid) for name, type_oid, _ in columns
        )
        found = _Shape(reads, identity, self._digest(table, columns))
        self._shapes[cache_key] = (described, found)
        return found

    def _digest(self, table: Table, columns: Columns) -> str:
        """The digest of the table's schema with ``columns``; the schema is kept in
        :attr:`schemas` for registering before the commit."""
        digest = self._digests.get((table.qualified, columns, table.key))
        if digest is None:
            prefix = f"{self.slot}.{table.qualified}"
            schema = table_schema(prefix, columns, table.key, self.source.pg_type)
            digest = connect_schemas.digest(schema)
            self._digests[(table.qualified, columns, table.key)] = digest
            self.schemas[digest] = (table.qualified, schema)
        return digest

    def _row(
        self, shape: _Shape, values: Sequence[Value], fallback: Sequence[Value] = ()
    ) -> tuple[dict[str, Any], list[str]]:
        """A row image; unchanged TOASTed values come from ``fallback`` (an old image under
        REPLICA IDENTITY FULL) or become :data:`UNAVAILABLE` (listed)."""
        image: dict[str, Any] = {}
        unavailable: list[str] = []
        for index, (name, base_oid) in enumerate(shape.reads):
            value = values[index] if index < len(values) else None
            if isinstance(value, Unchanged) and index < len(fallback):
                value = fallback[index]
            if isinstance(value, Unchanged):
                image[name] = UNAVAILABLE
                unavailable.append(name)
            else:
                image[name] = self.reader.read(base_oid, value)
        return image, unavailable

    def _key(self, table: Table, image: Mapping[str, Any]) -> str:
        return jsontext.encode({name: image.get(name) for name in table.key})

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
        metadata: dict[str, Any] = {
            "op": op,
            "ts_ms": ts_ms,
            "source": source,
            **(extra or {}),
            "schema": schema,
        }
        return {
            "event_id": str(uuid.uuid5(EVENT_ID_NAMESPACE, identity)),
            "timestamp": source["ts_ms"],
            "operation": OPERATIONS[op],
            "collection": table.qualified,
            "key": key,
            "data": RawJSON(jsontext.encode(image)),
            "before": RawJSON(jsontext.encode(before)) if before is not None else None,
            "metadata": RawJSON(jsontext.encode(metadata)),
        }

    def _source(
        self, table: Table, ts_ms: int, snapshot: str, xid: int | None, lsn: int
    ) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "connector": "postgresql",
            "name": self.slot,
            "ts_ms": ts_ms,
            "snapshot": snapshot,
            "db": self.source.database,
            "schema": table.schema,
            "table": table.name,
            "txId": xid,
            "lsn": lsn,
        }

    def snapshot_row(
        self, table: Table, values: Sequence[str | None], ts_ms: int, position: int
    ) -> dict[str, Any]:
        shape = self.shape(table)
        after, _ = self._row(shape, values)
        key = self._key(table, after)
        return self.event(
            table,
            op="r",
            key=key,
            after=after,
            before=None,
            source=self._source(table, ts_ms, "true", None, position),
            identity=f"{self.slot}:snapshot:{position}:{table.qualified}:{key}",
            schema=shape.digest,
            ts_ms=ts_ms,
        )

    def changes(
        self, table: Table, change: RowChange, txn: SourceTransaction, order: int, ts_ms: int
    ) -> list[dict[str, Any]]:
        """The events of one row change, numbered from ``order`` in the transaction; ``ts_ms``:
        when its batch was processed. An update that changes the row's key is, as Debezium
        emits it, a delete of the old key then a create of the new one: as one update (of
        the new key) the old key would live on in every table built from the log."""
        shape = self.shape(table, change.relation)
        before: dict[str, Any] | None = None
        if change.old is not None:
            before, _ = self._row(shape, change.old)
            if change.old_is_key_only:  # only the identity columns were sent
                before = {k: v for k, v in before.items() if k in shape.identity}
        after = None
        unavailable: list[str] = []
        if change.new is not None:
            full_old = change.old if change.old is not None and not change.old_is_key_only else ()
            after, unavailable = self._row(shape, change.new, full_old)
        image = after if after is not None else before
        assert image is not None
        key = self._key(table, image)
        parts: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None, str]] = [
            (change.op, after, before, key)
        ]
        if change.op == "u" and before is not None and all(k in before for k in table.key):
            old_key = self._key(table, before)  # the server sends the old key when it changed
            if old_key != key:
                parts = [("d", None, before, old_key), ("c", after, None, key)]
        events = []
        for index, (op, new_image, old_image, event_key) in enumerate(parts):
            number = order + index
            events.append(
                self.event(
                    table,
                    op=op,
                    key=event_key,
                    after=new_image,
                    before=old_image,
                    source=self._source(table, txn.commit_ms, "false", txn.xid, change.lsn),
                    identity=f"{self.slot}:{txn.end_lsn}:{number}",
                    schema=shape.digest,
                    ts_ms=ts_ms,
                    extra={
                        "transaction": {
                            "id": f"{txn.xid}:{txn.end_lsn}",
                            "total_order": number,
                            "data_collection_order": number,
                        },
                        **({"unavailable": unavailable} if unavailable and new_image else {}),
                    },
                )
            )
        return events


ProgressCallback = Callable[[CaptureProgress], None]


class PostgresCapture:
    """One capture of a PostgreSQL database into one log (see the module docstring).

    ``stop`` ends a following capture after the commit in progress.
    """

    def __init__(
        self,
        options: CaptureOptions,
        log: ReplicationLog,
        *,
        stop: threading.Event | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        options.check()
        self.options = options
        self.log = log
        self.stop = stop or threading.Event()
        self.on_progress = progress
        self.app_id = capture_app_id(options.slot)
        self.progress = CaptureProgress()
        self.source = PostgresSource(options)
        try:
            self.source.check()
        except BaseException:
            self.source.close()
            raise
        self.events = _Events(self.source, options.slot)
        self.decoder = Decoder()
        self._registered: set[str] = set()
        self._renames_noted: set[tuple[int, str]] = set()
        self._keys_followed: dict[int, Relation] = {}
        """Table id -> the relation description its key was last checked against."""
        self._logged = 0
        """The position the log holds as far as this capture knows (0: none): each commit
        must follow it, so a second capture of the slot cannot commit over this one's."""

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> PostgresCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self) -> CaptureProgress:
        """Snapshot if asked, then stream until caught up (or, following, until stopped)."""
        position = self._start()
        self.progress.position = position
        while not self.stop.is_set():
            captured = self._capture_batch()
            self._report()
            if not captured:
                if not self.options.follow:
                    break
                self.stop.wait(self.options.poll_s)
        if self.options.drop_slot:
            # Only a capture that got here retires the slot (one that failed keeps it: the
            # changes after its last commit are still to be read), and only once it has
            # read what is left (a stopped follower may not have).
            while self._capture_batch():
                self._report()
            self.source.drop_slot()
        return self.progress

    def _report(self) -> None:
        self.progress.lag_bytes = max(self.source.current_position() - self.progress.position, 0)
        if self.on_progress is not None:
            self.on_progress(self.progress)

    # -- starting: the slot and the log must agree --------------------------------------

    def _start(self) -> int:
        logged = self.log.transaction_version(self.app_id)  # the slot position it holds
        self._logged = logged or 0
        slot = self.source.slot()
        if logged is None:
            self.source.ensure_publication()
            if self.options.snapshot == "initial":
                if slot is not None:
                    logger.warning(
                        "slot %s exists but the log holds no capture of it: dropping it to "
                        "take a snapshot consistent with a new slot",
                        self.options.slot,
                    )
                    self.source.drop_slot()
                return self._snapshot()
            return slot[2] if slot is not None else self.source.create_slot()
        if slot is None:
            raise SourcePositionError(
                f"the log holds capture position {lsn_to_text(logged)} of slot "
                f"{self.options.slot!r}, but the slot does not exist: changes after it are "
                f"gone. Capture into a new slot (with --snapshot initial) to start over"
            )
        confirmed = slot[2]
        if confirmed > logged:
            raise SourcePositionError(
                f"slot {self.options.slot!r} was advanced to {lsn_to_text(confirmed)}, past "
                f"the log's position {lsn_to_text(logged)}: the changes between were consumed "
                f"elsewhere and would be lost"
            )
        self.source.ensure_publication()
        if confirmed < logged:  # killed after a commit, before the advance
            logger.info(
                "advancing slot %s from %s to the log's %s",
                self.options.slot,
                lsn_to_text(confirmed),
                lsn_to_text(logged),
            )
            self.source.advance(logged)
        return logged

    def _snapshot(self) -> int:
        """Every captured table at the slot's consistent point, in one commit."""
        with self.source.slot_with_snapshot() as (position, reader):
            ts_ms = now_ms()
            records: list[dict[str, Any]] = []
            for table in self.source.tables.values():
                columns = sql.SQL(", ").join(
                    sql.SQL("{}::text").format(sql.Identifier(name)) for name, _, _ in table.columns
                )
                query = sql.SQL("SELECT {} FROM {}").format(
                    columns, sql.Identifier(table.schema, table.name)
                )
                with reader.cursor(name=f"replog_snapshot_{self.options.slot}") as cursor:
                    cursor.execute(query)
                    for values in cursor:
                        records.append(self.events.snapshot_row(table, values, ts_ms, position))
            self._commit(records, position)
            self.progress.snapshot_rows = len(records)
            logger.info("snapshot of %d rows at %s committed", len(records), lsn_to_text(position))
        return position

    def _commit(self, records: list[dict[str, Any]], position: int) -> None:
        """One atomic commit of ``records`` that records ``position`` (also with no
        records: transactions of tables not captured still move the position on)."""
        transaction = Transaction(self.app_id, position, follows=self._logged)
        self._register()
        try:
            if records:
                record = self.log.append(records, transaction=transaction)
            else:
                record = self.log.commit_staged(
                    [], writer=transaction.writer(), follows=transaction.follows
                )
        except TransactionOrderError as exc:
            raise CaptureError(
                f"another capture of slot {self.options.slot!r} committed to {self.log.url} "
                f"while this one read the slot ({exc}); this capture stops without committing "
                f"(the changes it read would be doubled): run one capture per slot"
            ) from exc
        if record is not None:
            self.progress.commits += 1
            self._logged = position
        else:  # the log already holds this position (or a later one)
            self._logged = self.log.transaction_version(self.app_id) or 0

    def _register(self) -> None:
        """Store (put-if-absent) each schema an event was given that this capture has not
        stored yet: before the commit, so a reader that sees an event finds its schema."""
        for digest, (collection, schema) in list(self.events.schemas.items()):
            if digest not in self._registered:
                registry.register(self.log.storage, collection, schema, digest)
                self._registered.add(digest)

    # -- streaming -----------------------------------------------------------------------

    def _capture_batch(self) -> bool:
        """Read whole transactions from the slot, commit them, then advance the slot.
        Whether the slot had any."""
        messages = self.source.peek(self.options.max_changes)
        transactions: list[SourceTransaction] = []
        for lsn, message in messages:
            done = self.decoder.feed(lsn, message)
            if done is not None:
                transactions.append(done)
        if not transactions:
            return False
        position = self.progress.position
        fresh = [txn for txn in transactions if txn.end_lsn > position]
        self.progress.skipped_transactions += len(transactions) - len(fresh)
        processed_ms = now_ms()
        records: list[dict[str, Any]] = []
        for txn in fresh:
            order = 1
            for change in txn.changes:
                table = self._captured_table(change.relation, txn)
                if table is not None:
                    events = self.events.changes(table, change, txn, order, processed_ms)
                    records.extend(events)
                    order += len(events)
            self._skip_truncations(txn)
        last = transactions[-1].end_lsn
        if last > position:
            self._commit(records, last)
        crash_point("capture_committed")
        self.source.advance(last)
        if fresh:
            self.progress.last_commit_ms = fresh[-1].commit_ms
        self.progress.position = max(position, last)
        self.progress.rows += len(records)
        self.progress.transactions += len(fresh)
        return True

    def _note_rename(self, table: Table, name: str) -> None:
        if (table.oid, name) in self._renames_noted:
            return
        self._renames_noted.add((table.oid, name))
        logger.warning(
            "captured table %s is called %s at this point of the stream (renamed): its "
            "changes are captured as collection %s until capture starts again with the "
            "table's current name",
            table.qualified,
            name,
            table.qualified,
        )

    def _skip_truncations(self, txn: SourceTransaction) -> None:
        """Warn about each captured table a ``TRUNCATE`` emptied: the log has no event
        that says "every row is gone" (Debezium skips truncations by default too), so a
        table built from the log keeps the rows. The operator must see it to act."""
        for relation, lsn in txn.truncated:
            table = self._captured_table(relation, txn)
            if table is None:
                continue
            self.progress.skipped_truncations += 1
            logger.warning(
                "TRUNCATE of %s (transaction %d, LSN %s) is not captured: the log has no "
                "truncate event, so tables built from it keep the rows the source removed "
                "(rebuild them, or capture anew into a new slot with --snapshot initial)",
                table.qualified,
                txn.xid,
                lsn_to_text(lsn),
            )

    def _captured_table(self, relation: Relation, txn: SourceTransaction) -> Table | None:
        """The captured table a change is of; None for one not captured. With
        ``--publication`` the captured tables are the publication's: a table added to it
        while capturing is published from then on, so it is captured from then on (skipping
        its changes would lose them: the slot moves past them). Tables are matched by id first:
        a captured table renamed is still captured, under the collection it had (by name,
        its changes would be skipped, or a restart would meet its old name); one dropped and
        created again under its name is described afresh."""
        table = self.source.table_with_oid(relation.oid)
        if table is not None and table.qualified != relation.name:
            self._note_rename(table, relation.name)
        elif table is None and (relation.name in self.source.tables or not self.options.tables):
            how = (
                "was created again"
                if relation.name in self.source.tables
                else f"joined publication {self.source.publication}"
            )
            table = self.source.add_table(relation.name)  # errors (no key...) stop it
            logger.info("%s %s: captured from now on", table.qualified, how)
        if table is not None:
            table = self._follow_primary_key(table, relation, txn)
        return table

    def _follow_primary_key(
        self, table: Table, relation: Relation, txn: SourceTransaction
    ) -> Table:
        """Key ``table`` by its primary key as of this point of the stream. Under the
        default replica identity the columns pgoutput flags as identity are the primary key
        then (decoding reads the catalog as it was), which the catalog read at start-up may
        not be: an ``ALTER TABLE ... PRIMARY KEY`` while capturing, or before a restart with
        changes still unread. Keyed by a stale key, two rows could share one key and be
        merged into one downstream. Keys given with ``--keys`` are kept."""
        if self._keys_followed.get(table.oid) is relation:
            return table  # this description was seen: once per table per decoding session
        self._keys_followed[table.oid] = relation
        if relation.replica_identity != "d" or table.qualified in self.options.keys:
            return table
        identity = [column.name for column in relation.columns if column.in_identity]
        if not identity or set(identity) == set(table.key):
            return table
        current = self.source.primary_key(table.oid)
        key = current if set(current) == set(identity) else tuple(identity)
        logger.warning(
            "the primary key of %s is (%s) from transaction %d on, not (%s): its events are "
            "keyed by it, so rows a table built from the log keeps under the old key are not "
            "updated or deleted by them (rebuild such tables from a snapshot)",
            table.qualified,
            ", ".join(key),
            txn.xid,
            ", ".join(table.key),
        )
        return self.source.rekey(table, key)


def server_positions(dsn: str) -> tuple[int, dict[str, int | None]]:
    """The server's current WAL position and each logical slot's confirmed position (None
    for a slot that has confirmed nothing yet): what ``replog status --source-dsn`` needs."""
    with connect(dsn) as connection:
        row = connection.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        slots = connection.execute(
            "SELECT slot_name, confirmed_flush_lsn::text FROM pg_replication_slots"
            " WHERE slot_type = 'logical'"
        ).fetchall()
    return lsn_to_int(row[0]), {
        name: None if confirmed is None else lsn_to_int(confirmed) for name, confirmed in slots
    }


def capture(
    options: CaptureOptions,
    log: ReplicationLog,
    *,
    stop: threading.Event | None = None,
    progress: ProgressCallback | None = None,
) -> CaptureProgress:
    """Capture ``options`` into ``log`` (the Python form of ``replog capture postgres``)."""
    with PostgresCapture(options, log, stop=stop, progress=progress) as running:
        return running.run()
