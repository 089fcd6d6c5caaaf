"""The Python Data Source API's own ceiling: a source that only yields pre-built batches.

A module of its own (not ``__main__``) so executors import it by reference, as they do
replog, instead of unpickling the classes by value for every task. It imports nothing
of replog: Spark starts a Python process per query that imports the source's module,
and replog's imports are part of what replog costs, not of the API's floor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

CEILING_BATCH_ROWS = 100_000
SCHEMA_DDL = (
    "shard INT NOT NULL, sequence BIGINT NOT NULL, event_id STRING NOT NULL, "
    "timestamp TIMESTAMP NOT NULL, operation STRING NOT NULL, collection STRING, "
    "key STRING NOT NULL, data BINARY NOT NULL, before BINARY, metadata STRING"
)
"""replog's source schema, spelled out (the benchmarks check that it still matches)."""


class CeilingPartition(InputPartition):
    def __init__(self, index: int, rows: int, template: str) -> None:
        super().__init__(index)
        self.rows = rows
        self.template = template


class CeilingReader(DataSourceStreamReader):
    """Yields one pre-built 100k-row batch of real events, over and over."""

    def __init__(self, options: dict[str, str]) -> None:
        self.total = int(options["rows"])
        self.tasks = int(options["tasks"])
        self.template = options["template"]  # a path: tasks stay small

    def initialOffset(self) -> dict[str, int]:
        return {"offset": 0}

    def latestOffset(self) -> dict[str, int]:
        return {"offset": self.total}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[CeilingPartition]:
        rows = end["offset"] - start["offset"]
        share = -(-rows // self.tasks)
        return [
            CeilingPartition(i, min(share, rows - i * share), self.template)
            for i in range(self.tasks)
            if rows - i * share > 0
        ]

    def commit(self, end: dict[str, Any]) -> None:
        pass

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, CeilingPartition)
        # Build batches once per Python worker process (workers are reused), so the
        # ceiling pays only for handing batches to Spark. A by-value class has no module
        # of its own to cache in, hence pyarrow's module dict. Batches are whole, never
        # slices: a slice still drags its parent's buffers through serialisation.
        cache = vars(pa).setdefault("_replog_bench_ceiling_batches", {})
        left = partition.rows
        while left > 0:
            rows = min(left, CEILING_BATCH_ROWS)
            if rows not in cache:
                small = pa.ipc.open_file(partition.template).read_all()
                repeats = -(-rows // small.num_rows)
                table = pa.concat_tables([small] * repeats).slice(0, rows).combine_chunks()
                cache[rows] = table.to_batches()[0]
            yield cache[rows]
            left -= rows


class CeilingSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "ceiling"

    def schema(self) -> str:
        return SCHEMA_DDL

    def streamReader(self, schema: Any) -> CeilingReader:
        return CeilingReader(dict(self.options))
