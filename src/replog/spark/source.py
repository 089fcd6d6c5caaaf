"""``spark.readStream.format("replog")`` and ``spark.read.format("replog")``.

A thin adapter: offsets, planning and reading live in the pure core
(:mod:`replog.offsets`, :mod:`replog.planning`, :func:`replog.log.read_segment`).
The driver-side reader keeps its :class:`ReplicationLog` (and so the log state) between
micro-batches, so each batch reads only the commits made since the previous one.
"""

from __future__ import annotations

import logging
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
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from replog import consumers, planning
from replog.errors import InvalidOptionError
from replog.events import SPARK_SCHEMA_DDL
from replog.log import ReplicationLog, read_segment
from replog.offsets import Offsets, from_spark, parse_offsets_json, to_spark
from replog.planning import ReadTask
from replog.spark.options import SourceOptions
from replog.storage import Storage

logger = logging.getLogger(__name__)


class ReplogPartition(InputPartition):
    """One Spark task: a shard range and its segments. Carries the storage address only."""

    def __init__(self, storage: Storage, task: ReadTask) -> None:
        super().__init__(task.shard)
        self.storage = storage
        self.task = task

    def __repr__(self) -> str:  # never show storage options (secrets)
        return (
            f"ReplogPartition(shard={self.task.shard}, "
            f"sequences={self.task.first}..{self.task.last})"
        )


def read_partition(partition: ReplogPartition) -> Iterator[pa.RecordBatch]:
    """Executor side: stream the task's events as Arrow batches, checksum-verified."""
    task = partition.task
    for segment in task.segments:
        yield from read_segment(partition.storage, segment, task.first, task.last)


def resolve_offsets(log: ReplicationLog, spec: str, option: str, consumer: str | None) -> Offsets:
    """Offsets for ``startingOffsets``/``endingOffsets``: a keyword or JSON."""
    state = log.refresh()
    if spec == "earliest":
        return planning.earliest(state)
    if spec == "latest":
        return planning.latest(state)
    if spec == "manifest":
        position = consumers.committed_offsets(log, consumer) if consumer else None
        if position is not None:
            logger.info("consumer %s resumes from its manifest: %s", consumer, position.offsets)
            return {shard: position.offsets.get(shard, 0) for shard in range(log.shards)}
        return planning.earliest(state)
    offsets = parse_offsets_json(spec, log.shards, option)
    for shard, sequence in offsets.items():
        if sequence > state.heads[shard]:
            raise InvalidOptionError(
                f"option {option!r}: shard {shard} offset {sequence} is beyond its head "
                f"{state.heads[shard]}"
            )
    return offsets


class ReplogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reader over a replog log (driver side plus ``read`` on executors)."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._log: ReplicationLog | None = None
        self._available_now_target: Offsets | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "_log": None, "_available_now_target": None}

    @property
    def log(self) -> ReplicationLog:
        if self._log is None:
            self._log = ReplicationLog.open(
                self.options.path, storage_options=self.options.storage_options
            )
        return self._log

    # -- planning (driver) --------------------------------------------------------------

    def initialOffset(self) -> dict[str, int]:
        offsets = resolve_offsets(
            self.log, self.options.starting_offsets, "startingOffsets", self.options.consumer
        )
        logger.info(
            "replog source %s (consumer %s) starts at %s",
            self.options.path,
            self.options.consumer,
            offsets,
        )
        return to_spark(offsets, 0)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_events_per_trigger is not None:
            return ReadMaxRows(self.options.max_events_per_trigger)
        if self.options.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.options.max_bytes_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now_target = planning.latest(self.log.refresh())
        logger.info("Trigger.AvailableNow: reading up to %s", self._available_now_target)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        state = self.log.refresh()
        begin, _ = from_spark(start)
        target = self._available_now_target or planning.latest(state)
        target = {shard: max(target[shard], begin.get(shard, 0)) for shard in target}
        if not isinstance(limit, ReadAllAvailable):
            max_events = None
            if isinstance(limit, ReadMaxRows):
                max_events = limit.max_rows
            if self.options.max_bytes_per_trigger is not None or isinstance(limit, ReadMaxBytes):
                max_bytes = (
                    limit.max_bytes
                    if isinstance(limit, ReadMaxBytes)
                    else self.options.max_bytes_per_trigger
                )
                assert max_bytes is not None
                by_bytes = planning.events_for_bytes(state, begin, target, max_bytes)
                max_events = by_bytes if max_events is None else min(max_events, by_bytes)
            if max_events is not None:
                target = planning.cap_events(begin, target, max_events)
        return to_spark(target, state.version)

    def reportLatestOffset(self) -> dict[str, int]:
        state = self.log.state()
        return to_spark(planning.latest(state), state.version)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[ReplogPartition]:
        begin, _ = from_spark(start)
        finish, _ = from_spark(end)
        state = self.log.refresh()
        begin = planning.check_data_loss(
            state, begin, fail_on_data_loss=self.options.fail_on_data_loss
        )
        tasks = planning.plan_tasks(state, begin, finish, self.options.max_events_per_partition)
        return [ReplogPartition(self.log.storage, task) for task in tasks]

    def commit(self, end: dict[str, Any]) -> None:
        offsets, version = from_spark(end)
        consumers.commit_offsets(self.log, self.options.consumer, offsets, epoch=version)

    # -- reading (executors) ------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ReplogPartition)
        return read_partition(partition)


class ReplogBatchReader(DataSourceReader):
    """``spark.read.format("replog")``: a bounded range between two offsets."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[ReplogPartition]:
        log = ReplicationLog.open(self.options.path, storage_options=self.options.storage_options)
        start = resolve_offsets(
            log, self.options.starting_offsets, "startingOffsets", self.options.consumer
        )
        end = resolve_offsets(log, self.options.ending_offsets, "endingOffsets", None)
        state = log.state()
        start = planning.check_data_loss(
            state, start, fail_on_data_loss=self.options.fail_on_data_loss
        )
        tasks = planning.plan_tasks(state, start, end, self.options.max_events_per_partition)
        return [ReplogPartition(log.storage, task) for task in tasks]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ReplogPartition)
        return read_partition(partition)


class ReplogDataSource(DataSource):
    """The ``replog`` format."""

    @classmethod
    def name(cls) -> str:
        return "replog"

    def schema(self) -> str:
        return SPARK_SCHEMA_DDL

    def streamReader(self, schema: StructType) -> ReplogStreamReader:
        return ReplogStreamReader(SourceOptions.parse(self.options, streaming=True))

    def reader(self, schema: StructType) -> ReplogBatchReader:
        return ReplogBatchReader(SourceOptions.parse(self.options, streaming=False))
