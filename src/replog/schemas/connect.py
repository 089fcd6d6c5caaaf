"""Kafka Connect schemas as exact Arrow types, and their JSON values decoded (pure: no
storage, no pyspark).

Debezium's JSON converter sends each value with its Kafka Connect schema; the logical
types say how a value is encoded (docs/CDC.md, "Types"):

=========================================  ==================  ==========================
logical name                               JSON value          Arrow type
=========================================  ==================  ==========================
org.apache.kafka.connect.data.Decimal      base64 two's-       decimal128(p, s): scale
                                           complement bytes    from ``scale``, precision
                                                               ``connect.decimal.precision``
io.debezium.data.VariableScaleDecimal      {scale, value}      string (the exact decimal:
                                                               no fixed scale fits all)
io.debezium.time.Date, connect Date        int32 days          date32
io.debezium.time.Timestamp, connect ...    int64 ms            timestamp[ms, UTC]
io.debezium.time.MicroTimestamp            int64 µs            timestamp[us, UTC]
io.debezium.time.NanoTimestamp             int64 ns            timestamp[ns, UTC]
io.debezium.time.ZonedTimestamp            ISO 8601 string     timestamp[ns, UTC]
io.debezium.time.Time, connect Time        int32 ms            time32[ms]
io.debezium.time.MicroTime                 int64 µs            time64[us]
io.debezium.time.NanoTime                  int64 ns            time64[ns]
io.debezium.time.IsoDate                   ISO 8601 string     date32
io.debezium.time.IsoTimestamp              ISO 8601 string     timestamp[us] (no zone)
io.debezium.time.IsoTime                   ISO 8601 string     time64[us]
io.debezium.data.Json, Enum, Uuid, ...     string              string
=========================================  ==================  ==========================

A Decimal or VariableScaleDecimal whose parameters hold ``decimal.format: NUMERIC`` is a
JSON number with the exact digits instead (Kafka JsonConverter's ``decimal.format=NUMERIC``;
``replog capture postgres`` stores numerics so); a string there (PostgreSQL's ``NaN``,
``Infinity``) is no Decimal and decodes to None (a VariableScaleDecimal, typed as the
exact text, keeps it).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import pyarrow as pa

from replog.errors import IncompatibleSchemaError, InvalidEventError

DECIMAL = "org.apache.kafka.connect.data.Decimal"
VARIABLE_SCALE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
DECIMAL_FORMAT = "decimal.format"
"""The schema parameter saying how a decimal's value is written (JsonConverter's setting)."""
NUMERIC_FORMAT = "NUMERIC"
"""``decimal.format``: a JSON number with the exact digits (the default is base64 bytes)."""
DEFAULT_DECIMAL_PRECISION = 38
"""A Decimal whose schema does not give ``connect.decimal.precision``."""

_TIME_TYPES: dict[str, pa.DataType] = {
    "io.debezium.time.Date": pa.date32(),
    "org.apache.kafka.connect.data.Date": pa.date32(),
    "io.debezium.time.Timestamp": pa.timestamp("ms", tz="UTC"),
    "org.apache.kafka.connect.data.Timestamp": pa.timestamp("ms", tz="UTC"),
    "io.debezium.time.MicroTimestamp": pa.timestamp("us", tz="UTC"),
    "io.debezium.time.NanoTimestamp": pa.timestamp("ns", tz="UTC"),
    "io.debezium.time.ZonedTimestamp": pa.timestamp("ns", tz="UTC"),
    "io.debezium.time.Time": pa.time32("ms"),
    "org.apache.kafka.connect.data.Time": pa.time32("ms"),
    "io.debezium.time.MicroTime": pa.time64("us"),
    "io.debezium.time.NanoTime": pa.time64("ns"),
    "io.debezium.time.IsoDate": pa.date32(),
    "io.debezium.time.IsoTimestamp": pa.timestamp("us"),
    "io.debezium.time.IsoTime": pa.time64("us"),
}
_PRIMITIVES: dict[str, pa.DataType] = {
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "boolean": pa.bool_(),
    "string": pa.string(),
    "bytes": pa.binary(),
}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


@dataclass(frozen=True)
class Column:
    """One field of a Kafka Connect schema and the exact Arrow type of its values."""

    name: str
    type: pa.DataType
    connect: str
    """The Connect type (``int64``, ``bytes``, ``struct``, ...)."""
    logical: str | None = None
    """The schema's ``name`` for a logical type (``io.debezium.time.Date``)."""
    optional: bool = True
    scale: int | None = None
    """A Decimal's scale (only the schema holds it)."""
    children: tuple[Column, ...] = ()
    """A struct's fields; an array's element; a map's key and value."""
    numeric: bool = False
    """A decimal written as a JSON number (``decimal.format: NUMERIC``), not base64."""
    default: Any = None
    """The schema's ``default`` (its stored JSON form): what a row written before the
    column existed reads (PostgreSQL's ``ADD COLUMN ... DEFAULT``); None: NULL."""

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "name": self.name,
            "type": str(self.type),
            "connect": self.connect,
            "logical": self.logical,
            "optional": self.optional,
        }
        if self.children:
            document["fields"] = [child.to_json() for child in self.children]
        return document


