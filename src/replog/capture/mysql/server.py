"""The MySQL or MariaDB server a capture reads: connections, checks before anything is
written, the catalog, binlog positions, and capture's own tables in it (watermark rows and
snapshot requests).

DESIGN: every check names what is missing and how to set it (a setting, a grant), and runs
before the capture writes anything, to the log or to the source. Sessions read in UTC
(``time_zone = '+00:00'``: a TIMESTAMP is an instant) and in ``utf8mb4``; the reader's
session converts nothing (values arrive as the server's text, for
:func:`~replog.capture.mysql.columns.text_fragment`).
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import pymysql
import pymysql.converters

from replog.capture.mysql.columns import MySqlColumn, catalog_column, identifier
from replog.capture.mysql.options import SIGNAL_DATABASE, Dsn, MySqlOptions
from replog.capture.mysql.positions import FILE, GTID, MARIADB, MYSQL, BinlogPosition
from replog.errors import (
    InvalidOptionError,
    SourceConfigError,
    SourceConnectionError,
    SourcePrivilegeError,
)

logger = logging.getLogger(__name__)

ACCESS_DENIED = (1044, 1045, 1142, 1143, 1227, 1370)
"""Errors of a missing privilege (database, login, table, column, global, routine)."""
_RAW = {
    key: value for key, value in pymysql.converters.conversions.items() if not isinstance(key, int)
}
"""Encoders only: a reader's session leaves every value as the server's text (or bytes)."""

WATERMARKS = f"{SIGNAL_DATABASE}.watermarks"
SIGNALS = f"{SIGNAL_DATABASE}.signals"
_OWN_TABLES = (
    f"CREATE TABLE IF NOT EXISTS {WATERMARKS} (capture VARCHAR(64) NOT NULL PRIMARY KEY, "
    "chunk CHAR(32) NOT NULL, side VARCHAR(4) NOT NULL, at TIMESTAMP(6) NOT NULL) "
    "ENGINE=InnoDB",
    f"CREATE TABLE IF NOT EXISTS {SIGNALS} (id CHAR(32) NOT NULL PRIMARY KEY, "
    "capture VARCHAR(64) NULL, tables TEXT NOT NULL, at TIMESTAMP(6) NOT NULL) ENGINE=InnoDB",
)


LOST = frozenset((2003, 2006, 2013, 2055))
"""Client errors of a session lost or a server out of reach (restarting)."""


def lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost session or an unreachable server, which a capture waits
    out (a server restart), rather than an error of what it asked."""
    if isinstance(exc, SourceConnectionError):
        return True
    return isinstance(exc, pymysql.err.OperationalError) and bool(exc.args) and exc.args[0] in LOST


@functools.cache
def _preferred_tls() -> ssl.SSLContext | None:
    """The context PyMySQL makes for TLS where the server offers it (its PREFERRED mode,
    when no TLS option is given), made once; None for a PyMySQL without that mode.
    PyMySQL makes one per connection, loading the system's certificates each time (70-90
    ms of CPU), and capture connects for each snapshot chunk and each read of the binlog."""
    probe = pymysql.connect(defer_connect=True)
    if not (probe.ssl and getattr(probe, "_ssl_required", True) is False):
        return None
    context: ssl.SSLContext = probe.ctx
    return context


def open_session(**settings: Any) -> Any:
    """``pymysql.connect(**settings)``, with one PREFERRED TLS context for all
    connections (:func:`_preferred_tls`); TLS options in ``settings`` are left as given."""
    shared = None if any(k.startswith("ssl") for k in settings) else _preferred_tls()
    if shared is None:
        return pymysql.connect(**settings)
    connection = pymysql.connect(**settings, ssl=shared, defer_connect=True)
    connection._ssl_required = False  # PREFERRED, as without the context: plain if not offered
    connection.connect()
    return connection


