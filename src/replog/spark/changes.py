"""A micro-batch's changes of every table it feeds, in one pass (one Spark job).

``apply_changes`` types each table's events (the registry's schemas, a given schema, or a
struct already) in one projection over the micro-batch: a row's payload is parsed only by
its own collection's parser (a ``CASE`` per table). A ``mapInArrow`` task then splits its
partition by table: the rows a table can take without a merge (:mod:`replog.tables.ahead`)
are written by the task as a Parquet file in the table's folder, the rest go to the driver
as Arrow (their memory bounded by the source's ``maxEventsPerTrigger``); the driver commits
both in one Delta commit per table. A small batch (a follower's, after one of at most
:data:`LOCAL_EVENTS` events) is collected whole instead (``toArrow``) and split on the
driver by the same function, without a round trip through a Python worker.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType, TimestampType

from replog.errors import InvalidOptionError
from replog.format.events import TRUNCATE
from replog.processlocal import ProcessDict
from replog.schemas import registry
from replog.spark.conf import setting
from replog.spark.typed import VERSION, Typing, schema_version
from replog.spark.workers import settle
from replog.tables import ahead as written_ahead
from replog.tables import changes as rows
from replog.tables import coverage as covered

EVENT_COLUMNS = ("shard", "sequence", "operation", "timestamp", "data")
WHICH = "__replog_part"
"""Per event, the index of the part (table) it goes to; :data:`UNKNOWN`: a collection no
part takes, :data:`NO_COLLECTION`: an event without one."""
UNKNOWN = -1
NO_COLLECTION = -2
_KEY = "__replog_key"
_METADATA = "__replog_metadata"
"""Per event, its ``metadata`` text, which a task reads its position, source and marks
(:func:`replog.tables.changes.event_marks`) from."""
_POSITION = "__replog_position"
"""Per event, its source position (:func:`replog.tables.coverage.event_positions`)."""
_SOURCE = "__replog_source"
"""Per event, its source (:func:`replog.tables.coverage.event_sources`)."""
_RESULT = "part int, kind string, text string, payload binary"
_MAX_BYTES = "spark.sql.execution.arrow.maxBytesPerBatch"
_CHUNK_ROWS = 100_000
"""Rows per Arrow payload a task sends the driver (a binary value stays far below 2 GB)."""
_LOCAL_CHUNK_ROWS = 10_000
"""Rows per Arrow batch a driver-side split takes at once (a task's batches' size)."""


@dataclass(frozen=True)
class Part:
    """One table's part of a micro-batch: its collection (None: every event), key
    columns, the schema its rows are parsed with (None: the registry's versions ``found``,
    or ``data`` is a struct already), and how a task may write its rows ahead (None: it
    may not)."""

    index: int
    collection: str | None
    keys: tuple[str, ...]
    schema: StructType | str | None
    found: Sequence[registry.SchemaVersion] = ()
    ahead: written_ahead.Plan | None = None

    def condition(self) -> Column:
        if self.collection is None:
            return F.lit(True)
        return F.col("collection") == F.lit(self.collection)

    @property
    def row(self) -> str:
        return f"__replog_row{self.index}"

    def column(self, field: int) -> str:
        """The changes frame's column of the row's ``field``-th field."""
        return f"{self.row}_{field}"


@dataclass
class Gathered:
    """What the micro-batch holds for one part: its changes for the driver, its files
    written ahead, and one event's key (its JSON text)."""

    changes: list[pa.Table] = field(default_factory=list)
    ahead: list[written_ahead.Prewritten] = field(default_factory=list)
    sample: str | None = None

    def table(self) -> pa.Table | None:
        """The changes for the driver, as one table (None: the batch holds none)."""
        if not self.changes:
            return None
        return pa.concat_tables(self.changes, promote_options="permissive")


@dataclass
class Batch:
    """A micro-batch's changes, per part, and the collections no part takes (name ->
    one key), events without a collection (one key)."""

    parts: dict[int, Gathered]
    unknown: dict[str, str]
    without_collection: str | None
    coverage: covered.BatchCoverage = field(default_factory=covered.BatchCoverage)
    """What the micro-batch holds of the log and the source, over all its events."""
    events: int = 0
    """The micro-batch's events (a table's, or none, or unknown)."""


