"""A table's JSON payloads parsed into its exact columns by Arrow's C++ JSON reader.

Spark's ``from_json`` builds an ``InputStreamReader`` for every row it parses, and its
code is a good part of what the JIT compiles while a session warms up. When every column
of a table is one Arrow's reader gives exactly, as Debezium's JsonConverter writes it
(integers, booleans, texts; dates as epoch days; timestamps, times and durations as epoch
integers of micro- or milliseconds), a task parses the payloads itself (:func:`parse`),
to the types Spark's typing of the same registry gives
(:func:`replog.spark.typed.spark_type`). Any other column (decimals, floats, whose
``NaN`` is a text on the wire, base64 bytes, ISO texts, structs, arrays, maps) keeps the
table on Spark's typing: :func:`plan` says which.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from replog.errors import InvalidEventError
from replog.schemas import connect
from replog.tables import changes

_PLAIN = {
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "boolean": pa.bool_(),
    "string": pa.string(),
}
_PYTHON = {kind: bool if kind == pa.bool_() else int for kind in _PLAIN.values()}
"""The Python type of each wire type's JSON values (texts aside)."""
_PER_MICRO = {"us": 1, "ms": 1_000}
_DATE, _INSTANT, _SPAN = "date", "instant", "span"


@dataclass(frozen=True)
class Plan:
    """How one collection's payloads are parsed: its columns' names, the Arrow schema its
    reader parses them with, each column's conversion (None: as parsed; ``date``,
    ``instant`` timestamps, ``span`` durations) and unit's microseconds, and
    the schema versions (digests) it was planned from."""

    collection: str
    names: tuple[str, ...]
    wire: pa.Schema
    conversions: tuple[str | None, ...]
    micros: tuple[int, ...]
    digests: tuple[str, ...]


def plan(collection: str, columns: Sequence[connect.Column], digests: Sequence[str]) -> Plan | None:
    """How ``columns`` (the union of the registered versions ``digests``) are parsed by
    Arrow, or None when one of them is not (see the module)."""
    wire, conversions, micros = [], [], []
    for c in columns:
        read = _column(c)
        if read is None:
            return None
        wire.append(pa.field(c.name, read[0]))
        conversions.append(read[1])
        micros.append(read[2])
    if not wire:
        return None
    names = tuple(c.name for c in columns)
    return Plan(collection, names, pa.schema(wire), tuple(conversions), tuple(micros),
                tuple(digests))  # fmt: skip


def _column(c: connect.Column) -> tuple[pa.DataType, str | None, int] | None:
    """A column's wire type, conversion and unit, or None: Arrow's reader cannot give it."""
    kind = c.type
    if c.decimal or c.structured or c.connect not in _PLAIN:
        return None
    wire = _PLAIN[c.connect]
    if c.connect != "string":
        if pa.types.is_date32(kind):
            return (wire, _DATE, 1) if c.connect == "int32" else None
        if pa.types.is_timestamp(kind):
            conversion = _INSTANT if kind.tz is None else None  # zoned: ISO texts
        elif pa.types.is_time(kind) or pa.types.is_duration(kind):
            conversion = _SPAN
        else:
            conversion = None
        if conversion is not None:
            per = _PER_MICRO.get(kind.unit)
            return None if per is None else (wire, conversion, per)
    if pa.types.is_temporal(kind) or pa.types.is_interval(kind) or pa.types.is_binary(kind):
        return None  # an ISO text, base64 bytes, a date of another width
    return wire, None, 1


def parse(plan: Plan, payloads: pa.Array, *, text: pa.DataType) -> list[pa.Array]:
    """Each of ``plan``'s columns of the rows whose JSON ``payloads`` (text or binary; a
    null payload: a row of nulls) are given, in Spark's Arrow types (texts as ``text``:
    the task's text type).

    Raises:
        InvalidEventError: a payload is not a JSON object of the plan's wire types.
    """
    count = len(payloads)
    if count == 0:
        return [pa.array([], _spark_type(plan, j, text)) for j in range(len(plan.names))]
    filled = pc.fill_null(payloads.cast(pa.binary()), b"{}")
    lines = pc.binary_join_element_wise(filled, b"\n", b"").cast(pa.large_binary())
    offsets = np.frombuffer(lines.buffers()[1], np.int64)[: count + 1]
    data = lines.buffers()[2]
    body = data[int(offsets[0]) : int(offsets[-1])]
    try:
        if not _framed(offsets, data):
            raise pa.ArrowInvalid("a payload not framed as one object")
        _utf8(filled)
        spread = _SPREAD.search(memoryview(_data(filled))) is not None
        table = _read(plan, body, spread=spread)
        if table.num_rows != count:  # each line holds one object or more, never none
            raise pa.ArrowInvalid(f"{table.num_rows} rows from {count} payloads")
        values = [table.column(j).combine_chunks() for j in range(len(plan.names))]
    except pa.ArrowInvalid as refused:
        values = _read_as_spark(plan, payloads, str(refused))
    return [_converted(plan, j, column, text) for j, column in enumerate(values)]