def connect(dsn: Dsn, *, raw: bool = False, database: str | None = None) -> Any:
    """A session (autocommit, utf8mb4, UTC); ``raw``: values as the server's text."""
    try:
        connection = open_session(
            **dsn.connect_args(),
            database=database,
            charset="utf8mb4",
            autocommit=True,
            connect_timeout=30,
            init_command="SET time_zone = '+00:00'",
            **({"conv": _RAW} if raw else {}),
        )
    except pymysql.err.OperationalError as exc:
        code = exc.args[0] if exc.args else 0
        if code == 1045:
            raise SourcePrivilegeError(
                f"{dsn.redacted()}: the server refused the login ({exc.args[1]})"
            ) from exc
        raise SourceConnectionError(f"cannot connect to {dsn.redacted()}: {exc}") from exc
    return connection


@dataclass(frozen=True)
class TableInfo:
    """A captured table as the catalog has it now."""

    database: str
    name: str
    columns: tuple[MySqlColumn, ...]
    key: tuple[str, ...]
    """Its primary key's columns, or those given with ``--keys``."""
    json_columns: frozenset[str] = frozenset()
    filled_when_added: frozenset[str] = frozenset()
    """Columns that give rows written before them a value other than NULL (a default,
    NOT NULL's implicit one, a generated column's): an ALTER TABLE that adds one changes
    rows without row events."""

    @property
    def qualified(self) -> str:
        return f"{self.database}.{self.name}"

    @property
    def sql_name(self) -> str:
        return f"{identifier(self.database)}.{identifier(self.name)}"


