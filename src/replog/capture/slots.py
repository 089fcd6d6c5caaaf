"""The server's logical replication slots as an operator sees them: ``replog slots``,
``replog slots drop``, and the lag ``replog status --source-dsn`` and a capture's
``--metrics-port`` report.

DESIGN: everything here is measured on the source server, with its clock: the server's
WAL position, each slot's confirmed and restart positions, and the commit time of the
oldest transaction a slot holds past its confirmed position (the lag in seconds). That
commit time is read from a temporary copy of the slot (``pg_copy_logical_replication_slot``)
peeked for its first transaction: a copy never takes the slot from the capture reading it
(a peek of the slot itself would make the capture's next read fail, "slot is active"),
works whether a capture runs or not, and is dropped with its session. Its cost is the
decoding of the WAL from the slot's restart position to that transaction, bounded by
:data:`LAG_TIMEOUT`.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from replog.capture.options import CaptureOptions
from replog.capture.pgoutput import Decoder, SourceTransaction, lsn_to_int, lsn_to_text
from replog.capture.source import (
    CAPTURE_LOCK_CLASS,
    PostgresSource,
    connect,
    parse_owner,
    safe_dsn,
)
from replog.errors import CaptureRunningError, SourceConfigError, SourceConnectionError

logger = logging.getLogger(__name__)

LAG_TIMEOUT = "10s"
"""How long the peek that finds a slot's oldest unconfirmed commit may take (decoding from
the slot's restart position; a huge first transaction is sent whole)."""

NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Holder:
    """The session that holds a capture's advisory lock on a slot: a running capture
    (between two reads of the slot it is not *active*, but it holds this lock)."""

    pid: int
    application_name: str | None
    """``replog capture <slot> pid N on HOST`` (None: not visible to this role)."""
    client: str | None
    since_ms: int | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def describe(self) -> str:
        return (
            f"{self.application_name or 'a session'} (server process {self.pid}, from "
            f"{self.client or 'an unknown client'})"
        )


@dataclass(frozen=True)
class SlotState:
    """One logical slot as the server keeps it, measured at :attr:`server_ms`."""

    name: str
    database: str
    plugin: str
    temporary: bool
    active_pid: int | None
    """The server process reading the slot now (a capture holds it only while it reads)."""
    restart_lsn: int | None
    confirmed_lsn: int | None
    server_lsn: int
    """The server's WAL position when measured."""
    server_ms: int
    """The server's clock when measured (ms since the epoch)."""
    wal_status: str | None
    safe_bytes: int | None
    """WAL the server may still write before the slot is at risk (``safe_wal_size``;
    None: no ``max_slot_wal_keep_size``)."""
    invalidation: str | None
    inactive_since_ms: int | None
    """When the slot was last released (PostgreSQL 17's ``inactive_since``; None: active
    now, or an older server)."""
    holder: Holder | None = None
    owner: dict[str, str] | None = None
    """The log that owns the slot, from capture's own publication's comment."""
    owner_note: str | None = None
    """Why the owner could not be read (None: it was looked for)."""
    publication: str | None = None
    """Capture's own publication of the slot (named after it), if it exists."""
    oldest_unconfirmed_ms: int | None = None
    """Source commit time of the oldest transaction the slot holds past its confirmed
    position that its publication publishes (None: none: caught up)."""
    lag_note: str | None = NOT_MEASURED
    """Why the lag in seconds is unknown (None: it was measured)."""

    @property
    def retained_bytes(self) -> int | None:
        """WAL the server keeps for the slot: from its restart position on."""
        return None if self.restart_lsn is None else max(self.server_lsn - self.restart_lsn, 0)

    @property
    def lag_bytes(self) -> int | None:
        """WAL the server wrote past the slot's confirmed position."""
        if self.confirmed_lsn is None:
            return None
        return max(self.server_lsn - self.confirmed_lsn, 0)

    @property
    def lag_s(self) -> float | None:
        """Time since the oldest commit the slot holds unconfirmed, on the server's clock
        (0: caught up; None: not measured, :attr:`lag_note` says why)."""
        if self.lag_note is not None:
            return None
        if self.oldest_unconfirmed_ms is None:
            return 0.0
        return max(self.server_ms - self.oldest_unconfirmed_ms, 0) / 1000

    @property
    def lost(self) -> bool:
        return self.wal_status == "lost" or self.invalidation is not None

    def to_json(self) -> dict[str, Any]:
        def lsn(value: int | None) -> str | None:
            return None if value is None else lsn_to_text(value)

        return {
            "name": self.name,
            "database": self.database,
            "plugin": self.plugin,
            "temporary": self.temporary,
            "active_pid": self.active_pid,
            "holder": None if self.holder is None else self.holder.to_json(),
            "owner": self.owner,
            "owner_note": self.owner_note,
            "publication": self.publication,
            "restart_lsn": lsn(self.restart_lsn),
            "confirmed_lsn": lsn(self.confirmed_lsn),
            "retained_wal_bytes": self.retained_bytes,
            "lag_bytes": self.lag_bytes,
            "wal_status": self.wal_status,
            "safe_wal_bytes": self.safe_bytes,
            "invalidation": self.invalidation,
            "inactive_since_ms": self.inactive_since_ms,
            "oldest_unconfirmed_commit_ms": self.oldest_unconfirmed_ms,
            "lag_s": self.lag_s,
            "lag_note": self.lag_note,
        }