_SPREAD = re.compile(rb"[\n\r]")
_OPEN, _CLOSE = ord("{"), ord("}")


def _framed(offsets: np.ndarray, data: pa.Buffer) -> bool:
    """Whether each payload (a line of ``data``, ``offsets`` with its newline) begins with
    ``{`` and ends with ``}``: then no line is empty, each gives Arrow's reader one row or
    more, and a count of rows equal to the payloads' is a row for each, in order."""
    starts, stops = offsets[:-1], offsets[1:] - 2  # the newline, then the last byte
    if (stops < starts).any():
        return False  # an empty payload
    view = np.frombuffer(data, np.uint8)
    return bool((view[starts] == _OPEN).all() and (view[stops] == _CLOSE).all())


def _data(payloads: pa.Array) -> pa.Buffer:
    """The bytes of a binary array's values, one after the other."""
    offsets = np.frombuffer(payloads.buffers()[1], np.int32)
    first, last = offsets[payloads.offset], offsets[payloads.offset + len(payloads)]
    return payloads.buffers()[2][int(first) : int(last)]


def _utf8(payloads: pa.Array) -> None:
    """Raise ``ArrowInvalid`` for a payload that is not UTF-8 (Arrow's reader copies a
    text's bytes unchecked; Spark reads such a byte as U+FFFD)."""
    payloads.cast(pa.string())


def _read_as_spark(plan: Plan, payloads: pa.Array, refused: str) -> list[pa.Array]:
    """The payloads Arrow's reader ``refused`` (or that are not one object a line), read
    one by one as Spark's ``from_json`` reads them: a lone surrogate escape
    (``"\\ud800"``: valid JSON, which no UTF-8 text holds) as ``?``, a byte that is no
    UTF-8 as U+FFFD, an empty text or JSON ``null`` as a row of nulls, the first value
    of a text holding more. What Spark reads otherwise than Python's parser (single
    quotes; a number or a structure in a text column, which it writes as Java does) is
    refused, as is what Spark refuses.

    Raises:
        InvalidEventError: a payload is not a JSON object of the plan's wire types.
    """
    fault = (
        f"a payload of {plan.collection!r} is not a JSON object of its registered schema's "
        f"types (read by Spark's typing instead, give 'apply_changes' schema=): "
    )
    wire = {field.name: field.type for field in plan.wire}
    rows: list[dict[str, Any]] = []
    for payload in payloads.cast(pa.binary()).to_pylist():
        text = None if payload is None else payload.decode("utf-8", "replace")
        try:
            document = _first_value(text or "", wire)
        except (ValueError, RecursionError) as exc:
            raise InvalidEventError(f"{fault}{refused}; {exc}: {text!r:.200}") from None
        rows.append(document)
    values = []
    for name, kind in wire.items():
        column = [row.get(name) for row in rows]
        try:
            values.append(pa.array(column, kind))
        except (pa.ArrowException, OverflowError, TypeError) as exc:
            raise InvalidEventError(f"{fault}{refused}; column {name!r}: {exc}") from exc
    return values


