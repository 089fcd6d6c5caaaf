"""Spark auto-registration entry point of the ``replog`` streaming source format."""

from replog.spark.source import ReplogDataSource as DefaultSource

__all__ = ["DefaultSource"]