@dataclass(frozen=True)
class ServerSlots:
    """A server's logical slots, as one connection saw them."""

    database: str
    """The database connected to (the slots may belong to any)."""
    server_lsn: int
    server_ms: int
    max_slot_wal_keep_size: str
    slots: tuple[SlotState, ...]

    def get(self, name: str) -> SlotState | None:
        return next((slot for slot in self.slots if slot.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "database": self.database,
            "server_lsn": lsn_to_text(self.server_lsn),
            "server_ms": self.server_ms,
            "max_slot_wal_keep_size": self.max_slot_wal_keep_size,
            "slots": [slot.to_json() for slot in self.slots],
        }


_SERVER = (
    "SELECT current_database(), (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()"
    " ELSE pg_current_wal_lsn() END)::text,"
    " (extract(epoch FROM clock_timestamp()) * 1000)::bigint,"
    " current_setting('max_slot_wal_keep_size'), current_setting('server_version_num')::int"
)

_SLOTS = """
SELECT s.slot_name::text, s.database::text, s.plugin::text, s.temporary, s.active_pid,
       s.restart_lsn::text, s.confirmed_flush_lsn::text, s.wal_status, s.safe_wal_size,
       {invalidation}, (extract(epoch FROM {inactive_since}) * 1000)::bigint,
       h.pid, h.application_name, h.client, (extract(epoch FROM h.since) * 1000)::bigint
FROM pg_replication_slots s
LEFT JOIN LATERAL (
    SELECT a.pid, nullif(a.application_name, '') AS application_name,
           coalesce(a.client_hostname, host(a.client_addr),
                    CASE WHEN a.pid IS NOT NULL THEN 'a local socket' END) AS client,
           a.backend_start AS since
    FROM pg_locks l
    JOIN pg_database d ON d.oid = l.database
    LEFT JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
      AND l.classid = %(lock_class)s::bigint::oid
      AND l.objid = ((hashtext(s.slot_name::text)::bigint + 4294967296) %% 4294967296)::oid
      AND d.datname = s.database
    LIMIT 1
) h ON true
WHERE s.slot_type = 'logical' AND (%(name)s::text IS NULL OR s.slot_name = %(name)s::text)
ORDER BY s.database, s.slot_name
"""


def _slots_query(server_version: int) -> str:
    newer = server_version >= 170000
    return _SLOTS.format(
        invalidation="s.invalidation_reason" if newer else "NULL::text",
        inactive_since="s.inactive_since" if newer else "NULL::timestamptz",
    )


def read_slots(connection: psycopg.Connection[Any], name: str | None = None) -> ServerSlots:
    """The server's logical slots (or only ``name``), their positions, health and the
    capture holding each; nothing that needs the slots' own databases."""
    row = connection.execute(_SERVER).fetchone()
    assert row is not None
    database, server_text, server_ms, keep_size, version = row
    server_lsn = lsn_to_int(server_text) if server_text else 0
    found = []
    for r in connection.execute(
        _slots_query(version), {"lock_class": CAPTURE_LOCK_CLASS, "name": name}
    ).fetchall():
        holder = None if r[11] is None else Holder(r[11], r[12], r[13], r[14])
        found.append(
            SlotState(
                name=r[0],
                database=r[1],
                plugin=r[2],
                temporary=bool(r[3]),
                active_pid=r[4],
                restart_lsn=None if r[5] is None else lsn_to_int(r[5]),
                confirmed_lsn=None if r[6] is None else lsn_to_int(r[6]),
                server_lsn=server_lsn,
                server_ms=int(server_ms),
                wal_status=r[7],
                safe_bytes=None if r[8] is None else int(r[8]),
                invalidation=r[9],
                inactive_since_ms=None if r[10] is None else int(r[10]),
                holder=holder,
            )
        )
    return ServerSlots(database, server_lsn, int(server_ms), keep_size, tuple(found))


def database_dsn(dsn: str, database: str) -> str:
    """``dsn`` pointed at ``database`` (a slot's owner, lock and publication live there)."""
    return make_conninfo(dsn, dbname=database)


Session = Callable[[str], "psycopg.Connection[Any]"]
"""A session on a database of the server, by the database's name."""


@contextmanager
def sessions(dsn: str, connection: psycopg.Connection[Any]) -> Iterator[Session]:
    """A function giving a session on a database of the server: ``connection`` for its
    own database, one opened (and closed at the end) for any other."""
    opened: dict[str, psycopg.Connection[Any]] = {}
    own = str(connection.execute("SELECT current_database()").fetchone()[0])  # type: ignore[index]

    def session(database: str) -> psycopg.Connection[Any]:
        if database == own:
            return connection
        if database not in opened:
            opened[database] = connect(database_dsn(dsn, database), application_name="replog slots")
        return opened[database]

    try:
        yield session
    finally:
        for other in opened.values():
            other.close()


def with_owner(connection: psycopg.Connection[Any], slot: SlotState) -> SlotState:
    """``slot`` with its owner log and capture's own publication of it, read in the slot's
    database (``connection``)."""
    row = connection.execute(
        "SELECT pubname::text, obj_description(oid, 'pg_publication') FROM pg_publication"
        " WHERE pubname = %s",
        (slot.name,),
    ).fetchone()
    if row is None:
        return replace(slot, owner_note=None)
    return replace(slot, owner=parse_owner(row[1]), owner_note=None, publication=row[0])


def publications_of(connection: psycopg.Connection[Any], tables: Iterable[str]) -> list[str]:
    """The publications of ``connection``'s database that publish any of ``tables``
    (``schema.table``; a partitioned table counts through its partitions)."""
    rows = connection.execute(
        "SELECT DISTINCT pt.pubname::text FROM pg_publication_tables pt"
        " JOIN pg_namespace pn ON pn.nspname = pt.schemaname"
        " JOIN pg_class p ON p.relname = pt.tablename AND p.relnamespace = pn.oid"
        " JOIN pg_class c ON c.oid = coalesce(pg_partition_root(p.oid), p.oid)"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname || '.' || c.relname = ANY(%s) ORDER BY 1",
        (list(tables),),
    ).fetchall()
    return [row[0] for row in rows]


def with_lag(
    connection: psycopg.Connection[Any],
    slot: SlotState,
    publications: Sequence[str],
    timeout: str = LAG_TIMEOUT,
) -> SlotState:
    """``slot`` with the commit time of the oldest transaction it holds past its confirmed
    position that ``publications`` publish, read from a temporary copy of the slot in the
    slot's database (``connection``); or with :attr:`SlotState.lag_note` saying why not."""
    note = _lag_refusal(connection, slot, publications)
    if note is not None:
        return replace(slot, lag_note=note)
    copy = f"replog_lag_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        connection.execute("SELECT set_config('statement_timeout', %s, false)", (timeout,))
        connection.execute(
            "SELECT pg_copy_logical_replication_slot(%s, %s, true)", (slot.name, copy)
        )
        commit_ms = _first_commit_ms(connection, copy, publications)
    except psycopg.errors.QueryCanceled:
        return replace(
            slot,
            lag_note=f"the slot's oldest unconfirmed transaction could not be read within "
            f"{timeout} (a large transaction, or much WAL to decode)",
        )
    except psycopg.Error as exc:
        return replace(slot, lag_note=f"could not peek a copy of the slot: {str(exc).strip()}")
    finally:
        _drop_quietly(connection, copy)
    return replace(slot, oldest_unconfirmed_ms=commit_ms, lag_note=None)


def _lag_refusal(
    connection: psycopg.Connection[Any], slot: SlotState, publications: Sequence[str]
) -> str | None:
    """Why the lag of ``slot`` cannot be measured (None: it can)."""
    if slot.plugin != "pgoutput":
        return f"measured for pgoutput slots only (this one uses {slot.plugin})"
    if slot.lost or slot.confirmed_lsn is None:
        return "the server invalidated the slot" if slot.lost else "no confirmed position"
    if not publications:
        return "no publication of the slot is known (capture's own is named after it)"
    row = connection.execute(
        "SELECT (SELECT count(*) FROM pg_publication WHERE pubname = ANY(%s)),"
        " (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user)",
        (list(publications),),
    ).fetchone()
    present, allowed = row if row is not None else (0, False)
    if present != len(set(publications)):
        return f"publication {', '.join(publications)} does not exist in {slot.database}"
    return None if allowed else "reading the slot needs a role with REPLICATION"


def _first_commit_ms(
    connection: psycopg.Connection[Any], copy: str, publications: Sequence[str]
) -> int | None:
    names = ",".join('"' + name.replace('"', '""') + '"' for name in publications)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes(%s, NULL, 1,"
            " 'proto_version', '1', 'publication_names', %s)",
            (copy, names),
        )
        row = cursor.fetchone()
    if row is None:
        return None
    item = Decoder().feed(lsn_to_int(row[0]), bytes(row[1]))
    return item.commit_ms if isinstance(item, SourceTransaction) else None


def _drop_quietly(connection: psycopg.Connection[Any], copy: str) -> None:
    """Drop the temporary copy (it goes with the session anyway) and the timeout."""
    try:
        connection.execute("SELECT set_config('statement_timeout', '0', false)")
        connection.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
            " WHERE slot_name = %s",
            (copy,),
        )
    except psycopg.Error as exc:
        logger.warning("could not drop the temporary slot %s (it goes with the session): %s",
                       copy, exc)  # fmt: skip


