"""PostgreSQL values (their text output) as exact JSON values, shaped as Debezium does.

psycopg's own loaders parse the text of each type (arrays with their element types
included); this module only says how each parsed value is written as JSON:

* ``numeric`` as a JSON number with the server's exact digits (``1.50`` stays ``1.50``,
  ``0.000000000000000000000000001`` is not shortened to ``1E-27``; ``NaN`` and infinities
  as strings), also inside arrays; integers as numbers, floats as their shortest
  round-trip text;
* ``timestamptz`` as ISO-8601 in UTC (``2024-05-01T10:00:00.123456Z``), ``timestamp``,
  ``date`` and ``time`` as ISO-8601 (values beyond Python's range, such as ``infinity``,
  as the server's text);
* ``bytea`` as base64 (Debezium's ``binary.handling.mode=bytes`` in JSON);
* ``json``/``jsonb`` as a string holding the exact text (Debezium's ``io.debezium.data.Json``);
* ``interval`` as ISO-8601 text (the session's ``IntervalStyle``); arrays as JSON arrays;
  every other type as its text output.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import psycopg
import psycopg.adapt
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.pq import Format
from psycopg.types.string import TextLoader

from replog.format.jsontext import RawJSON

TEXT_AS_IS = ("json", "jsonb", "interval")
"""Types whose psycopg loader would lose something (number text, months of an interval)."""

SESSION_SETTINGS = {"TimeZone": "UTC", "DateStyle": "ISO, YMD", "IntervalStyle": "iso_8601"}
"""How the capture session asks the server to write values (the text the loaders read)."""

_UNKNOWN_OID = 0


class NumericTextLoader(Loader):
    """``numeric`` as its exact text: a :class:`RawJSON` number, or a string for ``NaN``
    and the infinities (not JSON numbers). psycopg's own loader makes a ``Decimal``,
    whose text may differ (``1E-27``)."""

    def load(self, data: Buffer) -> RawJSON | str:
        text = bytes(data).decode("ascii")
        return RawJSON(text) if text[-1].isdigit() else text


def _adapters() -> psycopg.adapt.AdaptersMap:
    adapters = psycopg.adapt.AdaptersMap(psycopg.adapters)
    for name in TEXT_AS_IS:
        adapters.register_loader(name, TextLoader)
    adapters.register_loader("numeric", NumericTextLoader)
    return adapters


def _decimal(value: Decimal) -> Any:
    return value if value.is_finite() else str(value)


def _float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _datetime(value: dt.datetime) -> str:
    if value.tzinfo is None:
        return value.isoformat()
    return value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _bytes(value: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(bytes(value)).decode("ascii")


def _list(value: list[Any]) -> list[Any]:
    return [to_json_value(item) for item in value]


_CONVERSIONS: tuple[tuple[type | tuple[type, ...], Callable[[Any], Any]], ...] = (
    ((bool, int, str), lambda value: value),
    (Decimal, _decimal),
    (float, _float),
    (dt.datetime, _datetime),  # before date: a datetime is a date
    ((dt.date, dt.time), lambda value: value.isoformat()),
    ((bytes, bytearray, memoryview), _bytes),
    (list, _list),
)


def to_json_value(value: Any) -> Any:
    """A value psycopg loaded, as the JSON value capture writes (see the module doc)."""
    if value is None:
        return None
    for types, convert in _CONVERSIONS:
        if isinstance(value, types):
            return convert(value)
    return str(value)  # uuid, inet, ...: their text form


class ValueReader:
    """Reads the text output of columns of known type ids into JSON values."""

    def __init__(self) -> None:
        self._adapters = _adapters()
        self._loaders: dict[int, Callable[[bytes], Any]] = {}

    def _loader(self, type_oid: int) -> Callable[[bytes], Any]:
        load = self._loaders.get(type_oid)
        if load is None:
            cls = self._adapters.get_loader(type_oid, Format.TEXT) or self._adapters.get_loader(
                _UNKNOWN_OID, Format.TEXT
            )
            assert cls is not None
            load = cls(type_oid, self._adapters).load
            self._loaders[type_oid] = load
        return load

    def read(self, type_oid: int, text: str | None) -> Any:
        """The JSON value of one column's text output (None for NULL)."""
        if text is None:
            return None
        try:
            loaded = self._loader(type_oid)(text.encode("utf-8"))
        except psycopg.DataError:  # infinity, years past 9999 or BC: keep the server's text
            return text
        return to_json_value(loaded)
