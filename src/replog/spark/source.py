"""``spark.readStream.format("replog")`` and ``spark.read.format("replog")``.

``spark.read.format("replog").option("view", "latest")`` reads one row per (collection,
key): its newest event unless that is a delete, reduced per shard on the executors.

A thin adapter: offsets, planning and reading live in the core (:mod:`replog.offsets`,
:mod:`replog.planning`, :func:`replog.format.files.read_segment`). The driver-side
reader keeps its :class:`ReplicationLog` (and so the log state) between micro-batches, so
each batch reads only the commits made since the previous one.

The consumer's committed offsets follow Spark's commit log exactly: Spark asks for
``latestOffset(start)`` only once the micro-batch that ended at ``start`` is in its commit
log (or ``start`` is the query's initial offset), so ``start`` is recorded there. Spark's
own ``commit(end)`` comes one batch later, and never for the last batch of an
``AvailableNow`` run; it is recorded too, and is then usually already there.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from replog import offsets as positions
from replog import planning
from replog.checkpoints import consumers
from replog.core.files import read_segments
from replog.errors import ReplogError
from replog.format.state import LogState
from replog.log import ReplicationLog
from replog.offsets import Offsets
from replog.planning import ReadTask
from replog.spark.offsets import SparkOffset
from replog.spark.options import SourceOptions, plain_errors
from replog.spark.schema import SPARK_SCHEMA_DDL
from replog.spark.workers import settle
from replog.storage import Storage
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

LEGACY_CONSUMER = "default"
"""The consumer of checkpoints written before offsets named their consumer."""


class ReplogPartition(InputPartition):
    """One Spark task: shard ranges and their segments. Carries the storage address only."""

    def __init__(self, storage: Storage, index: int, tasks: tuple[ReadTask, ...]) -> None:
        super().__init__(index)
        self.storage = storage
        self.tasks = tasks

    def __repr__(self) -> str:  # never show storage options (secrets)
        ranges = ", ".join(f"{t.shard}:{t.first}..{t.last}" for t in self.tasks)
        return f"ReplogPartition({ranges})"


def read_partition(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """Executor side: stream the task's events as Arrow batches, checksum-verified.

    An empty plan reaches here as Spark's placeholder ``InputPartition(None)``
    (``plan_data_source_read.py``): it reads nothing."""
    if not isinstance(partition, ReplogPartition):
        return
    wanted = [
        (segment, task.first, task.last) for task in partition.tasks for segment in task.segments
    ]
    yield from _coalesced(read_segments(partition.storage, wanted))
    settle()


COALESCE_ROWS = 65_536
COALESCE_BYTES = 32 * 1024 * 1024
"""Rows, and bytes, per Arrow batch a task hands Spark (at most, or one entry's batch when
it is bigger): the log's entries hold a few hundred to a few thousand events each, and
Spark's intake of a Python source's batches costs per batch (122,983 events read 1.3 s ->
0.8 s)."""


def _coalesced(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``batches`` joined, in order, into batches of at most :data:`COALESCE_ROWS` rows
    and :data:`COALESCE_BYTES` bytes (a bigger one alone)."""
    held: list[pa.RecordBatch] = []
    rows = size = 0
    for batch in batches:
        if held and (rows + batch.num_rows > COALESCE_ROWS or size + batch.nbytes > COALESCE_BYTES):
            yield _joined(held)
            held, rows, size = [], 0, 0
        held.append(batch)
        rows += batch.num_rows
        size += batch.nbytes
    if held:
        yield _joined(held)