# -- what the commands call ---------------------------------------------------------------


def list_slots(dsn: str, *, lag: bool = True) -> ServerSlots:
    """Every logical slot of the server with its owner log, the capture holding it and
    (``lag``) the lag in seconds of those a publication named after them publishes
    (capture's own): ``replog slots``."""
    with connect(dsn, application_name="replog slots") as connection:
        found = read_slots(connection)
        with sessions(dsn, connection) as session:
            slots = tuple(_described(session, slot, lag=lag) for slot in found.slots)
    return replace(found, slots=slots)


def _described(
    session: Session, slot: SlotState, *, lag: bool, tables: Sequence[str] = ()
) -> SlotState:
    """``slot`` with its owner and (``lag``) its lag, through capture's own publication
    or else those that publish ``tables``."""
    try:
        connection = session(slot.database)
    except SourceConnectionError as exc:  # no CONNECT on that database, say
        return replace(slot, owner_note=str(exc), lag_note=str(exc))
    slot = with_owner(connection, slot)
    if not lag:
        return slot
    publications = (
        [slot.publication] if slot.publication is not None else publications_of(connection, tables)
    )
    return with_lag(connection, slot, publications)


def capture_slots(
    dsn: str, tables: Mapping[str, Sequence[str]]
) -> tuple[ServerSlots, dict[str, SlotState]]:
    """The server's position and, for each capture slot of ``tables`` (slot -> its
    captured tables) that the server has, its state with owner and lag (``replog status
    --source-dsn``): the lag through capture's own publication, or else through the
    publications that publish its tables."""
    with connect(dsn, application_name="replog status") as connection:
        found = read_slots(connection)
        with sessions(dsn, connection) as session:
            states = {
                slot.name: _described(session, slot, lag=True, tables=tables[slot.name])
                for slot in found.slots
                if slot.name in tables
            }
    return found, states


