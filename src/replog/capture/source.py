"""The source database of a capture: its checks, catalog, slot and publication.

DESIGN: everything capture asks of PostgreSQL goes through :class:`PostgresSource`: the
checks that run before anything is written (``wal_level``, tables, keys, replica
identities), the catalog (columns, types, partitions, defaults), the slot (create, peek,
advance, drop) and the publication. The other stages (snapshot, change stream, the loop
that commits) never write SQL of their own, so each can be tested against a real server
through this one face.

Two rules protect the source:

* A table is published only after its replica identity was checked: published without
  one, every UPDATE and DELETE on it fails (a DEFERRABLE primary key cannot be the
  identity; ``REPLICA IDENTITY NOTHING`` has none; a partitioned table's partitions each
  need their own).
* Capture's own publication publishes partitions as themselves
  (``publish_via_partition_root = false``: only then is a TRUNCATE of one partition in
  the stream; the stream maps each partition to its root) and, from PostgreSQL 18,
  STORED generated columns (``publish_generated_columns``), so the stream carries what
  the snapshot reads.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import psycopg
import pyarrow as pa
import pyarrow.csv as pacsv
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from replog.capture.options import CaptureOptions
from replog.capture.pgoutput import lsn_to_int, lsn_to_text
from replog.capture.schemas import PgType
from replog.capture.values import SESSION_SETTINGS
from replog.errors import (
    CaptureError,
    CaptureRunningError,
    InvalidOptionError,
    SlotOwnershipError,
    SourceConfigError,
    SourceConnectionError,
    SourcePrivilegeError,
)

logger = logging.getLogger(__name__)

WATERMARK_PREFIX = "replog.watermark"
"""Prefix of the logical messages capture writes into the WAL around snapshot chunks."""
SIGNAL_PREFIX = "replog.signal"
"""Prefix of the logical messages that ask a running capture for a snapshot."""
HEARTBEAT_PREFIX = "replog.heartbeat"
"""Prefix of the logical messages a following capture writes while its tables are idle:
a transaction it then commits, so its slot advances (:data:`~replog.capture.options.
DEFAULT_HEARTBEAT_S`)."""
MARKER_PREFIX = "replog.marker"
"""Prefix of the logical messages capture writes to place in the stream what the catalog
showed it (a partition that left a captured table)."""

LOCK_WAIT = "200ms"
"""How long a catalog read that must lock tables waits for a lock a DDL holds."""
PARTITION_ROWS_PER_QUERY = 50_000
"""Rows sent at once when the server judges which of them a partition held."""

SlotInfo = tuple[str, str, int, int | None]
"""A slot's plug-in, database, confirmed position and active server process."""


class LogHolds(NamedTuple):
    """What the log a capture writes holds of its slot: whose slot it is depends on it."""

    log_id: str
    position: int | None
    """The capture position the log holds (None: none yet)."""
    slot_lsn: int
    """The consistent point of the slot this log's capture created (0: none known)."""


Columns = tuple[tuple[str, int, int], ...]
"""A table's columns: name, type id and type modifier (``atttypmod``: a numeric's
precision and scale; -1: none), as the catalog and pgoutput's Relation message give them."""


@dataclass(frozen=True)
class Table:
    """A captured table as the catalog describes it: its published columns and its key."""

    schema: str
    name: str
    columns: Columns
    key: tuple[str, ...]
    oid: int
    """The table's id: pgoutput names a table by it, and it survives a rename."""
    key_deferrable: bool = False
    """The key is a DEFERRABLE constraint: rows may share a key inside a statement."""
    key_indexed: bool = True
    """The key columns are a primary key or a unique index of NOT NULL columns, so the
    snapshot can read the table in key order; else it reads it in physical order."""
    defaults: tuple[tuple[str, str], ...] = ()
    """(column, text output) of each column whose rows written before it was added read
    as a value (``ALTER TABLE ... ADD COLUMN ... DEFAULT``: ``attmissingval``)."""

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    def key_of(self, row: Sequence[str | None]) -> list[str | None]:
        """The key of a row read with every column of :attr:`columns`, in key order."""
        names = [name for name, _, _ in self.columns]
        return [row[names.index(k)] for k in self.key]


@dataclass(frozen=True)
class SlotHealth:
    """A slot as the server keeps it (``pg_replication_slots``)."""

    retained_bytes: int
    """WAL the server keeps for it: from its ``restart_lsn`` to the server's position."""
    wal_status: str | None
    """``reserved``, ``extended``, ``unreserved`` (to be removed at the next checkpoint)
    or ``lost`` (invalidated: the changes it held are gone)."""
    safe_bytes: int | None
    """WAL that can still be written before the slot is in danger of being lost (None:
    no ``max_slot_wal_keep_size``)."""
    limit: str
    limit_bytes: int | None
    """``max_slot_wal_keep_size`` (None: unlimited, -1)."""
    invalidation: str | None
    """Why the server invalidated it (PostgreSQL 17: ``wal_removed``, ``rows_removed``...)."""

    @property
    def lost(self) -> bool:
        return self.wal_status == "lost" or self.invalidation is not None


class CatalogEntry(NamedTuple):
    """What the catalog says now of a captured table, named and known by id."""

    oid: int | None
    """The id its name has now (None: no such table)."""
    name: str | None
    """The name its id has now (None: dropped)."""
    leaves: list[str] | None
    """Its leaf partitions' ids as text (None: not partitioned)."""
    columns: dict[str, list[str]]
    """Its columns: ``attnum`` (as text) -> [name, type, the ``xmin`` of its catalog row
    (written anew by a rename, a retype, ``SET DEFAULT``...)]."""
    attached: dict[str, str]
    """Leaf partitions -> the ``xmin`` of the catalog rows that attach it and its parents
    (written anew by each ATTACH: one detached and attached again has other ones)."""
    storage: dict[str, int]
    """The table, or each leaf partition -> its storage (``relfilenode``: new when the
    relation is rewritten: a retype, a column added with a volatile default, ``VACUUM
    FULL``)."""


def parse_owner(comment: str | None) -> dict[str, str] | None:
    """The log that owns a slot, from the comment of capture's own publication of it
    (``{"replog": {"slot": ..., "log_id": ..., "log": ...}}``); None for any other."""
    try:
        found = json.loads(comment)["replog"] if comment else None
    except (ValueError, KeyError, TypeError):
        return None
    return found if isinstance(found, dict) and "log_id" in found else None


def safe_dsn(dsn: str) -> str:
    """The DSN without its password, for messages."""
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "the given DSN"
    shown = {k: v for k, v in parts.items() if k in ("host", "port", "dbname", "user")}
    return " ".join(f"{k}={v}" for k, v in shown.items()) or "the default server"


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """An autocommit session that writes values as :mod:`~replog.capture.values` reads them.
    It prepares no statement: a statement prepared before an ``ALTER COLUMN ... TYPE``
    fails after it ("cached plan must not change result type"), and capture reads tables
    while their schema moves."""
    try:
        connection = psycopg.connect(dsn, autocommit=True, prepare_threshold=None, **kwargs)
    except psycopg.Error as exc:
        raise SourceConnectionError(
            f"cannot connect to PostgreSQL ({safe_dsn(dsn)}): {str(exc).strip()}"
        ) from exc
    if not kwargs.get("replication"):
        for name, value in SESSION_SETTINGS.items():
            connection.execute("SELECT set_config(%s, %s, false)", (name, value))
    return connection


