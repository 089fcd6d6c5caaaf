"""The Debezium corpus (tests/data/debezium/corpus, README there) and what "exact" means
for one of its events: used by tests/test_debezium_corpus.py, and runnable as a script that
prints the table of exact events per file (``python tests/debezium_corpus.py``; with
``PYTHONPATH`` pointing at another checkout's ``src`` it measures that code).

An event is exact when, appended on its own (``ingest.read_lines``, what ``replog append
--format debezium`` runs):

* it gives the expected operation and key (or is skipped for the expected reason);
* ``data`` is the row as the event carried it: the exact text of ``after`` (``before`` for
  a delete; the row itself for a flattened one; the document for MongoDB), or what
  ``expected.json`` names;
* the envelope given back (:func:`replog.debezium.original_envelope`, what ``to_debezium``
  sends) is the input's envelope byte for byte (the payload, without its schema wrapper);
* with a schema, each column typed from it (:func:`replog.schemas.connect.to_arrow`) is the
  value the source held: ``expected.json``'s ``values``, else the JSON value itself for a
  column of a plain type.

Only functions every version of replog had are used, so an older checkout is measured by
the same rules.
"""

from __future__ import annotations

import base64
import json
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa

CORPUS = Path(__file__).parent / "data" / "debezium" / "corpus"
EXPECTED: dict[str, Any] = json.loads((CORPUS / "expected.json").read_text())
NANOS_PER_DAY = 86_400_000_000_000
_UNIT = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


def lines(name: str) -> list[str]:
    return (CORPUS / name).read_text().splitlines()


def events() -> list[tuple[str, int]]:
    """(file, line number) of every corpus line that holds a change event."""
    return [
        (name, int(number))
        for name, spec in EXPECTED.items()
        for number, line in spec["lines"].items()
        if "skipped" not in line
    ]


# -- canonical text of typed values -----------------------------------------------------------


def civil(days: int) -> str:
    """Days since 1970-01-01 as a proleptic Gregorian date (Hinnant), any year."""
    z = days + 719468
    era = (z if z >= 0 else z - 146096) // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + (3 if mp < 10 else -9)
    year = yoe + era * 400 + (month <= 2)
    return f"{year:04d}-{month:02d}-{day:02d}"