def _joined(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """``batches`` as one; one batch as it is (a snapshot's log entries are mostly big
    enough alone, and a join copies every buffer)."""
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


def read_latest(partition: InputPartition, options: SourceOptions) -> Iterator[pa.RecordBatch]:
    """Executor side of ``view=latest``: the partition holds whole shards, and a key's
    events share one shard, so its newest event per (collection, key) is the log's; with
    ``asOfLsn``/``asOfTimestamp``, among the events at or before that point (a shard's
    events are in source order: the point cuts each shard once, between transactions)."""
    # imported here: pyarrow.compute costs every query's planning process ~30 ms
    from replog.tables.as_of import Point  # noqa: PLC0415
    from replog.tables.changes import latest_events  # noqa: PLC0415

    events = read_partition(partition)
    if options.as_of_position is not None or options.as_of_ms is not None:
        point = Point(options.as_of_position, options.as_of_ms)
        events = (batch.filter(point.holds(batch)) for batch in events)
    latest = latest_events(events)
    if latest is not None:
        yield from latest.to_batches()


def _by_shard(partitions: Sequence[ReplogPartition]) -> list[ReplogPartition]:
    """The same ranges, one partition per shard (``view=latest`` reduces per shard)."""
    tasks: dict[int, list[ReadTask]] = {}
    for partition in partitions:
        for task in partition.tasks:
            tasks.setdefault(task.shard, []).append(task)
    return [
        ReplogPartition(partitions[0].storage, index, tuple(sorted(group, key=lambda t: t.first)))
        for index, (_, group) in enumerate(sorted(tasks.items()))
    ]


def _start_offsets(log: ReplicationLog, options: SourceOptions, consumer: str | None) -> Offsets:
    """Where a new query (or a batch read) starts."""
    if options.starting_timestamp_ms is not None:
        return positions.resolve(
            log, "", "startingTimestamp", timestamp_ms=options.starting_timestamp_ms
        )
    if options.starting_offsets == "manifest":
        if consumer is not None:
            resumed = consumers.resume_offsets(log, consumer, options.storage_options)
            if resumed is not None:
                logger.info("consumer %s resumes at %s", consumer, resumed.offsets)
                return resumed.offsets
        return positions.earliest(log.refresh())
    return positions.resolve(log, options.starting_offsets, "startingOffsets")


def _plan(
    log: ReplicationLog, options: SourceOptions, start: Offsets, end: Offsets
) -> list[ReplogPartition]:
    state = log.refresh()
    start = planning.check_data_loss(state, start, fail_on_data_loss=options.fail_on_data_loss)
    tasks = planning.plan_tasks(state, start, end, options.max_events_per_partition)
    groups = planning.pack(tasks, options.max_events_per_partition)
    return [ReplogPartition(log.storage, index, group) for index, group in enumerate(groups)]


class ReplogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reader over a replog log (driver side plus ``read`` on executors)."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._log: ReplicationLog | None = None
        self._committer: consumers.OffsetCommitter | None = None
        self._recorded: Offsets | None = None
        self._initial: SparkOffset | None = None
        self._available_now_target: Offsets | None = None
        self._last_trigger_ms = now_ms()

    def __getstate__(self) -> dict[str, Any]:  # executors need the options only
        return {"options": self.options, "owner": self.owner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"])  # type: ignore[misc]
        self.owner = state["owner"]

    @property
    def log(self) -> ReplicationLog:
        if self._log is None:
            self._log = ReplicationLog.open(
                self.options.path, storage_options=self.options.storage_options
            )
        return self._log

    def _offset(self, offsets: Offsets, version: int, consumer: str | None) -> SparkOffset:
        return SparkOffset(offsets, version, self.log.log_id, consumer, self.log.url)

    def _consumer(self, offset: SparkOffset) -> str:
        if self.options.consumer is not None:
            if offset.consumer not in (None, self.options.consumer):
                logger.warning(
                    "option consumer=%s differs from the checkpoint's consumer %s; "
                    "committing as %s",
                    self.options.consumer,
                    offset.consumer,
                    self.options.consumer,
                )
            return self.options.consumer
        return offset.consumer or LEGACY_CONSUMER

    def _record(self, consumer: str, offset: SparkOffset) -> None:
        """Commit ``offset`` as the consumer's position (once per distinct position)."""
        if offset.offsets == self._recorded:
            return
        if self._committer is None or self._committer.consumer != consumer:
            self._committer = consumers.OffsetCommitter(self.log, consumer, self.owner)
        self._committer.commit(offset.offsets, log_version=offset.version, note="spark")
        self._recorded = dict(offset.offsets)

    # -- planning (driver) --------------------------------------------------------------

    @plain_errors
    def initialOffset(self) -> dict[str, Any]:
        if self._initial is None:
            consumer = self.options.consumer or f"query-{uuid.uuid4().hex[:16]}"
            state = self.log.refresh()
            start = _start_offsets(self.log, self.options, self.options.consumer)
            self._initial = self._offset(start, state.version, consumer)
            logger.info(
                "replog source %s (consumer %s) starts at %s", self.options.path, consumer, start
            )
            if self.options.consumer is not None:  # a named consumer appears at once
                self._record(consumer, self._initial)
        return self._initial.to_json()

    @plain_errors
    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_events_per_trigger is not None:
            return ReadMaxRows(self.options.max_events_per_trigger)
        if self.options.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.options.max_bytes_per_trigger)
        if self.options.min_events_per_trigger is not None:
            return ReadMinRows(self.options.min_events_per_trigger)
        return ReadAllAvailable()

    @plain_errors
    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now_target = positions.latest(self.log.refresh())
        logger.info("Trigger.AvailableNow: reading up to %s", self._available_now_target)

    @plain_errors
    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        state = self.log.refresh()
        begin = SparkOffset.from_json(start)
        begin.check_log(self.log, state)
        consumer = self._consumer(begin)
        first = begin.offsets
        target = self._available_now_target or positions.latest(state)
        target = {shard: max(target[shard], first.get(shard, 0)) for shard in target}
        max_events = self._max_events(state, first, target, limit)
        if max_events is not None:
            target = planning.cap_events(first, target, max_events, state, self.log.row_sequences)
        if self._wait_for_more(state, first, target, limit):
            target = {shard: first.get(shard, 0) for shard in target}
        end = self._offset(target, state.version, consumer)
        new_data = target != {shard: first.get(shard, 0) for shard in target}
        if new_data:
            self._last_trigger_ms = now_ms()
        # Spark asks for latestOffset(start) once the batch ending at start is in its
        # commit log: start is processed. Its own initial offset is recorded only when a
        # batch follows (a derived consumer must not be left behind by a restart).
        persisted = self._initial is None or begin.offsets != self._initial.offsets
        if self.options.consumer is not None or persisted or new_data:
            self._record(consumer, self._offset(first, begin.version, consumer))
        return end.to_json()

    def _max_events(
        self, state: LogState, first: Offsets, target: Offsets, limit: ReadLimit
    ) -> int | None:
        if isinstance(limit, ReadAllAvailable):
            return None
        max_events = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        max_bytes = (
            limit.max_bytes
            if isinstance(limit, ReadMaxBytes)
            else self.options.max_bytes_per_trigger
        )
        if max_events is None:
            max_events = self.options.max_events_per_trigger
        if max_bytes is not None:
            by_bytes = planning.events_for_bytes(state, first, target, max_bytes)
            max_events = by_bytes if max_events is None else min(max_events, by_bytes)
        return max_events

    def _wait_for_more(
        self, state: LogState, first: Offsets, target: Offsets, limit: ReadLimit
    ) -> bool:
        """minEventsPerTrigger: hold the batch back until enough events wait, or until
        maxTriggerDelay has passed since the last batch (never under AvailableNow). The
        backlog counts events, not sequences: a key-compacted range holds fewer."""
        minimum = self.options.min_events_per_trigger
        if minimum is None or self._available_now_target is not None:
            return False
        if isinstance(limit, ReadAllAvailable):
            return False
        backlog = sum(
            state.events_between(shard, first.get(shard, 0) + 1, target[shard]) for shard in target
        )
        waited = now_ms() - self._last_trigger_ms
        return 0 < backlog < minimum and waited < self.options.max_trigger_delay_ms

    @plain_errors
    def reportLatestOffset(self) -> dict[str, Any]:
        state = self.log.state()
        return self._offset(positions.latest(state), state.version, None).to_json()

    @plain_errors
    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[ReplogPartition]:
        begin, finish = SparkOffset.from_json(start), SparkOffset.from_json(end)
        finish.check_log(self.log, self.log.refresh())
        return _plan(self.log, self.options, begin.offsets, finish.offsets)

    @plain_errors
    def commit(self, end: dict[str, Any]) -> None:
        offset = SparkOffset.from_json(end)
        self._record(self._consumer(offset), offset)

    # -- reading (executors) ------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition)


def _check_as_of(log: ReplicationLog, options: SourceOptions) -> None:
    """``view=latest`` as of a point is read from the log alone: the log must hold every
    event up to the point (none removed by retention, unless ``failOnDataLoss=false``)
    and reach it (the point is not past what the log knows of its source)."""
    from replog.tables import as_of  # noqa: PLC0415 - pyarrow.compute, see read_latest

    point = as_of.Point(options.as_of_position, options.as_of_ms)
    as_of.check_log_reaches(log, point, whole=options.fail_on_data_loss)


class ReplogBatchReader(DataSourceReader):
    """``spark.read.format("replog")``: a bounded range; it never commits offsets."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    @plain_errors
    def partitions(self) -> Sequence[ReplogPartition]:
        log = ReplicationLog.open(self.options.path, storage_options=self.options.storage_options)
        start = _start_offsets(log, self.options, self.options.consumer)
        end = positions.resolve(log, self.options.ending_offsets, "endingOffsets")
        if self.options.as_of_position is not None or self.options.as_of_ms is not None:
            _check_as_of(log, self.options)
        planned = _plan(log, self.options, start, end)
        return _by_shard(planned) if self.options.view == "latest" else planned

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if self.options.view == "latest":
            return read_latest(partition, self.options)
        return read_partition(partition)


class ReplogDataSource(DataSource):
    """The ``replog`` format."""

    @classmethod
    def name(cls) -> str:
        return "replog"

    def schema(self) -> str:
        return SPARK_SCHEMA_DDL

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        try:
            options = SourceOptions.parse(self.options, streaming=True)
        except ReplogError as exc:
            # pyspark's stream runner mishandles an error raised here (it then calls stop()
            # on a reader it never got: an UnboundLocalError buries the message), so the
            # error is raised by the reader's first call instead
            return RefusedStreamReader(exc)
        return ReplogStreamReader(options)

    @plain_errors
    def reader(self, schema: StructType) -> ReplogBatchReader:
        return ReplogBatchReader(SourceOptions.parse(self.options, streaming=False))


class RefusedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream reader whose options were refused: every call raises the error."""

    def __init__(self, error: ReplogError) -> None:
        self.error = error

    def _refused(self) -> ReplogError:
        return self.error.with_traceback(None)

    def initialOffset(self) -> dict[str, Any]:
        raise self._refused() from None

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        raise self._refused() from None

    def getDefaultReadLimit(self) -> ReadLimit:
        raise self._refused() from None

    def prepareForTriggerAvailableNow(self) -> None:
        raise self._refused() from None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        raise self._refused() from None

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        raise self._refused() from None

    def commit(self, end: dict[str, Any]) -> None:
        raise self._refused() from None

    def stop(self) -> None:
        """Nothing to release."""