def text_rows(
    connection: psycopg.Connection[Any], query: str | sql.Composed, params: Sequence[Any] = ()
) -> list[tuple[str | None, ...]]:
    """The rows of ``query`` as each type's output function writes its values (what
    pgoutput sends), not parsed by psycopg: the snapshot and the stream then read the
    same text, and a cast (``col::text`` drops a ``character(n)``'s trailing blanks)
    never stands in for the output function."""
    with connection.cursor() as cursor:
        cursor.execute(query, params, binary=False)
        result = cursor.pgresult
        if result is None:
            return []
        fields = range(result.nfields)
        return [
            tuple(
                None if (value := result.get_value(row, field)) is None else value.decode()
                for field in fields
            )
            for row in range(result.ntuples)
        ]


CAPTURE_LOCK_CLASS = 0x7265706C
"""The first key of replog's advisory locks ("repl"); the second is the slot name's hash."""
CAPTURE_LOCK_WAIT = "3s"
"""How long a capture waits for its slot's lock: a capture that ended a moment ago holds
it until its server process has exited (a restart at once was refused as a second
capture)."""


def session_name(slot: str) -> str:
    """``application_name`` of a capture's session: what ``pg_stat_activity`` and a
    refused second capture show of it (PostgreSQL keeps 63 bytes)."""
    return f"replog capture {slot} pid {os.getpid()} on {socket.gethostname()}"[:63]


def sql_ident(name: str) -> str:
    """``name`` as an SQL identifier in a statement shown to an operator."""
    return (
        name
        if name.isidentifier() and name == name.lower()
        else '"' + name.replace('"', '""') + '"'
    )


def copy_rows(
    connection: psycopg.Connection[Any], query: sql.Composable, params: Sequence[Any] = ()
) -> pa.Table:
    """The rows of ``query`` as columns of strings, each value its type's output text (as
    :func:`text_rows` gives it; NULL a null), read as ``COPY (query) TO STDOUT`` in CSV and
    parsed by Arrow's CSV reader: no Python object per value (a snapshot chunk's path)."""
    copy = sql.SQL("COPY ({}) TO STDOUT (FORMAT csv)").format(query)
    with connection.cursor() as cursor:
        with cursor.copy(copy, params or None) as stream:
            raw = b"".join(bytes(block) for block in stream)
        described = cursor.description or []
    names = [f"c{index}" for index in range(len(described))]
    if not raw:
        return pa.table({name: pa.array([], pa.string()) for name in names})
    return pacsv.read_csv(
        pa.py_buffer(raw),
        read_options=pacsv.ReadOptions(column_names=names, use_threads=False),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            column_types=dict.fromkeys(names, pa.string()),
            null_values=[""],  # not Arrow's default list, which holds "null" and "NaN"
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,  # "" is an empty string, nothing a NULL
        ),
    )


def quoted_list(name: str) -> str:
    """``name`` as one element of a text list option of pgoutput."""
    return '"' + name.replace('"', '""') + '"'


def qualified_name(name: str) -> str:
    """``schema.table`` for a table name given bare (``public``) or qualified."""
    return name if "." in name else f"public.{name}"