def changes_frame(
    batch: DataFrame, parts: Sequence[Part], *, flat: bool = True
) -> tuple[DataFrame, dict[int, StructType]]:
    """The micro-batch as changes: per event :data:`WHICH`, the bookkeeping columns of
    :mod:`replog.tables.changes`, its key's text and, per part, its row's fields (NULL for
    other parts' events); and each part's row type. The expressions are built once per
    query and shape of batch (a follower's micro-batch spent a second of py4j calls
    building them again). ``flat=False``: each part's row stays one struct column
    (:attr:`Part.row`), for a batch collected to the driver, which flattens it in Arrow
    (one projection fewer for Spark to analyse: ~30 ms of a follower's batch)."""
    columns = batch.columns
    absent = [c for c in EVENT_COLUMNS if c not in columns]
    if absent:
        raise InvalidOptionError(
            f"apply_changes: the micro-batch lacks the replog source's columns {absent} "
            f"(columns: {columns})"
        )
    key = _signature(batch, columns, parts)
    built = _BUILT.get(key)
    if built is None:
        built = _build(batch, columns, parts)
        if len(_BUILT) >= _BUILT_MAX:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = built
    projections, rows_of = built
    frame = batch
    for projection in projections if flat else projections[:-1]:
        frame = frame.select(*projection)
    return frame, rows_of


_Built = tuple[list[list[Column]], dict[int, StructType]]
_BUILT: ProcessDict[tuple[Any, ...], _Built] = ProcessDict()
_BUILT_MAX = 64


def _signature(batch: DataFrame, columns: list[str], parts: Sequence[Part]) -> tuple[Any, ...]:
    """What the built expressions depend on: the session's application, the batch's
    columns and payload type, and per part its collection, keys, schema and versions."""
    shape = tuple(
        (
            p.index,
            p.collection,
            p.keys,
            p.schema.json() if isinstance(p.schema, StructType) else p.schema,
            tuple(v.digest for v in p.found),
        )
        for p in parts
    )
    application = batch.sparkSession.sparkContext.applicationId
    return (application, tuple(columns), batch.schema["data"].dataType.json(), shape)


def _build(batch: DataFrame, columns: list[str], parts: Sequence[Part]) -> _Built:
    """The three projections of :func:`changes_frame`, and each part's row type."""
    typings, parsed = _parsers(batch, parts)
    metadata = "metadata" in columns
    version = []
    if typings and metadata:
        digests = [d for t in typings.values() for d in t.digests]
        version = [schema_version(F.col("metadata"), digests).alias(VERSION)]
    # parsed in a projection of its own: each row struct reads every column of its parse
    first = [
        *(F.col(c) for c in columns if c not in ("before", "event_id")),
        *version,
        *(c for t in typings.values() for c in t.parses("data")),
        *(json.alias(f"__replog_parsed{index}") for index, json in parsed.items()),
    ]
    made = []
    for part in parts:
        if part.index in typings:
            row = typings[part.index].typed("data", F.col(VERSION) if metadata else None)
        elif part.index in parsed:
            row = F.col(f"__replog_parsed{part.index}")
        else:  # a struct already
            row = F.when(part.condition(), F.col("data"))
        made.append(row.alias(part.row))
    second = [
        _which(columns, parts).alias(WHICH),
        F.col("shard").alias(rows.SHARD),
        F.col("sequence").alias(rows.SEQUENCE),
        F.col("operation").alias(rows.OPERATION),
        F.col("timestamp").cast(TimestampType()).alias(rows.TIMESTAMP),
        _column(columns, "collection").alias(rows.COLLECTION),
        _column(columns, "key").alias(_KEY),
        _column(columns, "metadata").cast("string").alias(_METADATA),
        *made,
    ]
    frame = batch.select(*first).select(*second)
    flat, rows_of = [], {}
    for part in parts:
        fields = frame.schema[part.row].dataType
        assert isinstance(fields, StructType)
        rows.check_columns(fields.names, part.keys)
        rows_of[part.index] = fields
        flat += [F.col(part.row)[name].alias(part.column(j)) for j, name in enumerate(fields.names)]
    # the rows' fields as columns of their own: Arrow's per-row size check (mapInArrow)
    # walks a struct's children for every row
    kept = [F.col(c) for c in frame.columns if not c.startswith("__replog_row")]
    return [first, second, [*kept, *flat]], rows_of


