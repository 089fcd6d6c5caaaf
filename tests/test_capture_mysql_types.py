"""Every built-in MySQL/MariaDB type, captured exactly: the snapshot (the server's text
output) and the binlog (the row image's bytes) write one JSON text per value, the value the
type holds (a real MariaDB server), and the schema both register is one."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from support.mysql import Db, events, run

from replog.capture.mysql import rows as chunk_rows
from replog.capture.mysql.capture import MySqlCapture
from replog.capture.mysql.options import MySqlOptions
from replog.format.jsontext import parse_object
from replog.log import ReplicationLog
from replog.schemas import registry

pytestmark = pytest.mark.slow  # a MariaDB server for the session (make test installs it)

WKB_POINT_1_2 = base64.b64encode(bytes.fromhex("0101000000000000000000f03f0000000000000040"))

TYPES: list[tuple[str, str, str]] = [  # column type, a literal, the JSON text it must become
    ("tinyint", "-128", "-128"),
    ("tinyint unsigned", "255", "255"),
    ("tinyint(1)", "2", "2"),  # a TINYINT(1) holds 2: it is an integer, not a boolean
    ("boolean", "true", "1"),
    ("smallint", "-32768", "-32768"),
    ("smallint unsigned", "65535", "65535"),
    ("mediumint", "-8388608", "-8388608"),
    ("mediumint unsigned", "16777215", "16777215"),
    ("int", "-2147483648", "-2147483648"),
    ("int unsigned", "4294967295", "4294967295"),
    ("bigint", "-9223372036854775808", "-9223372036854775808"),
    ("bigint unsigned", "18446744073709551615", "18446744073709551615"),
    ("decimal(12,4)", "-1.5", "-1.5000"),
    (
        "decimal(65,30)",
        "12345678901234567890123456789012345.123456789012345678901234567890",
        "12345678901234567890123456789012345.123456789012345678901234567890",
    ),
    ("decimal(5,5)", "-0.00001", "-0.00001"),
    ("decimal(10,0)", "-1234567890", "-1234567890"),
    ("decimal(20,10)", "0", "0.0000000000"),
    ("float", "1.2345678", "1.2345678"),  # the server's text says 1.23457
    ("float", "3.4028235e38", "3.4028235e+38"),
    ("double", "0.1e0 + 0.2e0", "0.30000000000000004"),
    ("float(30)", "1e-300", "1e-300"),
    ("bit(1)", "b'1'", "true"),
    ("bit(10)", "b'1010000001'", '"gQI="'),  # 641, little-endian: 0x81 0x02
    ("bit(64)", "b'" + "1" * 64 + "'", '"//////////8="'),
    ("year", "0", "0"),  # YEAR 0000, not 1900
    ("year", "2155", "2155"),
    ("date", "'2024-02-29'", '"2024-02-29"'),
    ("date", "'0000-00-00'", "null"),  # a zero date: null, counted
    ("time", "'-838:59:59'", "-3020399000000"),
    ("time(3)", "'-00:00:01.5'", "-1500000"),
    ("time(6)", "'838:59:58.999999'", "3020398999999"),
    ("time(1)", "'-12:00:00.1'", "-43200100000"),
    ("datetime", "'9999-12-31 23:59:59'", '"9999-12-31T23:59:59"'),
    ("datetime(6)", "'2024-01-02 03:04:05.000001'", '"2024-01-02T03:04:05.000001"'),
    ("datetime(3)", "'2024-01-02 03:04:05.1'", '"2024-01-02T03:04:05.100"'),
    ("datetime(2)", "'0000-00-00 00:00:00'", "null"),
    # the session is at +05:30 (the server's zone): the instants are in UTC
    ("timestamp(3)", "'2024-01-02 03:04:05.123'", '"2024-01-01T21:34:05.123Z"'),
    ("timestamp", "'1970-01-01 05:30:01'", '"1970-01-01T00:00:01Z"'),
    ("timestamp(6)", "'0000-00-00 00:00:00'", "null"),
    ("char(5)", "'ab'", '"ab"'),
    ("varchar(10)", "'ab  '", '"ab  "'),
    ("varchar(300)", "'x'", '"x"'),
    ("text", "'zoë \"q\"\\n'", '"zoë \\"q\\"\\n"'),
    ("longtext", "'😀 four bytes'", '"😀 four bytes"'),
    ("char(4) character set latin1", "'é€'", '"é€"'),
    # latin1's 0x81 is U+0081 in MySQL (Windows-1252 leaves it unassigned)
    ("varchar(20) character set latin1", "CONVERT(0x81E9 USING latin1)", '"\u0081é"'),
    ("binary(4)", "'ab'", '"YWIAAA=="'),  # padded with zeros, as the server stores it
    ("varbinary(10)", "0x00FF10", '"AP8Q"'),
    ("blob", "0x00", '"AA=="'),
    ("tinyblob", "''", '""'),
    ("enum('x','y z')", "'y z'", '"y z"'),
    ("set('a','b','c')", "'c,a'", '"a,c"'),  # in the set's order
    ("set('p','q')", "''", '""'),  # empty, not NULL
    ("json", '\'{"b": 1.50,  "a": [1,2]}\'', json.dumps('{"b": 1.50,  "a": [1,2]}')),
    ("geometry", "ST_GeomFromText('POINT(1 2)')", f'{{"wkb":"{WKB_POINT_1_2.decode()}","srid":0}}'),
    (
        "point",
        "ST_GeomFromText('POINT(1 2)', 4326)",
        f'{{"wkb":"{WKB_POINT_1_2.decode()}","srid":4326}}',
    ),
    (
        "polygon",
        "ST_GeomFromText('POLYGON((0 0,1 0,1 1,0 0))')",
        None,  # checked against ST_AsWKB below
    ),
]


def _table(db: Db) -> list[str]:
    columns = [f"c{i}" for i in range(len(TYPES))]
    definitions = ", ".join(f"{c} {t}" for c, (t, _, _) in zip(columns, TYPES, strict=True))
    db.sql(f"CREATE TABLE every_type (id int PRIMARY KEY, {definitions})")
    return columns


def _insert(db: Db, columns: list[str]) -> None:
    literals = ", ".join(literal for _, literal, _ in TYPES)
    db.server.sql(  # zero dates allowed (sql_mode '')
        "SET SESSION sql_mode = ''",
        f"INSERT INTO every_type VALUES (1, {literals})",
        "INSERT INTO every_type (id) VALUES (2)",
        database=db.name,
    )


@pytest.mark.parametrize("reader", ["c-extension", "pymysql"])
def test_every_type_is_one_text_on_the_snapshot_the_binlog_and_the_server(
    mysql_db: Db, tmp_path: Path, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot read by mysql-connector's C extension (in its child process) or by
    PyMySQL: the same text either way."""
    monkeypatch.setattr(chunk_rows, "CHILD_READER", reader == "c-extension")
    columns = _table(mysql_db)
    streamed, snapshotted = str(tmp_path / "streamed"), str(tmp_path / "snapshotted")
    run(mysql_db.dsn, streamed, tables=("every_type",))  # nothing yet: the binlog from here
    _insert(mysql_db, columns)
    with MySqlCapture(
        MySqlOptions(dsn=mysql_db.dsn, tables=("every_type",)),
        ReplicationLog.open(streamed),
    ) as capture:
        capture.run()
        zeros_streamed = capture.zero_dates
    with MySqlCapture(
        MySqlOptions(dsn=mysql_db.dsn, tables=("every_type",)),
        ReplicationLog.open_or_create(snapshotted, 4),
    ) as capture:
        capture.run()
        zeros_snapshotted = capture.zero_dates

    changes = sorted((e for e in events(streamed) if e["op"] == "c"), key=lambda e: e["key"])
    reads = sorted((e for e in events(snapshotted) if e["op"] == "r"), key=lambda e: e["key"])
    assert [e["key"] for e in changes] == [e["key"] for e in reads] == ['{"id":1}', '{"id":2}']
    for change, read in zip(changes, reads, strict=True):
        assert change["data"] == read["data"]  # byte for byte: number text, order, escapes
        assert change["metadata"]["schema"] == read["metadata"]["schema"]  # one schema

    row = parse_object(changes[0]["data"])
    for column, (kind, literal, expected) in zip(columns, TYPES, strict=True):
        if expected is not None:
            assert row[column].text == expected, (kind, literal, row[column].text)
    nulls = parse_object(changes[1]["data"])
    assert all(nulls[c].value is None for c in columns)

    # the server's own output where it writes the value whole
    by_kind = dict(zip([t for t, _, _ in TYPES], columns, strict=False))
    [(wkb, srid, binary, bits, stamp)] = mysql_db.query(
        f"SELECT HEX(ST_AsWKB({by_kind['polygon']})), ST_SRID({by_kind['polygon']}), "
        f"HEX({by_kind['binary(4)']}), CAST({by_kind['bit(10)']} AS UNSIGNED), "
        f"UNIX_TIMESTAMP({by_kind['timestamp(3)']}) FROM every_type WHERE id = 1"
    )
    polygon = row[by_kind["polygon"]].value
    assert base64.b64decode(polygon["wkb"]).hex().upper() == wkb and polygon["srid"] == srid
    assert base64.b64decode(row[by_kind["binary(4)"]].value).hex().upper() == binary
    assert int.from_bytes(base64.b64decode(row[by_kind["bit(10)"]].value), "little") == bits
    assert row[by_kind["timestamp(3)"]].value == "2024-01-01T21:34:05.123Z"
    assert str(stamp) == "1704144845.123"

    # zero dates: null, and counted per column
    zero_columns = {f"{mysql_db.name}.every_type.{c}" for c, (_, _, e) in zip(columns, TYPES,
                    strict=True) if e == "null"}  # fmt: skip
    assert zeros_streamed == zeros_snapshotted == dict.fromkeys(zero_columns, 1)

    # the registered schema names each column's logical type
    [version] = registry.versions(ReplicationLog.open(streamed).storage,
                                  f"{mysql_db.name}.every_type")  # fmt: skip
    fields = {f["field"]: f for f in version.schema["fields"][1]["fields"]}
    assert fields[by_kind["bigint unsigned"]]["name"] == "org.apache.kafka.connect.data.Decimal"
    assert fields[by_kind["decimal(12,4)"]]["parameters"]["scale"] == "4"
    assert fields[by_kind["tinyint(1)"]]["type"] == "int16"
    assert fields[by_kind["bit(1)"]]["type"] == "boolean"
    assert fields[by_kind["bit(10)"]]["name"] == "io.debezium.data.Bits"
    assert fields[by_kind["datetime(6)"]]["name"] == "io.debezium.time.IsoTimestamp"
    assert fields[by_kind["timestamp(3)"]]["name"] == "io.debezium.time.ZonedTimestamp"
    assert fields[by_kind["time(3)"]]["name"] == "io.debezium.time.MicroTime"
    assert fields[by_kind["json"]]["name"] == "io.debezium.data.Json"  # MariaDB: a LONGTEXT
    assert fields[by_kind["set('a','b','c')"]]["parameters"]["allowed"] == "a,b,c"
    assert fields[by_kind["geometry"]]["name"] == "io.debezium.data.geometry.Geometry"
