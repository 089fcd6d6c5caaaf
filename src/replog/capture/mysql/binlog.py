"""The binlog, read as whole transactions of row changes (``mysql-replication`` speaks the
replication protocol; replog decodes the values).

DESIGN: :class:`BinlogReader` connects as a replica (``COM_BINLOG_DUMP``, non-blocking: the
server sends what its binlog holds past the position, then end-of-file), from a binlog
file and offset, or from a GTID state where the file is not there (another server). It
yields what :mod:`~replog.capture.mysql.capture` needs, in binlog order: the start of a
transaction (its GTID), row events of the tables asked for, statements (DDL), and the end
of each transaction with the position after it. A connection lost, or an end of file met
inside a transaction, raises :class:`StreamBroken`: the caller reads again from the last
whole transaction (mysql-replication would connect again by itself, from a GTID state it
never updates: its issue #367, transactions twice).

Values: mysql-replication 1.0's row decoding loses or changes values (a FLOAT widened to a
double's digits, ``YEAR 0000`` as 1900, a zero TIMESTAMP as 1970-01-01, an empty SET as
NULL, BINARY(n) without its padding, one partial JSON diff per column at most, TIME with
a fraction below zero). Row images are read by replog instead (:class:`_RowDecoder`),
from the rows part of each event at once, each value written as JSON text, the same text
the snapshot writes from the server's text output (:mod:`~replog.capture.mysql.columns`).
The library is pinned to the 1.0 line.
"""

from __future__ import annotations

import codecs
import logging
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

import pymysql
from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.constants import BINLOG, FIELD_TYPE
from pymysqlreplication.event import (
    BinLogEvent,
    GtidEvent,
    HeartbeatLogEvent,
    MariadbGtidEvent,
    NotImplementedEvent,
    QueryEvent,
    RotateEvent,
    XAPrepareEvent,
    XidEvent,
)
from pymysqlreplication.row_event import (
    DeleteRowsEvent,
    PartialUpdateRowsEvent,
    RowsEvent,
    TableMapEvent,
    UpdateRowsEvent,
    WriteRowsEvent,
)

from replog.capture.mysql.columns import (
    ZERO,
    MySqlColumn,
    base64_text,
    bits_text,
    codec,
    decode_text,
    double_text,
    float_text,
    fraction,
    geometry_text,
    quoted,
)
from replog.capture.mysql.jsontext import binary_json_text
from replog.capture.mysql.positions import GTID, MARIADB, BinlogPosition
from replog.capture.mysql.server import open_session
from replog.errors import CaptureError, SourceConnectionError, SourcePrivilegeError

logger = logging.getLogger(__name__)

_NOT_IN_IMAGE = object()
"""A column the row image does not hold (``binlog_row_image`` other than FULL)."""

COMPRESSED_EVENTS = {
    40: "a compressed transaction (MySQL's binlog_transaction_compression=ON)",
    **{
        code: "a compressed event (MariaDB's log_bin_compress=ON)"
        for code in (165, 166, 167, 168, 169, 170, 171, 172)
    },
}
"""Event types mysql-replication does not decode: met, they stop capture (never skipped)."""


class StreamBroken(CaptureError):  # noqa: N818 - a state the reader acts on (read again), never escapes
    """The connection ended inside a transaction (or was lost): read again from the last
    whole one."""


class BinlogGone(CaptureError):  # noqa: N818 - named as the server says it
    """The server no longer has the binlog at the position asked for (purged), or cannot
    find the GTID state in its binlog (error 1236)."""


@dataclass(frozen=True)
class PartialJson:
    """A JSON column of an update's after image that holds only changes
    (``binlog_row_value_options=PARTIAL_JSON``): applied to the before image's value."""

    diffs: bytes


# -- values ---------------------------------------------------------------------------------


