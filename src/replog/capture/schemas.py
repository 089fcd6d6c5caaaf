"""The Kafka Connect schema of a captured table, as Debezium's PostgreSQL connector would
emit it, adapted to the values capture stores (docs/CDC.md, "Schemas of captured tables").

A table's schema is built from its columns' names, type ids and type modifiers only, which
the catalog (for the snapshot) and pgoutput's Relation message (for the stream) both give,
so an unchanged table has one schema, and one digest, whichever path saw it. A Relation
message with other columns (``ALTER TABLE ... ADD COLUMN``) gives a new schema: a new
version in the registry.

The stored values are those of :mod:`replog.capture.values`; each column's schema says
how to read them, with Debezium's logical names where they describe the value exactly:

==========================  ====================  ===========================================
PostgreSQL                  stored JSON value     Connect schema
==========================  ====================  ===========================================
``numeric(p, s)``           number, exact digits  ``bytes`` ``org.apache.kafka.connect.data
                                                  .Decimal`` (``scale``, ``connect.decimal.
                                                  precision``) with ``decimal.format``
                                                  ``NUMERIC``: Kafka's JsonConverter form
                                                  of a Decimal as a JSON number
``numeric``                 number, exact digits  ``io.debezium.data.VariableScaleDecimal``,
                                                  ``decimal.format`` ``NUMERIC``
``timestamptz``             ISO 8601, UTC (``Z``) ``string`` ``io.debezium.time.ZonedTimestamp``
``timestamp``/``date``/     ISO 8601              ``string`` ``io.debezium.time.IsoTimestamp``
``time``                                          / ``IsoDate`` / ``IsoTime``
``bytea``                   base64                ``bytes``
``json``, ``jsonb``         the text, as string   ``string`` ``io.debezium.data.Json``
``interval``                ISO 8601 duration     ``string`` ``io.debezium.time.Interval``
arrays                      JSON arrays           ``array`` of the element's schema
==========================  ====================  ===========================================

Integers, floats, booleans and text are Connect's primitives; every other type (enums,
ranges, ``inet``, ...) is ``string`` (its text output, as stored). Key columns are
``optional: false``; every other column is optional (pgoutput does not say which columns
are NOT NULL, and reading the catalog later could see a different table).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from replog.schemas.connect import (
    DECIMAL,
    DECIMAL_FORMAT,
    NUMERIC_FORMAT,
    VARIABLE_SCALE_DECIMAL,
)


@dataclass(frozen=True)
class PgType:
    """What a schema needs of a type id: its base type (domains resolved), the base's
    type modifier from the domain (-1: none), and an array's element type (0: not an array)."""

    base_oid: int
    modifier: int = -1
    element_oid: int = 0


TypeLookup = Callable[[int], PgType]
"""The type of an id (catalog types are immutable, so a lookup never changes)."""

NUMERIC_OID = 1700
_NUMERIC_HEADER = 4  # VARHDRSZ: a numeric's typmod is ((precision << 16) | scale) + 4


def _logical(name: str, kind: str = "string") -> dict[str, Any]:
    return {"type": kind, "name": name, "version": 1}


_SCALARS: dict[int, dict[str, Any]] = {
    16: {"type": "boolean"},
    21: {"type": "int16"},
    23: {"type": "int32"},
    20: {"type": "int64"},
    26: {"type": "int64"},  # oid
    700: {"type": "float"},  # FLOAT32, as Kafka's JsonConverter names it (JsonSchema)
    701: {"type": "double"},  # FLOAT64
    17: {"type": "bytes"},
    114: _logical("io.debezium.data.Json"),
    3802: _logical("io.debezium.data.Json"),
    2950: _logical("io.debezium.data.Uuid"),
    1082: _logical("io.debezium.time.IsoDate"),
    1083: _logical("io.debezium.time.IsoTime"),
    1114: _logical("io.debezium.time.IsoTimestamp"),
    1184: _logical("io.debezium.time.ZonedTimestamp"),
    1266: _logical("io.debezium.time.ZonedTime"),
    1186: _logical("io.debezium.time.Interval"),
}
"""Built-in types by id; anything else not here is its text output (``string``)."""


