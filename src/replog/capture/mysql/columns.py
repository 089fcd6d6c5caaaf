"""MySQL and MariaDB column types: one description whichever path saw the column, its
Kafka Connect schema, and its values as exact JSON (docs/CDC.md, "MySQL types").

DESIGN: a column is described by :class:`MySqlColumn` from the binlog's table map (with
``binlog_row_metadata=FULL`` it names columns, their signedness, charsets, ENUM and SET
members and the primary key: the table as it was at that point of the binlog) or from
``information_schema`` (the snapshot). The schema uses only what both give, so an
unchanged table has one schema, and one digest, on both paths.

Values are JSON text, one text per value whichever path read it: the snapshot reads the
server's text output (:func:`text_fragment`, the SELECT expressions of
:func:`select_expression`), the binlog decoder reads the row image's bytes
(:mod:`~replog.capture.mysql.binlog`), and both end in the writers below:

==========================  ==================================  ===============================
MySQL                       stored JSON value                   Connect schema
==========================  ==================================  ===============================
integers                    number                              ``int16``/``int32``/``int64``
                                                                (Debezium's widths: a TINYINT(1)
                                                                is an ``int16``: it holds 0..127)
``BIGINT UNSIGNED``         number (up to 2^64 - 1)             ``Decimal(20, 0)``, NUMERIC
``DECIMAL(p, s)``           number, exactly ``s`` decimals      ``Decimal``, NUMERIC
``FLOAT`` / ``DOUBLE``      shortest text that reads back as    ``float`` / ``double``
                            the same 32 / 64-bit float
``BIT(1)`` / ``BIT(n)``     ``true``/``false`` / base64,        ``boolean`` / ``bytes``
                            little-endian (Debezium's Bits)     ``io.debezium.data.Bits``
``YEAR``                    number (``0`` for ``0000``)         ``int32`` ``io.debezium.time.Year``
``DATE``, ``DATETIME(n)``   ISO 8601 wall clock, ``n`` digits   ``IsoDate``/``IsoTimestamp``
``TIMESTAMP(n)``            ISO 8601 UTC instant (``...Z``)     ``ZonedTimestamp``
``TIME(n)``                 number of µs (-838:59:59..)         ``int64`` ``MicroTime``
zero dates (``0000-00-00``) ``null`` (counted, as Debezium)
``CHAR``, ``VARCHAR``,      string (decoded from the column's   ``string``
``TEXT``                    charset: utf8mb4, latin1, ...)
``BINARY(n)``, ``VARBINARY``, base64 (``BINARY`` padded to n)   ``bytes``
``BLOB``
``ENUM`` / ``SET``          its text (``'a,c'``; ``''``)        ``string`` ``io.debezium.data
                                                                .Enum`` / ``EnumSet``
``JSON``                    string: the text (MariaDB: as       ``string`` ``io.debezium.data
                            written; MySQL: the server's form)  .Json``
``GEOMETRY`` and its kinds  ``{"wkb": base64, "srid": n}``      ``io.debezium.data.geometry
                                                                .Geometry`` struct
==========================  ==================================  ===============================
"""

from __future__ import annotations

import base64
import codecs
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from replog.capture.schemas import decimal_schema, envelope_schema
from replog.errors import SourceConfigError

INTEGERS = ("tinyint", "smallint", "mediumint", "int", "bigint")
TEXTS = ("char", "varchar", "text")
BINARIES = ("binary", "varbinary", "blob")
TEMPORALS = ("date", "datetime", "timestamp", "time", "year")
KINDS = (
    *INTEGERS,
    "decimal",
    "float",
    "double",
    "bit",
    *TEMPORALS,
    *TEXTS,
    *BINARIES,
    "enum",
    "set",
    "json",
    "geometry",
)

_CATALOG_KINDS = {
    **{kind: kind for kind in KINDS},
    "numeric": "decimal",
    "real": "double",
    "tinytext": "text",
    "mediumtext": "text",
    "longtext": "text",
    "tinyblob": "blob",
    "mediumblob": "blob",
    "longblob": "blob",
    **{
        shape: "geometry"
        for shape in (
            "point",
            "linestring",
            "polygon",
            "multipoint",
            "multilinestring",
            "multipolygon",
            "geometrycollection",
        )
    },
}
"""``information_schema.COLUMNS.DATA_TYPE`` -> the kind."""