def _time2(data: bytes, fsp: int) -> int:
    """MySQL's TIME2 (3 bytes of sign and h:m:s, then the fraction) as microseconds."""
    int_part = int.from_bytes(data[:3], "big") - 0x800000
    if fsp in (1, 2):  # the fraction unsigned; below zero in reverse order
        frac = data[3]
        if int_part < 0 and frac:
            int_part, frac = int_part + 1, frac - 0x100
        packed = (int_part << 24) + frac * 10_000
    elif fsp in (3, 4):
        frac = int.from_bytes(data[3:5], "big")
        if int_part < 0 and frac:
            int_part, frac = int_part + 1, frac - 0x10000
        packed = (int_part << 24) + frac * 100
    elif fsp in (5, 6):
        packed = int.from_bytes(data[:6], "big") - 0x800000000000
    else:
        packed = int_part << 24
    sign, packed = (-1, -packed) if packed < 0 else (1, packed)
    clock, micros = packed >> 24, packed % (1 << 24)
    hours, minutes, seconds = (clock >> 12) % (1 << 10), (clock >> 6) % 64, clock % 64
    return sign * (((hours * 60 + minutes) * 60 + seconds) * 1_000_000 + micros)


def _fraction_bytes(fsp: int) -> int:
    return (fsp + 1) // 2


_SCALE = {1: 10_000, 2: 100, 3: 1}
"""A fraction's bytes -> microseconds per unit (hundredths, ten-thousandths, µs)."""


def _micros(data: bytes, fsp: int) -> int:
    """The fraction of a DATETIME2/TIMESTAMP2 (big-endian, (fsp + 1) // 2 bytes)."""
    if not fsp:
        return 0
    value = int.from_bytes(data, "big")
    return value * _SCALE[len(data)]


def _datetime2(data: bytes, fsp: int) -> str:
    packed = int.from_bytes(data[:5], "big") - 0x8000000000
    ymd, hms = packed >> 17, packed % (1 << 17)
    year_month, day = ymd >> 5, ymd % 32
    year, month = divmod(year_month, 13)
    if not month or not day:
        return ZERO
    clock = f"{hms >> 12:02d}:{(hms >> 6) % 64:02d}:{hms % 64:02d}"
    micros = _micros(data[5:], fsp)
    return f'"{year:04d}-{month:02d}-{day:02d}T{clock}{fraction(micros, fsp)}"'


def _timestamp2(data: bytes, fsp: int) -> str:
    seconds = int.from_bytes(data[:4], "big")
    micros = _micros(data[4:], fsp)
    if not seconds and not micros:
        return ZERO
    days, rest = divmod(seconds, 86_400)
    year, month, day = _civil(days)
    clock = f"{rest // 3600:02d}:{rest // 60 % 60:02d}:{rest % 60:02d}"
    return f'"{year:04d}-{month:02d}-{day:02d}T{clock}{fraction(micros, fsp)}Z"'


def _civil(days: int) -> tuple[int, int, int]:
    """Days since 1970-01-01 -> (year, month, day) (Howard Hinnant's algorithm)."""
    days += 719_468
    era = days // 146_097
    doe = days - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def _date(value: int) -> str:
    day, month, year = value & 31, (value >> 5) & 15, value >> 9
    if not month or not day:
        return ZERO
    return f'"{year:04d}-{month:02d}-{day:02d}"'


Reader = Callable[[bytes, int], tuple[Any, int]]
"""Reads one present, non-NULL value of a row image from ``data`` at an offset: its JSON
text and the offset after it."""

_INTEGER_SIZES = {
    FIELD_TYPE.TINY: 1,
    FIELD_TYPE.SHORT: 2,
    FIELD_TYPE.INT24: 3,
    FIELD_TYPE.LONG: 4,
    FIELD_TYPE.LONGLONG: 8,
}
_DIGIT_BYTES = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4)
"""Bytes MySQL packs 0-8 leftover decimal digits in (9 digits take 4)."""


def _fixed(size: int, text: Callable[[bytes], Any]) -> Reader:
    def read(data: bytes, at: int) -> tuple[Any, int]:
        end = at + size
        return text(data[at:end]), end

    return read


def _prefixed(size: int, text: Callable[[bytes], Any]) -> Reader:
    """A value after its length (``size`` bytes, little-endian)."""

    def read(data: bytes, at: int) -> tuple[Any, int]:
        start = at + size
        end = start + int.from_bytes(data[at:start], "little")
        return text(data[start:end]), end

    return read


def _little(size: int, text: Callable[[int], Any]) -> Reader:
    return _fixed(size, lambda raw: text(int.from_bytes(raw, "little")))


def _integer(size: int, signed: bool) -> Reader:
    def read(data: bytes, at: int) -> tuple[Any, int]:
        end = at + size
        return str(int.from_bytes(data[at:end], "little", signed=signed)), end

    return read


