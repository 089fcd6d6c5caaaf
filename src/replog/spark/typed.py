"""Payloads typed by the schemas registered in the log (:func:`typed`).

The JSON is parsed in the JVM (``from_json``) with the types Debezium's JsonConverter
writes (the *wire* types: base64 strings, epoch integers, ISO strings), and each column is
then turned into its exact Spark type with built-in functions (``date_from_unix_date``,
``timestamp_micros``, ``unbase64``, casts). Only Decimals, whose base64 two's-complement
bytes no built-in decodes exactly at 38 digits, go through a small Python UDF
(:func:`replog.schemas.connect.decode_decimal`). Decimals written as JSON numbers
(``decimal.format: NUMERIC``, as ``replog capture postgres`` stores them) are parsed as
variants, which keep a number's digits (a string would go through a double), and read
with ``try_variant_get``: exact, and NULL for PostgreSQL's ``NaN``/``Infinity``. ISO 8601
dates, times and timestamps are ``try_cast``: NULL for ``infinity``, never a failed query.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
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


def wire_type(c: connect.Column) -> DataType:
    """The Spark type of a column's value as JsonConverter writes it."""
    if c.numeric:
        return VariantType()  # a JSON number, its digits kept
    if c.logical == VARIABLE_SCALE_DECIMAL:
        return StructType([StructField("scale", IntegerType()), StructField("value", StringType())])
    if c.connect == "struct":
        return StructType([StructField(child.name, wire_type(child)) for child in c.children])
    if c.connect == "array":
        return ArrayType(wire_type(c.children[0]))
    if c.connect == "map":
        return MapType(StringType(), wire_type(c.children[1]))
    return _WIRE[c.connect]


def spark_type(c: connect.Column) -> DataType:  # noqa: C901, PLR0911 - one return per type
    """The exact Spark type of a column (times of day as intervals since midnight: Spark's
    TIME type is not enabled; nanoseconds are cut to Spark's microseconds)."""
    kind = c.type
    if c.logical == DECIMAL:
        if kind.precision > SPARK_MAX_PRECISION:
            return StringType()  # beyond Spark's decimals: the exact text
        return DecimalType(kind.precision, kind.scale)
    if c.logical == VARIABLE_SCALE_DECIMAL:
        return StringType()
    if pa.types.is_date32(kind):
        return DateType()
    if pa.types.is_timestamp(kind):
        return TimestampType() if kind.tz is not None else TimestampNTZType()
    if pa.types.is_time(kind):
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


def _decimal(text: str | None, scale: int) -> Any:
    return None if text is None else connect.decode_decimal(text, scale)


def _decimal_text(text: str | None, scale: int) -> str | None:
    return None if text is None else str(connect.decode_decimal(text, scale))


def _variable(value: Any) -> str | None:
    return None if value is None else str(connect.decode_variable_scale(value.asDict()))


def _micros(value: Column, unit: str) -> Column:
    """Epoch (or since-midnight) integers of ``unit`` as microseconds, exactly."""
    if unit == "ns":  # floor division in decimals: a double would round
        return F.floor(value.cast("decimal(20,0)") / F.lit(1000)).cast("long")
    return value.cast("long") * F.lit(_PER_MICRO[unit] or 1)


def _convert(c: connect.Column, value: Column) -> Column:
    """A wire-typed column as its exact Spark type."""
    if c.numeric:  # a variant holding the number (or a string: NaN, Infinity -> NULL)
        return F.try_variant_get(value, "$", spark_type(c).simpleString())
    if c.logical == VARIABLE_SCALE_DECIMAL:  # a struct on the wire, the exact text typed
        return F.udf(_variable, StringType(), useArrow=False)(value)
    if c.connect == "struct":
        return F.when(value.isNull(), F.lit(None)).otherwise(_struct(c.children, value))
    if c.connect == "array":
        return F.transform(value, lambda item: _convert(c.children[0], item))
    if c.connect == "map":
        return F.transform_values(value, lambda _, item: _convert(c.children[1], item))
    return _scalar(c, value)


def _scalar(c: connect.Column, value: Column) -> Column:  # noqa: PLR0911 - one per type
    kind = c.type
    if c.connect == "string" and pa.types.is_temporal(kind):
        return _iso(kind, value)
    if c.logical == DECIMAL:
        scale = c.scale or 0
        target = spark_type(c)
        if isinstance(target, StringType):
            return F.udf(functools.partial(_decimal_text, scale=scale), target, useArrow=False)(
                value
            )
        return F.udf(functools.partial(_decimal, scale=scale), target, useArrow=False)(value)
    if pa.types.is_date32(kind):
        return F.date_from_unix_date(value)
    if pa.types.is_timestamp(kind):
        return F.timestamp_micros(_micros(value, kind.unit))
    if pa.types.is_time(kind):
        since_midnight = _micros(value, kind.unit)
        return F.timestamp_micros(since_midnight) - F.timestamp_micros(F.lit(0))
    if pa.types.is_binary(kind):
        return F.unbase64(value)
    return value


