"""Kafka Connect schemas as exact Arrow types, and their JSON values decoded (pure: no
storage, no pyspark).

Debezium's JSON converter sends each value with its Kafka Connect schema; the logical
types say how a value is encoded (docs/CDC.md, "Types"). Kafka's ``JsonConverter`` names
Connect's FLOAT32/FLOAT64 ``"float"``/``"double"`` in a schema (``JsonSchema``); the
``float32``/``float64`` that ``replog capture`` registered before are read too.

=========================================  ==================  ==========================
logical name                               JSON value          Arrow type
=========================================  ==================  ==========================
org.apache.kafka.connect.data.Decimal      base64 two's-       decimal128(p, s): scale
                                           complement bytes,   from ``scale``, precision
                                           or a JSON number    ``connect.decimal.precision``
io.debezium.data.VariableScaleDecimal      {scale, value}      string (the exact decimal)
io.debezium.time.Date, connect Date        int32 days          date32
io.debezium.time.Timestamp, connect ...    int64 ms            timestamp[ms] (no zone)
io.debezium.time.MicroTimestamp            int64 µs            timestamp[us] (no zone)
io.debezium.time.NanoTimestamp             int64 ns            timestamp[ns] (no zone)
io.debezium.time.ZonedTimestamp            ISO 8601 string     timestamp[ns, UTC]
io.debezium.time.Time, connect Time        int32 ms            time32[ms]
io.debezium.time.MicroTime / NanoTime      int64 µs / ns       time64[us] / time64[ns]
io.debezium.time.IsoDate                   ``2017-09-15Z``     date32
io.debezium.time.IsoTimestamp              ISO 8601 string     timestamp[ns] (no zone)
io.debezium.time.IsoTime                   ``04:05:11.789Z``   time64[ns]
io.debezium.time.ZonedTime                 ``12:05:11Z``       time64[ns] (in UTC)
io.debezium.time.MicroDuration / Nano...   int64 µs / ns       duration[us] / [ns]
io.debezium.time.Interval                  ``P1Y2M3DT4H5M6S``  month_day_nano_interval
io.debezium.time.Structured* (structured   a struct of fields  date32, time64[ns],
time.precision.mode)                                           timestamp[ns] (UTC when
                                                               zoned), month_day_nano
io.debezium.data.Json, Enum, Uuid, ...     string              string
=========================================  ==================  ==========================

Debezium's ``Timestamp``/``MicroTimestamp``/``NanoTimestamp`` (and Connect's ``Timestamp``
that its ``connect`` mode sends) hold a column *without* a time zone, written as if it were
UTC; ``IsoTimestamp``/``IsoDate``/``IsoTime`` write the same wall clock with a ``Z`` after
it: all are zone-less (the ``Z`` is dropped, not applied). ``ZonedTimestamp`` and
``ZonedTime`` carry a real offset, applied: instants, and a time of day in UTC.

A Decimal's encoding is told by its value's JSON type, as JsonConverter reads it: a string
is base64 bytes, a number (``decimal.format=NUMERIC``; the schema is the plain Decimal
schema) its exact digits. ``replog capture postgres`` marks its decimals with the parameter
``decimal.format: NUMERIC``: there a string is PostgreSQL's ``NaN``/``Infinity``, which no
Decimal holds (None; a VariableScaleDecimal, typed as the exact text, keeps it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Any

import pyarrow as pa

from replog.errors import IncompatibleSchemaError, InvalidEventError

DECIMAL = "org.apache.kafka.connect.data.Decimal"
VARIABLE_SCALE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
DECIMAL_FORMAT = "decimal.format"
"""The parameter ``replog capture postgres`` marks its decimals with (JsonConverter's
setting's name): its strings are ``NaN``/``Infinity``, not base64."""
NUMERIC_FORMAT = "NUMERIC"
DEFAULT_DECIMAL_PRECISION = 38
"""A Decimal whose schema does not give ``connect.decimal.precision``."""

_TIME = "io.debezium.time."
INTERVAL_TYPE = pa.month_day_nano_interval()

_TIME_TYPES: dict[str, pa.DataType] = {
    f"{_TIME}Date": pa.date32(),
    "org.apache.kafka.connect.data.Date": pa.date32(),
    f"{_TIME}Timestamp": pa.timestamp("ms"),
    "org.apache.kafka.connect.data.Timestamp": pa.timestamp("ms"),
    f"{_TIME}MicroTimestamp": pa.timestamp("us"),
    f"{_TIME}NanoTimestamp": pa.timestamp("ns"),
    f"{_TIME}ZonedTimestamp": pa.timestamp("ns", tz="UTC"),
    f"{_TIME}Time": pa.time32("ms"),
    "org.apache.kafka.connect.data.Time": pa.time32("ms"),
    f"{_TIME}MicroTime": pa.time64("us"),
    f"{_TIME}NanoTime": pa.time64("ns"),
    f"{_TIME}IsoDate": pa.date32(),
    f"{_TIME}IsoTimestamp": pa.timestamp("ns"),
    f"{_TIME}IsoTime": pa.time64("ns"),
    f"{_TIME}ZonedTime": pa.time64("ns"),
    f"{_TIME}MicroDuration": pa.duration("us"),
    f"{_TIME}NanoDuration": pa.duration("ns"),
    f"{_TIME}Interval": INTERVAL_TYPE,
}
"""Scalar logical types (the value is an int or a string)."""

STRUCTURED_TYPES: dict[str, pa.DataType] = {
    f"{_TIME}StructuredDate": pa.date32(),
    f"{_TIME}StructuredTime": pa.time64("ns"),
    f"{_TIME}StructuredTimestamp": pa.timestamp("ns"),
    f"{_TIME}StructuredZonedTimestamp": pa.timestamp("ns", tz="UTC"),
    f"{_TIME}StructuredZonedTime": pa.time64("ns"),
    f"{_TIME}StructuredDuration": INTERVAL_TYPE,
}
"""Logical types of ``time.precision.mode=structured``: a struct of calendar and clock fields
(``year``, ``month``, ..., ``nanos``, ``offsetSeconds``, ``specialValue``), one value."""

_ISO_STRINGS = {f"{_TIME}{name}" for name in ("IsoDate", "IsoTimestamp", "IsoTime")}
"""Zone-less values written with an offset (``Z``) that is dropped, not applied."""

_PRIMITIVES: dict[str, tuple[str, pa.DataType]] = {
    "int8": ("int8", pa.int8()),
    "int16": ("int16", pa.int16()),
    "int32": ("int32", pa.int32()),
    "int64": ("int64", pa.int64()),
    "float": ("float32", pa.float32()),  # JsonConverter's name of FLOAT32
    "double": ("float64", pa.float64()),  # ... and of FLOAT64
    "float32": ("float32", pa.float32()),  # what replog capture registered before
    "float64": ("float64", pa.float64()),
    "boolean": ("boolean", pa.bool_()),
    "string": ("string", pa.string()),
    "bytes": ("bytes", pa.binary()),
}
"""A schema's ``type`` → (Connect's Schema.Type, lowercased; the Arrow type)."""

_NS = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}
NANOS_PER_DAY = 86_400_000_000_000