def _decimal(precision: int, scale: int) -> Reader:
    """MySQL's packed DECIMAL: groups of 9 digits in 4 bytes big-endian (fewer bytes for a
    leftover group), the sign in the first bit (flipped), a negative's bytes inverted."""
    whole, whole_left = divmod(precision - scale, 9)
    part, part_left = divmod(scale, 9)
    size = _DIGIT_BYTES[whole_left] + 4 * (whole + part) + _DIGIT_BYTES[part_left]
    groups = [
        (_DIGIT_BYTES[whole_left], 0),
        *[(4, 9)] * whole,
        (0, -1),  # the point
        *[(4, 9)] * part,
        (_DIGIT_BYTES[part_left], part_left),
    ]

    def text(raw: bytes) -> str:
        negative = not raw[0] & 0x80
        packed = bytearray(raw)
        packed[0] ^= 0x80
        if negative:
            packed = bytearray(b ^ 0xFF for b in packed)
        digits, at = ["-"] if negative else [], 0
        for length, width in groups:
            if width < 0:
                digits.append(".")
            elif length:
                value = int.from_bytes(packed[at : at + length], "big")
                digits.append(f"{value:0{width}d}" if width else str(value))
                at += length
        return format(Decimal("".join(digits)), "f")

    return _fixed(size, text)


def _string_text(column: Any, fixed: bool) -> Callable[[bytes], str]:
    if column.character_set_name in ("binary", None) and column.collation_name in ("binary", None):
        width = column.max_length if fixed else 0

        def binary(raw: bytes) -> str:
            if len(raw) < width:  # BINARY(n): the server pads with zeros
                raw = raw + b"\0" * (width - len(raw))
            return base64_text(raw)

        return binary
    encoding = column.character_set_name
    try:
        codecs.lookup(codec(encoding))
    except LookupError:
        name = column.name

        def unreadable(raw: bytes) -> str:
            raise CaptureError(
                f"column {name!r} is in charset {encoding}, which capture cannot decode "
                f"from the binlog (Python has no codec for it): convert the column to "
                f"utf8mb4 (ALTER TABLE ... CONVERT TO CHARACTER SET utf8mb4)"
            )

        return unreadable
    if fixed:
        return lambda raw: quoted(decode_text(raw, encoding).rstrip(" "))
    return lambda raw: quoted(decode_text(raw, encoding))


def _members(column: Any) -> Callable[[int], str]:
    if column.type == FIELD_TYPE.ENUM:
        members = column.enum_values or [""]
        return lambda index: quoted(members[index] if index < len(members) else "")
    chosen = column.set_values or []
    return lambda mask: quoted(",".join(m for i, m in enumerate(chosen) if mask & (1 << i)))


def _reader(column: Any) -> Reader:  # noqa: C901, PLR0911, PLR0912 - one reader per type
    """How one column's present, non-NULL values are read from a row image."""
    kind = column.type
    if kind in _INTEGER_SIZES:
        return _integer(_INTEGER_SIZES[kind], not column.unsigned)
    if kind == FIELD_TYPE.NEWDECIMAL:
        return _decimal(column.precision, column.decimals)
    if kind in (FIELD_TYPE.VARCHAR, FIELD_TYPE.STRING):
        size = 2 if column.max_length > 255 else 1
        return _prefixed(size, _string_text(column, kind == FIELD_TYPE.STRING))
    if kind == FIELD_TYPE.BLOB:
        return _prefixed(column.length_size, _string_text(column, False))
    fsp = getattr(column, "fsp", 0)
    if kind == FIELD_TYPE.DATETIME2:
        return _fixed(5 + _fraction_bytes(fsp), lambda raw: _datetime2(raw, fsp))
    if kind == FIELD_TYPE.TIMESTAMP2:
        return _fixed(4 + _fraction_bytes(fsp), lambda raw: _timestamp2(raw, fsp))
    if kind == FIELD_TYPE.TIME2:
        return _fixed(3 + _fraction_bytes(fsp), lambda raw: str(_time2(raw, fsp)))
    if kind in (FIELD_TYPE.DATE, FIELD_TYPE.NEWDATE):
        return _little(3, _date)
    if kind == FIELD_TYPE.FLOAT:
        return _fixed(4, lambda raw: float_text(struct.unpack("<f", raw)[0]))
    if kind == FIELD_TYPE.DOUBLE:
        return _fixed(8, lambda raw: double_text(struct.unpack("<d", raw)[0]))
    if kind == FIELD_TYPE.YEAR:
        return _little(1, lambda year: str(year + 1900 if year else 0))
    if kind in (FIELD_TYPE.ENUM, FIELD_TYPE.SET):
        return _little(column.size, _members(column))
    if kind == FIELD_TYPE.BIT:
        bits = column.bits
        return _fixed(column.bytes, lambda raw: bits_text(int.from_bytes(raw, "big"), bits))
    if kind == FIELD_TYPE.GEOMETRY:
        return _prefixed(column.length_size, geometry_text)
    if kind == FIELD_TYPE.JSON:
        return _prefixed(column.length_size, lambda raw: quoted(binary_json_text(raw)))
    if kind == FIELD_TYPE.TIMESTAMP:
        return _little(4, lambda seconds: _timestamp2(seconds.to_bytes(4, "big"), 0))
    if kind == FIELD_TYPE.DATETIME:
        return _little(8, _old_datetime)
    if kind == FIELD_TYPE.TIME:
        return _little(3, lambda value: str(_old_time(value)))

    def unreadable(data: bytes, at: int) -> tuple[Any, int]:
        raise CaptureError(
            f"column {column.name!r} has binlog type {kind}, which capture cannot read"
        )

    return unreadable


