"""Spark auto-registration entry point of the ``replog-sink`` exactly-once sink format."""

from replog.spark.sink import ReplogSinkDataSource as DefaultSource

__all__ = ["DefaultSource"]