def canonical(schema: Mapping[str, Any]) -> bytes:
    """The schema's canonical JSON (sorted keys, no spaces): what its digest is of."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(schema: Mapping[str, Any]) -> str:
    """The content address of a schema: the SHA-256 of its canonical JSON."""
    return hashlib.sha256(canonical(schema)).hexdigest()


def column(schema: Mapping[str, Any], name: str | None = None) -> Column:
    """The column a Connect (field) schema describes, with its ``default``.

    Raises:
        InvalidEventError: the schema names no known Connect type.
    """
    found = _column(schema, name)
    default = schema.get("default")
    return found if default is None else replace(found, default=default)


def _column(schema: Mapping[str, Any], name: str | None = None) -> Column:  # noqa: PLR0911
    """The column a Connect (field) schema describes.

    Raises:
        InvalidEventError: the schema names no known Connect type.
    """
    field = name if name is not None else str(schema.get("field", ""))
    kind = schema.get("type")
    logical = schema.get("name")
    optional = bool(schema.get("optional", False))
    parameters = schema.get("parameters") or {}
    numeric = parameters.get(DECIMAL_FORMAT) == NUMERIC_FORMAT
    if logical == DECIMAL:
        try:
            scale = int(parameters["scale"])
            precision = int(parameters.get("connect.decimal.precision", DEFAULT_DECIMAL_PRECISION))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidEventError(
                f"field {field!r}: a Decimal schema needs an integer 'scale' parameter, got "
                f"{parameters!r}"
            ) from exc
        precision = max(precision, scale, 1)
        arrow = (
            pa.decimal128(precision, scale) if precision <= 38 else pa.decimal256(precision, scale)
        )
        return Column(field, arrow, str(kind), logical, optional, scale, numeric=numeric)
    if logical == VARIABLE_SCALE_DECIMAL:
        return Column(field, pa.string(), str(kind), logical, optional, numeric=numeric)
    if isinstance(logical, str) and logical in _TIME_TYPES:
        return Column(field, _TIME_TYPES[logical], str(kind), logical, optional)
    if kind in _PRIMITIVES:
        return Column(field, _PRIMITIVES[str(kind)], str(kind), logical, optional)
    if kind == "struct":
        children = tuple(column(child) for child in schema.get("fields", []))
        arrow_struct = pa.struct([pa.field(c.name, c.type) for c in children])
        return Column(field, arrow_struct, "struct", logical, optional, children=children)
    if kind == "array":
        element = column(schema.get("items") or {}, "element")
        arrow_list = pa.list_(element.type)
        return Column(field, arrow_list, "array", logical, optional, children=(element,))
    if kind == "map":
        key = column(schema.get("keys") or {}, "key")
        value = column(schema.get("values") or {}, "value")
        arrow_map = pa.map_(key.type, value.type)
        return Column(field, arrow_map, "map", logical, optional, children=(key, value))
    raise InvalidEventError(f"field {field!r}: unknown Kafka Connect type {kind!r}")


def row_columns(schema: Mapping[str, Any]) -> tuple[Column, ...]:
    """The row's columns in a value schema: the ``after`` (else ``before``) struct of a
    change-event envelope, or the struct itself (ExtractNewRecordState's flat rows)."""
    fields = {f.get("field"): f for f in schema.get("fields", [])}
    for image in ("after", "before"):
        if image in fields and fields[image].get("type") == "struct":
            return column(fields[image], image).children
    return column(schema, "row").children


def arrow_schema(columns: Sequence[Column]) -> pa.Schema:
    return pa.schema([pa.field(c.name, c.type, nullable=c.optional) for c in columns])


# -- the union of versions ---------------------------------------------------------------

_INTS = ["int8", "int16", "int32", "int64"]
_FLOATS = ["float32", "float64"]


def _merge(old: Column, new: Column, where: str, versions: tuple[str, str]) -> Column:
    """One column that holds the values of both (a widening), else an error."""
    optional = old.optional or new.optional
    if (old.logical, old.connect, old.numeric) == (new.logical, new.connect, new.numeric):
        if old.connect == "struct":
            children = _union(old.children, new.children, f"{where}.", versions)
            arrow = pa.struct([pa.field(c.name, c.type) for c in children])
            return replace(old, type=arrow, children=children, optional=optional)
        if old.type == new.type:
            return replace(old, optional=optional)
        if old.logical == DECIMAL and old.scale == new.scale:
            wider = old if old.type.precision >= new.type.precision else new
            return replace(wider, name=old.name, optional=optional)
    if old.logical is None and new.logical is None:
        for ladder in (_INTS, _FLOATS):
            if old.connect in ladder and new.connect in ladder:
                wider = max(old, new, key=lambda c: ladder.index(c.connect))
                return replace(wider, name=old.name, optional=optional)
    raise IncompatibleSchemaError(
        f"column {where}{old.name!r} is {_describe(old)} in schema version {versions[0]} but "
        f"{_describe(new)} in version {versions[1]}: no one type holds both"
    )


def _describe(c: Column) -> str:
    numeric = ", as JSON numbers" if c.numeric else ""
    return f"{c.type} ({c.connect}{', ' + c.logical if c.logical else ''}{numeric})"


def _union(
    old: Sequence[Column], new: Sequence[Column], where: str, versions: tuple[str, str]
) -> tuple[Column, ...]:
    merged = {c.name: c for c in old}
    for c in new:
        merged[c.name] = _merge(merged[c.name], c, where, versions) if c.name in merged else c
    return tuple(merged.values())


def union(versions: Sequence[tuple[str, Sequence[Column]]]) -> tuple[Column, ...]:
    """The columns of every version in order (``(version, columns)`` oldest first): a column
    that appears later is added (null in rows of earlier versions); a type that widens is
    widened. Raises :class:`IncompatibleSchemaError` naming the column and both versions."""
    columns: tuple[Column, ...] = ()
    seen: dict[str, str] = {}  # column name -> the version that gave its type
    for version, row in versions:
        merged = list(columns)
        for c in row:
            if c.name in seen:
                index = next(i for i, m in enumerate(merged) if m.name == c.name)
                merged[index] = _merge(merged[index], c, "", (seen[c.name], version))
            else:
                merged.append(replace(c, optional=True) if columns else c)
                seen[c.name] = version
        columns = tuple(merged)
    return columns


# -- values --------------------------------------------------------------------------------


def decode_decimal(text: str, scale: int) -> Decimal:
    """A Connect Decimal: base64 of the big-endian two's-complement unscaled value."""
    try:
        unscaled = int.from_bytes(base64.b64decode(text, validate=True), "big", signed=True)
    except (ValueError, TypeError) as exc:
        raise InvalidEventError(f"{text!r} is not a base64 Decimal: {exc}") from exc
    return Decimal(unscaled).scaleb(-scale)


def decode_variable_scale(value: Mapping[str, Any]) -> Decimal:
    """A VariableScaleDecimal: ``{"scale": s, "value": <base64 unscaled bytes>}``."""
    return decode_decimal(str(value["value"]), int(value["scale"]))


def decode_number(value: Any) -> Decimal | None:
    """A decimal written as a JSON number (parsed to a ``Decimal``, an int, or a float):
    the exact value; a string (``NaN``, ``Infinity``: no decimal holds them) is None."""
    if isinstance(value, str | bool):
        return None
    return value if isinstance(value, Decimal) else Decimal(str(value))


def _iso(kind: pa.DataType, text: str) -> Any:
    """An ISO 8601 date, time or timestamp (None for what Python cannot hold: ``infinity``,
    dates before year 1)."""
    try:
        if pa.types.is_date32(kind):
            return date.fromisoformat(text)
        if pa.types.is_time(kind):
            return time.fromisoformat(text)
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return stamp.astimezone(timezone.utc) if kind.tz is not None else stamp


def _epoch(value: int, unit: str) -> datetime:
    seconds, rest = divmod(int(value), _UNITS[unit])
    micros = rest * 1_000_000 // _UNITS[unit]
    return _EPOCH + timedelta(seconds=seconds, microseconds=micros)


def decode(c: Column, value: Any) -> Any:  # noqa: PLR0911 - one return per type
    """A JSON value of column ``c`` as the Python value of its Arrow type (``pa.array``
    takes it; nanoseconds are cut to microseconds, Python's resolution)."""
    if value is None:
        return None
    if c.numeric and c.logical == VARIABLE_SCALE_DECIMAL:  # a string: NaN, Infinity kept
        return value if isinstance(value, str) else str(decode_number(value))
    if c.numeric:
        return decode_number(value)
    if c.logical == VARIABLE_SCALE_DECIMAL:
        return str(decode_variable_scale(value))
    if c.connect == "struct":
        return {child.name: decode(child, value.get(child.name)) for child in c.children}
    if c.connect == "array":
        return [decode(c.children[0], item) for item in value]
    if c.connect == "map":
        return [(decode(c.children[0], k), decode(c.children[1], v)) for k, v in value.items()]
    return _scalar(c, value)


def _scalar(c: Column, value: Any) -> Any:  # noqa: PLR0911 - one return per type
    if c.logical == DECIMAL:
        return decode_decimal(value, c.scale or 0)
    kind = c.type
    if isinstance(value, str) and c.connect == "string" and pa.types.is_temporal(kind):
        return _iso(kind, value)
    if pa.types.is_date32(kind):
        return date(1970, 1, 1) + timedelta(days=int(value))
    if pa.types.is_timestamp(kind):
        return _epoch(value, kind.unit)
    if pa.types.is_time(kind):
        stamp = _epoch(value, kind.unit)
        return time(stamp.hour, stamp.minute, stamp.second, stamp.microsecond)
    if pa.types.is_binary(kind):
        return base64.b64decode(value)
    return value


def to_arrow(columns: Sequence[Column], rows: Sequence[Mapping[str, Any] | None]) -> pa.Table:
    """Rows (parsed JSON payloads) as an Arrow table typed by ``columns``."""
    arrays = [
        pa.array([decode(c, row.get(c.name)) if row else None for row in rows], type=c.type)
        for c in columns
    ]
    schema = arrow_schema([replace(c, optional=True) for c in columns])
    return pa.Table.from_arrays(arrays, schema=schema)
