"""``df.writeStream.format("replog-sink")`` and ``df.write.format("replog-sink")``.

Executors validate rows, route them to shards and stage segment files; the commit message
names the files with the Spark query id, run id and epoch. The driver runs the
exactly-once protocol of :mod:`replog.checkpoints.sinks`, recording in the log commit the
source positions the micro-batch covers (read from Spark's offset log).

A batch write is one atomic append (:mod:`replog.checkpoints.batches`). With
``txnAppId``/``txnVersion`` it is idempotent: a version already committed for the app id
is skipped (Delta's contract).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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
    NullType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from replog.checkpoints import consumers
from replog.checkpoints.batches import BatchCommitter, BatchWrite
from replog.checkpoints.sinks import Batch, SinkCommitter
from replog.core import files, leases
from replog.crashpoints import crash_point
from replog.errors import InvalidEventError, InvalidOptionError, ReplogError, SinkProtocolError
from replog.format.commits import SourcePosition
from replog.format.events import IGNORED_COLUMNS, INPUT_COLUMNS, events_from_table
from replog.format.gc import StagingStart
from replog.format.segments import StagedSegment
from replog.log import ReplicationLog
from replog.spark.offsets import SparkOffset
from replog.spark.options import SinkOptions, plain_errors
from replog.spark.workers import settle
from replog.storage import Storage
from replog.timeutil import now_ms, now_utc

logger = logging.getLogger(__name__)

STAGE_EVERY_ROWS = 262_144
STAGE_EVERY_BYTES = 128 * 1024 * 1024
"""A task stages a segment set every this many rows or bytes, bounding its memory (and
keeping every Arrow binary column far below its 2 GiB limit)."""


_TYPES: dict[str, tuple[type[DataType], ...]] = {
    "data": (BinaryType, StringType),
    "before": (BinaryType, StringType, NullType),
    "key": (StringType, NullType),
    "operation": (StringType, NullType),
    "collection": (StringType, NullType),
    "event_id": (StringType, NullType),
    "metadata": (StringType, NullType),
    "timestamp": (TimestampType, TimestampNTZType, NullType),
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
        allowed = _TYPES.get(field.name)
        if allowed and not isinstance(field.dataType, allowed):
            expected = " or ".join(t.__name__.removesuffix("Type").lower() for t in allowed)
            raise InvalidEventError(
                f"replog-sink: column {field.name!r} has type {field.dataType.simpleString()}, "
                f"expected {expected}"
            )


@dataclass(frozen=True)
class ReplogCommitMessage(WriterCommitMessage):
    """What one task staged, for which query, run and epoch, and when the micro-batch
    began staging (from the writer Spark built when it planned the write: the committer
    gets a writer built afresh, after the tasks staged)."""

    query_id: str | None
    run_id: str | None
    epoch: int | None
    partition: int
    segments: tuple[StagedSegment, ...]
    since: StagingStart | None = None


def _messages(messages: Sequence[WriterCommitMessage | None]) -> list[ReplogCommitMessage]:
    return sorted(
        (m for m in messages if isinstance(m, ReplogCommitMessage)), key=lambda m: m.partition
    )


def _staged(messages: Sequence[WriterCommitMessage | None]) -> tuple[StagedSegment, ...]:
    return tuple(segment for message in _messages(messages) for segment in message.segments)


def _since(messages: Sequence[ReplogCommitMessage]) -> StagingStart | None:
    """The earliest staging start the tasks report (None if one does not say)."""
    starts = [message.since for message in messages if message.since is not None]
    if not starts or len(starts) < len(messages):
        return None
    return StagingStart(min(s.version for s in starts), min(s.ms for s in starts))


def _one(values: set[str | None], what: str) -> str | None:
    known = {value for value in values if value}
    if len(known) > 1:
        raise SinkProtocolError(f"commit messages name several {what}: {sorted(known)}")
    return known.pop() if known else None


class _CommitProcess:
    """What Spark's long-lived driver-side Python processes keep between micro-batches.

    Spark runs every ``commit`` of a query in one long-lived Python process (one PID for
    all micro-batches, measured), on a fresh writer each time, and plans each
    micro-batch's writer in another. Keeping the target log (with its state) and each
    sink's committer (with its newest manifest) means a micro-batch reads only what was
    committed since the last one. Bounded: the least recently used entries go first.
    """

    MAX_ENTRIES = 32

    def __init__(self) -> None:
        self.logs: OrderedDict[str, ReplicationLog] = OrderedDict()
        self.committers: OrderedDict[tuple[str, str], SinkCommitter] = OrderedDict()
        self.links: OrderedDict[tuple[str, str, str], None] = OrderedDict()

    def target_log(self, options: SinkOptions) -> ReplicationLog:
        """The sink's target log (created if absent), this process's copy while it is
        still the same log."""
        opened = ReplicationLog.open_or_create(
            options.path, options.shards, storage_options=options.storage_options
        )
        key = json.dumps([options.path, options.storage_options], sort_keys=True, default=str)
        cached = self.logs.get(key)
        if cached is not None and cached.log_id == opened.log_id:
            self.logs.move_to_end(key)
            return cached  # refreshed before anything is decided
        _remember(self.logs, key, opened)
        return opened

    def committer(self, log: ReplicationLog, sink_id: str) -> SinkCommitter:
        key = (f"{log.url} {log.log_id}", sink_id)
        committer = self.committers.get(key)
        if committer is None or committer.log is not log:
            committer = SinkCommitter(log, sink_id)
        _remember(self.committers, key, committer)
        return committer

    def clear(self) -> None:
        self.logs.clear()
        self.committers.clear()
        self.links.clear()


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _CommitProcess.MAX_ENTRIES:
        cache.popitem(last=False)


PROCESS = _CommitProcess()
"""This process's cache (tests clear it to act as a fresh process)."""

