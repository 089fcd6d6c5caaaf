"""replog: change-data-capture replication logs, with an exactly-once Spark source and sink.

The core (this package minus :mod:`replog.spark`) never imports pyspark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from replog.errors import ReplogError
from replog.events import EVENT_SCHEMA, OPERATIONS
from replog.log import ReplicationLog

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "EVENT_SCHEMA",
    "OPERATIONS",
    "ReplicationLog",
    "ReplogError",
    "create_log",
    "open_log",
    "register",
]
__version__ = "0.1.0"


def create_log(url: str, shards: int = 8, **storage_options: Any) -> ReplicationLog:
    """Create an empty log at ``url`` (any fsspec URL)."""
    return ReplicationLog.create(url, shards, storage_options=storage_options)


def open_log(url: str, **storage_options: Any) -> ReplicationLog:
    """Open the log at ``url``."""
    return ReplicationLog.open(url, storage_options=storage_options)


def register(spark: SparkSession) -> None:
    """Register the ``replog`` and ``replog-sink`` formats with ``spark`` explicitly."""
    from replog.spark.register import register as _register  # noqa: PLC0415

    _register(spark)
