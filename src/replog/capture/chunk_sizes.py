"""How many rows a snapshot's next chunk of a table reads: as many as hold about
:data:`CHUNK_BYTES` of the table's row text, at most the chunk rows the capture was given.

A chunk is held whole in memory (its rows, then its events), and each chunk pays a fixed
cost (two watermarks, a log commit, the plan saved): narrow rows want long chunks (a
pgbench_accounts snapshot ran 30% faster at 100,000 rows a chunk than at 20,000) and wide
rows short ones (20,000 rows of 1 MB each are 20 GB). The first chunk of a table is short,
:data:`FIRST_CHUNK_ROWS`, and tells the width of its rows; each later chunk is sized from
the chunk before it.
"""

from __future__ import annotations

CHUNK_BYTES = 16 << 20
"""The row text a chunk aims to hold (as the server sends it: its events take about
twice that)."""
FIRST_CHUNK_ROWS = 1_000
"""Rows of a table's first chunk, before the width of its rows is known."""


class ChunkSizes:
    """The rows of each table's next chunk (by table name), learned from its last one."""

    def __init__(self, most: int, target_bytes: int | None = None) -> None:
        self.most = most
        self.target_bytes = CHUNK_BYTES if target_bytes is None else target_bytes
        self._row_bytes: dict[str, float] = {}

    def rows(self, table: str) -> int:
        """How many rows the next chunk of ``table`` reads (1 to ``most``)."""
        width = self._row_bytes.get(table)
        if width is None:
            return min(self.most, FIRST_CHUNK_ROWS)
        return max(1, min(self.most, int(self.target_bytes / max(width, 1.0))))

    def learn(self, table: str, rows: int, nbytes: int) -> None:
        """A chunk of ``table`` held ``rows`` rows in ``nbytes`` bytes."""
        if rows > 0:
            self._row_bytes[table] = nbytes / rows
