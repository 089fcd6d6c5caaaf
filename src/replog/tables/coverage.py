"""What each Delta commit of ``apply_changes`` covers of its log and of the source.

Each commit ``apply_changes`` makes carries, in its ``commitInfo``, a ``replog`` object
(:class:`Coverage`): the log's id, the cumulative per-shard offsets applied (shard -> last
sequence; every event of the log at or before them is in the table), and the source
positions and commit times its micro-batch held (first and last: for PostgreSQL the
commit LSN, as a number and as ``0/3A5F1C8``; the events' commit times in ms). Any reader
of the Delta log (Spark, delta-rs, DuckDB) maps a table version to a source position
with it; :mod:`replog.tables.as_of` reads a table as of any position from it.

An event's position (:func:`event_positions`) is its transaction's commit LSN
(``metadata.transaction.id`` ``"xid:commit_lsn"``, as capture and Debezium's PostgreSQL
connector write it), else its ``source.lsn`` (a snapshot read's, or a change without a
transaction block); its time is its ``timestamp`` (capture: the commit time; Debezium:
``source.ts_ms``). All events of one transaction share both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from replog.errors import InvalidOptionError

INFO_KEY = "replog"
"""The ``commitInfo`` member holding a commit's :class:`Coverage`."""

TRANSACTION_POSITION = r'"transaction"\s*:\s*\{[^{}]*?"id"\s*:\s*"[^"]*?:(?<p>[0-9]+)"'
SOURCE_POSITION = r'"lsn"\s*:\s*(?<p>[0-9]+)'
"""Where an event's ``metadata`` text holds its position: the commit LSN of its
transaction, else the source's LSN. One group (named ``p``, RE2's syntax). The Spark
layer reads them with :func:`event_positions` too, in its tasks."""
POSITION_PATTERNS = (TRANSACTION_POSITION, SOURCE_POSITION)

SOURCE_CONNECTOR = r'"source"\s*:\s*\{[^{}]*?"connector"\s*:\s*"(?<p>[^"]*)"'
SOURCE_NAME = r'"source"\s*:\s*\{[^{}]*?"name"\s*:\s*"(?<p>[^"]*)"'
"""Where an event's ``metadata`` text names its source: Debezium's ``source`` block (as
capture writes it too) names the connector (``postgresql``, ``mysql``) and the logical
server (``name``: capture's slot or server name, a Debezium connector's topic prefix).
An event's source is ``connector:name`` (:func:`event_sources`)."""
SOURCE_PATTERNS = (SOURCE_CONNECTOR, SOURCE_NAME)

MAX_LSN = (1 << 64) - 1


def lsn_to_int(text: str, option: str = "lsn") -> int:
    """``'16/B374D848'`` -> the 64-bit position; a bad text is an error naming ``option``."""
    high, slash, low = str(text).strip().partition("/")
    try:
        if not slash or not high or not low or len(high) > 8 or len(low) > 8:
            raise ValueError(text)
        return (int(high, 16) << 32) + int(low, 16)
    except ValueError as exc:
        raise InvalidOptionError(
            f"{option}: {text!r} is not a PostgreSQL LSN (two hexadecimal numbers of up to 8 "
            f"digits, e.g. 0/3A5F1C8)"
        ) from exc


def lsn_to_text(position: int) -> str:
    """The 64-bit position as PostgreSQL writes it (``'16/B374D848'``)."""
    return f"{position >> 32:X}/{position & 0xFFFFFFFF:X}"