@dataclass(frozen=True)
class Column:
    """One field of a Kafka Connect schema and the exact Arrow type of its values."""

    name: str
    type: pa.DataType
    connect: str
    """Connect's type (``int64``, ``float64``, ``bytes``, ``struct``, ...; JsonConverter's
    ``double`` is ``float64``)."""
    logical: str | None = None
    """The schema's ``name`` for a logical type (``io.debezium.time.Date``)."""
    optional: bool = True
    scale: int | None = None
    """A Decimal's scale (only the schema holds it)."""
    children: tuple[Column, ...] = ()
    """A struct's fields; an array's element; a map's key and value."""
    numeric: bool = False
    """A decimal of ``replog capture`` (``decimal.format: NUMERIC``): a string is a value
    no decimal holds (``NaN``), not base64."""
    default: Any = None
    """The schema's ``default`` (its stored JSON form): what a row written before the
    column existed reads (PostgreSQL's ``ADD COLUMN ... DEFAULT``); None: NULL."""

    @property
    def structured(self) -> bool:
        """A ``time.precision.mode=structured`` value: a struct on the wire, one value."""
        return self.logical in STRUCTURED_TYPES

    @property
    def decimal(self) -> bool:
        return self.logical in (DECIMAL, VARIABLE_SCALE_DECIMAL)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "name": self.name,
            "type": str(self.type),
            "connect": self.connect,
            "logical": self.logical,
            "optional": self.optional,
        }
        if self.children and not self.structured:
            document["fields"] = [child.to_json() for child in self.children]
        return document