class SlotProbe:
    """One capture's slot measured at each scrape of its ``--metrics-port`` endpoint, on
    a session of its own (opened at the first scrape, opened again after an error)."""

    def __init__(self, dsn: str, slot: str, publication: str, timeout: str = "5s") -> None:
        self.dsn, self.slot, self.publication, self.timeout = dsn, slot, publication, timeout
        self._connection: psycopg.Connection[Any] | None = None

    def measure(self) -> SlotState | None:
        """The slot now (None: no such slot yet, or the server cannot be reached: the
        scrape then lacks these metrics)."""
        try:
            if self._connection is None or self._connection.closed:
                self._connection = connect(
                    self.dsn, application_name=f"replog metrics {self.slot}"[:63]
                )
            slot = read_slots(self._connection, self.slot).get(self.slot)
            if slot is None:
                return None
            return with_lag(self._connection, slot, [self.publication], self.timeout)
        except (psycopg.Error, SourceConnectionError) as exc:
            logger.warning("metrics: cannot read slot %s on %s: %s", self.slot,
                           safe_dsn(self.dsn), exc)  # fmt: skip
            self.close()
            return None

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


# -- dropping a slot ----------------------------------------------------------------------


@dataclass(frozen=True)
class Dropped:
    slot: SlotState
    publication: str | None
    """Capture's own publication of the slot, dropped with it (None: none)."""


