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
    from replog.errors import ReplogError
    from replog.format.commits import CommitRecord, Transaction
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


def create_log(url: str, shards: int = 8, **storage_options: Any) -> ReplicationLog:
    """Create an empty log at ``url`` (any fsspec URL replog can write to).

    Args:
        url: a local path, ``file://``, ``memory://`` or ``s3://`` URL.
        shards: the fixed number of shards (1..4096); keys are hashed to them.
        **storage_options: fsspec options, e.g. ``endpoint_url=...``, ``key=...``.

    Raises:
        LogExistsError: a log is already there.
        UnsupportedStorageError: the backend cannot create files atomically.

    Example:
        >>> log = replog.create_log("/tmp/shop", shards=8)  # doctest: +SKIP
    """
    return ReplicationLog.create(url, shards, storage_options=storage_options)


def open_log(url: str, **storage_options: Any) -> ReplicationLog:
    """Open the log at ``url``.

    Raises:
        LogNotFoundError: there is no log at ``url``.

    Example:
        >>> replog.open_log("s3://bucket/shop", endpoint_url="http://minio:9000")  # doctest: +SKIP
    """
    return ReplicationLog.open(url, storage_options=storage_options)


def append(
    url: str, events: pa.Table | Iterable[Mapping[str, Any]], **storage_options: Any
) -> CommitRecord | None:
    """Append change events to the log at ``url`` as one atomic commit.

    Raises:
        InvalidEventError: an event is malformed (nothing was written).

    Example:
        >>> replog.append("/tmp/shop", [{"key": "o/1", "data": {"total": 9.5}}])  # doctest: +SKIP
    """
    return open_log(url, **storage_options).append(events)


def read(url: str, shard: int, first: int = 1, **storage_options: Any) -> Iterator[pa.RecordBatch]:
    """Events of one shard from sequence ``first`` on, as Arrow record batches.

    Raises:
        DataLossError: ``first`` was removed by retention.
        CorruptionError: a file does not match its checksum (it names the file).

    Example:
        >>> for batch in replog.read("/tmp/shop", shard=0):  # doctest: +SKIP
        ...     print(batch.num_rows)
    """
    return open_log(url, **storage_options).read(shard, first)


def register(spark: SparkSession) -> None:
    """Register the ``replog`` and ``replog-sink`` formats with ``spark`` explicitly.

    Needed only where auto-registration cannot work (``spark-submit --py-files``): then
    replog's code is pickled by value into the registered classes.

    Example:
        >>> replog.register(spark)  # doctest: +SKIP
    """
    from replog.spark.register import register as register_formats  # noqa: PLC0415

    register_formats(spark)