def event_positions(metadata: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Per event (its ``metadata`` text), its position (int64; null: none found)."""
    column = metadata.combine_chunks() if isinstance(metadata, pa.ChunkedArray) else metadata
    if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        column = column.cast(pa.string())
    found: pa.Array = pa.nulls(len(column), pa.int64())
    for pattern in POSITION_PATTERNS:
        extracted = pc.extract_regex(column, pattern)
        valid = pc.is_valid(extracted)
        values = pc.if_else(valid, pc.struct_field(extracted, "p"), pa.scalar(None, pa.string()))
        found = pc.coalesce(found, values.cast(pa.int64()))
    return found


def event_sources(metadata: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Per event (its ``metadata`` text), its source ``connector:name`` (string; null:
    its metadata names none)."""
    column = metadata.combine_chunks() if isinstance(metadata, pa.ChunkedArray) else metadata
    if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        column = column.cast(pa.string())
    parts = []
    for pattern in SOURCE_PATTERNS:
        extracted = pc.extract_regex(column, pattern)
        valid = pc.is_valid(extracted)
        parts.append(
            pc.if_else(valid, pc.struct_field(extracted, "p"), pa.scalar(None, pa.string()))
        )
    joined: pa.Array = pc.binary_join_element_wise(*parts, ":")  # null when one is
    return joined


def event_times(timestamps: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Per event (its ``timestamp``), its time in ms since the epoch (int64)."""
    column = timestamps.combine_chunks() if isinstance(timestamps, pa.ChunkedArray) else timestamps
    if pa.types.is_timestamp(column.type):
        # to the millisecond, down (a source's commit times are kept in ms)
        column = column.cast(pa.timestamp("ms", tz=column.type.tz), safe=False).cast(pa.int64())
    result: pa.Array = column.cast(pa.int64())
    return result


@dataclass(frozen=True)
class Span:
    """The first and last position and time of a set of events (None: none known)."""

    first_position: int | None = None
    last_position: int | None = None
    first_ms: int | None = None
    last_ms: int | None = None

    @classmethod
    def of(cls, positions: pa.Array, times: pa.Array) -> Span:
        """The span of events with these positions and times (nulls ignored)."""
        low, high = pc.min_max(positions).values()
        first, last = pc.min_max(times).values()
        return cls(low.as_py(), high.as_py(), first.as_py(), last.as_py())

    @classmethod
    def per_source(
        cls, sources: pa.Array, positions: pa.Array, times: pa.Array
    ) -> dict[str, Span]:
        """The span of each source's events (``sources``: :func:`event_sources`; events
        of no known source are left out)."""
        grouped = (
            pa.table({"source": sources, "position": positions, "time": times})
            .filter(pc.is_valid(sources))
            .group_by("source", use_threads=False)
            .aggregate([("position", "min"), ("position", "max"), ("time", "min"), ("time", "max")])
        )
        columns = ("position_min", "position_max", "time_min", "time_max")
        return {
            source: cls(*values)
            for source, *values in zip(
                grouped.column("source").to_pylist(),
                *(grouped.column(c).to_pylist() for c in columns),
                strict=True,
            )
        }

    def joined(self, other: Span) -> Span:
        return Span(
            _min(self.first_position, other.first_position),
            _max(self.last_position, other.last_position),
            _min(self.first_ms, other.first_ms),
            _max(self.last_ms, other.last_ms),
        )

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        if self.first_position is not None and self.last_position is not None:
            found["first_lsn"] = lsn_to_text(self.first_position)
            found["last_lsn"] = lsn_to_text(self.last_position)
            found["first_position"] = self.first_position
            found["last_position"] = self.last_position
        if self.first_ms is not None and self.last_ms is not None:
            found["first_ms"] = self.first_ms
            found["last_ms"] = self.last_ms
        return found

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Span:
        return cls(
            _int_or_none(data.get("first_position")),
            _int_or_none(data.get("last_position")),
            _int_or_none(data.get("first_ms")),
            _int_or_none(data.get("last_ms")),
        )


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


Sources = Mapping[str, Span]
"""Per source (``connector:name``), the span of its events."""


def joined_sources(first: Sources, second: Sources) -> dict[str, Span]:
    found = dict(first)
    for source, span in second.items():
        found[source] = found[source].joined(span) if source in found else span
    return found


def sources_json(sources: Sources) -> dict[str, Any]:
    return {source: span.to_json() for source, span in sorted(sources.items())}


def sources_from_json(data: Any) -> dict[str, Span]:
    if not isinstance(data, Mapping):
        return {}
    return {str(s): Span.from_json(v) for s, v in data.items() if isinstance(v, Mapping)}


@dataclass(frozen=True)
class Coverage:
    """A commit's ``replog`` commit info: what of the log and the source it covers.

    ``offsets`` are cumulative (the table holds every event at or before them); ``batch``
    is the span of the micro-batch this commit applied, ``sources`` the span of each
    source's events in it (a log may carry several PostgreSQL servers, Debezium
    connectors, MySQL servers, whose positions do not compare); ``collection``, ``keys``, ``mode``
    and ``schema`` (a DDL or Spark JSON schema, when ``apply_changes`` was given one) say
    how the table is built from the log's events, so that a reader can build it further."""

    offsets: Mapping[int, int]
    batch: Span = field(default_factory=Span)
    log_id: str | None = None
    collection: str | None = None
    keys: tuple[str, ...] = ()
    mode: str = "scd1"
    schema: str | None = None
    sources: Sources = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            **({"log_id": self.log_id} if self.log_id is not None else {}),
            "offsets": {str(shard): seq for shard, seq in sorted(self.offsets.items())},
            "batch": self.batch.to_json(),
            "sources": sources_json(self.sources),
            "collection": self.collection,
            "keys": list(self.keys),
            "mode": self.mode,
        }
        if self.schema is not None:
            document["schema"] = self.schema
        return document

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Coverage:
        offsets = data.get("offsets") or {}
        collection = data.get("collection")
        schema = data.get("schema")
        return cls(
            {int(shard): int(seq) for shard, seq in offsets.items()},
            Span.from_json(data.get("batch") or {}),
            data.get("log_id") if isinstance(data.get("log_id"), str) else None,
            collection if isinstance(collection, str) else None,
            tuple(str(k) for k in data.get("keys") or ()),
            str(data.get("mode") or "scd1"),
            schema if isinstance(schema, str) else None,
            sources_from_json(data.get("sources")),
        )

    def after(self, previous: Coverage | None) -> Coverage:
        """This commit's coverage made cumulative over ``previous`` (the table's last)."""
        if previous is None:
            return self
        offsets = dict(previous.offsets)
        for shard, sequence in self.offsets.items():
            offsets[shard] = max(sequence, offsets.get(shard, 0))
        return replace(
            self,
            offsets=offsets,
            collection=self.collection or previous.collection,
            log_id=self.log_id or previous.log_id,
        )