def inspect(dsn: str, name: str) -> SlotState:
    """Slot ``name`` with its owner and the capture holding it, or an error listing the
    server's logical slots."""
    with connect(dsn, application_name="replog slots") as connection:
        found = read_slots(connection)
        slot = found.get(name)
        if slot is None:
            known = ", ".join(s.name for s in found.slots) or "none"
            raise SourceConfigError(
                f"the server at {safe_dsn(dsn)} has no logical replication slot {name!r} "
                f"(its logical slots: {known})"
            )
        with sessions(dsn, connection) as session:
            return _described(session, slot, lag=False)


def check_free(slot: SlotState) -> None:
    """Refuse to drop a slot that is read now, or whose capture runs (it holds the slot's
    lock between two reads)."""
    if slot.holder is not None:
        raise CaptureRunningError(
            f"slot {slot.name!r} is being captured by {slot.holder.describe()}: stop that "
            f"capture first (Ctrl-C or SIGTERM ends it after its commit), then drop the slot"
        )
    if slot.active_pid is not None:
        raise CaptureRunningError(
            f"slot {slot.name!r} is in use by server process {slot.active_pid} (a "
            f"subscription, Debezium or another reader): stop it first, then drop the slot"
        )


def dependents(slot: SlotState) -> list[str]:
    """What depends on ``slot``, in words, for the question before it is dropped."""
    said = []
    if slot.owner is not None:
        said.append(
            f"the log {slot.owner.get('log', '?')} (id {slot.owner['log_id']}) follows it: "
            f"that log's capture can never resume once it is dropped (a new slot starts "
            f"over with a snapshot)"
        )
    elif slot.owner_note is not None:
        said.append(f"its owner could not be read: {slot.owner_note}")
    else:
        said.append("no replog log names it as its own (another tool's slot, or a capture "
                    "of an older replog)")  # fmt: skip
    if slot.publication is not None and slot.owner is not None:
        said.append(f"capture's own publication {slot.publication!r} is dropped with it")
    if slot.retained_bytes is not None:
        said.append(f"it keeps {slot.retained_bytes:,} bytes of WAL on the server, freed "
                    f"at the next checkpoint once it is dropped")  # fmt: skip
    return said


def drop(dsn: str, slot: SlotState) -> Dropped:
    """Drop ``slot`` (and capture's own publication of it) under the slot's capture lock,
    so no capture starts on it meanwhile; refused while it is read or captured."""
    check_free(slot)
    options = CaptureOptions(dsn=database_dsn(dsn, slot.database), slot=slot.name)
    source = PostgresSource(options)
    try:
        source.connection.execute(
            "SELECT set_config('application_name', %s, false)",
            (f"replog slots drop {slot.name} pid {os.getpid()} on {socket.gethostname()}"[:63],),
        )
        source.lock_slot()  # a capture started since is refused here, naming itself
        now = source.slot()
        if now is None:
            raise SourceConfigError(f"slot {slot.name!r} no longer exists (dropped meanwhile)")
        if now[3] is not None:
            check_free(replace(slot, active_pid=now[3]))
        owned = source.slot_owner() is not None
        source.drop_slot()
        publication = source.drop_own_publication() if owned else None
    finally:
        source.close()
    return Dropped(slot, publication)


__all__ = [
    "LAG_TIMEOUT",
    "Dropped",
    "Holder",
    "ServerSlots",
    "SlotProbe",
    "SlotState",
    "capture_slots",
    "check_free",
    "dependents",
    "drop",
    "inspect",
    "list_slots",
    "read_slots",
    "with_lag",
    "with_owner",
]