def canonical(schema: Mapping[str, Any]) -> bytes:
    """The schema's canonical JSON (sorted keys, no spaces): what its digest is of."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(schema: Mapping[str, Any]) -> str:
    """The content address of a schema: the SHA-256 of its canonical JSON."""
    return hashlib.sha256(canonical(schema)).hexdigest()


def _decimal_column(
    field: str, kind: str, parameters: Mapping[str, Any], optional: bool, numeric: bool
) -> Column:
    try:
        scale = int(parameters["scale"])
        precision = int(parameters.get("connect.decimal.precision", DEFAULT_DECIMAL_PRECISION))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidEventError(
            f"field {field!r}: a Decimal schema needs an integer 'scale' parameter, got "
            f"{dict(parameters)!r}"
        ) from exc
    precision = max(precision, scale, 1)
    arrow = pa.decimal128(precision, scale) if precision <= 38 else pa.decimal256(precision, scale)
    return Column(field, arrow, kind, DECIMAL, optional, scale, numeric=numeric)


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
        return _decimal_column(field, str(kind), parameters, optional, numeric)
    if logical == VARIABLE_SCALE_DECIMAL:
        return Column(field, pa.string(), str(kind), logical, optional, numeric=numeric)
    if isinstance(logical, str) and logical in _TIME_TYPES and kind != "struct":
        connect_kind = _PRIMITIVES[str(kind)][0] if kind in _PRIMITIVES else str(kind)
        return Column(field, _TIME_TYPES[logical], connect_kind, logical, optional)
    if kind in _PRIMITIVES:
        connect_kind, arrow = _PRIMITIVES[str(kind)]
        return Column(field, arrow, connect_kind, logical, optional)
    if kind == "struct":
        children = tuple(column(child) for child in schema.get("fields", []))
        if isinstance(logical, str) and logical in STRUCTURED_TYPES:
            return Column(
                field, STRUCTURED_TYPES[logical], "struct", logical, optional, None, children
            )
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
    raise InvalidEventError(
        f"field {field!r}: unknown Kafka Connect type {kind!r} (JsonConverter's types: "
        f"{', '.join(sorted(set(_PRIMITIVES) - {'float32', 'float64'}))}, struct, array, map)"
    )


def row_columns(schema: Mapping[str, Any]) -> tuple[Column, ...]:
    """The row's columns in a value schema: the ``after`` (else ``before``) struct of a
    change-event envelope, or the struct itself (ExtractNewRecordState's flat rows)."""
    fields = {f.get("field"): f for f in schema.get("fields", [])}
    images = [fields[image] for image in ("after", "before") if image in fields]
    for image in images:
        if image.get("type") == "struct":
            return column(image, str(image.get("field"))).children
    if images and "op" in fields:
        return ()  # an envelope whose row is no struct: MongoDB's documents are JSON text
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
        if old.connect == "struct" and not old.structured:
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
    numeric = ", replog capture's NUMERIC" if c.numeric else ""
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


# -- decimals --------------------------------------------------------------------------------


def decode_decimal(text: str, scale: int) -> Decimal:
    """A Connect Decimal: base64 of the big-endian two's-complement unscaled value."""
    try:
        unscaled = int.from_bytes(base64.b64decode(text, validate=True), "big", signed=True)
    except (ValueError, TypeError) as exc:
        raise InvalidEventError(f"{text!r} is not a base64 Decimal: {exc}") from exc
    # From text, never by arithmetic: Decimal arithmetic rounds to the context's 28 digits.
    return Decimal(f"{unscaled}E{-scale}")


def decode_variable_scale(value: Mapping[str, Any]) -> Decimal:
    """A VariableScaleDecimal: ``{"scale": s, "value": <base64 unscaled bytes>}``."""
    return decode_decimal(str(value["value"]), int(value["scale"]))


def decode_number(value: Any) -> Decimal:
    """A decimal written as a JSON number (parsed to a ``Decimal``, an int or a float):
    its exact value (a float gives its shortest repr: parse with ``parse_float=Decimal``)."""
    return value if isinstance(value, Decimal) else Decimal(str(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | Decimal) and not isinstance(value, bool)


def decode_decimal_value(c: Column, value: Any) -> Decimal | str | None:
    """A Decimal or VariableScaleDecimal value of column ``c``, by its JSON type: a number is
    its digits (``decimal.format=NUMERIC``), a string base64 bytes (replog capture's
    ``NaN``/``Infinity`` for a column it marked), a ``{scale, value}`` object a
    VariableScaleDecimal. A VariableScaleDecimal gives its exact text (plain notation)."""
    if value is None:
        return None
    if _is_number(value):
        number = decode_number(value)
        return format(number, "f") if c.logical == VARIABLE_SCALE_DECIMAL else number
    if c.logical == VARIABLE_SCALE_DECIMAL:
        if isinstance(value, Mapping):
            return format(decode_variable_scale(value), "f")
        return str(value)  # replog capture's NaN, Infinity: the text kept
    if isinstance(value, str):
        return None if c.numeric else decode_decimal(value, c.scale or 0)
    raise InvalidEventError(f"field {c.name!r}: {value!r} is not a Decimal (a number or base64)")


# -- ISO 8601 text -----------------------------------------------------------------------------

_DATE = r"(?P<year>[+-]?\d{4,})-(?P<month>\d{2})-(?P<day>\d{2})"
_CLOCK = r"(?P<hour>\d{2}):(?P<minute>\d{2})(?::(?P<second>\d{2})(?:[.,](?P<fraction>\d+))?)?"
_OFFSET = r"(?P<offset>Z|[+-]\d{2}(?::?\d{2}(?::?\d{2})?)?)?"
_ISO_DATE = re.compile(rf"{_DATE}{_OFFSET}")
_ISO_TIME = re.compile(rf"{_CLOCK}{_OFFSET}")
_ISO_TIMESTAMP = re.compile(rf"{_DATE}[T ]{_CLOCK}{_OFFSET}")
_ISO_DURATION = re.compile(
    r"(?P<sign>-)?P(?:(?P<years>[+-]?\d+)Y)?(?:(?P<months>[+-]?\d+)M)?(?:(?P<weeks>[+-]?\d+)W)?"
    r"(?:(?P<days>[+-]?\d+)D)?(?:T(?:(?P<hours>[+-]?\d+)H)?(?:(?P<minutes>[+-]?\d+)M)?"
    r"(?:(?P<seconds>[+-]?\d+(?:[.,]\d+)?)S)?)?"
)


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date, any year (Hinnant's algorithm:
    Python's ``date`` stops at year 9999, PostgreSQL does not)."""
    year -= month <= 2
    era = (year if year >= 0 else year - 399) // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146097 + day_of_era - 719468


def _offset_nanos(text: str | None) -> int:
    if not text or text == "Z":
        return 0
    sign = -1 if text[0] == "-" else 1
    digits = text[1:].replace(":", "")
    hours, minutes, seconds = int(digits[0:2]), int(digits[2:4] or 0), int(digits[4:6] or 0)
    return sign * ((hours * 60 + minutes) * 60 + seconds) * 1_000_000_000


def _clock_nanos(match: re.Match[str]) -> int:
    fraction = (match["fraction"] or "")[:9].ljust(9, "0")
    seconds = (int(match["hour"]) * 60 + int(match["minute"])) * 60 + int(match["second"] or 0)
    return seconds * 1_000_000_000 + int(fraction)


def _days(match: re.Match[str]) -> int:
    return days_from_civil(int(match["year"]), int(match["month"]), int(match["day"]))


def iso_date(text: str) -> int | None:
    """An ISO 8601 date (``2017-09-15``, ``2017-09-15Z``: the calendar date as written) as
    days since the epoch; None for text that is no date (``infinity``)."""
    match = _ISO_DATE.fullmatch(text.strip())
    return _days(match) if match else None


def iso_time(text: str, *, zoned: bool) -> int | None:
    """An ISO 8601 time of day as nanoseconds since midnight: ``zoned`` applies the offset
    (``ZonedTime``: in UTC), else it is dropped (``IsoTime``: the wall clock)."""
    match = _ISO_TIME.fullmatch(text.strip())
    if match is None:
        return None
    nanos = _clock_nanos(match)
    return (nanos - _offset_nanos(match["offset"])) % NANOS_PER_DAY if zoned else nanos


def iso_timestamp(text: str, *, zoned: bool) -> int | None:
    """An ISO 8601 timestamp as nanoseconds since the epoch: ``zoned`` applies the offset
    (an instant), else it is dropped (the wall clock of a zone-less column)."""
    match = _ISO_TIMESTAMP.fullmatch(text.strip())
    if match is None:
        return None
    nanos = _days(match) * NANOS_PER_DAY + _clock_nanos(match)
    return nanos - _offset_nanos(match["offset"]) if zoned else nanos


def iso_interval(text: str) -> tuple[int, int, int] | None:
    """An ISO 8601 duration (``P1Y2M3DT4H5M6.78S``, Debezium's ``Interval``; PostgreSQL's
    ``iso_8601`` style leaves out zero parts) as (months, days, nanoseconds)."""
    match = _ISO_DURATION.fullmatch(text.strip())
    if match is None or text.strip() in ("P", "-P"):
        return None
    part = {name: int(match[name] or 0) for name in ("years", "months", "weeks", "days")}
    part.update({name: int(match[name] or 0) for name in ("hours", "minutes")})
    try:
        seconds = Decimal((match["seconds"] or "0").replace(",", "."))
    except InvalidOperation:
        return None
    sign = -1 if match["sign"] else 1
    months = part["years"] * 12 + part["months"]
    days = part["weeks"] * 7 + part["days"]
    nanos = (part["hours"] * 60 + part["minutes"]) * 60 * 1_000_000_000
    nanos += int(seconds * 1_000_000_000)
    return sign * months, sign * days, sign * nanos


# -- values --------------------------------------------------------------------------------


def _structured(c: Column, value: Mapping[str, Any]) -> Any:
    """A ``time.precision.mode=structured`` struct as its one value (None for a
    ``specialValue``: PostgreSQL's infinities)."""
    if value.get("specialValue") is not None:
        return None

    def get(name: str) -> int:
        return int(value.get(name) or 0)

    kind = c.logical.rsplit(".", 1)[-1] if c.logical else ""
    clock = ((get("hour") * 60 + get("minute")) * 60 + get("second")) * 1_000_000_000
    clock += get("nanos")
    offset = get("offsetSeconds") * 1_000_000_000
    if kind == "StructuredDuration":
        nanos = ((get("hours") * 60 + get("minutes")) * 60 + get("seconds")) * 1_000_000_000
        return (get("years") * 12 + get("months"), get("days"), nanos + get("nanos"))
    if kind == "StructuredTime":
        return clock
    if kind == "StructuredZonedTime":
        return (clock - offset) % NANOS_PER_DAY
    days = days_from_civil(get("year"), get("month"), get("day"))
    if kind == "StructuredDate":
        return days
    stamp = days * NANOS_PER_DAY + clock
    return stamp - offset if kind == "StructuredZonedTimestamp" else stamp


def _temporal_text(c: Column, text: str) -> Any:
    """An ISO 8601 string of a time type as its Arrow value (ints of the type's unit)."""
    kind = c.type
    zoned = c.logical not in _ISO_STRINGS
    if pa.types.is_interval(kind):
        return iso_interval(text)
    if pa.types.is_date32(kind):
        return iso_date(text)
    if pa.types.is_time(kind):
        return iso_time(text, zoned=zoned)
    if pa.types.is_timestamp(kind):
        return iso_timestamp(text, zoned=zoned and kind.tz is not None)
    return text


def decode(c: Column, value: Any) -> Any:  # noqa: PLR0911 - one return per type
    """A JSON value of column ``c`` as a value ``pa.array`` takes for its Arrow type (times
    as integers of the type's unit: exact, whatever the year)."""
    if value is None:
        return None
    if c.decimal:
        return decode_decimal_value(c, value)
    if c.structured:
        return _structured(c, value)
    if c.connect == "struct":
        return {child.name: decode(child, value.get(child.name)) for child in c.children}
    if c.connect == "array":
        return [decode(c.children[0], item) for item in value]
    if c.connect == "map":
        pairs = value.items() if isinstance(value, Mapping) else value  # non-string keys: pairs
        return [(decode(c.children[0], k), decode(c.children[1], v)) for k, v in pairs]
    if isinstance(value, str) and c.connect == "string" and c.logical in _TIME_TYPES:
        return _temporal_text(c, value)
    if pa.types.is_binary(c.type):
        return base64.b64decode(value)
    if pa.types.is_floating(c.type) and isinstance(value, Decimal):
        return float(value)  # parsed with parse_float=Decimal: the float it denotes
    return value


def to_arrow(columns: Sequence[Column], rows: Sequence[Mapping[str, Any] | None]) -> pa.Table:
    """Rows (parsed JSON payloads: ``parse_float=Decimal`` keeps numbers exact) as an Arrow
    table typed by ``columns``."""
    arrays = [
        pa.array([decode(c, row.get(c.name)) if row else None for row in rows], type=c.type)
        for c in columns
    ]
    schema = arrow_schema([replace(c, optional=True) for c in columns])
    return pa.Table.from_arrays(arrays, schema=schema)
