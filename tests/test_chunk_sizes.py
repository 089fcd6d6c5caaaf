"""How long a snapshot's chunks are: about CHUNK_BYTES of row text, at most the chunk rows
given; a table's first chunk short until the width of its rows is known."""

from __future__ import annotations

from replog.capture import chunk_sizes
from replog.capture.chunk_sizes import ChunkSizes


def test_a_tables_first_chunk_is_short_and_later_ones_hold_about_the_target_bytes() -> None:
    sizes = ChunkSizes(100_000, target_bytes=16 << 20)
    assert sizes.rows("public.t") == chunk_sizes.FIRST_CHUNK_ROWS
    sizes.learn("public.t", 1_000, 100 * 1_000)  # 100-byte rows: the most rows
    assert sizes.rows("public.t") == 100_000
    sizes.learn("public.t", 100_000, 100_000 << 10)  # rows grew to 1 KiB each
    assert sizes.rows("public.t") == 16 << 10
    sizes.learn("public.t", 10, 10 << 30)  # 1 GiB rows: still one row a chunk
    assert sizes.rows("public.t") == 1
    assert sizes.rows("public.other") == chunk_sizes.FIRST_CHUNK_ROWS  # learned per table
    sizes.learn("public.other", 0, 0)  # an empty chunk tells nothing
    assert sizes.rows("public.other") == chunk_sizes.FIRST_CHUNK_ROWS


def test_a_chunk_never_reads_more_rows_than_given() -> None:
    sizes = ChunkSizes(16)
    assert sizes.rows("t") == 16
    sizes.learn("t", 16, 16)
    assert sizes.rows("t") == 16
