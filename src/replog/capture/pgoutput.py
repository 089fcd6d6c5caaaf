"""The messages of PostgreSQL's ``pgoutput`` plug-in, protocol version 1, decoded.

The layout is PostgreSQL's "Logical Replication Message Formats". Only what capture needs
is decoded: transactions (Begin, Commit), relations (column names and type ids), row
changes (Insert, Update, Delete), truncations and logical messages (``messages`` option:
the snapshot's watermarks and signals). Column values stay the server's text output, so
the caller decides how each type becomes JSON; a value is :data:`UNCHANGED_TOAST` when
the server did not send it (an unchanged TOASTed column).

The decoder hands each message on as it comes (:meth:`Decoder.feed`): a transaction of
millions of changes is never held whole.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

PG_EPOCH_MS: Final = 946_684_800_000
"""2000-01-01 in Unix milliseconds: pgoutput's timestamps count microseconds from it."""


class Unchanged:
    """The marker of a TOASTed value the server did not send (it did not change)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST: Final = Unchanged()

Value = str | None | Unchanged
"""A column's text output, NULL, or :data:`UNCHANGED_TOAST`."""


@dataclass(frozen=True)
class Column:
    name: str
    type_oid: int
    in_identity: bool
    """Part of the table's replica identity (the key pgoutput sends for old rows)."""
    type_modifier: int = -1
    """``atttypmod``: a ``numeric``'s precision and scale, a ``varchar``'s length; -1: none."""


@dataclass(frozen=True)
class Relation:
    """A table as pgoutput describes it before its first change in a decoding session."""

    oid: int
    schema: str
    table: str
    replica_identity: str
    """``d`` default, ``f`` full, ``i`` index, ``n`` nothing."""
    columns: tuple[Column, ...]

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"


@dataclass(frozen=True)
class RowChange:
    """One row's change: ``op`` is ``c``, ``u`` or ``d`` (Debezium's letters).

    ``old`` is the old row the server sent: the whole row under ``REPLICA IDENTITY FULL``,
    the key columns (others None) for an identity index, absent otherwise.
    ``old_is_key_only``: ``old`` holds only the identity columns.
    """

    relation: Relation
    op: str
    lsn: int
    new: tuple[Value, ...] | None
    old: tuple[Value, ...] | None
    old_is_key_only: bool = False


@dataclass
class SourceTransaction:
    """One source transaction, from its Begin; :attr:`end_lsn` is set by its Commit."""

    xid: int
    begin_lsn: int
    commit_ms: int
    commit_lsn: int = 0
    """Where its commit record is (known from Begin): names the transaction in event ids."""
    end_lsn: int = 0
    """The end of its commit record: the slot position just past this transaction."""


@dataclass(frozen=True)
class Truncation:
    """A ``TRUNCATE`` of ``relations`` at ``lsn``."""

    relations: tuple[Relation, ...]
    lsn: int


@dataclass(frozen=True)
class Message:
    """A logical message (``pg_logical_emit_message``); transactional ones come inside
    their transaction, so in commit order with every other transaction."""

    prefix: str
    content: bytes
    lsn: int
    transactional: bool


@dataclass(frozen=True)
class Commit:
    """The end of :attr:`transaction` (its :attr:`~SourceTransaction.end_lsn` set)."""

    transaction: SourceTransaction


Item = SourceTransaction | RowChange | Truncation | Message | Commit
"""What :meth:`Decoder.feed` hands on: a SourceTransaction is a Begin."""


class ProtocolError(ValueError):
    """A pgoutput message this decoder cannot read (an unexpected plug-in or version)."""


_BEGIN = struct.Struct("!QqI")
_MESSAGE = struct.Struct("!BQ")
_COMMIT = struct.Struct("!BQQq")
_INT32 = struct.Struct("!I")
_INT16 = struct.Struct("!H")
_COLUMN_TAIL = struct.Struct("!Ii")


def _cstring(data: bytes, at: int) -> tuple[str, int]:
    end = data.index(0, at)
    return data[at:end].decode("utf-8"), end + 1


def _tuple(data: bytes, at: int) -> tuple[tuple[Value, ...], int]:
    (count,) = _INT16.unpack_from(data, at)
    at += 2
    values: list[Value] = []
    for _ in range(count):
        kind = data[at]
        at += 1
        if kind == 0x74:  # 't': text
            (length,) = _INT32.unpack_from(data, at)
            at += 4
            values.append(data[at : at + length].decode("utf-8"))
            at += length
        elif kind == 0x6E:  # 'n': NULL
            values.append(None)
        elif kind == 0x75:  # 'u': unchanged TOASTed value, not sent
            values.append(UNCHANGED_TOAST)
        else:
            raise ProtocolError(f"unknown tuple value kind {chr(kind)!r} (binary mode is not used)")
    return tuple(values), at


