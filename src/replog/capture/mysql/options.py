"""What a MySQL capture is asked to do, checked before any connection is made."""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from replog.capture.options import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_MAX_CHANGES,
    DEFAULT_POLL_S,
    DEFAULT_STAGE_EVENTS,
    SNAPSHOT_MODES,
)
from replog.errors import InvalidOptionError

CAPTURE_APP_PREFIX = "mysql-capture."
"""The log records a MySQL capture's position as idempotent transaction
``mysql-capture.<name>``."""
DEFAULT_NAME = "mysql"
POSITION_MODES = ("auto", "gtid", "file")
SIGNAL_DATABASE = "replog"
"""The database of capture's own tables in the source: ``watermarks`` (a row per capture,
updated at each side of a snapshot chunk) and ``signals`` (snapshot requests)."""
_NAME = re.compile(r"[a-z0-9_]{1,63}")
_TABLE = re.compile(r"^[^.\s`]+\.[^.\s`]+$")


def capture_app_id(name: str) -> str:
    """The transaction app id under which the log records the capture's position."""
    return CAPTURE_APP_PREFIX + name


def capture_name(app_id: str) -> str | None:
    """The MySQL capture whose position ``app_id`` records, or None."""
    name = app_id.removeprefix(CAPTURE_APP_PREFIX)
    return name if name != app_id and _NAME.fullmatch(name) else None


@dataclass(frozen=True)
class Dsn:
    """``mysql://user:password@host:port/database`` (also ``mariadb://``; a
    ``?unix_socket=/path`` instead of a host)."""

    host: str
    port: int
    user: str
    password: str
    database: str
    unix_socket: str | None = None

    @classmethod
    def parse(cls, text: str) -> Dsn:
        parts = urlsplit(text)
        if parts.scheme not in ("mysql", "mariadb"):
            raise InvalidOptionError(
                f"DSN {_redacted(text)!r} is not a MySQL URL: mysql://user:password@host:port/"
                f"database"
            )
        query = parse_qs(parts.query)
        try:
            port = parts.port or 3306
        except ValueError as exc:
            raise InvalidOptionError(f"DSN {_redacted(text)!r}: {exc}") from exc
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=port,
            user=unquote(parts.username or "root"),
            password=unquote(parts.password or ""),
            database=unquote(parts.path.lstrip("/")),
            unix_socket=next(iter(query.get("unix_socket", [])), None),
        )

    def connect_args(self) -> dict[str, object]:
        args: dict[str, object] = {"user": self.user, "password": self.password}
        if self.unix_socket:
            args["unix_socket"] = self.unix_socket
        else:
            args.update(host=self.host, port=self.port)
        return args

    def redacted(self) -> str:
        return f"mysql://{self.user}@{self.host}:{self.port}/{self.database}"


def _redacted(text: str) -> str:
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", text)


@dataclass(frozen=True)
class MySqlOptions:
    """What to capture, and how (``replog capture mysql``)."""

    dsn: str
    tables: tuple[str, ...] = ()
    """``database.table`` names (a bare name is in the DSN's database); default: those the
    log's capture of ``name`` captures."""
    name: str = DEFAULT_NAME
    """Names the capture: its position in the log (``mysql-capture.<name>``), its plan, its
    events (``source.name``) and its watermark row."""
    server_id: int | None = None
    """The replica ``server_id`` capture connects with (default: one derived from the name
    and the log; it must differ from every other replica's)."""
    snapshot: str = "initial"
    keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Key columns (unique, NOT NULL) of tables without a primary key, by ``db.table``."""
    follow: bool = False
    max_changes: int = DEFAULT_MAX_CHANGES
    poll_s: float = DEFAULT_POLL_S
    snapshot_chunk_rows: int = DEFAULT_CHUNK_ROWS
    stage_events: int = DEFAULT_STAGE_EVENTS
    position: str = "auto"
    """``gtid`` (resume by GTID state: another server of the topology can take over),
    ``file`` (binlog file and offset of one server), ``auto`` (GTIDs where the server has
    them). A log keeps the mode it started with."""
    reset_position: bool = False
    """Start over from the server's current position with a new snapshot into this log
    (the way on when the binlog after the log's position was purged)."""
    tables_changed: bool = False
    skip_truncate: bool = False

    @property
    def source(self) -> Dsn:
        return Dsn.parse(self.dsn)

    def qualified(self, table: str) -> str:
        """``db.table`` of a name given with or without its database."""
        if "." in table:
            return table
        database = self.source.database
        if not database:
            raise InvalidOptionError(
                f"table {table!r} names no database, and the DSN has none: give db.table"
            )
        return f"{database}.{table}"

    def replica_id(self, log_id: str) -> int:
        """The ``server_id`` to connect to the binlog with."""
        if self.server_id is not None:
            return self.server_id
        return 1_000_000 + zlib.crc32(f"{self.name}:{log_id}".encode()) % 1_000_000_000

    def check(self) -> None:
        self.source  # noqa: B018 - parses the DSN: a bad one is refused first
        if not _NAME.fullmatch(self.name):
            raise InvalidOptionError(
                f"capture name {self.name!r} is not valid: lower-case letters, digits and '_', "
                f"at most 63 characters"
            )
        if self.snapshot not in SNAPSHOT_MODES:
            raise InvalidOptionError(
                f"snapshot mode {self.snapshot!r} is not one of {', '.join(SNAPSHOT_MODES)}"
            )
        if self.position not in POSITION_MODES:
            raise InvalidOptionError(
                f"position mode {self.position!r} is not one of {', '.join(POSITION_MODES)}"
            )
        if self.server_id is not None and not 1 <= self.server_id < 2**32:
            raise InvalidOptionError(f"--server-id must be 1 .. 4294967295, got {self.server_id}")
        for table in self.tables:
            if not _TABLE.match(self.qualified(table)):
                raise InvalidOptionError(f"--tables: {table!r} is not db.table")
        for name in ("max_changes", "snapshot_chunk_rows", "stage_events"):
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name} must be >= 1, got {getattr(self, name)}")