class PostgresSource:
    """The source database: checks, tables, the slot and the publication."""

    def __init__(self, options: CaptureOptions) -> None:
        self.options = options
        self.connection = connect(options.dsn, application_name=session_name(options.slot))
        self.database: str = self._one("SELECT current_database()")
        self.server_version: int = int(self._one("SHOW server_version_num"))
        self.tables: dict[str, Table] = {}
        self._by_oid: dict[int, Table] = {}
        self._types: dict[int, PgType] = {}
        self._roots: dict[int, int | None] = {}
        self._leaf_roots: dict[int, int] = {}
        self.known: dict[str, int] = {}
        """Tables the log's capture captured (collection -> id): one renamed since is
        described by its id, under its collection."""
        self._key_bounds: dict[tuple[tuple[int, int], ...], sql.Composed] = {}
        self.slot_ours = False
        """The slot is the log's (:meth:`check` judged it): named its owner in capture's
        own publication, or the one its capture created and never advanced."""

    def close(self) -> None:
        self.connection.close()

    def _one(self, query: str | sql.Composed, params: Sequence[Any] = ()) -> Any:
        row = self.connection.execute(query, params).fetchone()
        return None if row is None else row[0]

    def _all(self, query: str | sql.Composed, params: Sequence[Any] = ()) -> list[Any]:
        return self.connection.execute(query, params).fetchall()

    # -- checks, before anything is written ------------------------------------------

    def check(self, log: LogHolds | None = None) -> None:
        """Every reason capture cannot run, as an error naming the value at fault and the
        statement that fixes it: before anything is written (to the log or the source).
        ``log``: what the capture's log holds of the slot (None: a log not created yet),
        whose slot it is judged by (:attr:`slot_ours`)."""
        wal_level = self._one("SHOW wal_level")
        if wal_level != "logical":
            raise SourceConfigError(
                f"wal_level is {wal_level!r} on {safe_dsn(self.options.dsn)}; capture needs "
                f"'logical' (ALTER SYSTEM SET wal_level = logical, then restart the server)"
            )
        self._check_role()
        publication = self.options.publication
        if publication is not None and not self._one(
            "SELECT count(*) FROM pg_publication WHERE pubname = %s", (publication,)
        ):
            raise SourceConfigError(
                f"publication {publication!r} does not exist in database {self.database!r}"
            )
        names = [qualified_name(t) for t in self.options.tables] or self._published_roots()
        if not names:
            raise SourceConfigError(f"publication {publication!r} publishes no tables")
        for name in names:
            self.add_table(name)
        unknown = set(self.options.keys) - set(self.tables)
        if unknown:
            raise InvalidOptionError(f"keys given for tables not captured: {sorted(unknown)}")
        if publication is not None and self.options.tables:
            for table in self.tables.values():
                if not self.is_published(table):
                    raise SourceConfigError(
                        f"table {table.qualified!r} is not in publication {publication!r}"
                    )
        self._check_privileges()
        self._check_slot()
        self.slot_ours = self._check_owner(log)
        if publication is not None:
            self._warn_unpublished(publication)

    def _warn_unpublished(self, publication: str) -> None:
        """Say what the user's publication keeps out of the stream (nothing is skipped
        silently): the operations it does not publish, and, through partition roots, a
        TRUNCATE of one partition (PostgreSQL sends none)."""
        row = self.connection.execute(
            "SELECT pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot"
            " FROM pg_publication WHERE pubname = %s",
            (publication,),
        ).fetchone()
        if row is None:
            return
        *actions, via_root = row
        names = ("insert", "update", "delete", "truncate")
        missing = [
            name
            for name, published in zip(names, actions, strict=True)
            if not published and not (name == "truncate" and self.options.skip_truncate)
        ]
        if missing:
            logger.warning(
                "publication %s does not publish %s: those changes of its tables never reach "
                "the stream and are not captured (tables built from the log keep what they "
                "changed). ALTER PUBLICATION %s SET (publish = '%s')",
                publication, ", ".join(missing), sql_ident(publication), ", ".join(names),
            )  # fmt: skip
        partitioned = self._all(
            "SELECT oid::regclass::text FROM pg_class WHERE oid = ANY(%s) AND relkind = 'p'"
            " ORDER BY 1",
            ([table.oid for table in self.tables.values()],),
        )
        if via_root and partitioned and not self.options.skip_truncate:
            logger.warning(
                "publication %s publishes through partition roots (publish_via_partition_root)"
                ": PostgreSQL sends no TRUNCATE of one partition of %s through it, so such a "
                "TRUNCATE is not captured (tables built from the log keep the partition's "
                "rows). ALTER PUBLICATION %s SET (publish_via_partition_root = false)",
                publication, ", ".join(name for (name,) in partitioned), sql_ident(publication),
            )  # fmt: skip

    @property
    def role(self) -> str:
        return str(self._one("SELECT current_user"))

    def _check_role(self) -> None:
        """Reading a slot needs the REPLICATION attribute (or a superuser)."""
        if not self._one(
            "SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user"
        ):
            role = self.role
            raise SourcePrivilegeError(
                f"role {role!r} cannot read a replication slot: it lacks the REPLICATION "
                f"attribute. As a superuser: ALTER ROLE {sql_ident(role)} REPLICATION"
            )

    def _check_privileges(self) -> None:
        """SELECT on each table (the snapshot reads it); for capture's own publication,
        CREATE on the database (to create it) and ownership of each table (to publish it)
        or of the publication (to change it); a free replication slot for a new slot."""
        role = sql_ident(self.role)
        for table in self.tables.values():
            if not self._one("SELECT has_table_privilege(%s, 'SELECT')", (table.oid,)):
                raise SourcePrivilegeError(
                    f"the snapshot of {table.qualified} cannot read it: role {role} lacks "
                    f"SELECT on it. GRANT SELECT ON {sql_ident(table.schema)}."
                    f"{sql_ident(table.name)} TO {role}"
                )
        if self.own_publication:
            self._check_own_publication(role)
        if self.slot() is None:
            used, most = self.connection.execute(
                "SELECT count(*), current_setting('max_replication_slots')::int"
                " FROM pg_replication_slots"
            ).fetchone() or (0, 0)
            if used >= most:
                raise SourceConfigError(
                    f"no free replication slot for {self.options.slot!r}: the server has "
                    f"{used} of max_replication_slots = {most} (drop one no capture needs, "
                    f"'replog slots {safe_dsn(self.options.dsn)}' lists them, or raise the "
                    f"setting: ALTER SYSTEM SET max_replication_slots = {most + 4}, then "
                    f"restart the server)"
                )

    def _check_own_publication(self, role: str) -> None:
        way_out = (
            "or create a publication yourself (CREATE PUBLICATION p FOR TABLE ...) and give "
            "it with --publication p, which needs no CREATE"
        )
        exists = self.connection.execute(
            "SELECT pg_has_role(pubowner, 'USAGE') FROM pg_publication WHERE pubname = %s",
            (self.publication,),
        ).fetchone()
        if exists is None and not self._one(
            "SELECT has_database_privilege(current_database(), 'CREATE')"
        ):
            raise SourcePrivilegeError(
                f"capture creates publication {self.publication!r} for its tables, but role "
                f"{role} lacks CREATE on database {self.database!r}: GRANT CREATE ON DATABASE "
                f"{sql_ident(self.database)} TO {role}, {way_out}"
            )
        if exists is not None and not exists[0]:
            raise SourcePrivilegeError(
                f"publication {self.publication!r} (capture's own, named after the slot) "
                f"belongs to another role, so role {role} cannot change it: "
                f"ALTER PUBLICATION {sql_ident(self.publication)} OWNER TO {role}, {way_out}"
            )
        for table in self.tables.values():
            if not self._one(
                "SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = %s",
                (table.oid,),
            ):
                raise SourcePrivilegeError(
                    f"capture publishes {table.qualified} in its own publication "
                    f"{self.publication!r}, which only the table's owner may do: role {role} "
                    f"does not own it. Grant it the owner's role (GRANT <owner> TO {role}), "
                    f"{way_out}"
                )

    def lock_slot(self) -> None:
        """Hold, for this session's life, the advisory lock that stands for the slot's
        capture: a second capture of the slot (into any log) is refused here, naming the
        one that holds it, before it touches anything. The server releases it when the
        session ends, however the capture ended."""
        key = (CAPTURE_LOCK_CLASS, self.options.slot)
        try:
            with self.connection.transaction():  # a session lock: it outlives the transaction
                self.connection.execute(f"SET LOCAL lock_timeout = '{CAPTURE_LOCK_WAIT}'")
                self.connection.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", key)
            return
        except psycopg.errors.LockNotAvailable:
            pass
        holder = self.connection.execute(
            "SELECT a.pid, coalesce(a.client_hostname, host(a.client_addr), 'a local socket'),"
            " a.application_name, a.backend_start FROM pg_locks l"
            " JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory'"
            " AND l.granted AND l.objsubid = 2 AND l.classid = %s::bigint::oid"
            " AND l.objid = ((hashtext(%s)::bigint + 4294967296) %% 4294967296)::oid",
            key,
        ).fetchone()
        who = (
            f"{holder[2] or 'a session'} (server process {holder[0]}, from {holder[1]}, "
            f"since {holder[3]:%Y-%m-%d %H:%M:%S %Z})"
            if holder is not None
            else "a session that just ended"
        )
        raise CaptureRunningError(
            f"slot {self.options.slot!r} is being captured by {who}: one capture per slot. "
            f"Stop that one first, or capture into another slot (--slot)"
        )

    def _published_roots(self) -> list[str]:
        return publication_tables(self.connection, self.options.publication or "") or []

    def is_published(self, table: Table) -> bool:
        """Whether the user's publication publishes ``table`` (itself, or its partitions)."""
        return bool(
            self._one(
                "SELECT count(*) FROM pg_publication_tables pt"
                " JOIN pg_namespace pn ON pn.nspname = pt.schemaname"
                " JOIN pg_class p ON p.relname = pt.tablename AND p.relnamespace = pn.oid"
                " WHERE pt.pubname = %s AND coalesce(pg_partition_root(p.oid), p.oid) = %s",
                (self.options.publication, table.oid),
            )
        )

    def add_table(self, name: str) -> Table:
        """Describe table ``name`` from the catalog and capture it from now on; raises
        :class:`SourceConfigError` for one that is missing, has no usable key, or whose
        replica identity would make its writes fail once published."""
        table = self.describe(name)
        self.tables[table.qualified] = table
        self._by_oid[table.oid] = table
        return table

    def rekey(self, table: Table, key: tuple[str, ...]) -> Table:
        """Capture ``table`` keyed by ``key`` from now on."""
        return self._replace(replace(table, key=key))

    def _replace(self, table: Table) -> Table:
        """Know ``table`` as described anew (by its name only while no newer table holds
        the name: changes of a dropped table are still read after its successor's)."""
        current = self.tables.get(table.qualified)
        if current is None or current.oid == table.oid:
            self.tables[table.qualified] = table
        self._by_oid[table.oid] = table
        return table

    def refresh_columns(self, table: Table) -> Table | None:
        """``table`` with its columns and defaults as the catalog has them now (a column
        was added, dropped, retyped or renamed while capturing); None if it was dropped.
        Known by its id: a table renamed keeps its collection."""
        if not self._one("SELECT count(*) FROM pg_class WHERE oid = %s", (table.oid,)):
            return None
        columns = self.columns_of(table.oid)
        if columns == table.columns:
            return table
        return self._replace(replace(table, columns=columns, defaults=self._defaults(table.oid)))

    def remember_dropped(self, name: str, relation: Any) -> Table:
        """A dropped table known only from the stream (its Relation message): its changes
        still unread are captured under ``name``, keyed as the table under that name now
        is."""
        current = self.tables[name]
        columns = tuple((c.name, c.type_oid, c.type_modifier) for c in relation.columns)
        key = tuple(k for k in current.key if k in {c[0] for c in columns})
        dropped = Table(current.schema, current.name, columns, key or current.key, relation.oid)
        self._by_oid[relation.oid] = dropped
        return dropped

    def forget(self, table: Table) -> None:
        """Stop knowing ``table`` by its id (it was dropped)."""
        self._by_oid.pop(table.oid, None)

    def primary_key(self, oid: int) -> tuple[str, ...]:
        """The table's primary key columns as the catalog has them now, in key order."""
        return tuple(
            row[0]
            for row in self._all(
                "SELECT a.attname FROM pg_index i JOIN pg_attribute a"
                " ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
                " WHERE i.indrelid = %s AND i.indisprimary"
                " ORDER BY array_position(i.indkey::int2[], a.attnum)",
                (oid,),
            )
        )

    def relation_sql(self, oid: int) -> sql.Composable:
        """Relation ``oid`` by its current name (a captured table may have been renamed:
        its collection keeps the old one)."""
        name = self._one("SELECT %s::oid::regclass::text", (oid,))
        return sql.SQL(str(name).replace("%", "%%"))

    def captured(self, name: str) -> Table | None:
        """The captured table ``schema.table`` names: its collection, or the name a
        captured table has now (renamed while captured: ``replog snapshot`` checks the
        publication, which knows it by that name)."""
        found = self.tables.get(name)
        if found is None:
            found = self.table_with_oid(self.current_oids([name])[name] or 0)
        return found

    def table_with_oid(self, oid: int) -> Table | None:
        """The captured table whose id is ``oid`` (whatever it is called now)."""
        return self._by_oid.get(oid)

    def partition_root(self, oid: int) -> int | None:
        """The partitioned table at the top of relation ``oid``'s tree (None if it is no
        partition, or no longer exists). Cached: the stream's changes of a partition are
        older than the catalog, so a partition that left its table is placed where its
        changes still unread belong (:meth:`place_partition`) until the point of the
        stream where it left."""
        if oid not in self._roots:
            root = self._one("SELECT pg_partition_root(%s::regclass)::oid", (oid,))
            self._roots[oid] = int(root) if root is not None and int(root) != oid else None
        return self._roots[oid] or self._leaf_roots.get(oid)

    def remember_leaves(self, root: int, leaves: Sequence[int]) -> None:
        """``leaves`` are partitions of captured table ``root`` (as the catalog watch saw
        them): a change of one decoded after it was detached or dropped (its partition
        published as itself) is still mapped to its root."""
        for leaf in leaves:
            self._leaf_roots[leaf] = root

    def is_leaf_of(self, leaf: int, root: int) -> bool:
        """Whether relation ``leaf`` is a leaf partition of table ``root`` now."""
        return bool(
            self._one(
                "SELECT count(*) FROM pg_partition_tree(%s) WHERE relid = %s::oid AND isleaf",
                (root, leaf),
            )
        )

    def place_partition(self, oid: int, root: int | None) -> None:
        """Map changes of relation ``oid`` to the table ``root`` from now on (a partition
        that left it, whose changes up to that point are still to be read); None: to
        whatever the catalog says at its next change (the stream passed the point where it
        left: a detached partition a publication of the user's still publishes, as
        ``FOR ALL TABLES`` does, is no longer that table's)."""
        if root is None:
            self._roots.pop(oid, None)
        else:
            self._roots[oid] = root

    def relation_name(self, oid: int) -> str:
        """``schema.table`` of relation ``oid``."""
        return str(
            self._one(
                "SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n"
                " ON n.oid = c.relnamespace WHERE c.oid = %s",
                (oid,),
            )
        )

    def current_oids(self, names: Sequence[str]) -> dict[str, int | None]:
        """The id each table name has now (None: no such table): one query for all."""
        rows = self._all(
            "SELECT name, to_regclass(name)::oid FROM unnest(%s::text[]) AS name", (list(names),)
        )
        return {name: (int(oid) if oid is not None else None) for name, oid in rows}

    def catalog_now(self, known: dict[str, int]) -> dict[str, CatalogEntry]:
        """For each captured table (name -> id), what the catalog says of it now
        (:class:`CatalogEntry`): one query for all that takes no lock (catalogs only: a
        good guest never queues behind, or in front of, a DDL)."""
        rows = self._all(
            "SELECT k.name, to_regclass(k.name)::oid, cur.name,"
            " CASE WHEN cur.relkind = 'p' THEN coalesce(parts.leaves, '[]') END,"
            " cols.columns, parts.attached,"
            " CASE WHEN cur.relkind = 'r' THEN json_build_object(k.oid::text, cur.relfilenode)"
            "  ELSE parts.storage END"
            " FROM unnest(%s::text[], %s::oid[]) AS k(name, oid)"
            " LEFT JOIN LATERAL (SELECT n.nspname || '.' || c.relname AS name, c.relkind,"
            "  c.relfilenode FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            "  WHERE c.oid = k.oid) cur ON true"
            " LEFT JOIN LATERAL (WITH RECURSIVE tree(relid, chain) AS ("
            "   SELECT inhrelid, xmin::text FROM pg_inherits WHERE inhparent = k.oid"
            "   UNION ALL SELECT i.inhrelid, tree.chain || '.' || i.xmin::text"
            "   FROM pg_inherits i JOIN tree ON i.inhparent = tree.relid)"
            "  SELECT json_agg(tree.relid::text ORDER BY tree.relid) AS leaves,"
            "  json_object_agg(tree.relid::text, tree.chain) AS attached,"
            "  json_object_agg(tree.relid::text, c.relfilenode) AS storage"
            "  FROM tree JOIN pg_class c ON c.oid = tree.relid WHERE c.relkind <> 'p'"
            " ) parts ON cur.relkind = 'p'"
            " LEFT JOIN LATERAL (SELECT json_object_agg(a.attnum::text, json_build_array("
            "  a.attname, format_type(a.atttypid, a.atttypmod), a.xmin::text)) AS columns"
            "  FROM pg_attribute a WHERE a.attrelid = k.oid AND a.attnum > 0"
            "  AND NOT a.attisdropped) cols ON true",
            (list(known), list(known.values())),
        )
        return {
            name: CatalogEntry(
                int(oid) if oid is not None else None,
                current,
                list(leaves) if leaves is not None else None,
                dict(columns or {}),
                dict(attached or {}),
                {leaf: int(node) for leaf, node in (storage or {}).items()},
            )
            for name, oid, current, leaves, columns, attached, storage in rows
        }

    def partition_constraints(self, leaves: Sequence[str]) -> dict[str, str] | None:
        """Each leaf partition's constraint (``pg_get_partition_constraintdef``: it opens
        the partition, then its parent: the reverse of a DDL's order, so it waits at most
        :data:`LOCK_WAIT` for them; None when it could not, to be asked again later)."""
        try:
            with self.connection.transaction():
                self.connection.execute(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'")
                rows = self._all(
                    "SELECT leaf, coalesce(pg_get_partition_constraintdef(leaf::oid), 'true')"
                    " FROM unnest(%s::text[]) AS leaf",
                    (list(leaves),),
                )
        except psycopg.errors.LockNotAvailable:
            return None
        return dict(rows)

    def rows_of_partition(
        self,
        table: Table,
        rows: pa.Table,
        constraint: str,
        columns: dict[str, list[str]] | None = None,
        *,
        keep_held: bool = False,
    ) -> list[str]:
        """The keys of ``rows`` (newest events of ``table``'s collection: ``key`` and
        ``data``) whose row the partition constraint ``constraint``
        (``pg_get_partition_constraintdef``) selects and, unless ``keep_held``, whose key
        the table does not hold now (a partition gone: a key held again since, in another
        partition, stays; a TRUNCATE judged where it was done keeps them). The server
        evaluates the constraint, so range, list, hash and multi-level partitions all read
        as PostgreSQL reads them. A table keyed by its
        primary key is judged by the key alone (PostgreSQL makes every partition column
        part of it), any other by its row image. ``columns``: the table's columns as they
        were when the constraint was taken (``attnum`` -> [name, type, ...]), which it
        names: a column renamed since is read under the name the constraint gives it
        (else the table's columns now)."""
        constraint = self._evaluable(constraint)
        by_key = table.key == self.primary_key(table.oid)
        images = rows.column("key" if by_key else "data").cast(pa.string())
        keys = rows.column("key")
        relation = self.relation_sql(table.oid)
        record: sql.Composable = sql.SQL("jsonb_populate_record(NULL::{}, x.replog_row)").format(
            relation
        )
        named = list(table.key)
        if columns:
            then = {int(attnum): column[0] for attnum, column in columns.items()}
            now = {
                name: int(attnum)
                for name, attnum in self._all(
                    "SELECT attname, attnum FROM pg_attribute WHERE attrelid = %s"
                    " AND attname = ANY(%s) AND NOT attisdropped",
                    (table.oid, list(table.key)),
                )
            }
            named = [then.get(now.get(name, 0), name) for name in table.key]
            record = sql.SQL("jsonb_to_record(x.replog_row) AS r({})").format(
                sql.SQL(", ").join(
                    sql.SQL("{} {}").format(sql.Identifier(column[0]), sql.SQL(column[1]))
                    for _, column in sorted(columns.items(), key=lambda item: int(item[0]))
                )
            )
        else:
            record = sql.SQL("{} AS r").format(record)
        query = sql.SQL(
            "SELECT x.replog_key FROM jsonb_to_recordset(%s::jsonb)"
            " AS x(replog_key text, replog_row jsonb) CROSS JOIN LATERAL {} WHERE ({})"
        ).format(record, sql.SQL(constraint.replace("%", "%%")))
        if not keep_held:
            query = sql.SQL("{} AND NOT EXISTS (SELECT FROM {} AS held WHERE ({}) = ({}))").format(
                query,
                relation,
                sql.SQL(", ").join(sql.Identifier("held", k) for k in table.key),
                sql.SQL(", ").join(sql.Identifier("r", k) for k in named),
            )
        found: list[str] = []
        for start in range(0, len(keys), PARTITION_ROWS_PER_QUERY):  # a piece in memory
            members = [
                '{"replog_key":' + json.dumps(key) + ',"replog_row":' + image + "}"
                for key, image in zip(
                    keys.slice(start, PARTITION_ROWS_PER_QUERY).to_pylist(),
                    images.slice(start, PARTITION_ROWS_PER_QUERY).to_pylist(),
                    strict=True,
                )
            ]
            found.extend(row[0] for row in self._all(query, ("[" + ",".join(members) + "]",)))
        return found

    def _evaluable(self, constraint: str) -> str:
        """``constraint`` with each hash bound whose partitioned table is gone taken as
        true. A hash partition's constraint names its parent by id
        (``satisfies_hash_partition('16391'::oid, 2, 0, id)``: the parent's key says how to
        hash), which no longer answers once that parent was dropped (a sub-partitioned
        partition dropped whole). Every leaf went with it, so together they held the rows
        the bounds around the call select: taken as true, the call leaves those."""
        calls = list(_hash_calls(constraint))
        if not calls:
            return constraint
        present = {
            int(oid)
            for (oid,) in self._all(
                "SELECT oid FROM pg_class WHERE oid = ANY(%s::oid[])", ([o for o, _, _ in calls],)
            )
        }
        for oid, start, end in reversed(calls):
            if oid not in present:
                constraint = constraint[:start] + "true" + constraint[end:]
        return constraint

    def describe(self, name: str) -> Table:
        """Table ``name`` as the catalog describes it now, its identity checked."""
        qualified = qualified_name(name)
        schema, _, table = qualified.partition(".")
        row = self.connection.execute(
            "SELECT c.oid, c.relkind FROM pg_class c JOIN pg_namespace n"
            " ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s"
            " AND c.relkind IN ('r', 'p')",
            (schema, table),
        ).fetchone()
        if row is None and qualified in self.known:  # renamed since: captured by its id
            row = self.connection.execute(
                "SELECT oid, relkind FROM pg_class WHERE oid = %s AND relkind IN ('r', 'p')",
                (self.known[qualified],),
            ).fetchone()
        if row is None:
            raise SourceConfigError(
                f"table {qualified!r} does not exist in database {self.database!r}"
            )
        oid = int(row[0])
        columns = self.columns_of(oid)
        primary = self.primary_key(oid)
        key = tuple(self.options.keys.get(qualified, ())) or primary
        if not key:
            raise SourceConfigError(
                f"table {qualified!r} has no primary key: give its key columns "
                f"(--keys {qualified}=col[,col...]) and set REPLICA IDENTITY FULL on it"
            )
        names = {column for column, _, _ in columns}
        missing = [column for column in key if column not in names]
        if missing:
            raise SourceConfigError(f"table {qualified!r} has no column(s) {missing}")
        if key != primary:
            self._check_not_null(oid, qualified, key)
        deferrable = bool(
            self._one(
                "SELECT count(*) FROM pg_index WHERE indrelid = %s AND indisprimary"
                " AND NOT indimmediate",
                (oid,),
            )
        )
        leaves = [(oid, qualified)]
        if row[1] == "p":
            leaves = [
                (int(r[0]), r[1])
                for r in self._all(
                    "SELECT t.relid::oid, n.nspname || '.' || c.relname"
                    " FROM pg_partition_tree(%s) t JOIN pg_class c ON c.oid = t.relid"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE t.isleaf",
                    (oid,),
                )
            ]
        for leaf, leaf_name in leaves:
            self._check_identity(leaf, leaf_name, qualified, key)
        return Table(
            schema,
            table,
            columns,
            key,
            oid,
            key_deferrable=deferrable and set(key) == set(primary),
            key_indexed=self._key_indexed(oid, key),
            defaults=self._defaults(oid),
        )

    def _check_not_null(self, oid: int, qualified: str, key: tuple[str, ...]) -> None:
        """Refuse key columns given with ``--keys`` that allow NULL: a unique index holds
        any number of rows whose key has a NULL (``(1, NULL)`` twice), and one event key
        for two rows makes one of them disappear downstream. A unique index ``NULLS NOT
        DISTINCT`` on exactly those columns (PostgreSQL 15) keeps such keys unique."""
        nullable = [
            name
            for (name,) in self._all(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attname = ANY(%s)"
                " AND NOT attnotnull ORDER BY attnum",
                (oid, list(key)),
            )
        ]
        if not nullable or (self.server_version >= 150000 and self._one(
            "SELECT count(*) FROM pg_index i WHERE i.indrelid = %s AND i.indisunique"
            " AND i.indnullsnotdistinct AND i.indpred IS NULL AND i.indexprs IS NULL"
            " AND (SELECT array_agg(attname ORDER BY attname) FROM pg_attribute"
            "  WHERE attrelid = i.indrelid AND attnum = ANY(i.indkey))"
            " = (SELECT array_agg(k ORDER BY k) FROM unnest(%s::name[]) k)",
            (oid, list(key)),
        )):  # fmt: skip
            return
        column = nullable[0]
        raise SourceConfigError(
            f"--keys {qualified}={','.join(key)}: column {column} allows NULL, so two rows "
            f"could share one key (a unique index holds (1, NULL) twice) and one of them would "
            f"disappear from every table built from the log. Make it NOT NULL (ALTER TABLE "
            f"{qualified} ALTER COLUMN {column} SET NOT NULL), make the key's unique index "
            f"NULLS NOT DISTINCT, or key the table by columns that are NOT NULL"
        )

    def columns_of(self, oid: int) -> Columns:
        """The columns the stream carries: a user's publication says which (its column
        list; PostgreSQL 18 lists STORED generated columns only with
        ``publish_generated_columns = stored``); capture's own publication carries every
        column but VIRTUAL generated ones (and STORED ones before PostgreSQL 18). The
        snapshot reads the same columns, so a row has one shape on both paths."""
        rows = self._all(
            "SELECT attname, atttypid, atttypmod, attgenerated FROM pg_attribute"
            " WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (oid,),
        )
        published = self._published_columns(oid)
        kept = []
        for name, type_oid, modifier, generated in rows:
            if published is not None:
                carried = name in published
            else:
                carried = generated == "" or (generated == "s" and self.server_version >= 180000)
            if carried:
                kept.append((name, int(type_oid), int(modifier)))
            elif generated:
                logger.warning(
                    "generated column %s of table %s is not published (%s): capture leaves "
                    "it out of the snapshot and the schema too",
                    name,
                    oid,
                    "VIRTUAL columns never are"
                    if generated == "v"
                    else "publish_generated_columns = stored would publish it",
                )
        return tuple(kept)

    def _published_columns(self, oid: int) -> set[str] | None:
        """The columns the user's publication publishes of the table (None: capture's
        own publication, or a server before PostgreSQL 15, which has no column lists)."""
        if self.options.publication is None or self.server_version < 150000:
            return None
        row = self.connection.execute(
            "SELECT attnames FROM pg_publication_tables pt"
            " JOIN pg_namespace pn ON pn.nspname = pt.schemaname"
            " JOIN pg_class p ON p.relname = pt.tablename AND p.relnamespace = pn.oid"
            " WHERE pt.pubname = %s AND coalesce(pg_partition_root(p.oid), p.oid) = %s LIMIT 1",
            (self.options.publication, oid),
        ).fetchone()
        return None if row is None or row[0] is None else set(row[0])

    def _identity_columns(self, oid: int, where: str, name: str) -> tuple[str, str]:
        """(what the identity is, its columns as a comma list; empty for FULL) of table
        ``oid`` (called ``name``, described as ``where``), or the refusal of one that has
        none."""
        fail = "once published, every UPDATE and DELETE on it would fail on the source"
        fix = f"ALTER TABLE {name} REPLICA IDENTITY FULL"
        identity = self._one("SELECT relreplident FROM pg_class WHERE oid = %s", (oid,))
        if identity == "f":
            return "REPLICA IDENTITY FULL", ""
        if identity == "n":
            raise SourceConfigError(
                f"{where} has REPLICA IDENTITY NOTHING: {fail}. Give it an identity first: "
                f"{fix} (or DEFAULT, with a primary key)"
            )
        indexed = self.connection.execute(
            "SELECT i.indexrelid::regclass::text, i.indimmediate,"
            " array_agg(a.attname ORDER BY a.attnum) FROM pg_index i JOIN pg_attribute a"
            " ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
            " WHERE i.indrelid = %s AND (i.indisprimary AND %s OR i.indisreplident AND NOT %s)"
            " GROUP BY 1, 2",
            (oid, identity == "d", identity == "d"),
        ).fetchone()
        if indexed is None and identity == "d":
            raise SourceConfigError(
                f"{where} has no primary key, so its deletes would carry no key and {fail}: {fix}"
            )
        if indexed is None:
            raise SourceConfigError(
                f"{where} has REPLICA IDENTITY USING INDEX, but the index is gone: {fail}. {fix}"
            )
        index, immediate, columns = indexed
        if identity == "d" and not immediate:
            raise SourceConfigError(
                f"the primary key of {where} is DEFERRABLE, so it cannot be the replica "
                f"identity: {fail}. {fix} (or USING INDEX a unique index that is not "
                f"deferrable) before capturing it"
            )
        what = "its primary key" if identity == "d" else f"REPLICA IDENTITY USING INDEX {index}"
        return what, ", ".join(columns)

    def _check_identity(self, oid: int, name: str, table: str, key: tuple[str, ...]) -> None:
        """Refuse a table (or partition) whose UPDATEs and DELETEs would fail once
        published, or whose deletes would not carry the key capture keys it by."""
        where = f"table {table!r}" if name == table else f"{name!r} (a partition of {table!r})"
        what, listed = self._identity_columns(oid, where, name)
        columns = listed.split(", ") if listed else []
        if columns and not set(key) <= set(columns):
            raise SourceConfigError(
                f"{where} has {what} ({listed}): its deletes carry only those columns, not "
                f"its key ({', '.join(key)}). Capture it keyed by them "
                f"(--keys {table}={listed.replace(', ', ',')}), or ALTER TABLE {name} REPLICA "
                f"IDENTITY FULL"
            )

    def _key_indexed(self, oid: int, key: tuple[str, ...]) -> bool:
        """Whether ``key`` is the primary key or a unique index's columns, all NOT NULL:
        then the snapshot can page through the table in key order."""
        rows = self._all(
            "SELECT array_agg(a.attname), bool_and(a.attnotnull) FROM pg_index i"
            " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
            " WHERE i.indrelid = %s AND i.indisunique AND i.indpred IS NULL"
            " AND i.indexprs IS NULL GROUP BY i.indexrelid",
            (oid,),
        )
        return any(set(columns) == set(key) and not_null for columns, not_null in rows)

    def _defaults(self, oid: int) -> tuple[tuple[str, str], ...]:
        """The value rows written before each added column hold (its text output). A
        partitioned table holds no rows: its partitions keep the value, each its own copy
        (those created after the column have none)."""
        holders = (
            "(attrelid = %s OR attrelid IN (SELECT relid FROM pg_partition_tree(%s) WHERE isleaf))"
            " AND atthasmissing AND NOT attisdropped"
        )
        values: dict[str, set[str]] = {}
        for name, type_name in self._all(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute r"
            " WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND EXISTS"
            " (SELECT FROM pg_attribute WHERE attname = r.attname AND " + holders + ")"
            " ORDER BY attnum",
            (oid, oid, oid),
        ):
            # attmissingval is an array of the column's type (anyarray): read back as one
            # value of the type, written by its output function; one query a column, for
            # every partition at once.
            rows = text_rows(
                self.connection,
                sql.SQL(
                    "SELECT DISTINCT (attmissingval::text::{}[])[1] FROM pg_attribute"
                    " WHERE attname = %s AND " + holders
                ).format(sql.SQL(type_name)),
                (name, oid, oid),
            )
            values[name] = {value for (value,) in rows if value is not None}
        found = []
        for name, held in values.items():
            if len(held) == 1:
                found.append((name, held.pop()))
            elif held:  # partitions whose columns came from different ALTERs
                logger.warning(
                    "capture: column %r of table %d holds different values in rows written "
                    "before it, partition by partition (%s): no default is recorded for it",
                    name,
                    oid,
                    sorted(held),
                )
        return tuple(found)

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

    def key_bound(self, table: Table) -> sql.Composed:
        """Parameters for ``table``'s key columns' text, in key order, each cast to its
        column's SQL type as ``table`` describes it (``%s::int, %s::text``): a key compared
        in SQL. A key column retyped is cast to its new type once the table is described
        anew."""
        types = {name: (type_oid, modifier) for name, type_oid, modifier in table.columns}
        if not all(name in types for name in table.key):  # a key column not published
            types.update(
                (name, (int(type_oid), int(modifier)))
                for name, type_oid, modifier in self._all(
                    "SELECT attname, atttypid, atttypmod FROM pg_attribute"
                    " WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
                    (table.oid,),
                )
            )
        wanted = tuple(types[name] for name in table.key)
        found = self._key_bounds.get(wanted)
        if found is None:
            names = self._all(
                "SELECT format_type(t, m) FROM unnest(%s::oid[], %s::int[]) WITH ORDINALITY"
                " AS u(t, m, n) ORDER BY n",
                ([t for t, _ in wanted], [m for _, m in wanted]),
            )
            found = sql.SQL(", ").join(sql.SQL("%s::{}").format(sql.SQL(n)) for (n,) in names)
            self._key_bounds[wanted] = found
        return found

    def current_values(
        self, table: Table, key: Sequence[str | None], columns: Sequence[str]
    ) -> dict[str, str | None] | None:
        """``columns`` of the row whose key columns' text is ``key``, as the table holds it
        now (each value its output text); None if no row has that key. The change that
        asks may be older than DDL on the table: the table is named by its id (renamed
        since: still found), only the columns it still has are read (a column renamed or
        dropped since is left out: its value is not the row's any more under that name),
        and the key is compared as its columns are typed now; a table, or a key column,
        gone since holds no row."""
        relation = relation_of(self.connection, table.oid)
        now = self.columns_of(table.oid)
        present = {name for name, _, _ in now}
        if relation is None or not set(table.key) <= present:
            return None
        wanted = [name for name in columns if name in present]
        query = sql.SQL("SELECT {} FROM {} WHERE ({}) = ({})").format(
            sql.SQL(", ").join([sql.SQL("true"), *(sql.Identifier(name) for name in wanted)]),
            relation,
            sql.SQL(", ").join(sql.Identifier(name) for name in table.key),
            self.key_bound(replace(table, columns=now)),
        )
        try:
            rows = text_rows(self.connection, query, list(key))
        except psycopg.errors.DataException:  # the key's text is no value of its type now
            return None
        return dict(zip(wanted, rows[0][1:], strict=True)) if rows else None

    def estimated_rows(self, table: Table, relation: int = 0) -> int:
        """The planner's estimate of the rows of ``table`` (or of its partition
        ``relation``): ``pg_class.reltuples`` of each leaf of a partitioned table, or of the
        table itself; 0 when never analysed."""
        oid = relation or table.oid
        value = self._one(
            "SELECT coalesce((SELECT sum(greatest(c.reltuples, 0)) FROM pg_class c"
            " JOIN pg_partition_tree(%s) t ON t.relid = c.oid WHERE t.isleaf),"
            " (SELECT greatest(reltuples, 0) FROM pg_class WHERE oid = %s), 0)::bigint",
            (oid, oid),
        )
        return int(value or 0)

    def _check_owner(self, log: LogHolds | None) -> bool:
        """Never drop or advance a slot another log owns: the log that created it (named
        in capture's own publication, or by its plan's ``slot_lsn``: the slot is where
        that log's capture created it), or, without that record, one this log holds no
        capture of. ``--reset-slot`` takes an unowned or foreign slot over, explicitly.
        Whether the slot is this log's."""
        slot = self.slot()
        if slot is None:
            return False
        owner = self.slot_owner()
        name, logged = self.options.slot, log.position if log is not None else None
        if owner is not None:
            ours = log is not None and owner.get("log_id") == log.log_id
        else:
            ours = log is not None and bool(log.slot_lsn) and slot[2] == log.slot_lsn
        if ours or self.options.reset_slot:
            return ours  # or taken over explicitly
        if logged is None and owner is None and self.options.snapshot == "never":
            return False  # a slot of the user's, adopted without a snapshot (as documented)
        if logged is not None and owner is None:
            return False  # a --publication capture's: the log's position is the only record
        whose = (
            f"log {owner.get('log', '?')} (id {owner['log_id']})"
            if owner is not None
            else "another log, or none (no capture's publication names its owner)"
        )
        here = (
            f"this log holds capture position {lsn_to_text(logged)} of it, but"
            if logged is not None
            else "this log holds no capture of it:"
        )
        raise SlotOwnershipError(
            f"slot {name!r} exists and {here} it belongs to {whose}. Capture into that "
            f"log's URL to resume it; use another slot (--slot) for this log; or give "
            f"--reset-slot to drop {name!r} and start over here with a new slot and a "
            f"snapshot (the log that follows {name!r} can then never resume)"
        )

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

    def slot_health(self) -> SlotHealth | None:
        """How much WAL the slot keeps and whether the server still keeps it (None: no
        such slot)."""
        row = self.connection.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, wal_status,"
            " safe_wal_size, current_setting('max_slot_wal_keep_size'),"
            " pg_size_bytes(current_setting('max_slot_wal_keep_size'))"
            + (", invalidation_reason" if self.server_version >= 170000 else ", NULL")
            + " FROM pg_replication_slots WHERE slot_name = %s",
            (self.options.slot,),
        ).fetchone()
        if row is None:
            return None
        retained, status, safe, limit_text, limit_bytes, reason = row
        return SlotHealth(
            retained_bytes=int(retained or 0),
            wal_status=status,
            safe_bytes=None if safe is None else int(safe),
            limit=limit_text,
            limit_bytes=None if limit_bytes is None or int(limit_bytes) < 0 else int(limit_bytes),
            invalidation=reason,
        )

    def slot(self) -> SlotInfo | None:
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

    @property
    def own_publication(self) -> bool:
        """Capture made the publication (named after the slot) and keeps it in step."""
        return self.options.publication is None

    def _own_members(self) -> set[int]:
        return {
            int(row[0])
            for row in self._all(
                "SELECT r.prrelid FROM pg_publication_rel r JOIN pg_publication p"
                " ON p.oid = r.prpubid WHERE p.pubname = %s",
                (self.publication,),
            )
        }

    def ensure_publication(self, owner: dict[str, str]) -> list[Table]:
        """Create the slot's own publication for the tables, or add those missing from it
        (each table was checked when it was described), and name ``owner`` (the log that
        owns the slot: ``log_id``, ``log``) in its comment; the tables it added to an
        existing publication (their rows so far were never streamed).

        It publishes partitions as themselves (``publish_via_partition_root = false``):
        only then does a ``TRUNCATE`` of one partition reach the stream (PostgreSQL sends
        none through the root); the stream maps each partition to its root."""
        if not self.own_publication:
            return []
        name = sql.Identifier(self.publication)
        options = sql.SQL("publish_via_partition_root = false")
        if self.server_version >= 180000:
            options = sql.SQL(
                "publish_via_partition_root = false, publish_generated_columns = stored"
            )
        exists = self._one(
            "SELECT count(*) FROM pg_publication WHERE pubname = %s", (self.publication,)
        )
        added = []
        if not exists:
            tables = [self.relation_sql(t.oid) for t in self.tables.values()]
            self.connection.execute(
                sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH ({})").format(
                    name, sql.SQL(", ").join(tables), options
                )
            )
            logger.info("created publication %s", self.publication)
        else:
            # A publication made by an earlier replog has other options: set these (changes
            # still unread were decoded with the old ones: the stream maps either form).
            self.connection.execute(sql.SQL("ALTER PUBLICATION {} SET ({})").format(name, options))
            members = self._own_members()
            for table in self.tables.values():
                if table.oid not in members:
                    self.add_to_publication(table)
                    added.append(table)
        self.connection.execute(
            sql.SQL("COMMENT ON PUBLICATION {} IS {}").format(
                name, sql.Literal(json.dumps({"replog": {"slot": self.options.slot, **owner}}))
            )
        )
        return added

    def own_publication_state(self) -> str | None:
        """Capture's own publication as it is now: None (it does not exist), ``root`` (it
        publishes through partition roots, as replog before 0.6 made it) or
        ``partitions``; ``user`` with ``--publication``."""
        if not self.own_publication:
            return "user"
        row = self.connection.execute(
            "SELECT pubviaroot FROM pg_publication WHERE pubname = %s", (self.publication,)
        ).fetchone()
        return None if row is None else "root" if row[0] else "partitions"

    def unpublished(self, oids: Sequence[int]) -> list[int] | None:
        """Those of tables ``oids`` capture's own publication does not publish now (None:
        the publication is gone; [] with ``--publication``)."""
        if not self.own_publication:
            return []
        row = self.connection.execute(
            "SELECT array(SELECT prrelid::bigint FROM pg_publication_rel WHERE prpubid = p.oid)"
            " FROM pg_publication p WHERE pubname = %s",
            (self.publication,),
        ).fetchone()
        if row is None:
            return None
        members = set(row[0])
        return [oid for oid in oids if oid not in members]

    def is_partitioned(self, oid: int) -> bool:
        return bool(self._one("SELECT relkind = 'p' FROM pg_class WHERE oid = %s", (oid,)))

    def slot_owner(self) -> dict[str, str] | None:
        """The log that owns the slot, as capture's own publication names it (None: no
        such publication, or one no replog commented)."""
        return parse_owner(
            self._one(
                "SELECT obj_description(oid, 'pg_publication') FROM pg_publication"
                " WHERE pubname = %s",
                (self.options.slot,),
            )
        )

    def add_to_publication(self, table: Table) -> None:
        """Publish ``table`` in capture's own publication (its identity was checked)."""
        if table.oid in self._own_members():
            return
        self.connection.execute(
            sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                sql.Identifier(self.publication), self.relation_sql(table.oid)
            )
        )
        logger.info("added %s to publication %s", table.qualified, self.publication)

    def remove_from_publication(self, oid: int) -> bool:
        """Stop publishing relation ``oid`` in capture's own publication; whether it was
        published there (and still exists)."""
        if not self.own_publication or oid not in self._own_members():
            return False
        self.connection.execute(
            sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(
                sql.Identifier(self.publication), self.relation_sql(oid)
            )
        )
        logger.info("removed relation %d from publication %s", oid, self.publication)
        return True

    def drop_own_publication(self) -> str | None:
        """Drop capture's own publication (with the slot, at ``--drop-slot``); its name,
        or None (a ``--publication`` given is the user's, never dropped)."""
        if not self.own_publication:
            return None
        self.connection.execute(
            sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(self.publication))
        )
        logger.info("dropped publication %s", self.publication)
        return self.publication

    def create_slot(self) -> int:
        """Create the slot; its consistent point."""
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
        return list(self.peek_stream(max_changes))

    def peek_stream(self, max_changes: int, fetch: int = 2_000) -> Iterator[tuple[int, bytes]]:
        """The slot's next messages (whole transactions, messages included), consuming
        nothing, fetched ``fetch`` at a time: a transaction of millions of changes is
        never held whole in this process."""
        with self.connection.transaction(), self.connection.cursor(name="replog_peek") as cursor:
            cursor.itersize = fetch
            cursor.execute(
                "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes("
                "%s, NULL, %s, 'proto_version', '1', 'publication_names', %s,"
                " 'messages', 'true')",
                (self.options.slot, max_changes, quoted_list(self.publication)),
            )
            for lsn, data in cursor:
                yield lsn_to_int(lsn), bytes(data)

    def emit_message(self, prefix: str, content: str) -> int:
        """Write a transactional logical message into the WAL (its own transaction); the
        message's position. The stream meets it in commit order with every other
        transaction: the snapshot's watermarks."""
        return lsn_to_int(
            self._one("SELECT pg_logical_emit_message(true, %s, %s)::text", (prefix, content))
        )

    def reader(self) -> psycopg.Connection[Any]:
        """A second session, for reading table rows (the snapshot's chunks)."""
        return connect(self.options.dsn)


