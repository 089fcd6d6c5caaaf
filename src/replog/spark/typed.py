"""Payloads typed by the schemas registered in the log (:func:`typed`).

The JSON is parsed in the JVM (``from_json``) with the types Debezium's JsonConverter
writes (the *wire* types: base64 strings, epoch integers, ISO strings, structs), and each
column is then turned into its exact Spark type with built-in functions
(``date_from_unix_date``, ``timestamp_micros``, ``unbase64``, casts). Zone-less timestamps
(``Timestamp``, ``MicroTimestamp``, ``NanoTimestamp``, ``IsoTimestamp``, structured
timestamps) are ``timestamp_ntz``: the wall clock the column held, whatever the session's
time zone.

Decimals are the exception. Their encoding is told by each value's JSON type (a string is
base64 bytes, a number the digits of ``decimal.format=NUMERIC``), which ``from_json`` into
one type cannot see, and a number's digits do not survive a string or double on the way. A
row's top-level Decimal and VariableScaleDecimal columns are read by one small Python UDF
from the payload's text (:func:`replog.schemas.connect.decode_decimal_value`): exact in
every form, at any precision. A decimal nested in an array, struct or map is parsed as a
variant (which keeps a number's digits up to 38 of them in plain notation; a number in
scientific notation or longer goes through a double) and read by its type. ISO 8601
dates, times and timestamps are ``try_cast``: NULL for ``infinity``, never a failed query.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DayTimeIntervalType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
    VariantType,
)

from replog.errors import InvalidOptionError
from replog.format import jsontext
from replog.format.events import TRUNCATE
from replog.log import ReplicationLog
from replog.schemas import connect, registry
from replog.schemas.connect import DECIMAL, VARIABLE_SCALE_DECIMAL

_WIRE: dict[str, DataType] = {
    "int8": ByteType(),
    "int16": ShortType(),
    "int32": IntegerType(),
    "int64": LongType(),
    "float32": FloatType(),
    "float64": DoubleType(),
    "boolean": BooleanType(),
    "string": StringType(),
    "bytes": StringType(),  # base64
}
SPARK_MAX_PRECISION = 38
_PER_MICRO = {"s": None, "ms": 1_000, "us": 1, "ns": None}
_MICROS_PER_DAY = 86_400_000_000
INTERVAL = StructType(
    [
        StructField("months", IntegerType()),
        StructField("days", IntegerType()),
        StructField("microseconds", LongType()),
    ]
)
"""An ``Interval``/``StructuredDuration`` (months, days and a time apart, as PostgreSQL's
``interval`` and Arrow's month_day_nano: no Spark interval type holds all three)."""
_EPOCH_NTZ = datetime(1970, 1, 1)
_OFFSET_TAIL = r"(Z|[+-]\d{2}:\d{2}(:\d{2})?)$"  # a date's own "-29" is no offset


def wire_type(c: connect.Column) -> DataType:
    """The Spark type of a column's value as JsonConverter writes it."""
    if c.decimal:
        return VariantType()  # a string, a number or an object: told apart per value
    if c.connect == "struct":
        return StructType([StructField(child.name, wire_type(child)) for child in c.children])
    if c.connect == "array":
        return ArrayType(wire_type(c.children[0]))
    if c.connect == "map":
        return MapType(StringType(), wire_type(c.children[1]))
    return _WIRE[c.connect]


def spark_type(c: connect.Column) -> DataType:  # noqa: C901, PLR0911 - one return per type
    """The exact Spark type of a column (times of day and durations as intervals: Spark's
    TIME type is not enabled; nanoseconds are cut to Spark's microseconds)."""
    kind = c.type
    if c.logical == DECIMAL:
        if kind.precision > SPARK_MAX_PRECISION:
            return StringType()  # beyond Spark's decimals: the exact text
        return DecimalType(kind.precision, kind.scale)
    if c.logical == VARIABLE_SCALE_DECIMAL:
        return StringType()
    if pa.types.is_interval(kind):
        return INTERVAL
    if pa.types.is_date32(kind):
        return DateType()
    if pa.types.is_timestamp(kind):
        return TimestampType() if kind.tz is not None else TimestampNTZType()
    if pa.types.is_time(kind) or pa.types.is_duration(kind):
        return DayTimeIntervalType(DayTimeIntervalType.DAY, DayTimeIntervalType.SECOND)
    if pa.types.is_binary(kind):
        return BinaryType()
    if c.connect == "struct":
        return StructType([StructField(child.name, spark_type(child)) for child in c.children])
    if c.connect == "array":
        return ArrayType(spark_type(c.children[0]))
    if c.connect == "map":
        return MapType(StringType(), spark_type(c.children[1]))
    return wire_type(c)


# -- decimals ----------------------------------------------------------------------------------


def _spark_decimal(c: connect.Column, value: Any) -> Any:
    decoded = connect.decode_decimal_value(c, value)
    if decoded is None or c.logical == VARIABLE_SCALE_DECIMAL:
        return decoded
    return format(decoded, "f") if c.type.precision > SPARK_MAX_PRECISION else decoded


def _decimal_array(c: connect.Column) -> bool:
    """An array (of arrays ...) of decimals."""
    return c.connect == "array" and (c.children[0].decimal or _decimal_array(c.children[0]))


def _exact(c: connect.Column, value: Any) -> Any:
    if value is None:
        return None
    if c.decimal:
        return _spark_decimal(c, value)
    return [_exact(c.children[0], item) for item in value]


def _exact_decimals(text: str | None, columns: tuple[connect.Column, ...]) -> Any:
    """A row's top-level decimal columns (and arrays of them) read from the payload's text
    (numbers keep every digit: the parser gives ``Decimal``)."""
    if text is None:
        return None
    members = jsontext.parse_object(text)
    values = [members[c.name].value if c.name in members else None for c in columns]
    return tuple(_exact(c, value) for c, value in zip(columns, values, strict=True))


def _lambda_decimals(c: connect.Column, path: str, in_lambda: bool = False) -> list[str]:
    """Columns whose decimals lie where a Python UDF cannot reach them (a map, or a struct
    inside an array: Spark runs those through lambda functions)."""
    if c.decimal:
        return [path] if in_lambda else []
    if c.connect == "struct" and not c.structured:
        found: list[str] = []
        for child in c.children:
            found += _lambda_decimals(child, f"{path}.{child.name}", in_lambda)
        return found
    if c.connect in ("array", "map"):
        return _lambda_decimals(c.children[-1], f"{path}[]", True)
    return []


def _variant_decimal(c: connect.Column, value: Any) -> Any:
    """A nested decimal given as a variant's JSON text (a string or an object)."""
    return (
        None
        if value is None
        else _spark_decimal(c, jsontext.parse_object('{"v":' + value + "}")["v"].value)
    )


def _nested_decimal(c: connect.Column, value: Column) -> Column:
    """A decimal inside a struct: a variant read by its JSON type."""
    kind = F.schema_of_variant(value)
    number = F.try_variant_get(value, "$", spark_type(c).simpleString())
    other = F.udf(functools.partial(_variant_decimal, c), spark_type(c), useArrow=False)(
        F.to_json(value)
    )
    is_number = ~(kind.startswith("STRING") | kind.startswith("OBJECT"))
    return F.when(value.isNull(), F.lit(None)).when(is_number, number).otherwise(other)


# -- times -------------------------------------------------------------------------------------


def _micros(value: Column, unit: str) -> Column:
    """Epoch (or since-midnight) integers of ``unit`` as microseconds, exactly."""
    if unit == "ns":  # floor division in decimals: a double would round
        return F.floor(value.cast("decimal(20,0)") / F.lit(1000)).cast("long")
    return value.cast("long") * F.lit(_PER_MICRO[unit] or 1)


def _interval(micros: Column) -> Column:
    """Microseconds as an ``interval day to second``."""
    return F.timestamp_micros(micros) - F.timestamp_micros(F.lit(0))


def _ntz(micros: Column) -> Column:
    """Microseconds since the epoch as the zone-less ``timestamp_ntz`` (no session zone is
    involved: the epoch plus an interval)."""
    return F.try_add(F.lit(_EPOCH_NTZ).cast("timestamp_ntz"), _interval(micros))


def _iso(c: connect.Column, value: Column) -> Column:
    """An ISO 8601 string as its exact Spark type; NULL for what Spark cannot hold
    (``infinity``). ``IsoDate``/``IsoTime``/``IsoTimestamp`` drop their ``Z`` (a zone-less
    column's wall clock); ``ZonedTimestamp``/``ZonedTime`` apply their offset."""
    kind = c.type
    zoneless = c.logical in ("io.debezium.time.IsoDate", "io.debezium.time.IsoTime")
    bare = F.regexp_replace(value, _OFFSET_TAIL, "") if zoneless else value
    if pa.types.is_interval(kind):
        return _iso_interval(value)
    if pa.types.is_date32(kind):
        return bare.try_cast("date")
    if pa.types.is_timestamp(kind):
        return value.try_cast("timestamp" if kind.tz is not None else "timestamp_ntz")
    stamp = F.concat(F.lit("1970-01-01T"), bare)
    if zoneless:
        return stamp.try_cast("timestamp_ntz") - F.lit(_EPOCH_NTZ).cast("timestamp_ntz")
    since_midnight = F.pmod(F.unix_micros(stamp.try_cast("timestamp")), F.lit(_MICROS_PER_DAY))
    return _interval(since_midnight)


_DURATION = (
    r"^-?P([+-]?\d+Y)?([+-]?\d+M)?([+-]?\d+W)?([+-]?\d+D)?"
    r"(T([+-]?\d+H)?([+-]?\d+M)?([+-]?\d+([.,]\d+)?S)?)?$"
)


def _iso_interval(value: Column) -> Column:
    """An ISO 8601 duration (``P1Y2M3DT4H5M6.78S``) as (months, days, microseconds)."""
    date_part = F.regexp_extract(value, r"^-?P([^T]*)", 1)
    time_part = F.regexp_extract(value, r"T(.*)$", 1)

    def number(part: Column, unit: str) -> Column:
        found = F.regexp_extract(part, rf"([+-]?\d+){unit}", 1)
        return F.coalesce(found.try_cast("long"), F.lit(0))

    seconds = F.regexp_replace(F.regexp_extract(time_part, r"([+-]?\d+([.,]\d+)?)S", 1), ",", ".")
    sign = F.when(value.startswith("-"), F.lit(-1)).otherwise(F.lit(1))
    micros = (number(time_part, "H") * 60 + number(time_part, "M")) * 60_000_000 + F.floor(
        F.coalesce(seconds.try_cast("decimal(38,9)"), F.lit(0)) * 1_000_000
    ).cast("long")
    interval = F.struct(
        (sign * (number(date_part, "Y") * 12 + number(date_part, "M"))).cast("int").alias("months"),
        (sign * (number(date_part, "W") * 7 + number(date_part, "D"))).cast("int").alias("days"),
        (sign * micros).cast("long").alias("microseconds"),
    )
    valid = value.rlike(_DURATION) & ~value.isin("P", "-P")
    return F.when(valid, interval.cast(INTERVAL))  # nullable fields: NULL is a value here


def _structured(c: connect.Column, value: Column) -> Column:
    """A ``time.precision.mode=structured`` struct as its one value (NULL for a
    ``specialValue``: PostgreSQL's infinities)."""
    names = {child.name for child in c.children}

    def get(name: str) -> Column:
        return F.coalesce(value[name].cast("long"), F.lit(0)) if name in names else F.lit(0)

    kind = (c.logical or "").rsplit(".", 1)[-1]
    clock = (get("hour") * 60 + get("minute")) * 60_000_000 + get("second") * 1_000_000
    clock = clock + F.floor(get("nanos") / 1000).cast("long")
    offset = get("offsetSeconds") * 1_000_000
    special = value["specialValue"] if "specialValue" in names else F.lit(None)
    if kind == "StructuredDuration":
        time_part = (get("hours") * 60 + get("minutes")) * 60_000_000 + get("seconds") * 1_000_000
        result = F.struct(
            (get("years") * 12 + get("months")).cast("int").alias("months"),
            get("days").cast("int").alias("days"),
            (time_part + F.floor(get("nanos") / 1000).cast("long")).alias("microseconds"),
        ).cast(INTERVAL)
    elif kind == "StructuredTime":
        result = _interval(clock)
    elif kind == "StructuredZonedTime":
        result = _interval(F.pmod(clock - offset, F.lit(_MICROS_PER_DAY)))
    else:
        date = F.make_date(
            get("year").cast("int"), get("month").cast("int"), get("day").cast("int")
        )
        if kind == "StructuredDate":
            result = date
        else:
            micros = F.unix_date(date).cast("long") * _MICROS_PER_DAY + clock
            zoned = kind == "StructuredZonedTimestamp"
            result = F.timestamp_micros(micros - offset) if zoned else _ntz(micros)
    return F.when(value.isNull() | special.isNotNull(), F.lit(None)).otherwise(result)


# -- columns -----------------------------------------------------------------------------------


def _convert(c: connect.Column, value: Column) -> Column:
    """A wire-typed column as its exact Spark type."""
    if c.decimal:
        return _nested_decimal(c, value)
    if c.structured:
        return _structured(c, value)
    if c.connect == "struct":
        return F.when(value.isNull(), F.lit(None)).otherwise(_struct(c.children, value))
    if c.connect == "array":
        return F.transform(value, lambda item: _convert(c.children[0], item))
    if c.connect == "map":
        return F.transform_values(value, lambda _, item: _convert(c.children[1], item))
    return _scalar(c, value)


def _scalar(c: connect.Column, value: Column) -> Column:
    kind = c.type
    if c.connect == "string" and (pa.types.is_temporal(kind) or pa.types.is_interval(kind)):
        return _iso(c, value)
    if pa.types.is_date32(kind):
        return F.date_from_unix_date(value)
    if pa.types.is_timestamp(kind):
        micros = _micros(value, kind.unit)
        return F.timestamp_micros(micros) if kind.tz is not None else _ntz(micros)
    if pa.types.is_time(kind) or pa.types.is_duration(kind):
        return _interval(_micros(value, kind.unit))
    if pa.types.is_binary(kind):
        return F.unbase64(value)
    return value


def _struct(
    columns: Sequence[connect.Column], parsed: Column, exact: Column | None = None
) -> Column:
    def value(c: connect.Column) -> Column:
        if exact is not None and (c.decimal or _decimal_array(c)):
            return exact[c.name]
        return _convert(c, parsed[c.name])

    return F.struct(*[value(c).alias(c.name) for c in columns])


def _parsed(payload: Column, columns: Sequence[connect.Column]) -> tuple[Column, Column | None]:
    """A JSON payload column (string or binary) parsed into its wire types, and the exact
    values of its decimal columns (None: it has none)."""
    wire = StructType([StructField(c.name, wire_type(c)) for c in columns])
    text = payload.cast("string")
    parsed = F.from_json(text, wire, {"mode": "FAILFAST"})
    decimals = tuple(c for c in columns if c.decimal or _decimal_array(c))
    if not decimals:
        return parsed, None
    fields = StructType([StructField(c.name, spark_type(c)) for c in decimals])
    read = functools.partial(_exact_decimals, columns=decimals)
    return parsed, F.udf(read, fields, useArrow=False)(text)


def typed(
    frame: DataFrame,
    log: ReplicationLog | str,
    collection: str,
    *,
    storage_options: dict[str, Any] | None = None,
) -> DataFrame:
    """The events of ``collection`` with their payloads typed by the schemas registered in
    ``log`` (``replog append --format debezium``; ``replog schemas`` lists them)::

        typed(spark.read.format("replog").load(url), url, "inventory.customers")
            .select("operation", "after.id", "after.balance")   # balance: decimal(12,2)

    Returns the event columns with ``data`` (the row: ``after``, or ``before`` for a
    delete; null for a truncate, which has none), ``after`` and ``before`` as structs
    of the union of every registered version (a column a later version added is null in
    earlier rows, or the later version's ``default`` when it gives one: PostgreSQL's
    ``ADD COLUMN ... DEFAULT``).

    Raises:
        InvalidOptionError: no schema of ``collection`` is registered.
        IncompatibleSchemaError: two versions give a column types no one type holds.
    """
    opened = (  # by str, not by class: see ManifestStore (by-value pickling copies classes)
        ReplicationLog.open(log, storage_options=storage_options) if isinstance(log, str) else log
    )
    found = registry.versions(opened.storage, collection)
    if not found:
        raise InvalidOptionError(registry.unknown_collection(opened.storage, collection, "typed"))
    return typed_by(frame, collection, found)


class Typing:
    """How one collection's payloads are typed by its registered versions ``found``, in
    two projections: :meth:`parses` (each payload parsed once per row, with its exact
    decimals) and :meth:`typed` (the struct of exact types built from them). One
    expression would parse again for each column: Spark shares no subexpression inside a
    ``CASE`` branch, and from_json once per column cost most of a snapshot's load.

    ``tag`` tells apart the columns of several collections typed in one projection
    (apply_changes types every collection of a micro-batch in one pass); ``where``
    selects the rows of the collection there (other rows: NULL, never parsed)."""

    def __init__(
        self,
        collection: str,
        found: Sequence[registry.SchemaVersion],
        *,
        tag: str = "",
        where: Column | None = None,
    ) -> None:
        self.collection, self.found, self.tag = collection, found, tag
        self.where = where
        self.columns = connect.union([(version.digest, version.columns()) for version in found])
        self.digests = [version.digest for version in found]
        unreachable = [
            name
            for c in self.columns
            if not _decimal_array(c)
            for name in _lambda_decimals(c, c.name)
        ]
        if unreachable:
            raise InvalidOptionError(
                f"typed: decimals inside a map or an array of structs are not typed "
                f"({unreachable} of {collection!r}): parse 'data' with parse_payload and a "
                f"schema of your own"
            )
        if not self.columns:
            raise InvalidOptionError(
                f"typed: the schema of collection {collection!r} gives its rows no columns (a "
                f"MongoDB document is JSON text, io.debezium.data.Json): parse 'data' with "
                f"parse_payload and a schema of your own"
            )
        self._decimals = any(c.decimal or _decimal_array(c) for c in self.columns)

    def _name(self, kind: str, payload: str) -> str:
        return f"__replog_{kind}{self.tag}_{payload}"

    def _only(self, value: Column) -> Column:
        return value if self.where is None else F.when(self.where, value)

    def parses(self, payload: str) -> list[Column]:
        """The first projection's columns for payload column ``payload``."""
        parsed, exact = _parsed(self._only(F.col(payload)), self.columns)
        found = [parsed.alias(self._name("wire", payload))]
        if exact is not None:
            found.append(exact.alias(self._name("exact", payload)))
        return found

    def typed(self, payload: str, version: Column | None) -> Column:
        """The second projection's typed struct of ``payload`` (``version``: the event's
        schema version, :func:`schema_version`; None: the events name none)."""
        exact = F.col(self._name("exact", payload)) if self._decimals else None
        built = _struct(self.columns, F.col(self._name("wire", payload)), exact)
        value = F.when(F.col(payload).isNull(), F.lit(None)).otherwise(built)
        if version is not None:
            known = _known_versions(version, self.collection, self.digests)
            value = known(_defaults(version, self.found, self.columns)(value))
        return self._only(value)


def typed_by(
    frame: DataFrame, collection: str, found: Sequence[registry.SchemaVersion]
) -> DataFrame:
    """:func:`typed` by the registered versions ``found`` (read by the caller)."""
    typing = Typing(collection, found)
    rows = frame.where(F.col("collection") == F.lit(collection))
    version = None
    if "metadata" in frame.columns:  # the schema version each event names
        version = F.col(VERSION)
        rows = rows.withColumn(VERSION, schema_version(F.col("metadata"), typing.digests))
    kept = [name for name in frame.columns if name not in ("data", "before")]
    rows = rows.select("*", *typing.parses("data"), *typing.parses("before"))
    data = typing.typed("data", version)
    operation = F.col("operation")
    return rows.select(
        *[F.col(name) for name in kept],
        F.when(operation != F.lit(TRUNCATE), data).alias("data"),  # a table's: no row
        F.when(~operation.isin("delete", TRUNCATE), data).alias("after"),
        typing.typed("before", version).alias("before"),
    )


VERSION = "__replog_schema_version"


def schema_version(metadata: Column, digests: Sequence[str]) -> Column:
    """``metadata.schema`` (the event's schema version). A metadata text ending with
    ``,"schema":"<digest>"}`` names that digest (the last member of the object: the
    position ``replog capture`` writes it in); it is told by that ending first, without a
    parse (parsing every event's metadata cost a snapshot's load a third of its time)."""
    text = metadata.cast("string")
    found = F.get_json_object(text, "$.schema")
    for digest in digests:
        if digest.isalnum():  # nothing to escape: the ending holds the whole value
            found = F.when(text.endswith(f',"schema":"{digest}"}}'), F.lit(digest)).otherwise(found)
    return found


def _defaults(
    version: Column, found: Sequence[registry.SchemaVersion], columns: Sequence[connect.Column]
) -> Callable[[Column], Column]:
    """A typed payload of an event whose schema ``version`` (``metadata.schema``) lacks a
    column that a later version gives a ``default`` reads the default: the row was written
    before the column existed (PostgreSQL's ``ADD COLUMN ... DEFAULT``), and holds it."""
    names = {v.digest: {x.name for x in v.columns()} for v in found}
    fills = []
    for c in columns:
        if c.default is None:
            continue
        lacking = [digest for digest, held in names.items() if c.name not in held]
        if lacking:
            wire = StructType([StructField(c.name, wire_type(c))])
            parsed = F.from_json(F.lit(json.dumps({c.name: c.default})), wire)
            fills.append((c.name, version.isin(*lacking), _convert(c, parsed[c.name])))

    def filled(payload: Column) -> Column:
        for name, before_column, value in fills:
            payload = payload.withField(name, F.when(before_column, value).otherwise(payload[name]))
        return payload

    return filled


def _known_versions(
    named: Column, collection: str, digests: Sequence[str]
) -> Callable[[Column], Column]:
    """A guard for a typed payload: an event whose schema version (``named``:
    ``metadata.schema``) is one ``typed`` did not read (registered after it was called, as
    a column added while a streaming query runs) fails the query, naming it, rather than
    being read with the older union, which would drop the new column's values silently."""
    unknown = named.isNotNull() & ~named.isin(*digests)
    message = F.concat(
        F.lit(f"typed: an event of {collection!r} names schema version "),
        named,
        F.lit(
            ", not known to typed (registered after typed() read the log's schemas, or "
            "never): its columns may be missing from the typed rows. Restart the query so "
            "that typed reads the registry again"
        ),
    )
    return lambda payload: F.when(unknown, F.raise_error(message)).otherwise(payload)