def seconds(nanos: int) -> str:
    """Nanoseconds as decimal seconds without trailing zeros (``14706.78``, ``0``)."""
    text = format(Decimal(nanos).scaleb(-9), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def clock(nanos: int) -> str:
    whole, fraction = divmod(nanos, 1_000_000_000)
    minutes, second = divmod(whole, 60)
    hour, minute = divmod(minutes, 60)
    text = f"{hour:02d}:{minute:02d}:{second:02d}"
    return text + ("." + f"{fraction:09d}".rstrip("0") if fraction else "")


def canonical(value: Any, kind: pa.DataType, as_: str | None = None) -> Any:  # noqa: C901, PLR0911
    """A typed value as comparable text: dates ``2017-09-15``, timestamps
    ``2019-07-09T02:28:57.1`` (``Z`` after an instant), times ``04:05:11.789``, durations
    ``PT31557600S``, intervals ``P14M3DT14706.78S``, decimals with their scale, floats by
    their type's precision. ``value`` is the integer of the type's unit for temporal types
    (``as_``: ``time``/``duration``/``interval`` read an interval Spark gave)."""
    if value is None:
        return None
    if as_ == "interval" or pa.types.is_interval(kind):
        months, days, nanos = (
            (value["months"], value["days"], value["microseconds"] * 1000)
            if isinstance(value, dict)
            else (value.months, value.days, value.nanoseconds)
        )
        return f"P{months}M{days}DT{seconds(nanos)}S"
    if pa.types.is_timestamp(kind):
        nanos = value * _UNIT[kind.unit]
        days, rest = divmod(nanos, NANOS_PER_DAY)
        return f"{civil(days)}T{clock(rest)}" + ("Z" if kind.tz else "")
    if pa.types.is_date(kind):
        return civil(value)
    if as_ == "time" or pa.types.is_time(kind):
        return clock(value * _UNIT[kind.unit])
    if as_ == "duration" or pa.types.is_duration(kind):
        return f"PT{seconds(value * _UNIT[kind.unit])}S"
    if pa.types.is_decimal(kind):
        return format(value, "f")
    if pa.types.is_float32(kind):
        return f"{value:.7g}"
    if pa.types.is_float64(kind):
        return repr(value)
    if pa.types.is_binary(kind):
        return base64.b64encode(value).decode()
    return value


def arrow_values(table: pa.Table, kinds: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Each row of an Arrow table as canonical text per column (``kinds``: how to read a
    column given as another type, see :func:`canonical`)."""
    out: list[dict[str, Any]] = [{} for _ in range(table.num_rows)]
    for name, column in zip(table.column_names, table.columns, strict=True):
        kind = column.type
        as_ = (kinds or {}).get(name)
        temporal = pa.types.is_temporal(kind) and not pa.types.is_interval(kind)
        raw = (
            column.cast(pa.int32() if pa.types.is_date32(kind) else pa.int64())
            if temporal
            else column
        )
        for index, value in enumerate(raw.to_pylist()):
            out[index][name] = canonical(value, kind, as_)
    return out


# -- one event ------------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    number: int
    problems: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.problems


def _payload_text(line: str) -> tuple[str | None, dict[str, Any] | None]:
    """The envelope a line carries, as its exact text (a Kafka record's value, without the
    schema wrapper), and that wrapper's schema."""
    from replog.format import jsontext

    members = jsontext.parse_object(line)
    if "value" in members and set(members) <= {"key", "value"}:
        if members["value"].value is None:
            return None, None
        line = members["value"].text
        members = jsontext.parse_object(line)
    if "payload" in members and set(members) <= {"schema", "payload"}:
        schema = members.get("schema")
        return members["payload"].text, schema.value if schema is not None else None
    return line, None


def _expected_data(envelope: str, operation: str, connector: str | None) -> str | None:
    from replog.format import jsontext

    members = jsontext.parse_object(envelope)
    if "op" not in members:
        return envelope  # a flattened row: the row as given
    image = members.get("before" if operation == "delete" else "after")
    if image is None or image.value is None:
        return None
    return image.value if isinstance(image.value, str) else image.text


def check(name: str, number: int) -> Outcome:
    """Whether one corpus event comes out exact (:class:`Outcome` lists what did not)."""
    from replog import ingest

    spec = EXPECTED[name]
    expected = spec["lines"][str(number)]
    line = lines(name)[number - 1]
    outcome = Outcome(name, number)
    problems = outcome.problems
    try:
        read = ingest.read_lines(
            [line + "\n"], format="debezium", key_fields=tuple(spec["key_fields"])
        )
    except Exception as exc:  # an old checkout's failure is a finding
        problems.append(f"not appended: {type(exc).__name__}: {exc}")
        return outcome
    rows = read.table.to_pylist()
    if "skipped" in expected:
        if rows or read.skipped.get(expected["skipped"]) != 1:
            problems.append(
                f"expected skipped as {expected['skipped']!r}, got {rows} {read.skipped}"
            )
        return outcome
    if len(rows) != 1:
        problems.append(f"{len(rows)} events (skipped: {dict(read.skipped)})")
        return outcome
    problems.extend(_event_problems(line, rows[0], expected))
    return outcome


def _event_problems(line: str, row: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """What differs between one appended event and what its line says it is."""
    from replog import debezium
    from replog.format import jsontext
    from replog.schemas import connect

    problems = [
        f"{name} {row[name]!r}, expected {expected[name]!r}"
        for name in ("operation", "key")
        if row[name] != expected[name]
    ]
    envelope, schema = _payload_text(line)
    assert envelope is not None
    source = json.loads(envelope).get("source") or {}
    data_expected = expected.get("data") or _expected_data(
        envelope, expected["operation"], source.get("connector")
    )
    data = row["data"].decode() if row["data"] is not None else None
    if data != data_expected:
        problems.append(f"data {data!r}, expected {data_expected!r}")
    try:
        back = debezium.original_envelope(
            row["metadata"],
            operation=row["operation"],
            data=data,
            before=row["before"].decode() if row["before"] is not None else None,
        )
    except Exception as exc:
        back = f"{type(exc).__name__}: {exc}"
    if back != envelope:
        problems.append(f"envelope back {back!r}, expected {envelope!r}")
    if schema is not None and _row_is_struct(schema):
        problems.extend(_typed_problems(connect, jsontext, schema, envelope, expected))
    return problems


def _row_is_struct(schema: dict[str, Any]) -> bool:
    """Whether an envelope's schema types its rows (MongoDB's are JSON text)."""
    images = [f for f in schema.get("fields", []) if f.get("field") in ("after", "before")]
    return bool(images) and all(f.get("type") == "struct" for f in images)


def _typed_problems(
    connect: Any, jsontext: Any, schema: Any, envelope: str, expected: Any
) -> list[str]:
    try:
        columns = connect.row_columns(schema)
        image = json.loads(envelope, parse_float=Decimal)
        row = image["before"] if expected["operation"] == "delete" else image["after"]
        table = connect.to_arrow(columns, [row])
        got = arrow_values(table)[0]
    except Exception as exc:
        return [f"not typed: {type(exc).__name__}: {exc}"]
    values = expected.get("values") or {}
    problems = []
    for c in columns:
        if c.name in values:
            want = values[c.name]
        elif c.logical is None and c.connect not in ("bytes", "struct", "array", "map"):
            want = row.get(c.name)
            want = canonical(want, c.type) if isinstance(want, float | Decimal) else want
        else:
            problems.append(f"column {c.name!r} ({c.logical or c.connect}): no expected value")
            continue
        if got.get(c.name) != want:
            problems.append(f"column {c.name!r}: {got.get(c.name)!r}, expected {want!r}")
    return problems


def table() -> list[tuple[str, int, int]]:
    """(file, events, exact events) per corpus file."""
    totals: dict[str, list[int]] = {}
    for name, number in events():
        outcome = check(name, number)
        total = totals.setdefault(name, [0, 0])
        total[0] += 1
        total[1] += outcome.exact
    return [(name, events_, exact) for name, (events_, exact) in totals.items()]


if __name__ == "__main__":
    verbose = "-v" in sys.argv
    for name, number in events() if verbose else []:
        outcome = check(name, number)
        if not outcome.exact:
            print(f"{name}:{number}: " + " | ".join(p[:300] for p in outcome.problems))
    rows = table()
    for name, total, exact in rows:
        print(f"{name}\t{total}\t{exact}")
    print(f"total\t{sum(r[1] for r in rows)}\t{sum(r[2] for r in rows)}")