def _parsers(
    batch: DataFrame, parts: Sequence[Part]
) -> tuple[dict[int, Typing], dict[int, Column]]:
    """How each part's payloads are parsed: by the registry (a :class:`Typing`) or by a
    given schema (``from_json``); neither for a struct already."""
    typings: dict[int, Typing] = {}
    parsed: dict[int, Column] = {}
    if isinstance(batch.schema["data"].dataType, StructType):
        return typings, parsed
    for part in parts:
        if part.schema is not None:
            json = F.from_json(F.col("data").cast("string"), part.schema, {"mode": "FAILFAST"})
            parsed[part.index] = F.when(part.condition(), json)
        elif part.found:
            typings[part.index] = Typing(
                part.collection or "", part.found, tag=str(part.index), where=part.condition()
            )
        else:
            raise InvalidOptionError(
                "apply_changes: 'data' is a JSON payload: give schema= (a DDL string or a "
                "StructType of the row), log= (the schemas registered in the log) or type it "
                "first (parse_payload, typed)"
            )
    return typings, parsed


def _which(columns: Sequence[str], parts: Sequence[Part]) -> Column:
    """:data:`WHICH`: the part an event goes to."""
    if any(p.collection is None for p in parts):  # one table: every event is its
        return F.lit(parts[0].index)
    chosen: Column | None = None
    for part in parts:
        chosen = (F.when if chosen is None else chosen.when)(part.condition(), F.lit(part.index))
    assert chosen is not None
    return F.when(F.col("collection").isNull(), F.lit(NO_COLLECTION)).otherwise(
        chosen.otherwise(F.lit(UNKNOWN))
    )


def _column(columns: Sequence[str], name: str) -> Column:
    return F.col(name) if name in columns else F.lit(None).cast("string")


@dataclass(frozen=True)
class _TaskPart:
    """What a task needs of a part: its row's columns (the changes frame's, and the
    names they stand for), its key columns (a delete sends no other), and how it may
    write rows ahead."""

    index: int
    row: str
    columns: tuple[str, ...]
    names: tuple[str, ...]
    keys: tuple[str, ...]
    ahead: written_ahead.Plan | None


LOCAL_EVENTS = 20_000
"""A micro-batch after one of at most this many events is split on the driver: its events
collected (``toArrow``) and run through the task's function there, without a
``mapInArrow`` round trip through a Python worker (~75 ms a job on an idle 2-core
machine, more under load: a follower's batches are small and many). Such a batch holds
what the log took while the small one ran (a query's first batch, a restarted one's, is
always split by the tasks), so the driver collects what a follower's batch holds, not
a backlog."""


def gather(
    frame: DataFrame,
    rows_of: Mapping[int, StructType],
    parts: Sequence[Part],
    *,
    local: bool = False,
) -> Batch:
    """Run the micro-batch's one job over ``frame`` (:func:`changes_frame`, whose parts'
    rows are ``rows_of``): each task splits its events by part, writes what it may ahead
    and sends the rest; gathered per part on the driver. ``local``: the events are
    collected and split on the driver by the same function (a small batch)."""
    tasks = []
    for part in parts:
        names = tuple(rows_of[part.index].names)
        columns = tuple(part.column(j) for j in range(len(names)))
        tasks.append(_TaskPart(part.index, part.row, columns, names, part.keys, part.ahead))
    if local:
        events = _flattened(frame.toArrow(), tasks).to_batches(max_chunksize=_LOCAL_CHUNK_ROWS)
        result = pa.Table.from_batches(list(_task(tasks)(iter(events))))
    else:
        # Arrow's per-row size check (it walks every column's buffers for each row) cost
        # a quarter of a load's pass; batches stay bounded by their 10,000 rows. Set on
        # the streaming query's own session (a clone of the user's) for this job only.
        with setting(frame.sparkSession, _MAX_BYTES, lambda _: str(2**31 - 1)):
            result = frame.mapInArrow(_task(tasks), _RESULT).toArrow()
    found = Batch({p.index: Gathered() for p in parts}, {}, None)
    kinds = result.column("kind").to_pylist()
    indexes = result.column("part").to_pylist()
    texts = result.column("text").to_pylist()
    for row, kind in enumerate(kinds):
        payload = result.column("payload")[row].as_py()
        if _noted(found, kind, texts[row], payload):
            continue
        gathered = found.parts.get(indexes[row])
        if gathered is None:
            continue
        if kind == "rows":
            with pa.ipc.open_stream(pa.py_buffer(payload)) as stream:
                gathered.changes.append(stream.read_all())
        elif kind == "ahead":
            gathered.ahead.append(written_ahead.Prewritten.from_bytes(payload))
        elif kind == "sample" and gathered.sample is None:
            gathered.sample = texts[row]
    return found