_HASH_CALL = "satisfies_hash_partition('"


def _hash_calls(constraint: str) -> Iterator[tuple[int, int, int]]:
    """(parent id, start, end) of each ``satisfies_hash_partition('<id>'::oid, ...)`` call
    in a partition constraint (its parentheses matched, quoted text skipped)."""
    start = constraint.find(_HASH_CALL)
    while start >= 0:
        oid_start = start + len(_HASH_CALL)
        oid = int(constraint[oid_start : constraint.index("'", oid_start)])
        depth, index, quoted = 0, start + len(_HASH_CALL) - 2, False
        while True:
            char = constraint[index]
            if char == "'":
                quoted = not quoted  # a doubled quote leaves and enters again: the same
            elif not quoted and char == "(":
                depth += 1
            elif not quoted and char == ")":
                depth -= 1
                if depth == 0:
                    break
            index += 1
        yield oid, start, index + 1
        start = constraint.find(_HASH_CALL, index + 1)


def relation_of(connection: psycopg.Connection[Any], oid: int) -> sql.Composable | None:
    """Relation ``oid`` as a query names it (None: it no longer exists): ``ONLY`` a plain
    table (inheritance children are published as themselves), a partitioned table with
    its partitions; by its name now, so a table renamed is still found."""
    row = connection.execute(
        "SELECT c.relkind, quote_ident(n.nspname) || '.' || quote_ident(c.relname)"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s",
        (oid,),
    ).fetchone()
    if row is None:
        return None
    only = sql.SQL("ONLY ") if row[0] == "r" else sql.SQL("")
    return sql.SQL("{}{}").format(only, sql.SQL(row[1]))


def publication_tables(connection: psycopg.Connection[Any], publication: str) -> list[str] | None:
    """The tables publication ``publication`` publishes, a partitioned table once (not each
    of its partitions, which a publication without ``publish_via_partition_root`` lists);
    None if there is no such publication."""
    if not connection.execute(
        "SELECT count(*) FROM pg_publication WHERE pubname = %s", (publication,)
    ).fetchone()[0]:  # type: ignore[index]
        return None
    rows = connection.execute(
        "SELECT DISTINCT n.nspname || '.' || c.relname FROM pg_publication_tables pt"
        " JOIN pg_namespace pn ON pn.nspname = pt.schemaname"
        " JOIN pg_class p ON p.relname = pt.tablename AND p.relnamespace = pn.oid"
        " JOIN pg_class c ON c.oid = coalesce(pg_partition_root(p.oid), p.oid)"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE pt.pubname = %s ORDER BY 1",
        (publication,),
    ).fetchall()
    return [row[0] for row in rows]


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
