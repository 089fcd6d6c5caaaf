"""The Python Data Source API's own sink ceiling: an Arrow stream writer that discards.

A module of its own so executors import it by reference, as they do replog.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)


class NullWriter(DataSourceStreamArrowWriter):
    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        for _ in iterator:
            pass
        return WriterCommitMessage()

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass


class NullSink(DataSource):
    @classmethod
    def name(cls) -> str:
        return "python-null"

    def streamWriter(self, schema: Any, overwrite: bool) -> NullWriter:
        return NullWriter()
