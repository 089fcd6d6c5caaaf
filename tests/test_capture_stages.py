"""Each stage of capture on its own against a real PostgreSQL: the source (catalog and
checks), the snapshot's chunk reader, the change stream's decoder and relations."""

from __future__ import annotations

import json

from support.capture import sql

from replog.capture.chunks import ChunkReader
from replog.capture.events import EventMaker
from replog.capture.options import CaptureOptions
from replog.capture.pgoutput import Commit, Decoder, Message, RowChange, SourceTransaction
from replog.capture.progress import CaptureProgress
from replog.capture.snapshot import TableSnapshot, watermark
from replog.capture.source import WATERMARK_PREFIX, PostgresSource
from replog.capture.stream import Relations


def _source(dsn: str, **options: object) -> PostgresSource:
    return PostgresSource(CaptureOptions(dsn=dsn, slot="stages", **options))  # type: ignore[arg-type]


def test_the_source_describes_a_table_and_reads_a_row_now(pg_dsn: str) -> None:
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, c character(4), n numeric(6, 2),"
        " g int GENERATED ALWAYS AS (id * 2) STORED)",
        "INSERT INTO t (id, c, n) VALUES (1, 'ab', 1.5)",
        "ALTER TABLE t ADD COLUMN d int DEFAULT 7",
    )
    source = _source(pg_dsn, tables=("t",))
    try:
        table = source.add_table("t")
        assert [name for name, _, _ in table.columns] == ["id", "c", "n", "g", "d"]
        assert table.key == ("id",) and table.key_indexed and not table.key_deferrable
        assert table.defaults == (("d", "7"),)
        assert source.current_values(table, ["1"], ["c", "n"]) == {"c": "ab  ", "n": "1.50"}
        assert source.current_values(table, ["2"], ["c"]) is None
    finally:
        source.close()


def test_the_chunk_reader_reads_a_table_in_key_order_between_watermarks(pg_dsn: str) -> None:
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 25) g",
    )
    source = _source(pg_dsn, tables=("t",))
    try:
        table = source.add_table("t")
        reader = ChunkReader(source, EventMaker(source.database, "stages", source.pg_type), 10)
        owed = TableSnapshot("public.t", table.oid, "initial")
        sizes = []
        while True:
            chunk = reader.read(owed, table)
            assert chunk is not None
            sizes.append(len(chunk.events))
            assert chunk.low_lsn < chunk.high_lsn
            first = next(iter(chunk.events.values()), None)
            if first is not None:
                assert json.loads(first.data)["v"] == f"v{json.loads(first.key)['id']}"
            owed.after = chunk.after
            if chunk.finished:
                break
        assert sizes == [10, 10, 5]
        reader.close()
    finally:
        source.close()


def test_the_stream_decodes_messages_and_maps_a_partition_to_its_root(pg_dsn: str) -> None:
    sql(
        pg_dsn,
        "CREATE TABLE p (id int, region text, PRIMARY KEY (region, id)) PARTITION BY LIST (region)",
        "CREATE TABLE p_eu PARTITION OF p FOR VALUES IN ('eu')",
        "CREATE PUBLICATION stages FOR TABLE p",  # partitions' names: no publish_via_root
        "SELECT pg_create_logical_replication_slot('stages', 'pgoutput')",
        "INSERT INTO p VALUES (1, 'eu')",
    )
    source = _source(pg_dsn, tables=("p",), publication="stages")
    try:
        source.add_table("p")
        mark = source.emit_message(WATERMARK_PREFIX, json.dumps({"chunk": "c1", "side": "low"}))
        decoder = Decoder()
        relations = Relations(source, source.options, CaptureProgress(), lambda _: None)
        seen: list[object] = []
        txn = None
        for lsn, message in source.peek_stream(100):
            item = decoder.feed(lsn, message)
            if isinstance(item, SourceTransaction):
                txn = item
            elif isinstance(item, RowChange):
                assert txn is not None
                mapped = relations.map(item, txn)
                assert mapped is not None
                seen.append((item.relation.name, mapped.table.qualified))
            elif isinstance(item, Message):
                seen.append((item.lsn == mark, watermark(item.content)))
            elif isinstance(item, Commit):
                seen.append("commit")
        assert seen == [
            ("public.p_eu", "public.p"),
            "commit",
            (True, ("c1", "low")),
            "commit",
        ]
    finally:
        source.close()