OFFSET_LOG_VERSION = "v1"
"""The only format of Spark's offset log this sink reads (Spark 4.x writes ``v1``)."""


def source_positions(options: SinkOptions, batch_id: int) -> list[tuple[SourcePosition, str]]:
    """The replog source positions micro-batch ``batch_id`` read up to, from Spark's offset
    log (``<checkpoint>/offsets/<batch id>``, written before the batch ran), with each
    source's URL. Empty when the checkpoint is not known or holds no replog source."""
    if options.checkpoint is None:
        return []
    relative = f"offsets/{batch_id}"
    try:
        data = Storage(options.checkpoint, options.storage_options).read_optional(relative)
    except (ReplogError, OSError) as exc:
        logger.warning(
            "cannot read Spark's offset log %s/%s: %s", options.checkpoint, relative, exc
        )
        return []
    if data is None:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if not lines or lines[0] != OFFSET_LOG_VERSION:
        raise SinkProtocolError(
            f"Spark's offset log {options.checkpoint}/{relative} starts with "
            f"{lines[0] if lines else 'nothing'!r}, not {OFFSET_LOG_VERSION!r}: a format this "
            f"replog does not know (a newer Spark?); the sink cannot record which source "
            f"positions the micro-batch covers"
        )
    found = []
    for line in lines[2:]:
        try:
            document = json.loads(line)
        except ValueError:
            continue
        if isinstance(document, dict) and "log_id" in document and "consumer" in document:
            offset = SparkOffset.from_json(document)
            assert offset.log_id is not None and offset.consumer is not None
            position = SourcePosition(offset.log_id, offset.consumer, offset.offsets)
            found.append((position, offset.url or ""))
    return found


class _Stager:
    """Shared by the streaming and the batch writer: staging on executors."""

    options: SinkOptions

    @property
    def since(self) -> StagingStart:
        """When the write began staging (before any task staged)."""
        raise NotImplementedError

    def _stage_all(self, batches: Iterator[pa.RecordBatch]) -> ReplogCommitMessage:
        context = TaskContext.get()
        query_id = context.getLocalProperty("sql.streaming.queryId") if context else None
        run_id = context.getLocalProperty("spark.jobGroup.id") if context else None
        batch_id = context.getLocalProperty("streaming.sql.batchId") if context else None
        partition = context.partitionId() if context else 0
        epoch = int(batch_id) if batch_id is not None else None
        log = ReplicationLog.open(self.options.path, storage_options=self.options.storage_options)
        log.storage.require_writable()
        now = now_utc()
        staged: list[StagedSegment] = []
        routed = files.RoutedRows(log.shards)
        try:
            # Each batch is validated and routed as it comes, and let go of: the task holds
            # one copy of its rows (fresh memory costs page faults on every task).
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                routed.add(
                    events_from_table(batch, default_collection=self.options.collection, now=now)
                )
                if routed.rows >= STAGE_EVERY_ROWS or routed.nbytes >= STAGE_EVERY_BYTES:
                    staged.extend(files.stage_routed(log.storage, routed))
                    routed = files.RoutedRows(log.shards)
            staged.extend(files.stage_routed(log.storage, routed))
            if context is not None and context.attemptNumber() == 0:
                crash_point("write_task", epoch)
        except BaseException:
            log.discard_staged(staged)  # this task's files: never in any commit message
            raise
        settle()
        return ReplogCommitMessage(
            query_id, run_id, epoch, partition, tuple(staged), since=self.since
        )


