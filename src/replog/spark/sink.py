"""``df.writeStream.format("replog-sink")`` and ``df.write.format("replog-sink")``.

Executors validate rows, route them to shards and stage segment files; the commit
message names the files with the Spark query id and epoch. The driver runs the
exactly-once protocol of :mod:`replog.sink_protocol`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    DataType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from replog.errors import InvalidEventError
from replog.events import IGNORED_COLUMNS, INPUT_COLUMNS, events_from_table, now_utc
from replog.faults import fault_point
from replog.log import ReplicationLog
from replog.segments import StagedSegment
from replog.sink_protocol import SinkCommitter
from replog.spark.options import SinkOptions

logger = logging.getLogger(__name__)

STAGE_EVERY_ROWS = 262_144
"""A task stages a segment set every this many rows, bounding its memory."""

_ALLOWED_TYPES: dict[str, tuple[type[DataType], ...]] = {
    "data": (BinaryType, StringType),
    "key": (StringType,),
    "operation": (StringType,),
    "collection": (StringType,),
    "event_id": (StringType,),
    "metadata": (StringType,),
    "timestamp": (TimestampType, TimestampNTZType),
}


def validate_input_schema(schema: StructType) -> None:
    """Reject unknown columns, a missing ``data`` and wrong types before any task runs."""
    names = [field.name for field in schema.fields]
    unknown = [n for n in names if n not in INPUT_COLUMNS and n not in IGNORED_COLUMNS]
    if unknown:
        raise InvalidEventError(
            f"replog-sink: unknown column(s) {unknown}; allowed: {sorted(INPUT_COLUMNS)} "
            f"(shard and sequence are ignored); select or rename columns before writing"
        )
    if "data" not in names:
        raise InvalidEventError("replog-sink: column 'data' (binary or string) is required")
    for field in schema.fields:
        allowed = _ALLOWED_TYPES.get(field.name)
        if allowed and not isinstance(field.dataType, allowed):
            expected = " or ".join(t.__name__.removesuffix("Type").lower() for t in allowed)
            raise InvalidEventError(
                f"replog-sink: column {field.name!r} has type {field.dataType.simpleString()}, "
                f"expected {expected}"
            )


@dataclass(frozen=True)
class ReplogCommitMessage(WriterCommitMessage):
    """What one task staged, and for which query and epoch."""

    query_id: str | None
    epoch: int | None
    partition: int
    segments: tuple[StagedSegment, ...]


def _staged(messages: Sequence[WriterCommitMessage | None]) -> list[StagedSegment]:
    ordered = sorted(
        (m for m in messages if isinstance(m, ReplogCommitMessage)), key=lambda m: m.partition
    )
    return [segment for message in ordered for segment in message.segments]


def _query_id(messages: Sequence[WriterCommitMessage | None]) -> str | None:
    ids = {m.query_id for m in messages if isinstance(m, ReplogCommitMessage) and m.query_id}
    if len(ids) > 1:
        raise InvalidEventError(f"commit messages from several queries: {sorted(ids)}")
    return ids.pop() if ids else None


_COMMITTING_LOGS: dict[str, ReplicationLog] = {}
"""Target logs this process has committed to, with their state.

Spark runs every ``commit`` of a query in one long-lived driver-side Python process
(one PID for all micro-batches, measured), on a fresh writer each time. Keeping the log
here means the next commit reads only the log commits made since, instead of a snapshot
and up to 99 commits after it (up to ~100 GETs per micro-batch on S3).
"""


def _target_log(options: SinkOptions) -> ReplicationLog:
    """The sink's target log, reusing this process's copy if it is still the same log."""
    opened = ReplicationLog.open(options.path, storage_options=options.storage_options)
    key = json.dumps([options.path, options.storage_options], sort_keys=True, default=str)
    cached = _COMMITTING_LOGS.get(key)
    if cached is not None and cached.descriptor.log_id == opened.descriptor.log_id:
        return cached  # refreshed by the committer before it decides anything
    _COMMITTING_LOGS[key] = opened
    return opened


class _ArrowStager:
    """Shared by the streaming and the batch writer: staging (executors), committer (driver)."""

    options: SinkOptions

    def _committer(self) -> SinkCommitter:
        """Driver side: the protocol runner for this sink's target log."""
        return SinkCommitter(_target_log(self.options), self.options.sink_id)

    def _stage_all(self, batches: Iterator[pa.RecordBatch]) -> ReplogCommitMessage:
        context = TaskContext.get()
        query_id = context.getLocalProperty("sql.streaming.queryId") if context else None
        batch_id = context.getLocalProperty("streaming.sql.batchId") if context else None
        partition = context.partitionId() if context else 0
        epoch = int(batch_id) if batch_id is not None else None
        log = ReplicationLog.open(self.options.path, storage_options=self.options.storage_options)
        now = now_utc()
        staged: list[StagedSegment] = []
        buffered: list[pa.Table] = []
        rows = 0
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                buffered.append(
                    events_from_table(batch, default_collection=self.options.collection, now=now)
                )
                rows += batch.num_rows
                if rows >= STAGE_EVERY_ROWS:
                    staged.extend(log.stage(pa.concat_tables(buffered)))
                    buffered, rows = [], 0
            if buffered:
                staged.extend(log.stage(pa.concat_tables(buffered)))
            if context is not None and context.attemptNumber() == 0:
                fault_point("write_task", epoch)
        except BaseException:
            log.discard_staged(staged)
            raise
        return ReplogCommitMessage(query_id, epoch, partition, tuple(staged))


class ReplogStreamWriter(_ArrowStager, DataSourceStreamArrowWriter):
    def __init__(self, options: SinkOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ReplogCommitMessage:
        return self._stage_all(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        query_id = _query_id(messages)
        staged = _staged(messages)
        if query_id is None:
            if staged:
                raise InvalidEventError("staged data without a streaming query id")
            return
        self._committer().commit(query_id, batchId, staged)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self._committer().abort(
            _query_id(messages),
            batchId,
            _staged(messages),
            reason=f"Spark aborted micro-batch {batchId}",
        )


class ReplogBatchWriter(_ArrowStager, DataSourceArrowWriter):
    """``df.write``: the whole job is one epoch of a one-off query id."""

    def __init__(self, options: SinkOptions) -> None:
        self.options = options
        self.job_id = f"batch-{uuid.uuid4()}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ReplogCommitMessage:
        return self._stage_all(iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self._committer().commit(self.job_id, 0, _staged(messages))

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self._committer().abort(self.job_id, 0, _staged(messages), reason="Spark aborted the job")


class ReplogSinkDataSource(DataSource):
    """The ``replog-sink`` format."""

    @classmethod
    def name(cls) -> str:
        return "replog-sink"

    def _prepare(self, schema: StructType, *, streaming: bool) -> SinkOptions:
        validate_input_schema(schema)
        options = SinkOptions.parse(self.options, streaming=streaming)
        ReplicationLog.open_or_create(
            options.path, options.shards, storage_options=options.storage_options
        )
        return options

    def streamWriter(self, schema: StructType, overwrite: bool) -> ReplogStreamWriter:
        return ReplogStreamWriter(self._prepare(schema, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> ReplogBatchWriter:
        if overwrite:
            raise InvalidEventError("replog-sink is append-only: use mode('append')")
        return ReplogBatchWriter(self._prepare(schema, streaming=False))