def _flattened(events: pa.Table, parts: Sequence[_TaskPart]) -> pa.Table:
    """``events`` with each part's row struct (:attr:`Part.row`, ``changes_frame(...,
    flat=False)``) as one column per field, as the frame's last projection makes them (a
    NULL row: NULL fields)."""
    for part in parts:
        if part.row not in events.column_names:
            continue  # flat already
        struct = events.column(part.row)
        events = events.drop_columns([part.row])
        for j, name in enumerate(part.columns):
            events = events.append_column(name, pc.struct_field(struct, [j]))
    return events


def _noted(found: Batch, kind: str, text: str | None, payload: bytes | None) -> bool:
    """Note a task's result row about the whole batch (not one part's) in ``found``;
    whether it was one."""
    if kind == "unknown":
        assert text is not None
        found.unknown.setdefault(text, payload.decode() if payload else "")
    elif kind == "no collection":
        found.without_collection = text
    elif kind == "events":
        assert text is not None
        found.events += int(text)
    elif kind == "coverage":
        assert text is not None
        found.coverage = found.coverage.joined(covered.BatchCoverage.from_json(json.loads(text)))
    else:
        return False
    return True


Task = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]


def _task(parts: Sequence[_TaskPart]) -> Task:
    """The function each task runs over its partition of the changes frame."""
    by_index = {p.index: p for p in parts}

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        held: dict[int, list[pa.Table]] = {}
        out = _Output()
        coverage = covered.BatchCoverage()
        count = 0
        for events in batches:
            count += events.num_rows
            batch = _with_metadata_read(events)
            coverage = coverage.joined(_coverage(batch))
            _split(batch, by_index, held, out)
        out.add(-1, "coverage", json.dumps(coverage.to_json()), None)
        out.add(-1, "events", str(count), None)
        for index, parts_held in held.items():
            changes = pa.concat_tables(parts_held)
            plan = by_index[index].ahead
            if plan is not None:
                changes, written = written_ahead.write_ahead(changes, plan)
                if written is not None:
                    out.add(index, "ahead", None, written.to_bytes())
            for start in range(0, max(changes.num_rows, 1), _CHUNK_ROWS):
                out.add(index, "rows", None, _ipc(changes.slice(start, _CHUNK_ROWS)))
        yield out.batch()
        settle()

    return run