def _old_datetime(value: int) -> str:
    """A DATETIME of the format before MySQL 5.6 (YYYYMMDDhhmmss as a number)."""
    date, clock = divmod(value, 1_000_000)
    year, rest = divmod(date, 10_000)
    month, day = divmod(rest, 100)
    if not month or not day:
        return ZERO
    hours, rest = divmod(clock, 10_000)
    return f'"{year:04d}-{month:02d}-{day:02d}T{hours:02d}:{rest // 100:02d}:{rest % 100:02d}"'


def _old_time(value: int) -> int:
    hours, rest = divmod(value, 10_000)
    return ((hours * 60 + rest // 100) * 60 + rest % 100) * 1_000_000


def _bit(bitmap: bytes, index: int) -> int:
    return bitmap[index >> 3] & (1 << (index & 7))


def _bitmap_size(present: bytes) -> int:
    """Bytes of a row image's NULL bitmap: a bit per column present."""
    return (sum(bin(byte).count("1") for byte in present) + 7) // 8


def _length_coded(data: bytes, at: int) -> tuple[int, int]:
    """A length-coded integer (1, 3, 4 or 9 bytes) at ``at``; the offset after it."""
    first = data[at]
    if first < 0xFB:
        return first, at + 1
    size = {0xFC: 2, 0xFD: 3, 0xFE: 8}.get(first)
    if size is None:
        raise CaptureError(f"a row event holds a length-coded integer led by byte {first:#x}")
    return int.from_bytes(data[at + 1 : at + 1 + size], "little"), at + 1 + size


class _RowDecoder:
    """Reads the row images of a table's row events (one decoder per table map): the rows
    part of an event read at once, each value by its column's :data:`Reader` (not through
    mysql-replication's per-value packet reads and per-row dicts: a fifth of a binlog
    backlog's time)."""

    def __init__(self, table: Any) -> None:
        self.readers = tuple(_reader(column) for column in table.columns)
        self.json = tuple(column.type == FIELD_TYPE.JSON for column in table.columns)
        self.json_count = sum(self.json)
        self.length_sizes = tuple(getattr(column, "length_size", 0) for column in table.columns)

    def rows(self, event: RowsEvent) -> list[tuple[list[Any] | None, list[Any] | None]]:
        """Each row of ``event``: (before, after) images (None where it has none), a value
        per column: JSON text, None for NULL, :data:`_NOT_IN_IMAGE`, :class:`PartialJson`."""
        if not event.complete:
            return []
        packet = event.packet
        data = bytes(packet.read(event.event_size - packet.read_bytes))
        update = isinstance(event, UpdateRowsEvent)
        partial = event.event_type == BINLOG.PARTIAL_UPDATE_ROWS_EVENT
        present = event.columns_present_bitmap
        found: list[tuple[list[Any] | None, list[Any] | None]] = []
        at = 0
        after_present = event.columns_present_bitmap2 if update else present
        nulls, after_nulls = _bitmap_size(present), _bitmap_size(after_present)
        while at < len(data):
            image, at = self._image(data, at, present, nulls, False)
            if update:
                after, at = self._image(data, at, after_present, after_nulls, partial)
                found.append((image, after))
            elif isinstance(event, DeleteRowsEvent):
                found.append((image, None))
            else:
                found.append((None, image))
        if at != len(data):  # a slice past the end is short, not an error: never a row
            raise CaptureError(
                f"a row event of {event.schema}.{event.table} (ending at binlog offset "
                f"{event.packet.log_pos}) does not read as its table map describes it: its "
                f"rows run {at - len(data)} bytes past the event. Capture stops rather than "
                f"log values it cannot read (a column stored in a format capture does not "
                f"read, such as MariaDB's temporal format from before 10.1: ALTER TABLE ... "
                f"FORCE rewrites it; changes made before need a new snapshot of the table)"
            )
        return found

    def _image(
        self, data: bytes, at: int, present: bytes, size: int, partial: bool
    ) -> tuple[list[Any], int]:
        partial_bitmap = None
        if partial:  # an update's after image may hold JSON diffs (PARTIAL_JSON)
            options, at = _length_coded(data, at)
            if options & 0b10000001:
                width = (self.json_count + 7) // 8
                partial_bitmap, at = data[at : at + width], at + width
        nulls, at = data[at : at + size], at + size
        values: list[Any] = []
        null_index = json_index = 0
        for index, read in enumerate(self.readers):
            diffs = False
            if partial_bitmap is not None and self.json[index]:
                diffs = bool(_bit(partial_bitmap, json_index))
                json_index += 1
            if not _bit(present, index):
                values.append(_NOT_IN_IMAGE)
                continue
            if _bit(nulls, null_index):
                values.append(None)
            elif diffs:
                length = self.length_sizes[index]
                end = at + length + int.from_bytes(data[at : at + length], "little")
                values.append(PartialJson(data[at + length : end]))
                at = end
            else:
                value, at = read(data, at)
                values.append(value)
            null_index += 1
        return values, at


_parse_table_map = TableMapEvent.__init__
_TABLE_MAPS: dict[bytes, dict[str, Any]] = {}
"""Table maps parsed, by their bytes: what parsing one set on its event."""
_TABLE_MAPS_KEPT = 1_000


def _table_map(
    self: TableMapEvent,
    from_packet: Any,
    event_size: int,
    table_map: dict[int, Any],
    ctl_connection: Any,
    **options: Any,
) -> None:
    """Replaces ``TableMapEvent.__init__``: every row event is preceded by its table's
    map (id, names, types, metadata), which mysql-replication parses in Python each time
    (two-fifths of a backlog of single-row changes). A map the same to the byte as one
    parsed before is the same table: its parsed state, the same :class:`Table` object, is
    taken again (which also lets :func:`binlog_columns` find its columns). Maps whose
    column names are not in the map itself (``binlog_row_metadata`` not FULL: the library
    asks the server) are parsed each time."""
    body = bytes(from_packet.packet._data[20 : 20 + event_size])
    known = _TABLE_MAPS.get(body)
    wanted = options["only_schemas"]
    if known is not None and (wanted is None or known["schema"] in wanted):
        BinLogEvent.__init__(self, from_packet, event_size, table_map, ctl_connection, **options)
        for name, value in known.items():
            self.__dict__.setdefault(name, value)
        table_map[self.table_id] = self.table_obj
        return
    _parse_table_map(self, from_packet, event_size, table_map, ctl_connection, **options)
    if not self._processed or not self.optional_metadata.column_name_list:
        return
    if len(_TABLE_MAPS) >= _TABLE_MAPS_KEPT:
        _TABLE_MAPS.clear()
    _TABLE_MAPS[body] = {
        name: value
        for name, value in self.__dict__.items()
        if name not in ("packet", "table_map", "timestamp", "_ctl_connection")
    }


if "_data" not in getattr(pymysql.protocol.MysqlPacket, "__slots__", ()):  # pragma: no cover
    raise ImportError(
        "PyMySQL's MysqlPacket keeps no _data (read by _table_map): this replog knows "
        "PyMySQL 1.1 and 1.2"
    )
TableMapEvent.__init__ = _table_map


# -- what the reader yields ---------------------------------------------------------------------


@dataclass
class Begin:
    """A transaction starts (``gtid``: its GTID, None where the server has none) at
    ``file``:``pos``, written by server ``server_id``."""

    gtid: str | None
    ts_ms: int
    file: str
    pos: int
    server_id: int


@dataclass
class Rows:
    """One row event of a table asked for: ``op`` ``c``, ``u`` or ``d``; ``rows``: each
    row's images as JSON fragments in column order (before, after; None where the event
    has none)."""

    schema: str
    table: str
    op: str
    event: RowsEvent
    position: tuple[str, int]
    """Where the event ends in the binlog (file, offset)."""
    _rows: list[tuple[list[Any] | None, list[Any] | None]] | None = None

    @property
    def columns(self) -> tuple[MySqlColumn, ...]:
        return binlog_columns(self.event.table_map[self.event.table_id])

    @property
    def key(self) -> tuple[str, ...]:
        """The primary key at this point of the binlog (its columns, in key order)."""
        table = self.event.table_map[self.event.table_id]
        return tuple(c.name for c in table.columns if c.is_primary)

    @property
    def rows(self) -> list[tuple[list[Any] | None, list[Any] | None]]:
        if self._rows is None:
            event = self.event
            decoded = _decoder(event.table_map[event.table_id]).rows(event)
            self._rows = [(self._checked(old), self._checked(new)) for old, new in decoded]
        return self._rows

    def _checked(self, image: list[Any] | None) -> list[Any] | None:
        if image is not None and _NOT_IN_IMAGE in image:
            raise CaptureError(
                f"a row image of {self.schema}.{self.table} at {self.position[0]}:"
                f"{self.position[1]} lacks columns: capture needs binlog_row_image=FULL "
                f"(SET GLOBAL binlog_row_image = 'FULL'; changes written before stay partial: "
                f"take a new snapshot of the table)"
            )
        return image


@dataclass
class Statement:
    """A statement the binlog holds as text (DDL, TRUNCATE), in database ``schema``."""

    schema: str
    query: str
    ts_ms: int


@dataclass
class End:
    """A transaction ends; the binlog position after it."""

    file: str
    pos: int
    ts_ms: int


Item = Begin | Rows | Statement | End

_BINLOG_TYPES = {
    FIELD_TYPE.TINY: "tinyint",
    FIELD_TYPE.SHORT: "smallint",
    FIELD_TYPE.INT24: "mediumint",
    FIELD_TYPE.LONG: "int",
    FIELD_TYPE.LONGLONG: "bigint",
    FIELD_TYPE.NEWDECIMAL: "decimal",
    FIELD_TYPE.FLOAT: "float",
    FIELD_TYPE.DOUBLE: "double",
    FIELD_TYPE.BIT: "bit",
    FIELD_TYPE.YEAR: "year",
    FIELD_TYPE.DATE: "date",
    FIELD_TYPE.NEWDATE: "date",
    FIELD_TYPE.TIME: "time",
    FIELD_TYPE.TIME2: "time",
    FIELD_TYPE.DATETIME: "datetime",
    FIELD_TYPE.DATETIME2: "datetime",
    FIELD_TYPE.TIMESTAMP: "timestamp",
    FIELD_TYPE.TIMESTAMP2: "timestamp",
    FIELD_TYPE.ENUM: "enum",
    FIELD_TYPE.SET: "set",
    FIELD_TYPE.GEOMETRY: "geometry",
    FIELD_TYPE.JSON: "json",
}

_T = TypeVar("_T")
_PER_TABLE_KEPT = 10_000


def _per_table(cache: dict[int, tuple[Any, _T]], table: Any, make: Callable[[Any], _T]) -> _T:
    """What ``make`` gives for a table map's table, once per table object (the same
    object for the same map: :func:`_table_map`)."""
    cached = cache.get(id(table))
    if cached is not None and cached[0] is table:
        return cached[1]
    if len(cache) > _PER_TABLE_KEPT:
        cache.clear()
    made = make(table)
    cache[id(table)] = (table, made)
    return made


_described: dict[int, tuple[Any, tuple[MySqlColumn, ...]]] = {}
_decoders: dict[int, tuple[Any, _RowDecoder]] = {}


def _decoder(table: Any) -> _RowDecoder:
    """The row decoder of a table map's table."""
    return _per_table(_decoders, table, _RowDecoder)


def binlog_columns(
    table: Any, json_columns: frozenset[str] = frozenset()
) -> tuple[MySqlColumn, ...]:
    """The columns a table map describes (``binlog_row_metadata=FULL``: names, signedness,
    charsets, ENUM/SET members). ``json_columns``: MariaDB's JSON columns (LONGTEXT)."""
    if json_columns:
        return tuple(_binlog_column(c, json_columns) for c in table.columns)
    return _per_table(
        _described, table, lambda t: tuple(_binlog_column(c, json_columns) for c in t.columns)
    )


def _binlog_column(column: Any, json_columns: frozenset[str]) -> MySqlColumn:  # noqa: C901, PLR0911 - one return per column kind
    name = column.name
    kind = _BINLOG_TYPES.get(column.type)
    binary = column.character_set_name in ("binary", None)
    if column.type in (FIELD_TYPE.VARCHAR, FIELD_TYPE.VAR_STRING):
        kind = "varbinary" if binary else "varchar"
    elif column.type == FIELD_TYPE.STRING:
        if binary:
            return MySqlColumn(name, "binary", length=column.max_length)
        kind = "char"
    elif column.type == FIELD_TYPE.BLOB:
        kind = "blob" if binary else ("json" if name in json_columns else "text")
    if kind is None:
        raise CaptureError(
            f"column {name!r} has binlog type {column.type}, which capture cannot read"
        )
    if kind == "decimal":
        return MySqlColumn(name, kind, column.unsigned, column.precision, column.decimals)
    if kind in ("time", "datetime", "timestamp"):
        return MySqlColumn(name, kind, fsp=getattr(column, "fsp", 0))
    if kind == "bit":
        return MySqlColumn(name, kind, length=column.bits)
    if kind == "enum":
        return MySqlColumn(name, kind, members=tuple((column.enum_values or [""])[1:]))
    if kind == "set":
        return MySqlColumn(name, kind, members=tuple(column.set_values or ()))
    return MySqlColumn(name, kind, column.unsigned if kind in _INTEGER_KINDS else False)


_INTEGER_KINDS = frozenset(("tinyint", "smallint", "mediumint", "int", "bigint"))


# -- the reader -----------------------------------------------------------------------------------


@dataclass
class Connection:
    """How to reach the server as a replica."""

    host: str
    port: int
    user: str
    password: str
    server_id: int
    flavor: str
    extra: dict[str, Any] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "passwd": self.password,
            "charset": "utf8mb4",
            "connect_timeout": 30,
            **self.extra,
        }


class BinlogReader:
    """Reads the binlog from a position to its end, as whole transactions (see the module
    docstring). ``schemas``: the databases whose row events to decode (others' are
    passed over without being read)."""

    def __init__(
        self,
        connection: Connection,
        start: BinlogPosition,
        schemas: set[str],
        *,
        by_gtid: bool = False,
        wanted: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.connection = connection
        self.start = start
        self.wanted = wanted or (lambda schema, table: True)
        self._opened = 0
        settings = connection.settings()
        mariadb = connection.flavor == MARIADB
        position: dict[str, Any]
        if by_gtid:
            if start.mode != GTID or not start.gtids:
                raise CaptureError(f"position {start.text()} has no GTID state to start from")
            position = {"auto_position": start.gtids, "is_mariadb": mariadb}
        else:
            position = {"log_file": start.file, "log_pos": start.pos, "resume_stream": True}
        self.stream = BinLogStreamReader(
            connection_settings=settings,
            server_id=connection.server_id,
            blocking=False,
            only_schemas=sorted(schemas),
            filter_non_implemented_events=False,
            only_events=[
                GtidEvent,
                MariadbGtidEvent,
                QueryEvent,
                XidEvent,
                XAPrepareEvent,
                RotateEvent,
                HeartbeatLogEvent,
                NotImplementedEvent,
                WriteRowsEvent,
                UpdateRowsEvent,
                DeleteRowsEvent,
                PartialUpdateRowsEvent,
            ],
            pymysql_wrapper=self._connect,
            enable_logging=False,
            **position,
        )

    def _connect(self, **settings: Any) -> Any:
        """Connections of the stream: the first one only (mysql-replication connects again
        by itself from where it started, which would read transactions twice)."""
        if settings.get("db") != "information_schema":
            self._opened += 1
            if self._opened > 1:
                raise StreamBroken("the binlog connection was lost: read again")
        try:
            return open_session(**settings)
        except pymysql.err.OperationalError as exc:
            raise SourceConnectionError(f"cannot connect to read the binlog: {exc}") from exc

    def close(self) -> None:
        self.stream.close()

    def __enter__(self) -> BinlogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _where(self, event: Any) -> tuple[str, int, int]:
        """(file, offset, server id) of the start of ``event``."""
        packet = event.packet
        return self.stream.log_file, packet.log_pos - packet.event_size, packet.server_id

    def items(self) -> Iterator[Item]:  # noqa: C901, PLR0912, PLR0915 - one branch per event kind
        """The binlog from the start position to its end, transaction by transaction."""
        stream = self.stream
        begun = False
        """A transaction with BEGIN (or a MariaDB GTID that is not standalone) is open."""
        inside = False
        """A transaction (or a standalone statement's GTID group) is open."""
        xa = False
        try:
            for event in stream:
                ts_ms = event.timestamp * 1000
                if isinstance(event, MariadbGtidEvent | GtidEvent):
                    gtid = event.gtid if isinstance(event, MariadbGtidEvent) else str(event.gtid)
                    standalone = isinstance(event, MariadbGtidEvent) and bool(event.flags & 1)
                    begun, inside, xa = (
                        not standalone and isinstance(event, MariadbGtidEvent),
                        True,
                        False,
                    )
                    yield Begin(gtid, ts_ms, *self._where(event))
                elif isinstance(event, QueryEvent):
                    query = event.query.strip()
                    upper = query[:12].upper()
                    if upper == "BEGIN":
                        if not inside:
                            yield Begin(None, ts_ms, *self._where(event))
                        begun = inside = True
                    elif upper.startswith("XA "):
                        xa = True
                        if upper.startswith(("XA COMMIT", "XA ROLLBACK")):
                            raise CaptureError(
                                f"an XA transaction at {stream.log_file}:{event.packet.log_pos}: "
                                "capture does not capture XA transactions (their rows are in "
                                "the binlog at XA PREPARE, before they commit or roll back)"
                            )
                    elif upper in ("COMMIT", "ROLLBACK"):
                        begun = inside = False
                        yield End(stream.log_file, event.packet.log_pos, ts_ms)
                    else:
                        schema = (
                            event.schema.decode()
                            if isinstance(event.schema, bytes)
                            else event.schema
                        )
                        if not begun:
                            if not inside:
                                yield Begin(None, ts_ms, *self._where(event))
                            yield Statement(schema or "", query, ts_ms)
                            inside = False
                            yield End(stream.log_file, event.packet.log_pos, ts_ms)
                        else:
                            yield Statement(schema or "", query, ts_ms)
                elif isinstance(event, XidEvent):
                    begun = inside = False
                    yield End(stream.log_file, event.packet.log_pos, ts_ms)
                elif isinstance(event, XAPrepareEvent) or xa:
                    raise CaptureError(
                        f"an XA transaction at {stream.log_file}:{event.packet.log_pos}: capture "
                        "does not capture XA transactions"
                    )
                elif isinstance(event, RowsEvent):
                    if not self.wanted(event.schema, event.table):
                        continue
                    op = (
                        "c"
                        if isinstance(event, WriteRowsEvent)
                        else ("d" if isinstance(event, DeleteRowsEvent) else "u")
                    )
                    yield Rows(event.schema, event.table, op, event,
                               (stream.log_file, event.packet.log_pos))  # fmt: skip
                elif isinstance(event, NotImplementedEvent):
                    kind = event.event_type
                    if kind in COMPRESSED_EVENTS:
                        raise CaptureError(
                            f"the binlog holds {COMPRESSED_EVENTS[kind]} at {stream.log_file}:"
                            f"{event.packet.log_pos}, which capture cannot read: turn the "
                            f"compression off and take a new snapshot"
                        )
        except pymysql.err.MySQLError as exc:
            code = exc.args[0] if exc.args else 0
            if code == 1236:
                raise BinlogGone(f"the server cannot send the binlog from {self.start.text()}: "
                                 f"{exc.args[1]}") from exc  # fmt: skip
            if code in (1044, 1045, 1227):
                raise SourcePrivilegeError(
                    f"{self.connection.user} may not read the binlog ({exc.args[1]}): GRANT "
                    f"REPLICATION SLAVE ON *.* TO '{self.connection.user}'"
                ) from exc
            if isinstance(exc, pymysql.err.OperationalError) and code in (2006, 2013, 2014):
                raise StreamBroken(f"the binlog connection was lost: {exc}") from exc
            raise
        if inside:
            raise StreamBroken("the binlog ended inside a transaction: read again")