class ReplogStreamWriter(_Stager, DataSourceStreamArrowWriter):
    """One micro-batch of a streaming query.

    Spark builds one writer when it plans the micro-batch and pickles it into the tasks,
    and builds another in its commit process, right before ``commit`` or ``abort``. The
    staging start is taken when the writer is pickled (on the driver, before any task
    stages) and reaches the committer in the tasks' commit messages; the committing
    writer never reads it, and uses the target log it opened (one identity check).
    """

    def __init__(self, options: SinkOptions, log: ReplicationLog | None = None) -> None:
        self.options = options
        self._log = log
        self._since: StagingStart | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "since": self.since}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options, self._since, self._log = state["options"], state["since"], None

    @property
    def since(self) -> StagingStart:
        """When this micro-batch began staging: taken once, from a refreshed log."""
        if self._since is None:
            self._since = StagingStart(self._target().refresh().version, now_ms())
        return self._since

    def _target(self) -> ReplicationLog:
        return self._log if self._log is not None else PROCESS.target_log(self.options)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ReplogCommitMessage:
        return self._stage_all(iterator)

    def _batch(self, messages: Sequence[WriterCommitMessage | None], batch_id: int) -> Batch:
        received = _messages(messages)
        query_id = _one({m.query_id for m in received}, "query ids")
        staged = _staged(messages)
        if query_id is None and staged:
            raise SinkProtocolError("replog-sink: staged data without a streaming query id")
        # Not self.since: Spark builds the committing writer afresh, after the tasks staged.
        since = _since(received)
        return Batch(
            query_id=query_id or "",
            epoch=batch_id,
            staged=staged,
            run_id=_one({m.run_id for m in received}, "run ids"),
            since_version=since.version if since else 0,
            since_ms=since.ms if since else None,
        )

    def _committer(self) -> SinkCommitter:
        assert self.options.sink_id is not None
        return PROCESS.committer(self._target(), self.options.sink_id)

    @plain_errors
    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        batch = self._batch(messages, batchId)
        if not batch.query_id:
            return
        committer = self._committer()
        found = source_positions(self.options, batchId)
        for position, url in found:
            self._link(committer.log, position, url)
        committer.commit(
            dataclasses.replace(batch, sources=tuple(position for position, _ in found))
        )
        settle()

    def _link(self, target: ReplicationLog, position: SourcePosition, url: str) -> None:
        """Tell the source's consumer that this sink writes what it reads (once)."""
        key = (position.log_id, position.consumer, target.log_id)
        if not url or key in PROCESS.links:
            return
        link = consumers.SinkLink(target.url, target.log_id, self.options.sink_id or "")
        try:
            consumers.write_link(
                Storage(url, self.options.storage_options), position.consumer, link
            )
        except (ReplogError, OSError) as exc:
            logger.warning(
                "sink %s: cannot record in source %s that it writes what consumer %s reads "
                "(%s): a query that replaces its checkpoint may repeat the last micro-batch",
                self.options.sink_id,
                url,
                position.consumer,
                exc,
            )
            return
        _remember(PROCESS.links, key, None)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        batch = self._batch(messages, batchId)
        self._committer().abort(batch, reason=f"Spark aborted micro-batch {batchId}")


class ReplogBatchWriter(_Stager, DataSourceArrowWriter):
    """``df.write``: the whole job is one atomic append (idempotent with a transaction),
    by the protocol of :mod:`replog.checkpoints.batches`."""

    def __init__(self, options: SinkOptions, planned: BatchWrite) -> None:
        self.options = options
        self.planned = planned

    @property
    def since(self) -> StagingStart:
        """Taken when the job was planned (Spark pickles this writer to its committer)."""
        return self.planned.since

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ReplogCommitMessage:
        leases.renew(Storage(self.options.path, self.options.storage_options), self.planned.lease)
        return self._stage_all(iterator)

    @plain_errors
    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        BatchCommitter(PROCESS.target_log(self.options)).commit(self.planned, _staged(messages))

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        BatchCommitter(PROCESS.target_log(self.options)).abort(self.planned, _staged(messages))


class ReplogSinkDataSource(DataSource):
    """The ``replog-sink`` format."""

    @classmethod
    def name(cls) -> str:
        return "replog-sink"

    def _open(self, schema: StructType, *, streaming: bool) -> tuple[SinkOptions, ReplicationLog]:
        validate_input_schema(schema)
        options = SinkOptions.parse(self.options, streaming=streaming)
        log = PROCESS.target_log(options)
        log.storage.require_writable()
        return options, log

    @plain_errors
    def streamWriter(self, schema: StructType, overwrite: bool) -> ReplogStreamWriter:
        options, log = self._open(schema, streaming=True)
        settle()
        return ReplogStreamWriter(options, log)

    @plain_errors
    def writer(self, schema: StructType, overwrite: bool) -> ReplogBatchWriter:
        if overwrite:
            raise InvalidOptionError("replog-sink is append-only: use mode('append')")
        options, log = self._open(schema, streaming=False)
        return ReplogBatchWriter(options, BatchCommitter(log).begin(options.transaction))