class MySqlServer:
    """The source server of one capture."""

    def __init__(self, options: MySqlOptions) -> None:
        self.options = options
        self.dsn = options.source
        self.connection = connect(self.dsn)
        version = str(self.scalar("SELECT VERSION()"))
        self.version = version
        self.flavor = MARIADB if "mariadb" in version.lower() else MYSQL

    def close(self) -> None:
        self.connection.close()

    # -- queries -----------------------------------------------------------------------

    def rows(self, statement: str, args: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """The rows of ``statement``; a session lost (a server restart) is opened again
        once (a statement of capture's is a read, or a watermark written again)."""
        for attempt in (1, 2):
            try:
                with self.connection.cursor() as cursor:
                    cursor.execute(statement, args)
                    return list(cursor.fetchall())
            except pymysql.err.OperationalError as exc:
                if not lost(exc) or attempt == 2:
                    raise
                self.reconnect()
        raise AssertionError("unreachable")

    def reconnect(self) -> None:
        """A new session in place of a lost one (SourceConnectionError: none can be had)."""
        with suppress(pymysql.err.Error):  # the old session is lost already
            self.connection.close()
        self.connection = connect(self.dsn)

    def scalar(self, statement: str, args: Sequence[Any] | None = None) -> Any:
        found = self.rows(statement, args)
        return found[0][0] if found else None

    def variable(self, name: str) -> str | None:
        found = self.rows("SHOW GLOBAL VARIABLES LIKE %s", (name,))
        return str(found[0][1]) if found else None

    @contextmanager
    def _privilege(self, what: str, grant: str) -> Iterator[None]:
        """Turn the server's access-denied error into one naming the grant that fixes it."""
        try:
            yield
        except pymysql.err.MySQLError as exc:
            code = exc.args[0] if exc.args else 0
            if code in ACCESS_DENIED:
                raise SourcePrivilegeError(
                    f"{self.dsn.user} may not {what} ({exc.args[1]}): {grant}"
                ) from exc
            raise

    # -- checks ---------------------------------------------------------------------------

    def check_settings(self) -> None:
        """The binlog settings capture needs, each missing one named with its fix."""
        wanted = {
            "log_bin": "ON",
            "binlog_format": "ROW",
            "binlog_row_image": "FULL",
            "binlog_row_metadata": "FULL",
        }
        problems = []
        for name, value in wanted.items():
            found = self.variable(name)
            if found is None:
                problems.append(
                    f"{name} does not exist on {self.version}: capture needs MySQL 8.0.14+ or "
                    f"MariaDB 10.5+ (binlog_row_metadata names the columns in the binlog)"
                )
            elif found.upper() != value:
                problems.append(f"{name} is {found}, must be {value}")
        compression = (
            "log_bin_compress" if self.flavor == MARIADB else "binlog_transaction_compression"
        )
        if (self.variable(compression) or "OFF").upper() == "ON":
            problems.append(f"{compression} is ON, must be OFF (compressed events cannot be read)")
        if problems:
            raise SourceConfigError(
                f"{self.dsn.redacted()} cannot be captured: {'; '.join(problems)}. Set them in "
                f"the server's configuration ([mysqld] log_bin, binlog_format=ROW, "
                f"binlog_row_image=FULL, binlog_row_metadata=FULL, server_id) and restart it "
                f"(the binlog settings but log_bin can also be SET GLOBAL)"
            )

    def check_binlog_privileges(self) -> None:
        """``REPLICATION CLIENT`` (MariaDB: ``BINLOG MONITOR``): the position and binlog
        files. (``REPLICATION SLAVE`` is proven by reading the binlog.)"""
        grant = (
            f"GRANT REPLICATION CLIENT ON *.* TO '{self.dsn.user}' (MariaDB 10.5+: BINLOG MONITOR)"
        )
        with self._privilege("read the binlog position (SHOW MASTER STATUS)", grant):
            self.master_status()
        with self._privilege("list the binlog files (SHOW BINARY LOGS)", grant):
            self.binlog_files()

    def ensure_own_tables(self) -> None:
        """Capture's own tables in the source (``replog.watermarks``, ``replog.signals``),
        created if missing (then a write of a watermark row is tried)."""
        grant = (
            f"GRANT CREATE, INSERT, UPDATE, DELETE ON {SIGNAL_DATABASE}.* TO "
            f"'{self.dsn.user}' (capture writes its snapshot watermarks there)"
        )
        with self._privilege(f"use database {SIGNAL_DATABASE}", grant):
            found = self.scalar(
                "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s",
                (SIGNAL_DATABASE,),
            )
            if found == len(_OWN_TABLES):
                return  # (a grant revoked since fails the first watermark, naming it)
            self.rows(f"CREATE DATABASE IF NOT EXISTS {SIGNAL_DATABASE}")
            for statement in _OWN_TABLES:
                self.rows(statement)
            self.rows(
                f"INSERT INTO {WATERMARKS} VALUES ('', '', 'init', NOW(6)) "
                "ON DUPLICATE KEY UPDATE at = NOW(6)"
            )
            self.rows(f"DELETE FROM {WATERMARKS} WHERE capture = ''")

    def check_select(self, table: TableInfo) -> None:
        with self._privilege(
            f"read {table.qualified}",
            f"GRANT SELECT ON {table.database}.* TO '{self.dsn.user}'",
        ):
            self.rows(f"SELECT 1 FROM {table.sql_name} LIMIT 0")

    # -- the catalog ---------------------------------------------------------------------

    def describe(self, qualified: str, keys: Sequence[str] = ()) -> TableInfo | None:
        """``db.table`` as the catalog has it now (None: no such table). ``keys``: the
        key columns given with ``--keys`` (checked: a unique index of NOT NULL columns)."""
        database, _, name = qualified.partition(".")
        found = self.rows(
            "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, NUMERIC_PRECISION, NUMERIC_SCALE, "
            "DATETIME_PRECISION, CHARACTER_OCTET_LENGTH, IS_NULLABLE, COLUMN_DEFAULT, EXTRA FROM "
            "information_schema.COLUMNS WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s "
            "ORDER BY ORDINAL_POSITION",
            (database, name),
        )
        if not found:
            return None
        json_columns = self._json_columns(database, name)
        columns = tuple(
            catalog_column(
                str(column),
                str(data_type),
                str(column_type),
                precision=precision,
                scale=scale,
                fsp=fsp,
                octets=octets,
                json_columns=json_columns,
                table=qualified,
            )
            for column, data_type, column_type, precision, scale, fsp, octets, *_ in found
        )
        nullable = {str(row[0]) for row in found if row[7] == "YES"}
        filled = frozenset(
            str(row[0])
            for row in found
            if row[7] != "YES" or row[8] not in (None, "NULL") or "GENERATED" in str(row[9]).upper()
        )
        key = tuple(keys) or self._primary_key(database, name)
        if keys:
            self._check_keys(qualified, columns, nullable, tuple(keys))
        return TableInfo(database, name, columns, key, json_columns, filled)

    def _json_columns(self, database: str, name: str) -> frozenset[str]:
        """MariaDB's ``JSON`` columns: a LONGTEXT with the check ``json_valid(`c`)``."""
        if self.flavor != MARIADB:
            return frozenset()
        clauses = self.rows(
            "SELECT CHECK_CLAUSE FROM information_schema.CHECK_CONSTRAINTS "
            "WHERE CONSTRAINT_SCHEMA = %s AND TABLE_NAME = %s",
            (database, name),
        )
        found = set()
        for (clause,) in clauses:
            text = str(clause).strip()
            if text.startswith("json_valid(`") and text.endswith("`)"):
                found.add(text[len("json_valid(`") : -2].replace("``", "`"))
        return frozenset(found)

    def _primary_key(self, database: str, name: str) -> tuple[str, ...]:
        return tuple(
            str(row[0])
            for row in self.rows(
                "SELECT COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = %s "
                "AND TABLE_NAME = %s AND INDEX_NAME = 'PRIMARY' ORDER BY SEQ_IN_INDEX",
                (database, name),
            )
        )

    def _check_keys(
        self,
        qualified: str,
        columns: tuple[MySqlColumn, ...],
        nullable: set[str],
        keys: tuple[str, ...],
    ) -> None:
        names = {column.name for column in columns}
        missing = [k for k in keys if k not in names]
        if missing:
            raise InvalidOptionError(
                f"--keys {qualified}={','.join(keys)}: {qualified} has no column "
                f"{', '.join(missing)}"
            )
        null = [k for k in keys if k in nullable]
        if null:
            raise InvalidOptionError(
                f"--keys {qualified}={','.join(keys)}: {', '.join(null)} may be NULL (a unique "
                f"index holds any number of rows with a NULL in its key, which would be one "
                f"row downstream): ALTER TABLE ... MODIFY ... NOT NULL, or other key columns"
            )
        database, _, name = qualified.partition(".")
        indexes: dict[str, list[str]] = {}
        for index, column in self.rows(
            "SELECT INDEX_NAME, COLUMN_NAME FROM information_schema.STATISTICS WHERE "
            "TABLE_SCHEMA = %s AND TABLE_NAME = %s AND NON_UNIQUE = 0 ORDER BY INDEX_NAME, "
            "SEQ_IN_INDEX",
            (database, name),
        ):
            indexes.setdefault(str(index), []).append(str(column))
        if not any(set(columns_of) <= set(keys) for columns_of in indexes.values()):
            raise InvalidOptionError(
                f"--keys {qualified}={','.join(keys)}: no unique index of {qualified} is on "
                f"these columns, so two rows could share a key: name the columns of a "
                f"unique index (CREATE UNIQUE INDEX ... ON {qualified} ({', '.join(keys)}))"
            )

    def table(self, qualified: str) -> TableInfo:
        """A table to capture, checked: it exists, it has a key, capture may read it."""
        keys = self.options.keys.get(qualified, ())
        found = self.describe(qualified, keys)
        if found is None:
            raise SourceConfigError(
                f"{self.dsn.redacted()} has no table {qualified}, or {self.dsn.user} may not "
                f"see it (the catalog shows only tables one may read: GRANT SELECT ON "
                f"{qualified.partition('.')[0]}.* TO '{self.dsn.user}')"
            )
        if not found.key:
            raise SourceConfigError(
                f"{qualified} has no primary key: capture keys each event by it. Add one "
                f"(ALTER TABLE {qualified} ADD PRIMARY KEY (...)), or name unique NOT NULL "
                f"columns with --keys {qualified}=col[,col...]"
            )
        self.check_select(found)
        return found

    # -- positions ------------------------------------------------------------------------

    def master_status(self) -> tuple[str, int, str]:
        """(binlog file, offset, MySQL's executed GTID set or '') of the server now."""
        try:
            found = self.rows("SHOW BINARY LOG STATUS")
        except pymysql.err.ProgrammingError:
            found = self.rows("SHOW MASTER STATUS")
        if not found:
            raise SourceConfigError(
                f"{self.dsn.redacted()} writes no binlog: set log_bin (and server_id) in its "
                f"configuration and restart it"
            )
        row = found[0]
        gtids = str(row[4]) if len(row) > 4 and row[4] else ""
        return str(row[0]), int(row[1]), gtids

    def has_gtids(self) -> bool:
        if self.flavor == MARIADB:
            return True  # every MariaDB transaction has a GTID
        return (self.variable("gtid_mode") or "OFF").upper() == "ON"

    def current(self, mode: str) -> BinlogPosition:
        """The server's binlog position now, in ``mode`` (``gtid`` or ``file``)."""
        file, pos, gtids = self.master_status()
        if mode == GTID and self.flavor == MARIADB:
            gtids = str(self.scalar("SELECT BINLOG_GTID_POS(%s, %s)", (file, pos)) or "")
        return BinlogPosition(
            self.flavor,
            mode,
            file,
            pos,
            gtids if mode == GTID else "",
            self.server_id(),
            self.server_uuid(),
        )

    def mode(self, asked: str) -> str:
        """The position mode for ``--position`` (``auto``: GTIDs where the server has them)."""
        if asked == GTID and not self.has_gtids():
            raise SourceConfigError(
                f"--position gtid: {self.dsn.redacted()} has no GTIDs (gtid_mode is "
                f"{self.variable('gtid_mode')})"
            )
        if asked == "auto":
            return GTID if self.has_gtids() else FILE
        return asked

    def server_id(self) -> int:
        return int(self.scalar("SELECT @@server_id"))

    def server_uuid(self) -> str:
        if self.flavor == MARIADB:
            return ""
        return str(self.scalar("SELECT @@server_uuid"))

    def binlog_files(self) -> list[tuple[str, int]]:
        """The binlog files the server still has, oldest first, with their sizes."""
        return [(str(row[0]), int(row[1])) for row in self.rows("SHOW BINARY LOGS")]

    def gtid_state_of(self, position: BinlogPosition) -> str:
        """MariaDB: the GTID state at ``position``'s file and offset on this server."""
        return str(
            self.scalar("SELECT BINLOG_GTID_POS(%s, %s)", (position.file, position.pos)) or ""
        )

    def lag_bytes(self, position: BinlogPosition) -> int:
        """Binlog bytes the server wrote past ``position`` (its files after it, whole)."""
        files = self.binlog_files()
        total, counting = 0, False
        for file, size in files:
            if file == position.file:
                counting = True
                total += max(size - position.pos, 0)
            elif counting:
                total += size
        return total

    # -- capture's own rows ---------------------------------------------------------------

    def watermark(self, capture: str, chunk: str, side: str) -> None:
        """Write a watermark: the capture's row in ``replog.watermarks``, in a transaction
        of its own (the stream meets it in commit order)."""
        grant = f"GRANT INSERT, UPDATE ON {SIGNAL_DATABASE}.* TO '{self.dsn.user}'"
        with self._privilege(f"write its snapshot watermark in {WATERMARKS}", grant):
            self.rows(
                f"INSERT INTO {WATERMARKS} VALUES (%s, %s, %s, NOW(6)) ON DUPLICATE KEY "
                "UPDATE chunk = VALUES(chunk), side = VALUES(side), at = NOW(6)",
                (capture, chunk, side),
            )
