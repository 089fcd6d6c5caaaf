"""replog: change-data-capture replication logs, with an exactly-once Spark source and sink.

The layers, from the bottom::

    storage/      fsspec locations, atomic put-if-absent per backend, retries, fault injection
    format/       the storage format: events, segments, commits, state, history (FORMAT.md)
    reading.py, writing.py (committing.py), maintenance.py
                  a log's reads, its commits, its merges and expiry
    log.py        ReplicationLog, the face writers and readers use over those three
    checkpoints/  consumers' offsets and sinks' commit protocol, in checkpoint manifests
    ops/          status, verify, retention, compaction, garbage and recovery
    ingest.py, debezium.py, offsets.py, planning.py   ingestion, CDC mapping, positions, planning
    cli/, spark/  the ``replog`` command and the Spark adapter (the only pyspark imports)
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

# Importing replog (with fsspec, pyarrow and numpy) creates tens of thousands of objects
# that live as long as the process; the collections they trigger meanwhile cost ~30 ms of
# the import (measured), paid in the Python process Spark starts for every streaming query.
_collecting = gc.isenabled()
gc.disable()
try:
    from replog.about import __version__ as __version__
    from replog.appender import GroupAppender
    from replog.errors import InvalidOptionError, ReplogError
    from replog.format.commits import (
        DEFAULT_RETENTION_MS,
        DEFAULT_SHARDS,
        DEFAULT_SNAPSHOT_INTERVAL,
        CommitRecord,
        Transaction,
    )
    from replog.format.events import EVENT_SCHEMA, OPERATIONS
    from replog.log import ReplicationLog
finally:
    if _collecting:
        gc.enable()

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

__all__ = [
    "EVENT_SCHEMA",
    "OPERATIONS",
    "GroupAppender",
    "ReplicationLog",
    "ReplogError",
    "Transaction",
    "append",
    "create_log",
    "open_log",
    "read",
    "register",
]


def _refuse_unknown(function: Any, unknown: Mapping[str, Any]) -> None:
    """Refuse keywords ``function`` does not take, naming the ones it does (they would
    otherwise be lost, or reach fsspec as storage options)."""
    if not unknown:
        return
    accepted = [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    raise InvalidOptionError(
        f"{function.__name__}() got unknown option(s) {', '.join(map(repr, sorted(unknown)))}; "
        f"it takes {', '.join(accepted)} by name (fsspec options go in "
        f"storage_options={{...}})"
    )


def create_log(
    url: str,
    shards: int = DEFAULT_SHARDS,
    *,
    retention_ms: int = DEFAULT_RETENTION_MS,
    auto_compact: bool = True,
    snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
    storage_options: Mapping[str, Any] | None = None,
    **unknown: Any,
) -> ReplicationLog:
    """Create an empty log at ``url`` (any fsspec URL replog can write to):
    :meth:`ReplicationLog.create`, with its options and limits.

    Args:
        url: a local path, ``file://``, ``memory://`` or ``s3://`` URL.
        shards: the fixed number of shards (1..4096); keys are hashed to them.
        retention_ms: how long commits, snapshots and files that left the log are kept
            (at least 10 minutes; default 2 hours).
        auto_compact: whether writers merge small files after their commits.
        snapshot_interval: commits between segment tables.
        storage_options: fsspec options, e.g. ``{"endpoint_url": ..., "key": ...}``.

    Raises:
        LogExistsError: a log is already there.
        InvalidOptionError: an option is out of its limits, or unknown (the accepted
            ones are named).
        UnsupportedStorageError: the backend cannot create files atomically.

    Example:
        >>> log = replog.create_log("/tmp/shop", shards=8)  # doctest: +SKIP
    """
    _refuse_unknown(create_log, unknown)
    return ReplicationLog.create(
        url,
        shards,
        storage_options=storage_options,
        snapshot_interval=snapshot_interval,
        retention_ms=retention_ms,
        auto_compact=auto_compact,
    )


def open_log(
    url: str,
    *,
    auto_compact: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **unknown: Any,
) -> ReplicationLog:
    """Open the log at ``url`` (``auto_compact``: this writer's choice, default the log's).

    Raises:
        LogNotFoundError: there is no log at ``url``.
        InvalidOptionError: an unknown option (the accepted ones are named).

    Example:
        >>> options = {"endpoint_url": "http://minio:9000"}
        >>> replog.open_log("s3://bucket/shop", storage_options=options)  # doctest: +SKIP
    """
    _refuse_unknown(open_log, unknown)
    return ReplicationLog.open(url, storage_options=storage_options, auto_compact=auto_compact)


def append(
    url: str,
    events: pa.Table | Iterable[Mapping[str, Any]],
    *,
    transaction: Transaction | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **unknown: Any,
) -> CommitRecord | None:
    """Append change events to the log at ``url`` as one atomic commit
    (:meth:`ReplicationLog.append`).

    Raises:
        InvalidEventError: an event is malformed (nothing was written).
        InvalidOptionError: an unknown option (the accepted ones are named).

    Example:
        >>> replog.append("/tmp/shop", [{"key": "o/1", "data": {"total": 9.5}}])  # doctest: +SKIP
    """
    _refuse_unknown(append, unknown)
    return open_log(url, storage_options=storage_options).append(events, transaction=transaction)


def read(
    url: str,
    shard: int,
    first: int = 1,
    last: int | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    **unknown: Any,
) -> Iterator[pa.RecordBatch]:
    """Events of one shard with sequences ``first`` to ``last`` (default: the head), as
    Arrow record batches.

    Raises:
        DataLossError: ``first`` was removed by retention.
        CorruptionError: a file does not match its checksum, or the log is damaged (it
            names the file).
        InvalidOptionError: an unknown option (the accepted ones are named).

    Example:
        >>> for batch in replog.read("/tmp/shop", shard=0):  # doctest: +SKIP
        ...     print(batch.num_rows)
    """
    _refuse_unknown(read, unknown)
    return open_log(url, storage_options=storage_options).read(shard, first, last)


def register(spark: SparkSession) -> None:
    """Register the ``replog`` and ``replog-sink`` formats with ``spark`` explicitly.

    Needed only where auto-registration cannot work (``spark-submit --py-files``): then
    replog's code is pickled by value into the registered classes.

    Example:
        >>> replog.register(spark)  # doctest: +SKIP
    """
    from replog.spark.register import register as register_formats  # noqa: PLC0415

    register_formats(spark)