class Zero(str):
    """A zero date (``0000-00-00``, or a zero month or day): stored as JSON ``null`` and
    counted (Debezium writes such dates as null)."""

    __slots__ = ()


ZERO = Zero("null")
"""The fragment of a zero date: ``null`` that the event maker can tell from a NULL."""


@dataclass(frozen=True)
class MySqlColumn:
    """One column, as the schema and the value writers need it."""

    name: str
    kind: str
    unsigned: bool = False
    precision: int = 0
    """``DECIMAL``'s digits."""
    scale: int = 0
    """``DECIMAL``'s digits after the point."""
    fsp: int = 0
    """Digits of a second's fraction (``TIME``, ``DATETIME``, ``TIMESTAMP``)."""
    length: int = 0
    """``BIT(n)``'s bits; ``BINARY(n)``'s bytes."""
    members: tuple[str, ...] = ()
    """``ENUM``/``SET`` members, in their defined order."""

    def schema(self) -> dict[str, Any]:
        """The Connect schema of the column's stored values (without ``field``/``optional``)."""
        return column_schema(self)


# -- from the catalog and from the binlog ------------------------------------------------

_LITERAL = re.compile(r"'((?:[^']|'')*)'")
_SIZE = re.compile(r"\((\d+)\)")


def catalog_column(
    name: str,
    data_type: str,
    column_type: str,
    *,
    precision: int | None = None,
    scale: int | None = None,
    fsp: int | None = None,
    octets: int | None = None,
    json_columns: frozenset[str] = frozenset(),
    table: str = "",
) -> MySqlColumn:
    """A column as ``information_schema.COLUMNS`` describes it (``DATA_TYPE``,
    ``COLUMN_TYPE``, ``NUMERIC_PRECISION``/``SCALE``, ``DATETIME_PRECISION``,
    ``CHARACTER_OCTET_LENGTH``). ``json_columns``: MariaDB's ``JSON`` columns (a LONGTEXT
    with a ``json_valid`` check). A type capture cannot write exactly is refused by name."""
    data_type = data_type.lower()
    kind = _CATALOG_KINDS.get(data_type)
    if kind == "text" and name in json_columns:
        kind = "json"
    if kind is None:
        raise SourceConfigError(
            f"column {table}.{name} has type {column_type}, which capture cannot write "
            f"exactly (MariaDB's UUID, INET4, INET6 and other plug-in types are not "
            f"supported): leave the table out, or change the column's type"
        )
    unsigned = "unsigned" in column_type.lower()
    if kind == "decimal":
        return MySqlColumn(name, kind, unsigned, precision or 10, scale or 0)
    if kind in ("time", "datetime", "timestamp"):
        return MySqlColumn(name, kind, fsp=fsp or 0)
    if kind == "bit":
        found = _SIZE.search(column_type)
        return MySqlColumn(name, kind, length=int(found.group(1)) if found else 1)
    if kind == "binary":
        return MySqlColumn(name, kind, length=octets or 0)
    if kind in ("enum", "set"):
        members = tuple(m.replace("''", "'") for m in _LITERAL.findall(column_type))
        return MySqlColumn(name, kind, members=members)
    return MySqlColumn(name, kind, unsigned if kind in INTEGERS else False)


# -- Connect schemas ------------------------------------------------------------------------

_INTEGER_SCHEMAS = {
    ("tinyint", False): "int16",
    ("tinyint", True): "int16",
    ("smallint", False): "int16",
    ("smallint", True): "int32",
    ("mediumint", False): "int32",
    ("mediumint", True): "int32",
    ("int", False): "int32",
    ("int", True): "int64",
    ("bigint", False): "int64",
}
"""Debezium MySQL's integer types (``BIGINT UNSIGNED``: a Decimal, ``precise`` mode)."""


def _logical(name: str, kind: str = "string", **parameters: str) -> dict[str, Any]:
    found: dict[str, Any] = {"type": kind, "name": name, "version": 1}
    if parameters:
        found["parameters"] = parameters
    return found