def _truncated_oids(data: bytes) -> tuple[int, ...]:
    """The relation ids of a Truncate message (count, option bits, ids)."""
    (count,) = _INT32.unpack_from(data, 1)
    return struct.unpack_from(f"!{count}I", data, 6)


def _relation(data: bytes) -> Relation:
    (oid,) = _INT32.unpack_from(data, 1)
    schema, at = _cstring(data, 5)
    table, at = _cstring(data, at)
    identity = chr(data[at])
    (count,) = _INT16.unpack_from(data, at + 1)
    at += 3
    columns = []
    for _ in range(count):
        flags = data[at]
        name, at = _cstring(data, at + 1)
        type_oid, modifier = _COLUMN_TAIL.unpack_from(data, at)
        at += 8
        columns.append(Column(name, type_oid, bool(flags & 1), modifier))
    return Relation(oid, schema, table, identity, tuple(columns))


class Decoder:
    """Turns the rows of ``pg_logical_slot_peek_binary_changes`` into items, one message
    at a time (:data:`Item`).

    Relations are remembered across calls (the server sends each one again at the start
    of every decoding session, and whenever it changes).
    """

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}
        self._open: SourceTransaction | None = None

    def feed(self, lsn: int, message: bytes) -> Item | None:  # noqa: PLR0911 - one per kind
        """Take one message; what it says, or None (relations, types, origins)."""
        kind = message[:1]
        if kind == b"B":
            final_lsn, commit_us, xid = _BEGIN.unpack_from(message, 1)
            self._open = SourceTransaction(xid, lsn, PG_EPOCH_MS + commit_us // 1000, final_lsn)
            return self._open
        if kind == b"C":
            _flags, _commit_lsn, end_lsn, _ts = _COMMIT.unpack_from(message, 1)
            done, self._open = self._require_open(kind), None
            done.end_lsn = end_lsn
            return Commit(done)
        if kind == b"R":
            relation = _relation(message)
            self.relations[relation.oid] = relation
            return None
        if kind in (b"I", b"U", b"D"):
            self._require_open(kind)
            return self._change(kind, lsn, message)
        if kind == b"T":
            self._require_open(kind)
            oids = _truncated_oids(message)
            return Truncation(tuple(self._relation_of(oid) for oid in oids), lsn)
        if kind == b"M":
            flags, message_lsn = _MESSAGE.unpack_from(message, 1)
            prefix, at = _cstring(message, 1 + _MESSAGE.size)
            (length,) = _INT32.unpack_from(message, at)
            content = message[at + 4 : at + 4 + length]
            return Message(prefix, content, message_lsn, bool(flags & 1))
        # 'Y' (type), 'O' (origin): nothing to capture.
        return None

    def _require_open(self, kind: bytes) -> SourceTransaction:
        if self._open is None:
            raise ProtocolError(f"message {kind!r} outside a transaction")
        return self._open

    def _relation_of(self, oid: int) -> Relation:
        relation = self.relations.get(oid)
        if relation is None:
            raise ProtocolError(f"change of relation {oid} before its relation message")
        return relation

    def _change(self, kind: bytes, lsn: int, message: bytes) -> RowChange:
        (oid,) = _INT32.unpack_from(message, 1)
        relation = self._relation_of(oid)
        at = 5
        old: tuple[Value, ...] | None = None
        new: tuple[Value, ...] | None = None
        key_only = False
        if kind == b"I":
            new, at = _tuple(message, at + 1)  # 'N'
            return RowChange(relation, "c", lsn, new, None)
        submessage = message[at : at + 1]
        if submessage in (b"K", b"O"):
            key_only = submessage == b"K"
            old, at = _tuple(message, at + 1)
            submessage = message[at : at + 1]
        if kind == b"D":
            return RowChange(relation, "d", lsn, None, old, key_only)
        if submessage != b"N":
            raise ProtocolError(f"update of {relation.name} without a new row")
        new, at = _tuple(message, at + 1)
        return RowChange(relation, "u", lsn, new, old, key_only)


def lsn_to_int(text: str) -> int:
    """``'16/B374D848'`` -> the 64-bit position."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) + int(low, 16)


def lsn_to_text(position: int) -> str:
    """The 64-bit position as PostgreSQL writes it (``'16/B374D848'``)."""
    return f"{position >> 32:X}/{position & 0xFFFFFFFF:X}"