def _iso(kind: pa.DataType, value: Column) -> Column:
    """An ISO 8601 string (ZonedTimestamp with its offset, IsoTimestamp, IsoDate, IsoTime)
    as its exact Spark type; NULL for what Spark cannot hold (``infinity``)."""
    if pa.types.is_date32(kind):
        return value.try_cast("date")
    if pa.types.is_timestamp(kind):
        return value.try_cast("timestamp" if kind.tz is not None else "timestamp_ntz")
    since_midnight = F.unix_micros(
        F.concat(F.lit("1970-01-01T"), value, F.lit("Z")).try_cast("timestamp")
    )
    return F.timestamp_micros(since_midnight) - F.timestamp_micros(F.lit(0))


def _struct(columns: Sequence[connect.Column], parsed: Column) -> Column:
    return F.struct(*[_convert(c, parsed[c.name]).alias(c.name) for c in columns])


def typed_payload(payload: Column, columns: Sequence[connect.Column]) -> Column:
    """A JSON payload column (string or binary) as a struct of ``columns``' exact types."""
    wire = StructType([StructField(c.name, wire_type(c)) for c in columns])
    parsed = F.from_json(payload.cast("string"), wire, {"mode": "FAILFAST"})
    return F.when(payload.isNull(), F.lit(None)).otherwise(_struct(columns, parsed))


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
    delete), ``after`` and ``before`` as structs of the union of every registered version
    (a column a later version added is null in earlier rows, or the later version's
    ``default`` when it gives one: PostgreSQL's ``ADD COLUMN ... DEFAULT``).

    Raises:
        InvalidOptionError: no schema of ``collection`` is registered.
        IncompatibleSchemaError: two versions give a column types no one type holds.
    """
    opened = (  # by str, not by class: see ManifestStore (by-value pickling copies classes)
        ReplicationLog.open(log, storage_options=storage_options) if isinstance(log, str) else log
    )
    found = registry.versions(opened.storage, collection)
    if not found:
        raise InvalidOptionError(
            f"typed: no schema of collection {collection!r} is registered in {opened.url} "
            f"('replog append --format debezium' registers the schemas of values sent with "
            f"them: JsonConverter with schemas.enable=true)"
        )
    columns = connect.union([(version.digest, version.columns()) for version in found])
    rows = frame.where(F.col("collection") == F.lit(collection))
    after = F.when(F.col("operation") != F.lit("delete"), F.col("data"))
    known = _known_versions(frame, collection, [version.digest for version in found])
    filled = _defaults(frame, found, columns)
    return rows.select(
        *[F.col(name) for name in frame.columns if name not in ("data", "before")],
        known(filled(typed_payload(F.col("data"), columns))).alias("data"),
        known(filled(typed_payload(after, columns))).alias("after"),
        known(filled(typed_payload(F.col("before"), columns))).alias("before"),
    )


def _defaults(
    frame: DataFrame, found: Sequence[registry.SchemaVersion], columns: Sequence[connect.Column]
) -> Callable[[Column], Column]:
    """A typed payload of an event whose schema version (``metadata.schema``) lacks a
    column that a later version gives a ``default`` reads the default: the row was written
    before the column existed (PostgreSQL's ``ADD COLUMN ... DEFAULT``), and holds it."""
    if "metadata" not in frame.columns:
        return lambda payload: payload
    version = F.get_json_object(F.col("metadata").cast("string"), "$.schema")
    fills = []
    for c in columns:
        if c.default is None:
            continue
        lacking = [v.digest for v in found if c.name not in {x.name for x in v.columns()}]
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
    frame: DataFrame, collection: str, digests: Sequence[str]
) -> Callable[[Column], Column]:
    """A guard for a typed payload: an event whose ``metadata.schema`` names a version
    ``typed`` did not read (registered after it was called, as a column added while a
    streaming query runs) fails the query, naming it, rather than being read with the
    older union, which would drop the new column's values silently."""
    if "metadata" not in frame.columns:
        return lambda payload: payload
    named = F.get_json_object(F.col("metadata").cast("string"), "$.schema")
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