def _with_metadata_read(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with each event's position and source (:data:`_POSITION`,
    :data:`_SOURCE`) and its marks (:data:`~replog.tables.changes.UNSENT`,
    :data:`~replog.tables.changes.OLD_KEY`) in place of its metadata text, read by the
    core's functions from each distinct text once: a transaction's events, a snapshot
    chunk's, share one. (Read by Spark in the projection, for every event, the position
    and source were about half of a 1M-event batch's projection, 3.7-5 s of 7-7.9 s; the
    marks' two substring tests a fifth of the JVM's time in a load.)"""
    at = batch.schema.get_field_index(_METADATA)
    texts = pc.dictionary_encode(batch.column(at))
    distinct = texts.dictionary
    unsent, old_keys = rows.event_marks(distinct)
    facts = {
        _POSITION: covered.event_positions(distinct),
        _SOURCE: covered.event_sources(distinct),
        rows.UNSENT: unsent,
        rows.OLD_KEY: old_keys,
    }
    taken = {name: values.take(texts.indices) for name, values in facts.items()}
    # an event without metadata (a null index) names no column
    taken[rows.UNSENT] = pc.coalesce(taken[rows.UNSENT], pa.scalar([], unsent.type))
    batch = batch.remove_column(at)
    for name, values in taken.items():
        batch = batch.append_column(name, values)
    return batch


def _coverage(batch: pa.RecordBatch) -> covered.BatchCoverage:
    """What one Arrow batch of a task's events holds of the log and the source."""
    return covered.BatchCoverage.of_events(
        batch.column(rows.SHARD),
        batch.column(rows.SEQUENCE),
        batch.column(_POSITION),
        covered.event_times(batch.column(rows.TIMESTAMP)),
        batch.column(_SOURCE),
    )


def _split(
    batch: pa.RecordBatch,
    parts: dict[int, _TaskPart],
    held: dict[int, list[pa.Table]],
    out: _Output,
) -> None:
    """One Arrow batch of a task's events, by part (``held``); one key per part, and
    the events no part takes, noted in ``out``."""
    which = batch.column(WHICH).to_numpy(zero_copy_only=False)
    found = np.unique(which).tolist()
    for index in found:
        picked = batch if len(found) == 1 else batch.filter(pa.array(which == index))
        key = picked.column(_KEY)[0].as_py()
        if index == NO_COLLECTION:
            out.add(index, "no collection", key, None)
        elif index == UNKNOWN:
            name = picked.column(rows.COLLECTION)[0].as_py()
            out.add(index, "unknown", name, (key or "").encode())
        else:
            if index not in out.sampled:  # a row's key (a truncate's only routes it)
                rows_of = pc.not_equal(picked.column(rows.OPERATION), TRUNCATE)
                first = pc.index(pc.fill_null(rows_of, True), True).as_py()
                if first >= 0:
                    out.add(index, "sample", picked.column(_KEY)[first].as_py(), None)
                    out.sampled.add(index)
            held.setdefault(index, []).append(_flatten(picked, parts[index]))


class _Output:
    """A task's result rows (:data:`_RESULT`)."""

    def __init__(self) -> None:
        self.columns: tuple[list[int], list[str], list[str | None], list[bytes | None]] = (
            [],
            [],
            [],
            [],
        )
        self.sampled: set[int] = set()
        """The parts whose sample key was sent."""

    def add(self, index: int, kind: str, text: str | None, payload: bytes | None) -> None:
        for column, value in zip(self.columns, (index, kind, text, payload), strict=True):
            column.append(value)  # type: ignore[attr-defined]

    def batch(self) -> pa.RecordBatch:
        index, kind, text, payload = self.columns
        return pa.RecordBatch.from_arrays(
            [
                pa.array(index, pa.int32()),
                pa.array(kind, pa.string()),
                pa.array(text, pa.string()),
                pa.array(payload, pa.binary()),
            ],
            names=["part", "kind", "text", "payload"],
        )


def _flatten(picked: pa.RecordBatch, part: _TaskPart) -> pa.Table:
    """A part's events as a batch of changes: its row's fields and the bookkeeping
    columns; a delete's row is its old image (often the key only): it sends no value."""
    deletes = pc.fill_null(pc.equal(picked.column(rows.OPERATION), rows.DELETE), False)
    values = [name for name in part.names if name not in part.keys]
    every = pa.scalar(values, pa.list_(pa.string()))
    unsent = pc.if_else(deletes, every, picked.column(rows.UNSENT).cast(every.type))
    bookkeeping = [*rows.CHANGE_COLUMNS, rows.COLLECTION, rows.OLD_KEY]
    return pa.table(
        [
            *(picked.column(c) for c in part.columns),
            *(picked.column(c) for c in bookkeeping),
            unsent,
            picked.column(_POSITION),
        ],
        names=[*part.names, *bookkeeping, rows.UNSENT, rows.SOURCE_POSITION],
    )


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as stream:
        stream.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data