_TIME = "io.debezium.time."
_FIXED: dict[str, dict[str, Any]] = {
    "float": {"type": "float"},
    "double": {"type": "double"},
    "year": _logical(f"{_TIME}Year", "int32"),
    "date": _logical(f"{_TIME}IsoDate"),
    "datetime": _logical(f"{_TIME}IsoTimestamp"),
    "timestamp": _logical(f"{_TIME}ZonedTimestamp"),
    "time": _logical(f"{_TIME}MicroTime", "int64"),
    "json": _logical("io.debezium.data.Json"),
    "geometry": {
        "type": "struct",
        "name": "io.debezium.data.geometry.Geometry",
        "version": 1,
        "doc": "Geometry",
        "fields": [
            {"field": "wkb", "type": "bytes", "optional": False},
            {"field": "srid", "type": "int32", "optional": True},
        ],
    },
    **{kind: {"type": "string"} for kind in TEXTS},
    **{kind: {"type": "bytes"} for kind in BINARIES},
}


def column_schema(column: MySqlColumn) -> dict[str, Any]:  # noqa: PLR0911 - one return per type
    """The Connect schema of ``column``'s stored values (see the module's table)."""
    kind = column.kind
    if kind in INTEGERS:
        if kind == "bigint" and column.unsigned:
            return decimal_schema(20, 0)
        return {"type": _INTEGER_SCHEMAS[(kind, column.unsigned)]}
    if kind == "decimal":
        return decimal_schema(column.precision, column.scale)
    if kind == "bit":
        if column.length == 1:
            return {"type": "boolean"}
        return _logical("io.debezium.data.Bits", "bytes", length=str(column.length))
    if kind in ("enum", "set"):
        name = "io.debezium.data.Enum" if kind == "enum" else "io.debezium.data.EnumSet"
        return _logical(name, allowed=",".join(column.members))
    return dict(_FIXED[kind])


def table_schema(
    prefix: str, columns: tuple[MySqlColumn, ...], key: tuple[str, ...]
) -> dict[str, Any]:
    """The change-event envelope schema of a table (``prefix``: ``<name>.<db>.<table>``):
    key columns required, every other column optional (a zero date is null whatever the
    column says)."""
    fields = [
        {"field": column.name, **column.schema(), "optional": column.name not in key}
        for column in columns
    ]
    return envelope_schema(prefix, fields)


# -- the value writers both paths end in ------------------------------------------------------

quoted: Callable[[str], str] = __import__("json").encoder.encode_basestring
"""A JSON string, as ``json.dumps(text, ensure_ascii=False)`` writes it (its C core)."""


def float_text(value: float) -> str:
    """A FLOAT's JSON: the shortest text that reads back as the same 32-bit float
    (``1.2345678``, not the double ``1.2345677614212036`` it widens to)."""
    return str(np.float32(value))


def double_text(value: float) -> str:
    """A DOUBLE's JSON: the shortest text that reads back as the same double."""
    return repr(value)


def base64_text(raw: bytes) -> str:
    return '"' + base64.b64encode(raw).decode("ascii") + '"'