@dataclass(frozen=True)
class BatchCoverage:
    """What a micro-batch holds, gathered from its events: the last sequence per shard,
    the span of positions and times, and each source's."""

    offsets: Mapping[int, int] = field(default_factory=dict)
    span: Span = field(default_factory=Span)
    sources: Sources = field(default_factory=dict)

    @classmethod
    def of_events(
        cls,
        shards: pa.Array,
        sequences: pa.Array,
        positions: pa.Array,
        times: pa.Array,
        sources: pa.Array | None = None,
    ) -> BatchCoverage:
        """The coverage of events given column by column (``sources``: each event's,
        :func:`event_sources`; None: not known)."""
        if len(shards) == 0:
            return cls()
        grouped = (
            pa.table({"shard": shards, "sequence": sequences})
            .group_by("shard", use_threads=False)
            .aggregate([("sequence", "max")])
        )
        offsets = dict(
            zip(
                grouped.column("shard").to_pylist(),
                grouped.column("sequence_max").to_pylist(),
                strict=True,
            )
        )
        per_source = {} if sources is None else Span.per_source(sources, positions, times)
        return cls(offsets, Span.of(positions, times), per_source)

    def joined(self, other: BatchCoverage) -> BatchCoverage:
        offsets = dict(self.offsets)
        for shard, sequence in other.offsets.items():
            offsets[shard] = max(sequence, offsets.get(shard, 0))
        sources = joined_sources(self.sources, other.sources)
        return BatchCoverage(offsets, self.span.joined(other.span), sources)

    def to_json(self) -> dict[str, Any]:
        return {
            "offsets": {str(s): q for s, q in sorted(self.offsets.items())},
            "span": self.span.to_json(),
            "sources": sources_json(self.sources),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchCoverage:
        offsets = {int(s): int(q) for s, q in (data.get("offsets") or {}).items()}
        span = Span.from_json(data.get("span") or {})
        return cls(offsets, span, sources_from_json(data.get("sources")))

    @classmethod
    def union(cls, parts: Iterable[BatchCoverage]) -> BatchCoverage:
        found = cls()
        for part in parts:
            found = found.joined(part)
        return found


@dataclass(frozen=True)
class VersionCoverage:
    """A table version and what it covers: cumulative offsets, and the highest position
    and time among every event applied up to it (``reached``); ``batch``: its own commit's
    span (None: a commit that applied no events, e.g. a column added)."""

    version: int
    timestamp_ms: int
    coverage: Coverage
    reached: Span
    own: bool
    """Whether this version's commit carries replog's commit info (else it inherits the
    version before: a column added, a compaction)."""


def table_history(history: Sequence[Mapping[str, Any]]) -> list[VersionCoverage]:
    """The versions of a table (delta-rs's ``DeltaTable.history()``: commit infos, newest
    first) that hold replog's coverage or follow one, oldest first; ``reached`` accumulates
    the batches' last positions and times."""
    found: list[VersionCoverage] = []
    last: VersionCoverage | None = None
    for commit in sorted(history, key=lambda c: int(c["version"])):
        info = commit.get(INFO_KEY)
        version, stamp = int(commit["version"]), int(commit.get("timestamp") or 0)
        if isinstance(info, Mapping):
            coverage = Coverage.from_json(info)
            reached = coverage.batch if last is None else last.reached.joined(coverage.batch)
            last = VersionCoverage(version, stamp, coverage, reached, True)
        elif last is not None:
            last = VersionCoverage(version, stamp, last.coverage, last.reached, False)
        else:
            continue
        found.append(last)
    return found


def latest(history: Sequence[Mapping[str, Any]]) -> Coverage | None:
    """The newest coverage among commit infos (any order); None: none holds one."""
    for commit in sorted(history, key=lambda c: -int(c.get("version", -1))):
        info = commit.get(INFO_KEY)
        if isinstance(info, Mapping):
            return Coverage.from_json(info)
    return None
