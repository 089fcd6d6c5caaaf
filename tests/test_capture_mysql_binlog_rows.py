# ruff: noqa: E501 - the type tables are one value list a line
"""The binlog's row images as replog reads them (``_RowDecoder``) against the server: each
value, in multi-row events, wide bitmaps, every precision of DECIMAL and MySQL's wide
charsets, the same text the snapshot writes from the server's own output; rows that do
not read as their table map says stop capture. (Written by an adversarial review of the
decoder: the tests under "findings" failed on its first version.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from pymysqlreplication.column import Column
from pymysqlreplication.constants import FIELD_TYPE
from pymysqlreplication.row_event import WriteRowsEvent
from support.mysql import Db, events, run

from replog.capture.mysql import binlog
from replog.errors import CaptureError

pytestmark = pytest.mark.slow  # a MariaDB server for the session


def _state(url: str) -> dict[str, str]:
    """key -> data of the rows a log leaves (its events applied in order)."""
    table: dict[str, str] = {}
    for event in events(url):
        if event["op"] == "d":
            table.pop(event["key"], None)
        elif event["op"] != "t":
            table[event["key"]] = event["data"]
    return table


def _snapshot(db: Db, path: Path, table: str) -> dict[str, str]:
    """key -> data as a fresh snapshot reads the table (the server's text output)."""
    url = str(path)
    run(db.dsn, url, tables=(table,))
    return {e["key"]: e["data"] for e in events(url) if e["op"] == "r"}


def _check(db: Db, tmp_path: Path, create: str, *steps: list[str], table: str = "t") -> list:
    """Creates the table, captures it, then runs each step's statements (one transaction
    a step) and captures: after each step, the streamed log's rows are the snapshot's, and
    every update's before image / delete's old image is the row as it was."""
    db.sql(create)
    streamed = str(tmp_path / "streamed")
    run(db.dsn, streamed, tables=(table,))
    seen = 0
    previous: dict[str, str] = {}
    for number, statements in enumerate(steps):
        db.transaction("SET SESSION sql_mode = ''", *statements)  # zero dates allowed
        run(db.dsn, streamed, tables=(table,))
        found = events(streamed)
        for event in found[seen:]:
            if event["op"] == "u":
                assert event["before"] == previous[event["key"]], event
            if event["op"] == "d":
                assert event["before"] == previous[event["key"]], event
            if event["op"] == "d":
                previous.pop(event["key"], None)
            elif event["op"] in ("c", "u"):
                previous[event["key"]] = event["data"]
        seen = len(found)
        expected = _snapshot(db, tmp_path / f"snapshot{number}", table)
        assert _state(streamed) == expected
    return events(streamed)


DECIMALS = [
    ("decimal(1,0)", ["0", "9", "-9", "-1"]),
    ("decimal(9,0)", ["999999999", "-999999999", "1", "-1", "100000000"]),
    ("decimal(10,0)", ["9999999999", "-9999999999", "1000000000", "-1000000001"]),
    ("decimal(18,9)", ["999999999.999999999", "-0.000000001", "-1.5", "1.000000001"]),
    ("decimal(19,0)", ["9999999999999999999", "-9999999999999999999", "-1"]),
    ("decimal(65,30)", ["-0.5", "-" + "9" * 35 + "." + "9" * 30, "0.000000000000000000000000000001"]),
    ("decimal(65,0)", ["9" * 65, "-" + "9" * 65, "-1000000000000000000000000000000"]),
    ("decimal(10,10)", ["0.9999999999", "-0.9999999999", "-0.5", "0.0000000001"]),
    ("decimal(4,2)", ["-0.5", "99.99", "-99.99", "0.05", "-0.05"]),
    ("decimal(38,20)", ["-123456789012345678.00000000000000000001", "0.01"]),
    ("decimal(12,3) unsigned", ["999999999.999", "0.001"]),
    ("decimal(2,1)", ["-0.1", "9.9", "-9.9"]),
    ("decimal(30,25)", ["-0.0000000000000000000000001", "12345.1234567890123456789012345"]),
]


@pytest.mark.parametrize(("kind", "values"), DECIMALS, ids=[k for k, _ in DECIMALS])
def test_decimals_of_each_precision_in_one_multi_row_event(
    mysql_db: Db, tmp_path: Path, kind: str, values: list[str]
) -> None:
    """Each DECIMAL precision/scale, many rows a statement, updated and deleted in one
    statement each: the streamed values are the server's."""
    rows = ", ".join(f"({i}, {v}, {v}, 'x')" for i, v in enumerate(values))
    _check(
        mysql_db,
        tmp_path,
        f"CREATE TABLE t (id int PRIMARY KEY, d {kind}, e {kind}, s varchar(3))",
        [f"INSERT INTO t VALUES {rows}"],
        ["UPDATE t SET s = 'yy'"],
        ["DELETE FROM t WHERE id > 0"],
    )


WIDE = [  # (type, values for rows 1..n: a literal or NULL)
    ("tinyint", ["-128", "NULL", "127", "0"]),
    ("smallint unsigned", ["65535", "0", "NULL", "1"]),
    ("mediumint", ["-8388608", "NULL", "8388607", "NULL"]),
    ("int unsigned", ["NULL", "4294967295", "0", "2147483648"]),
    ("bigint unsigned", ["18446744073709551615", "9223372036854775808", "NULL", "9223372036854775807"]),
    ("bigint", ["-9223372036854775808", "NULL", "-1", "9223372036854775807"]),
    ("decimal(65,30)", ["-0.5", "NULL", "-99999999999999999999999999999999999.999999999999999999999999999999", "0"]),
    ("float", ["-1.5", "NULL", "3.4e38", "1e-38"]),
    ("double", ["NULL", "-2.2250738585072014e-308", "1.7976931348623157e308", "0.1"]),
    ("year", ["1901", "0", "NULL", "2155"]),
    ("date", ["'1000-01-01'", "'9999-12-31'", "NULL", "'2024-02-29'"]),
    ("time(1)", ["'-838:59:58.9'", "'-00:00:00.1'", "NULL", "'12:34:56.7'"]),
    ("time(2)", ["'-00:00:00.01'", "'-01:00:00.99'", "'838:59:58.99'", "NULL"]),
    ("time(4)", ["'-00:00:00.0001'", "NULL", "'-10:00:00.5'", "'00:00:00.9999'"]),
    ("time(5)", ["'-00:00:00.00001'", "'-838:59:58.99999'", "NULL", "'1:2:3.4'"]),
    ("time(6)", ["'-00:00:00.000001'", "'-838:59:59.000000'", "'838:59:59'", "NULL"]),
    ("datetime(1)", ["'2024-01-02 03:04:05.1'", "NULL", "'1000-01-01 00:00:00.9'", "'9999-12-31 23:59:59.9'"]),
    ("datetime(4)", ["'2024-01-02 03:04:05.1234'", "'0000-00-00 00:00:00'", "NULL", "'2001-02-03 04:05:06.0001'"]),
    ("datetime(5)", ["NULL", "'2024-01-02 03:04:05.12345'", "'2001-02-03 04:05:06.00001'", "'1999-12-31 23:59:59.99999'"]),
    ("timestamp(2) NULL", ["'2024-01-02 03:04:05.12'", "NULL", "'2038-01-19 08:44:07.99'", "'1970-01-01 05:30:01.01'"]),
    ("timestamp(5) NULL", ["'2024-01-02 03:04:05.12345'", "'1970-01-01 05:30:00.00001'", "NULL", "'2001-01-01 00:00:00'"]),
    ("char(10) character set utf8mb4", ["'😀 a  '", "' lead'", "NULL", "''"]),
    ("char(80) character set utf8mb4", ["'😀😀😀 x'", "NULL", "REPEAT('é', 80)", "'a'"]),
    ("varchar(300) character set latin1", ["REPEAT('ÿ', 300)", "NULL", "''", "'a '"]),
    ("varchar(100) character set utf8mb4", ["REPEAT('😀', 70)", "'x'", "NULL", "REPEAT('a', 100)"]),
    ("binary(3)", ["'a'", "0x000000", "NULL", "0x010000"]),
    ("tinytext", ["REPEAT('z', 255)", "NULL", "''", "'t'"]),
    ("mediumblob", ["REPEAT(0xFF, 70000)", "NULL", "''", "0x00"]),
    ("longtext", ["REPEAT('😀', 20000)", "''", "NULL", "'l'"]),
    ("bit(1)", ["b'0'", "b'1'", "NULL", "b'0'"]),
    ("bit(9)", ["b'100000001'", "NULL", "b'0'", "b'111111111'"]),
    ("bit(64)", ["b'1" + "0" * 63 + "'", "NULL", "0", "1"]),
    ("set('a','b','c','d','e','f','g','h','i','j')", ["'a,j'", "''", "NULL", "'i,h,b'"]),
    ("enum('x','y')", ["'y'", "NULL", "''", "'x'"]),
]


def test_a_wide_table_with_nulls_across_bitmap_bytes_many_rows_an_event(
    mysql_db: Db, tmp_path: Path
) -> None:
    """35 columns of every kind, NULLs interleaved, 4 rows inserted, updated and deleted
    by one statement each: every value the server's, every row's boundary right."""
    definitions = ", ".join(f"c{i} {kind}" for i, (kind, _) in enumerate(WIDE))
    rows = [
        "(" + ", ".join([str(n + 1), *[values[n] for _, values in WIDE]]) + ")"
        for n in range(4)
    ]
    found = _check(
        mysql_db,
        tmp_path,
        f"CREATE TABLE t (id int PRIMARY KEY, {definitions})",
        ["SET time_zone = '+05:30'", f"INSERT INTO t VALUES {', '.join(rows)}"],
        ["UPDATE t SET c0 = c0 DIV 2, c3 = NULL, c21 = 'q'"],
        ["DELETE FROM t"],
    )
    assert [e["op"] for e in found] == ["c"] * 4 + ["u"] * 4 + ["d"] * 4


def test_columns_added_and_retyped_between_events_of_one_read(mysql_db: Db, tmp_path: Path) -> None:
    """A column added in the middle, one retyped (INT -> DECIMAL, VARCHAR(10) -> (400)),
    between row events read in one capture: each event read by its own table map."""
    mysql_db.sql("CREATE TABLE t (id int PRIMARY KEY, a int, s varchar(10))")
    streamed = str(tmp_path / "streamed")
    run(mysql_db.dsn, streamed, tables=("t",))
    mysql_db.sql(
        "INSERT INTO t VALUES (1, -5, 'one'), (2, NULL, 'two')",
        "ALTER TABLE t ADD COLUMN m bigint unsigned DEFAULT 18446744073709551615 AFTER id",
        "INSERT INTO t VALUES (3, 9223372036854775808, 7, 'three')",
        "UPDATE t SET a = a + 1",
        "ALTER TABLE t MODIFY a decimal(20,5), MODIFY s varchar(400)",
        "INSERT INTO t VALUES (4, 0, -0.5, REPEAT('s', 400))",
        "UPDATE t SET s = CONCAT(s, '!') WHERE id < 4",
        "DELETE FROM t WHERE id IN (1, 4)",
    )
    run(mysql_db.dsn, streamed, tables=("t",))
    assert _state(streamed) == _snapshot(mysql_db, tmp_path / "snapshot", "t")


def test_enum_of_300_members_set_of_64_and_binary_collations(mysql_db: Db, tmp_path: Path) -> None:
    """ENUM with a 2-byte index, SET with an 8-byte mask, CHAR with a binary collation and
    BINARY padding, in one multi-row event: the server's values."""
    members = ", ".join(f"'m{i}'" for i in range(300))
    bits = ", ".join(f"'b{i}'" for i in range(64))
    _check(
        mysql_db,
        tmp_path,
        f"CREATE TABLE t (id int PRIMARY KEY, e enum({members}), s set({bits}), "
        "c char(4) character set utf8mb4 collate utf8mb4_bin, b binary(5), n int)",
        [
            "INSERT INTO t VALUES (1, 'm299', 'b0,b63', 'ab ', 'a', 1), "
            "(2, 'm255', 'b7,b8,b31,b32', '', '', 2), (3, NULL, '', NULL, 0x0000000001, 3), "
            "(4, 'm0', NULL, '😀', NULL, 4)"
        ],
        ["UPDATE t SET n = -n"],
        ["DELETE FROM t"],
    )


# -- findings: rows that do not read as their table map says, wide charsets ---------------


def test_a_mariadb_old_format_timestamp6_never_becomes_wrong_values_and_a_phantom_row(
    mysql_db: Db, tmp_path: Path
) -> None:
    """A TIMESTAMP(6) of MariaDB's own pre-10.1 format (mysql56_temporal_format=OFF, kept
    by upgraded tables), which capture does not read: it stops, naming the table and the
    way out, rather than log wrong values plus a row id 0 that was never written (what
    the decoder's first version did)."""
    mysql_db.sql("CREATE TABLE warm (id int PRIMARY KEY)")
    run(mysql_db.dsn, str(tmp_path / "warm"), tables=("warm",))  # replog's tables, new format
    mysql_db.server.sql("SET GLOBAL mysql56_temporal_format = OFF")
    try:
        mysql_db.sql("CREATE TABLE t (id int PRIMARY KEY, c timestamp(6) NULL, n int)")
    finally:
        mysql_db.server.sql("SET GLOBAL mysql56_temporal_format = ON")
    url = str(tmp_path / "streamed")
    run(mysql_db.dsn, url, tables=("t",))
    mysql_db.sql("INSERT INTO t VALUES (1, '2024-01-02 03:04:05.678901', 5)")
    with pytest.raises(CaptureError, match=r"\.t \(ending at binlog offset \d+\).*FORCE"):
        run(mysql_db.dsn, url, tables=("t",))
    assert [e["op"] for e in events(url)] == []  # nothing of it in the log


class _Packet:
    def __init__(self, data: bytes) -> None:
        self.data, self.read_bytes, self.log_pos = data, 0, 4096

    def read(self, size: int) -> bytes:
        found = self.data[self.read_bytes : self.read_bytes + size]
        self.read_bytes += size
        return found


def _write_event(columns: list[Column], rows_part: bytes) -> WriteRowsEvent:
    event = WriteRowsEvent.__new__(WriteRowsEvent)
    event.complete, event.event_type = True, 23  # WRITE_ROWS_EVENT_V1, as MariaDB writes
    event.packet, event.event_size = _Packet(rows_part), len(rows_part)
    event.schema, event.table = "db", "t"
    event.columns_present_bitmap = bytes([(1 << len(columns)) - 1])
    return event


def _int(name: str) -> Column:
    return Column(type=FIELD_TYPE.LONG, name=name, unsigned=False)


def test_a_rows_part_that_ends_inside_a_row_is_an_error_not_a_row() -> None:
    """Rows (id int, n int): one whole row, then 3 bytes (a misread column's leftovers):
    the decoder must raise, not return a second row (id 2, n 0) read past the end."""
    table = type("Table", (), {"columns": [_int("id"), _int("n")]})()
    whole = b"\x00" + (1).to_bytes(4, "little") + (5).to_bytes(4, "little")
    event = _write_event(table.columns, whole + b"\x00\x02\x00")
    with pytest.raises(CaptureError, match=r"db\.t .* does not read as its table map"):
        binlog._RowDecoder(table).rows(event)


def test_a_string_longer_than_its_event_is_an_error_not_a_cut_string() -> None:
    """A VARCHAR whose length prefix (200) runs past the rows part's end: an error, not
    the bytes that are there taken as the whole value."""
    column = Column(type=FIELD_TYPE.VARCHAR, name="s", unsigned=False, max_length=40,
                    character_set_name="utf8", collation_name="utf8mb4_general_ci")  # fmt: skip
    table = type("Table", (), {"columns": [column]})()
    event = _write_event(table.columns, b"\x00" + bytes([200]) + b"abc")
    with pytest.raises(CaptureError, match="bytes past the event"):
        binlog._RowDecoder(table).rows(event)


@pytest.mark.parametrize("charset", ["utf16", "ucs2", "utf32", "utf16le"])
def test_strings_of_mysql_wide_charsets_are_the_servers(
    mysql_db: Db, tmp_path: Path, charset: str
) -> None:
    """VARCHAR/CHAR in utf16 ('ab' read as '愀戀': big-endian bytes decoded little-endian),
    ucs2, utf32, utf16le (no such Python codec / wrong byte order): the server's text."""
    _check(
        mysql_db,
        tmp_path,
        f"CREATE TABLE t (id int PRIMARY KEY, a varchar(20) character set {charset}, "
        f"b char(5) character set {charset}, n int)",
        ["INSERT INTO t VALUES (1, 'ab', 'x', 1), (2, '€', '', 2)"],
    )