class _Object(dict[str, Any]):
    """A JSON object with its members as written (a repeated one each time)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs


def _first_value(text: str, wire: dict[str, pa.DataType]) -> dict[str, Any]:
    """The plan's members of the JSON object ``text`` begins with, checked by their wire
    types (every occurrence of a repeated member; the last one is read); ``{}`` for a
    text that is empty or ``null``.

    Raises:
        ValueError: ``text`` is no object of those types.
    """
    stripped = text.strip(" \t\n\r")
    if not stripped:
        return {}
    value, _ = json.JSONDecoder(object_pairs_hook=_Object).raw_decode(stripped)  # the first
    if value is None:
        return {}
    if not isinstance(value, _Object):
        raise ValueError("not a JSON object")
    for name, item in value.pairs:
        kind = wire.get(name)
        if kind is not None and item is not None:
            expected = str if pa.types.is_string(kind) else _PYTHON[kind]
            if type(item) is not expected:
                raise ValueError(f"{name!r} holds {item!r:.100}, not a {kind}")
    return {
        name: changes.as_spark_text(item) if isinstance(item, str) else item
        for name, item in ((name, value.get(name)) for name in wire)
    }


def _read(plan: Plan, body: pa.Buffer, *, spread: bool) -> pa.Table:
    """``body``'s JSON objects, one a line (``spread``: an object may span lines, which
    Arrow's reader finds more slowly), by the plan's wire schema."""
    try:
        return pajson.read_json(
            pa.BufferReader(body),
            read_options=pajson.ReadOptions(use_threads=False, block_size=max(len(body), 1)),
            parse_options=pajson.ParseOptions(
                explicit_schema=plan.wire,
                unexpected_field_behavior="ignore",
                newlines_in_values=spread,
            ),
        )
    except pa.ArrowNotImplementedError as exc:
        raise pa.ArrowInvalid(str(exc)) from exc


def _converted(plan: Plan, j: int, values: pa.Array, text: pa.DataType) -> pa.Array:
    conversion, per = plan.conversions[j], plan.micros[j]
    if conversion is None:
        return values.cast(text) if pa.types.is_string(values.type) else values
    if conversion == _DATE:
        return values.cast(pa.date32())
    micros = values.cast(pa.int64())
    if per != 1:
        micros = pc.multiply_checked(micros, per)
    return micros.cast(_spark_type(plan, j, text))


def _spark_type(plan: Plan, j: int, text: pa.DataType) -> pa.DataType:
    """The Arrow type Spark gives column ``j``'s type."""
    conversion = plan.conversions[j]
    if conversion == _DATE:
        return pa.date32()
    if conversion == _INSTANT:
        return pa.timestamp("us")
    if conversion == _SPAN:
        return pa.duration("us")
    kind = plan.wire.field(j).type
    return text if pa.types.is_string(kind) else kind


def schema_versions(metadata: pa.Array) -> pa.Array:
    """Per event (its ``metadata`` text), the schema version it names (``schema``: as
    Spark's ``get_json_object(metadata, '$.schema')`` reads it; null: none)."""
    texts = metadata.cast(pa.string()) if pa.types.is_binary(metadata.type) else metadata
    return pa.array([_named_schema(text) for text in texts.to_pylist()], pa.string())


def _named_schema(text: str | None) -> str | None:
    """``schema`` of the object ``text`` begins with, its first occurrence (what follows
    the object is not read), as ``get_json_object`` reads it (single quotes aside)."""
    if text is None:
        return None
    try:
        document: Any = json.JSONDecoder(object_pairs_hook=_first_members).raw_decode(
            text.lstrip(" \t\n\r")
        )[0]
    except (ValueError, RecursionError):
        return None
    value = document.get("schema") if isinstance(document, dict) else None
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _first_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, a repeated one's first value."""
    members: dict[str, Any] = {}
    for name, value in pairs:
        members.setdefault(name, value)
    return members


UNKNOWN_VERSION = (
    "typed: an event of {collection!r} names schema version ",
    ", not known to typed (registered after typed() read the log's schemas, or never): "
    "its columns may be missing from the typed rows. Restart the query so that typed "
    "reads the registry again",
)
"""The message's two parts around the version an event names that typing did not read."""


def check_versions(plan: Plan, versions: pa.Array) -> None:
    """Fail, naming it, on an event whose schema version (``versions``) the plan was not
    made from: a later version may hold columns the plan would drop silently.

    Raises:
        InvalidEventError: an event names a version the plan does not know.
    """
    named = pc.drop_null(pc.unique(versions)).to_pylist()
    unknown = [v for v in named if v not in plan.digests]
    if unknown:
        head, tail = UNKNOWN_VERSION
        raise InvalidEventError(head.format(collection=plan.collection) + unknown[0] + tail)