def bits_text(value: int, bits: int) -> str:
    """A ``BIT(n)``: ``true``/``false`` for one bit; else Debezium's Bits, the value's
    bytes little-endian, as many as ``n`` bits need, in base64."""
    if bits == 1:
        return "true" if value else "false"
    return base64_text(value.to_bytes((bits + 7) // 8, "little"))


def geometry_text(raw: bytes) -> str:
    """A geometry as MySQL stores it (4 bytes of SRID, little-endian, then WKB): Debezium's
    Geometry struct."""
    srid = int.from_bytes(raw[:4], "little")
    return '{"wkb":' + base64_text(raw[4:]) + ',"srid":' + str(srid) + "}"


def fraction(micros: int, fsp: int) -> str:
    """``.ffff`` of a value with ``fsp`` digits (nothing for 0 digits)."""
    if not fsp:
        return ""
    return "." + f"{micros:06d}"[:fsp]


def _mysql_latin1(error: UnicodeError) -> tuple[str, int]:
    """MySQL's ``latin1`` is Windows-1252 whose five unassigned bytes (0x81, 0x8D, 0x8F,
    0x90, 0x9D) are the code points of their value."""
    assert isinstance(error, UnicodeDecodeError)
    return chr(error.object[error.start]), error.start + 1


codecs.register_error("replog-mysql-latin1", _mysql_latin1)


_CODECS = {
    "utf16": "utf-16-be",
    "ucs2": "utf-16-be",
    "utf16le": "utf-16-le",
    "utf32": "utf-32-be",
}
"""MySQL's wide charsets, whose bytes are big-endian unless named ``le`` (Python's
``utf16`` and ``utf32`` read this machine's order, and it has no ``ucs2``)."""


def codec(encoding: str | None) -> str:
    """The Python codec of a column's charset (as mysql-replication names MySQL's)."""
    return _CODECS.get(encoding or "", encoding or "utf-8")


def decode_text(raw: bytes, encoding: str) -> str:
    """Text of a column in ``encoding`` (as mysql-replication names MySQL's charsets)."""
    if encoding == "cp1252":
        return raw.decode("cp1252", "replog-mysql-latin1")
    return raw.decode(codec(encoding))


# -- the snapshot path: the server's text output --------------------------------------------


def select_expression(column: MySqlColumn) -> str:
    """What a snapshot selects for ``column``: the column itself (its text output), except
    a FLOAT, whose text the server cuts to six digits: as the double it widens to (exact)."""
    name = identifier(column.name)
    if column.kind == "float":
        return f"CAST({name} AS DOUBLE)"
    return name


def identifier(name: str) -> str:
    """A quoted MySQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def _text(value: str | bytes) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else value


def _date_text(value: str | bytes) -> str:
    text = _text(value)
    if text[5:7] == "00" or text[8:10] == "00":
        return ZERO
    return '"' + text + '"'


def _datetime_text(value: str | bytes) -> str:
    text = _text(value)
    if text[5:7] == "00" or text[8:10] == "00":
        return ZERO
    return '"' + text.replace(" ", "T", 1) + '"'


def _timestamp_text(value: str | bytes) -> str:
    text = _text(value)
    if text.startswith("0000-00-00"):
        return ZERO
    return '"' + text.replace(" ", "T", 1) + 'Z"'


def time_micros(text: str) -> int:
    """``-838:59:59.500000`` -> its microseconds."""
    negative = text.startswith("-")
    clock, _, digits = text.lstrip("-").partition(".")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    micros = ((hours * 60 + minutes) * 60 + seconds) * 1_000_000 + int((digits + "000000")[:6])
    return -micros if negative else micros


def _bits_of(column: MySqlColumn) -> Callable[[str | bytes], str]:
    def bits(value: str | bytes) -> str:
        raw = value if isinstance(value, bytes) else value.encode("latin-1")
        return bits_text(int.from_bytes(raw, "big"), column.length)

    return bits


def _bytes_of(column: MySqlColumn) -> Callable[[str | bytes], str]:
    def raw(value: str | bytes) -> str:
        data = value if isinstance(value, bytes) else value.encode("utf-8")
        return base64_text(data)

    return raw


def _geometry(value: str | bytes) -> str:
    return geometry_text(value if isinstance(value, bytes) else value.encode("latin-1"))


def _string(value: str | bytes) -> str:
    return quoted(value.decode("utf-8") if isinstance(value, bytes) else value)


_TEXT_WRITERS: Mapping[str, Callable[[str | bytes], str]] = {
    **{kind: _text for kind in INTEGERS},
    "decimal": _text,
    "float": lambda value: float_text(float(_text(value))),
    "double": lambda value: double_text(float(_text(value))),
    "year": lambda value: str(int(_text(value))),
    "date": _date_text,
    "datetime": _datetime_text,
    "timestamp": _timestamp_text,
    "time": lambda value: str(time_micros(_text(value))),
    "geometry": _geometry,
    **{kind: _string for kind in (*TEXTS, "enum", "set", "json")},
}


def text_fragment(column: MySqlColumn) -> Callable[[str | bytes], str]:
    """How the server's text output of ``column`` (as PyMySQL returns it without
    conversions: ``str`` for text, ``bytes`` for binary and numbers) becomes its JSON.
    The session reads TIMESTAMPs in UTC (``time_zone = '+00:00'``)."""
    if column.kind == "bit":
        return _bits_of(column)
    if column.kind in BINARIES:
        return _bytes_of(column)
    return _TEXT_WRITERS[column.kind]