def numeric_precision_scale(modifier: int) -> tuple[int, int] | None:
    """``numeric(p, s)``'s precision and scale from its type modifier (None: unconstrained)."""
    if modifier < _NUMERIC_HEADER:
        return None
    packed = modifier - _NUMERIC_HEADER
    scale = ((packed & 0x7FF) ^ 1024) - 1024  # PostgreSQL 15+ allows a negative scale
    return (packed >> 16) & 0xFFFF, scale


def _numeric(modifier: int) -> dict[str, Any]:
    constrained = numeric_precision_scale(modifier)
    if constrained is None or constrained[1] < 0:
        return {
            "type": "struct",
            "name": VARIABLE_SCALE_DECIMAL,
            "version": 1,
            "doc": "Variable scaled decimal",
            "fields": [
                {"field": "scale", "type": "int32", "optional": False},
                {"field": "value", "type": "bytes", "optional": False},
            ],
            "parameters": {DECIMAL_FORMAT: NUMERIC_FORMAT},
        }
    return decimal_schema(*constrained)


def decimal_schema(precision: int, scale: int) -> dict[str, Any]:
    """A fixed-scale decimal's schema (Kafka Connect's ``Decimal``, its value as exact
    text), as every database's capture writes it."""
    return {
        "type": "bytes",
        "name": DECIMAL,
        "version": 1,
        "parameters": {
            "scale": str(scale),
            "connect.decimal.precision": str(precision),
            DECIMAL_FORMAT: NUMERIC_FORMAT,
        },
    }


def value_schema(type_oid: int, modifier: int, lookup: TypeLookup) -> dict[str, Any]:
    """The Connect schema (without ``field``/``optional``) of one column's stored values."""
    found = lookup(type_oid)
    if found.element_oid:
        items = value_schema(found.element_oid, modifier, lookup)
        return {"type": "array", "items": {**items, "optional": True}}
    if modifier < 0:
        modifier = found.modifier
    if found.base_oid == NUMERIC_OID:
        return _numeric(modifier)
    return dict(_SCALARS.get(found.base_oid, {"type": "string"}))


def table_schema(
    prefix: str,
    columns: Sequence[tuple[str, int, int]],
    key: Sequence[str],
    lookup: TypeLookup,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The change-event envelope schema of a table with ``columns`` ``(name, type id, type
    modifier)`` and ``key``; ``prefix`` names it (``<slot>.<schema>.<table>``).
    ``defaults``: the value (as stored) that rows written before a column was added hold
    (``ADD COLUMN ... DEFAULT``): the field's ``default``, as Debezium's schemas carry
    one, so a table built from the log can give those rows the value the source gives."""
    defaults = defaults or {}
    fields = [
        {
            "field": name,
            **value_schema(type_oid, modifier, lookup),
            "optional": name not in key,
            **({"default": defaults[name]} if name in defaults else {}),
        }
        for name, type_oid, modifier in columns
    ]
    return envelope_schema(prefix, fields)


def envelope_schema(prefix: str, fields: list[dict[str, Any]]) -> dict[str, Any]:
    """Debezium's change-event envelope around a row of ``fields`` (``prefix`` names it):
    ``before``, ``after``, ``op``, ``ts_ms`` (every database's capture writes this one)."""
    row = {"type": "struct", "name": f"{prefix}.Value", "fields": fields}
    return {
        "type": "struct",
        "name": f"{prefix}.Envelope",
        "optional": False,
        "fields": [
            {**row, "field": "before", "optional": True},
            {**row, "field": "after", "optional": True},
            {"field": "op", "type": "string", "optional": False},
            {"field": "ts_ms", "type": "int64", "optional": True},
        ],
    }
